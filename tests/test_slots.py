"""zfunc.model.slots: a call with tensors swapped into the slots found once equals torch.func.functional_call."""
import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrizations

from tests.models import BNNet, Tiny
from zfunc.model.slots import Slots


class Counting(nn.Module):
    """Reassigns one buffer (a new tensor) and writes another in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x):
        self.calls = self.calls + 1
        self.total.add_(x.sum(0))
        return self.lin(x)


def _fresh(module):
    params = {n: torch.randn_like(p).requires_grad_() for n, p in module.named_parameters()}
    buffers = {n: b.clone() for n, b in module.named_buffers()}
    return {**params, **buffers}


@pytest.mark.parametrize("build", [Tiny, lambda: BNNet().train(), Counting,
                                   lambda: parametrizations.weight_norm(nn.Linear(3, 3))])
def test_swapped_equals_functional_call(build):
    torch.manual_seed(0)
    module = build()
    held = {n: t for n, t in [*module.named_parameters(), *module.named_buffers()]}
    x = torch.randint(0, 13, (2, 5)) if isinstance(module, Tiny) else torch.randn(4, 3)
    ours, theirs = _fresh(module), None
    theirs = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in ours.items()}
    got = Slots(module).swapped(ours, (x,), {})
    want = functional_call(module, theirs, (x,))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert ours.keys() == theirs.keys()
    for n in ours:  # what each name's slot held after the forward (reassigned buffers) came back alike
        torch.testing.assert_close(ours[n], theirs[n], rtol=0, atol=0)
    g_ours = torch.autograd.grad(got.sum(), [ours[n] for n, _ in module.named_parameters()])
    g_theirs = torch.autograd.grad(want.sum(), [theirs[n] for n, _ in module.named_parameters()])
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(t is held[n] for n, t in [*module.named_parameters(), *module.named_buffers()])


def test_ties_follow_their_first_name():
    module = Tiny(tie=True)
    slots = Slots(module)
    assert "head.weight" not in slots.of and len(slots.of["emb.weight"]) == 2
    seen = {}
    module.head.register_forward_pre_hook(lambda m, args: seen.setdefault("head", m.weight))
    tensors = _fresh(module)
    slots.swapped(tensors, (torch.zeros(1, 2, dtype=torch.long),), {})
    assert seen["head"] is tensors["emb.weight"]
    assert module.head.weight is module.emb.weight and isinstance(module.head.weight, nn.Parameter)


def test_module_restored_when_the_forward_raises():
    module = Counting()
    before = dict(module.named_parameters())

    def boom(m, args):
        raise RuntimeError("stop")

    module.lin.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="stop"):
        Slots(module).swapped(_fresh(module), (torch.randn(2, 3),), {})
    assert dict(module.named_parameters()) == before and module.calls.item() == 0
