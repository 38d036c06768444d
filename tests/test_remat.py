"""remat: the same loss and grads as the plain model, with and without activation offload."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from tests.models import NormUnit, token_loss
from zfunc.model.rematerialize import remat


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc, self.drop = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Dropout(0.3)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x, scale=1.0):
        return x + scale * self.out(self.drop(F.gelu(self.fc(self.ln(x)))))


class Net(nn.Module):
    def __init__(self, d=8, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        for b in self.blocks:
            x = b(x, scale=0.5)
        return self.head(x)


def loss_and_grads(offload=None):
    torch.manual_seed(0)
    model = Net()
    if offload is not None:
        for b in model.blocks:
            b.forward = remat(b.forward, offload=offload)
    apply, params = zf.functionalize(model)
    x, y = torch.randn(4, 6, 8), torch.randint(0, 5, (4, 6))
    torch.manual_seed(1)  # the dropout masks
    return zf.value_and_grad(token_loss(apply))(params, (x, y))


@pytest.mark.parametrize("offload", [False, True])
def test_remat_gives_the_same_loss_and_grads_with_dropout(offload):
    loss, grads = loss_and_grads()
    loss_r, grads_r = loss_and_grads(offload)
    assert torch.equal(loss, loss_r)
    for name in grads:
        torch.testing.assert_close(grads_r[name], grads[name], rtol=1e-6, atol=1e-7)


def test_remat_trains_in_a_step_equal_to_the_plain_step():
    def run(use_remat):
        torch.manual_seed(0)
        model = Net()
        if use_remat:
            for b in model.blocks:
                b.forward = remat(b.forward)
        apply, params = zf.functionalize(model)
        step = zf.train_step(token_loss(apply),
                             zf.optim.adamw(1e-2))
        state = step.init(params)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            state, m = step(state, (torch.randn(4, 6, 8, generator=g), torch.randint(0, 5, (4, 6), generator=g)))
        return state.params

    plain, rematted = run(False), run(True)
    for name in plain:
        torch.testing.assert_close(rematted[name], plain[name], rtol=1e-6, atol=1e-7)


def test_remat_recomputes_in_backward_and_keeps_only_inputs():
    calls = []

    def fn(x):
        calls.append(1)
        return torch.tanh(x).exp().sum()

    x = torch.randn(5, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = remat(fn)(x)
    out.backward()
    assert len(calls) == 2  # forward, then the recomputation in backward
    torch.testing.assert_close(x.grad, (torch.tanh(x).exp() * (1 - torch.tanh(x) ** 2)).detach())


def test_remat_is_a_plain_call_without_grad():
    calls = []
    f = remat(lambda x: calls.append(1) or x * 2)
    with torch.no_grad():
        assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
    assert calls == [1]


def test_remat_rejects_bad_arguments():
    with pytest.raises(TypeError, match="fn: expected a callable"):
        remat(3)
    with pytest.raises(TypeError, match="offload: expected a bool"):
        remat(lambda x: x, offload="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_remat_offload_keeps_the_inputs_on_the_host():
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    w = torch.randn(64, 64, device="cuda", requires_grad=True)
    f = lambda a: torch.relu(a @ w).sum()  # noqa: E731
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.device.type) or t, lambda t: t):
        out = remat(f, offload=True)(x)
    out.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    f(x).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


class Outer(nn.Module):
    """Calls ``remat(block)`` -- the module itself, not its bound forward."""

    def __init__(self):
        super().__init__()
        self.block = Block(8).eval()
        self.rematted = remat(self.block)

    def forward(self, x, use_remat):
        return (self.rematted if use_remat else self.block)(x)


def test_remat_of_a_module_recomputes_with_the_params_functional_call_swapped_in():
    torch.manual_seed(0)
    outer = Outer()
    apply, params = zf.functionalize(outer)
    params = {n: torch.randn_like(p) for n, p in params.items()}  # not the module's own tensors
    x = torch.randn(3, 8)
    plain = zf.value_and_grad(lambda p, x: apply(p, x, False).square().sum())(params, x)
    rematted = zf.value_and_grad(lambda p, x: apply(p, x, True).square().sum())(params, x)
    torch.testing.assert_close(rematted[0], plain[0])
    for name in params:
        torch.testing.assert_close(rematted[1][name], plain[1][name], rtol=1e-6, atol=1e-7)


def test_torch_checkpoint_updates_batchnorm_statistics_twice():
    """The fact zf.remat departs from: torch's non-reentrant checkpoint recomputes the forward in
    backward, BatchNorm's running statistics included."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert bn.num_batches_tracked.item() == 2


@pytest.mark.parametrize("offload", [False, True])
def test_remat_updates_batchnorm_statistics_once_like_the_plain_step(offload):
    def run(use_remat):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 5), NormUnit(), NormUnit(), nn.Linear(5, 2))
        if use_remat:
            for b in (model[1], model[2]):
                b.forward = remat(b.forward, offload=offload)
        apply, params = zf.functionalize(model)
        step = zf.train_step(lambda p, b: F.mse_loss(apply(p, b[0]), b[1]), zf.optim.sgd(0.1, momentum=0.9), accum=2)
        state = step.init(params)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            state, _ = step(state, (torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)))
        return state

    plain, rematted = run(False), run(True)
    assert set(rematted.buffers) == set(plain.buffers) and len(plain.buffers) == 6
    for name in plain.buffers:
        torch.testing.assert_close(rematted.buffers[name], plain.buffers[name], rtol=1e-6, atol=1e-7)
    assert rematted.buffers["1.bn.num_batches_tracked"].item() == 6  # 3 steps of 2 microbatches
    for name in plain.params:
        torch.testing.assert_close(rematted.params[name], plain.params[name], rtol=1e-6, atol=1e-7)


def test_remat_keeps_a_buffer_the_forward_reassigns():
    class Count(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.register_buffer("calls", torch.tensor(0))

        def forward(self, x):
            self.calls = self.calls + 1
            return self.fc(x)

    model = nn.Sequential(Count(), nn.Linear(3, 1))
    model[0].forward = remat(model[0].forward)
    apply, params = zf.functionalize(model)
    step = zf.train_step(lambda p, x: apply(p, x).sum(), zf.optim.sgd(0.1))
    state = step.init(params)
    for _ in range(2):
        state, _ = step(state, torch.randn(4, 3))
    assert state.buffers["0.calls"].item() == 2  # once per forward: not by the recomputation


@pytest.mark.parametrize("offload", [False, True])
def test_the_recomputation_runs_under_the_contexts_captured_at_its_forward(offload, monkeypatch):
    """A ``replay_context`` capture: what was in force at the forward is in force again at each recomputation,
    though backward runs outside it (zf.sequence_parallel's attention, on a pipeline stage's backward)."""
    from zfunc.model import rematerialize

    state = {"mode": "plain", "seen": []}

    class Mode:
        def __init__(self, mode):
            self.mode, self.before = mode, []

        def __enter__(self):
            self.before.append(state["mode"])
            state["mode"] = self.mode

        def __exit__(self, *exc):
            state["mode"] = self.before.pop()

    monkeypatch.setattr(rematerialize, "_replayed", [lambda: Mode(state["mode"])])

    def fn(x):
        state["seen"].append(state["mode"])
        return x.sin() * 2

    x = torch.randn(4, requires_grad=True)
    with Mode("forward's"):
        y = remat(fn, offload=offload)(x)
    y.sum().backward()
    assert state["seen"] == ["forward's", "forward's"] and state["mode"] == "plain"
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
