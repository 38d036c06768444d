"""The plain step's one fp32 microbatch in a process without CUDA (``Step._direct``): the microbatch
loop's work written out (``zfunc.core.grads.one_microbatch``) trains exactly as the loop does, bit
for bit: losses, aux, grad norms, skipped steps, params, optimizer state and carried buffers."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import zfunc as zf
from tests.models import BNNet, bn_batches, bn_step, inject, tree_equal
from zfunc import optim
from zfunc.core import step as core_step
from zfunc.core.roles import Accumulation


class Loop(Accumulation):
    """Accumulation under another class: the same schedule, which ``_direct`` leaves to the loop."""


def looped(step):
    step.schedule = Loop(step.accum)
    return step


def params(odd_leaves=True):
    """``odd_leaves``: an int tensor and a Python float among them, which get no grads."""
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(6, 4, generator=g), "b": torch.zeros(4), "unused": torch.randn(3, generator=g)}
    return p | {"count": torch.tensor(2), "scale": 0.5} if odd_leaves else p


def loss_fn(p, batch):
    """Dropout (the step's seeded RNG), an unused param, the odd leaves, an fp64 loss, an aux, faults."""
    x, y, fault = batch
    h = F.dropout(x @ p["w"] + p["b"], 0.3, training=True) * p.get("count", 2) * p.get("scale", 0.5)
    loss = inject(F.mse_loss(h, y).double(), fault)
    return loss, {"h": h.detach().mean()}


def batches(n=5, inf_grads=True):
    """``n`` batches, the second with inf grads behind a finite loss (``inf_grads``) and the fourth
    with a nan loss."""
    g = torch.Generator().manual_seed(1)
    faults = [None, "inf_grads" if inf_grads else None, None, "nan_loss", None][:n]
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g), f) for f in faults]


def train(step, state, data):
    metrics = []
    for b in data:
        state, m = step(state, b)
        metrics.append(m)
    return state, metrics


def assert_same(got, ref):
    (state, metrics), (ref_state, ref_metrics) = got, ref
    assert tree_equal(state.params, ref_state.params) and tree_equal(state.opt_state, ref_state.opt_state)
    assert tree_equal(state.buffers, ref_state.buffers) and state.step == ref_state.step
    for m, r in zip(metrics, ref_metrics, strict=True):  # bit for bit, a nan norm equal to a nan norm
        assert m.keys() == r.keys(), (m, r)
        torch.testing.assert_close(m, r, rtol=0, atol=0, equal_nan=True)
    return metrics


@pytest.mark.parametrize("tx, odd_leaves, clips", [
    (lambda: optim.adamw(1e-2, weight_decay=0.1), False, False),
    (lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1)), False, True),
    (lambda: optim.sgd(0.1), True, False)], ids=["adamw", "clip-adamw", "sgd"])  # adamw refuses odd leaves
@pytest.mark.parametrize("grad_norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("donate", [True, False], ids=["donate", "copy"])
def test_direct_step_trains_as_the_loop_bit_for_bit(tx, odd_leaves, clips, grad_norm, donate):
    checked = grad_norm or clips  # clipping computes the norm (and so skips inf grads) whatever grad_norm says
    runs = []
    for direct in (True, False):
        step = zf.train_step(loss_fn, tx(), has_aux=True, donate=donate, grad_norm=grad_norm, seed=3)
        step = step if direct else looped(step)
        state = step.init(params(odd_leaves))
        assert step._direct(state.loss_scale) is direct
        runs.append(train(step, state, batches(inf_grads=checked)))  # unchecked, inf grads would reach the params
    assert [m["skipped"] for m in assert_same(*runs)] == [False, checked, False, True, False]


def test_direct_step_carries_buffers_as_the_loop():
    runs = []
    for direct in (True, False):
        torch.manual_seed(0)
        model = BNNet()
        _, step = bn_step(model)
        step = step if direct else looped(step)
        runs.append(train(step, step.init(zf.functionalize(model)[1]), bn_batches()))
    assert runs[0][0].buffers.keys() == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    assert_same(*runs)


def test_direct_step_runs_no_microbatch_loop_and_leaves_its_inputs_alone(monkeypatch):
    loops = []
    loop = core_step.run_microbatches
    monkeypatch.setattr(core_step, "run_microbatches", lambda *a, **k: loops.append(1) or loop(*a, **k))
    step = zf.train_step(loss_fn, optim.adamw(1e-2), has_aux=True, donate=False)
    state, batch = step.init(params(odd_leaves=False)), batches(1)[0]
    inputs = lambda: zf.tree.tensors((state.params, state.opt_state, batch[:2]))  # noqa: E731
    before = [t.clone() for t in inputs()]
    new, _ = step(state, batch)
    assert not loops
    assert all(torch.equal(a, b) for a, b in zip(inputs(), before, strict=True))
    assert not torch.equal(new.params["w"], state.params["w"])


@pytest.mark.parametrize("kw", [dict(precision="bf16"), dict(precision="fp16"), dict(accum=2)],
                         ids=["bf16", "fp16", "accum"])
def test_the_loop_runs_what_the_direct_step_does_not_take(kw):
    kw = dict(kw)
    tx = kw.pop("tx", optim.adamw(1e-2))
    step = zf.train_step(lambda p, b: (p["w"] * b).mean(), tx, **kw)
    state = step.init({"w": torch.ones(4)})
    assert not step._direct(state.loss_scale)
    state, m = step(state, torch.full((4, 4) if kw.get("accum") else (4,), 0.01))
    assert m["step"] == 1 and m["skipped"] == (kw.get("precision") == "fp16")  # fp16: its first scale overflows


def test_a_subclass_that_reworks_the_grads_takes_the_loop():
    class Halved(core_step.Step):
        def _loss_and_grads(self, *args):
            loss, aux, grads = super()._loss_and_grads(*args)
            return loss, aux, zf.tree.map(lambda g: g / 2, grads)

    step = Halved(lambda p, b: (p["w"] * b).sum(), optim.sgd(1.0), "fp32", 1, True, False, 0)
    state = step.init({"w": torch.zeros(3)})
    assert not step._direct(state.loss_scale)
    state, _ = step(state, torch.ones(3))
    assert torch.equal(state.params["w"], torch.full((3,), -0.5))


def test_an_nn_module_step_trains_as_the_loop():
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.2), nn.GELU(), nn.Linear(8, 1))
        apply, p = zf.functionalize(model)
        return zf.train_step(lambda q, b: F.mse_loss(apply(q, b[0]), b[1]), optim.adamw(1e-2)), p

    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 5, generator=g), torch.randn(4, 1, generator=g)) for _ in range(4)]
    runs = []
    for direct in (True, False):
        step, p = make()
        step = step if direct else looped(step)
        runs.append(train(step, step.init(p), data))
    assert_same(*runs)
