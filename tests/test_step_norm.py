"""The default CPU step's grad norm (``train_step(grad_norm=True)``): one read of the grads by zfunc's
CPU kernel (``zfunc.ops.cpu.norm``) before the update, none of its own with accumulation (the last
microbatch's add sums the squares), the same training as torch's norm, and a step with a nan or inf
grad skipped with the state unchanged, bit for bit."""
import math

import pytest
import torch
from torch import nn

import zfunc as zf
from zfunc import optim
from zfunc.ops.cpu import adam as cpu_adam, norm as cpu_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = {"one small": [1000], "several small": [3, 700, 1, 64], "one threaded": [50_000],
           "mixed": [40_000, 5, 300, 20_000, 0]}


def exact(tensors):
    return sum(float(t.double().pow(2).sum()) for t in tensors)


@pytest.fixture
def two_threads():
    cpu_adam.set_num_threads(2)
    yield
    cpu_adam.set_num_threads(None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_sum_squares_is_the_fp64_sum_and_non_finite_iff_an_element_is(two_threads, layout, dtype):
    g = torch.Generator().manual_seed(0)
    leaves = [(torch.randn(n, generator=g) * 3).to(dtype) for n in LAYOUTS[layout]]
    assert cpu_norm.sum_squares(leaves) == pytest.approx(exact(leaves), rel=1e-6)
    assert cpu_norm.sum_squares([t.reshape(-1, 1) if t.numel() else t for t in leaves]) == cpu_norm.sum_squares(leaves)
    big = max(range(len(leaves)), key=lambda i: leaves[i].numel())
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, leaves[big].numel() // 2, leaves[big].numel() - 1):
            poisoned = [t.clone() for t in leaves]
            poisoned[big][at] = bad
            s = cpu_norm.sum_squares(poisoned)
            assert math.isnan(s) if math.isnan(bad) else s == math.inf


def test_squares_in_ram_reads_the_flat_list_where_the_kernel_takes_it():
    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(300, generator=g), None, torch.randn(20_000, generator=g).to(torch.bfloat16)]
    assert optim.squares_in_ram(leaves) == pytest.approx(exact([leaves[0], leaves[2]]), rel=1e-6)
    assert optim.squares_in_ram([None]) is None  # no tensor: the caller's norm (zero)
    assert optim.squares_in_ram([leaves[0], torch.ones(3, dtype=torch.float64)]) is None
    assert optim.squares_in_ram([torch.ones(4, 4).t()]) is None


def test_sum_squares_names_what_it_cannot_read():
    with pytest.raises(ValueError, match=r"contiguous fp32/bf16/fp16 CPU tensors, got torch.float64"):
        cpu_norm.sum_squares([torch.ones(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"non-contiguous"):
        cpu_norm.sum_squares([torch.ones(4, 4).t()])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_global_norm_of_cpu_grads_is_the_fp64_norm(dtype):
    g = torch.Generator().manual_seed(1)
    grads = {"a": torch.randn(30, 20, generator=g).to(dtype), "b": torch.randn(20_000, generator=g).to(dtype)}
    norm = optim.global_norm(grads)
    assert norm.dtype == torch.float32 and norm.dim() == 0
    assert float(norm) == pytest.approx(math.sqrt(exact(list(grads.values()))), rel=1e-6)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.stack(torch._foreach_norm(
        [t.float() for t in grads.values()]))), rtol=1e-5, atol=0)


class Fault(torch.autograd.Function):
    """The identity on the params' first leaf in forward; backward adds ``value`` to one element
    of its grad (0: nothing): a finite loss whose grads hold a nan or an inf."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.value:
            g = g.clone()
            g.view(-1)[g.numel() // 2] += ctx.value
        return g, None


def model(leaves):
    torch.manual_seed(0)
    if leaves == "one":
        return nn.Linear(6, 2, bias=False)
    return nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 2))


def make_step(leaves, precision="fp32", accum=1, donate=True, tx=None):
    apply, params = zf.functionalize(model(leaves))
    first = next(iter(params))

    def loss_fn(p, batch):
        x, y, value = batch
        p = {**p, first: Fault.apply(p[first], value)}
        return nn.functional.mse_loss(apply(p, x).float(), y)

    step = zf.train_step(loss_fn, tx or optim.adamw(1e-2, weight_decay=0.1), precision, accum, donate=donate)
    return step, step.init(params)


def batch(k, value=0.0):
    g = torch.Generator().manual_seed(k)
    return torch.randn(12, 6, generator=g), torch.randn(12, 2, generator=g), value


CASES = [("one", "fp32", 1), ("several", "fp32", 1), ("several", "fp32", 2), ("one", "bf16", 2),
         ("several", "bf16", 1)]


@pytest.mark.parametrize("leaves, precision, accum", CASES)
def test_the_default_step_trains_as_with_torchs_norm(monkeypatch, leaves, precision, accum):
    """Params and moments bit-equal to a step whose norm is torch's (``_foreach_norm`` after the
    microbatches' grads are summed by ``_foreach_add_``: the norm does not enter the update), the
    reported norm within 1e-6 of the grads' fp64 norm. One read of the grads for it, or none:
    accumulated, the last microbatch's add sums the squares in its own pass."""
    ref_step, ref = make_step(leaves, precision, accum)
    step, state = make_step(leaves, precision, accum)
    reads, adds, norms = [], [], []
    read, add = optim.norm.sum_squares_in_ram, optim.add_with_squares

    def added(into, grads):
        sq = add(into, grads)
        adds.append(exact(into))
        return sq

    for k in range(4):
        monkeypatch.setattr(optim.norm, "_in_ram", lambda leaves: False)
        ref, ref_m = ref_step(ref, batch(k))
        monkeypatch.undo()
        monkeypatch.setattr(optim.norm, "sum_squares_in_ram", lambda g: reads.append(exact(g)) or read(g))
        monkeypatch.setattr(optim, "add_with_squares", added)
        state, m = step(state, batch(k))
        monkeypatch.undo()
        norms.append(float(m["grad_norm"]))
        assert not m["skipped"] and not ref_m["skipped"]
        torch.testing.assert_close(m["grad_norm"], ref_m["grad_norm"], rtol=1e-5, atol=0)
    squares = reads if accum == 1 else adds  # the sums: the 1/accum rides in the update
    assert len(squares) == 4 and (accum == 1 or not reads)
    assert norms == pytest.approx([math.sqrt(s) / accum for s in squares], rel=1e-6)
    for got, want in zip(zf.tree.leaves((state.params, state.opt_state)), zf.tree.leaves((ref.params, ref.opt_state))):
        assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("leaves, precision, accum", CASES)
def test_a_step_with_a_non_finite_grad_changes_nothing(leaves, precision, accum, value):
    step, state = make_step(leaves, precision, accum)
    state, _ = step(state, batch(0))  # moments non-zero from here on
    before = zf.tree.clone((state.params, state.opt_state))
    after, m = step(state, batch(1, value))
    assert m["skipped"] and torch.isfinite(m["loss"]) and not torch.isfinite(m["grad_norm"])
    assert state.consumed and after.step == 2
    for got, want in zip(zf.tree.leaves((after.params, after.opt_state)), zf.tree.leaves(before)):
        assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want
    after, m = step(after, batch(2))
    assert not m["skipped"] and after.opt_state.count == 2


class Unfolded(zf.core.step.Step):
    """The plain step with the grads' unscale as a pass of its own (a subclass that reworks the
    grads keeps it so)."""

    def _loss_and_grads(self, *args):
        return super()._loss_and_grads(*args)


OPTIMIZERS = {"sgd": lambda: optim.sgd(1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
              "lion": lambda: optim.lion(1e-3, weight_decay=0.1), "lamb": lambda: optim.lamb(1e-2, weight_decay=0.1),
              "adamw-torch": lambda: optim.adamw(1e-2, weight_decay=0.1, backend="torch")}


@pytest.mark.parametrize("precision, accum, tx", [("fp32", 2, None), ("fp32", 3, None), ("bf16", 3, None),
                                                  ("fp16", 1, None), ("fp16", 2, None), *[("fp32", 3, name)
                                                                                        for name in OPTIMIZERS]])
def test_the_unscale_in_the_update_pass_trains_as_a_pass_of_its_own(precision, accum, tx):
    """1/(microbatches x loss scale) multiplied in the optimizer's pass: params and moments bit-equal
    to the step that multiplies the grads first, the norm within 1e-6."""
    make = OPTIMIZERS.get(tx, lambda: None)
    step, state = make_step("several", precision, accum, tx=make())
    ref_step, ref = make_step("several", precision, accum, tx=make())
    ref_step.__class__ = Unfolded
    for k in range(4):
        ref, ref_m = ref_step(ref, batch(k))
        state, m = step(state, batch(k))
        assert m["skipped"] == ref_m["skipped"]
        torch.testing.assert_close(m["grad_norm"], ref_m["grad_norm"], rtol=1e-6, atol=0)
    for got, want in zip(zf.tree.leaves((state.params, state.opt_state)), zf.tree.leaves((ref.params, ref.opt_state))):
        assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["one small", "several small", "mixed"])
def test_add_with_squares_is_foreach_add_with_the_sums_squares(two_threads, layout, dtype):
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(n, generator=g).to(dtype) for n in LAYOUTS[layout]]
    into = [torch.randn(n, generator=g) for n in LAYOUTS[layout]]
    want = [t.clone() for t in into]
    torch._foreach_add_(want, grads)
    sq = optim.add_with_squares(into, grads)
    assert all(torch.equal(a, b) for a, b in zip(into, want))
    assert sq == pytest.approx(exact(want), rel=1e-6)
    grads[0].view(-1)[0] = float("nan")
    assert math.isnan(optim.add_with_squares(into, grads))
    assert optim.add_with_squares([None, *into[1:]], grads) is None  # a leaf without a sum: the caller adds
    assert optim.add_with_squares([t.double() for t in into], grads) is None
