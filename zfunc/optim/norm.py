"""Global grad norms and clipping by them (re-exported by ``zfunc.optim``).

``global_norm`` is the L2 norm of all grads together. Two context managers let the step that runs
the optimizer steer it without the optimizer knowing: ``summing_across`` (the grads are one rank's
share: the squared norm is summed over ranks, one all-reduce of a scalar) and ``known_norm`` (the
step computed this norm already: no second read of the grads, no second collective).
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable
from contextlib import contextmanager

import torch

from zfunc.core import tree
from zfunc.optim.base import EmptyState, GradientTransformation, PyTree, _check_number


# Set by a sharded step: sums a 0-d tensor over the ranks, so norms of sharded grads are global.
_SUM_ACROSS_RANKS: contextvars.ContextVar[Callable[[torch.Tensor], torch.Tensor] | None] = contextvars.ContextVar(
    "zfunc_sum_across_ranks", default=None)


@contextmanager
def summing_across(sum_fn: Callable[[torch.Tensor], torch.Tensor]):
    """Within the block, ``global_norm`` treats the grads as one rank's share: it sums the squared
    norm with ``sum_fn`` (an all-reduce) before the square root, like ``psum`` in JAX."""
    token = _SUM_ACROSS_RANKS.set(sum_fn)
    try:
        yield
    finally:
        _SUM_ACROSS_RANKS.reset(token)


# Set by the training step around the optimizer: the norm it already computed of its grads.
_KNOWN_NORM: contextvars.ContextVar[tuple[list[tuple[torch.Tensor, int]], torch.Tensor] | None] = \
    contextvars.ContextVar("zfunc_known_norm", default=None)


@contextmanager
def known_norm(grads: PyTree, norm: torch.Tensor):
    """Within the block, ``global_norm`` of these same grad tensors, unmodified since (same
    objects, same version counters), returns ``norm`` instead of computing it again: in a sharded
    step each computation is an all-reduce, and the step reports the norm that clipping uses."""
    token = _KNOWN_NORM.set(([(t, t._version) for t in tree.tensors(grads)], norm))
    try:
        yield
    finally:
        _KNOWN_NORM.reset(token)


def _known_norm_of(leaves: list[torch.Tensor]) -> torch.Tensor | None:
    known = _KNOWN_NORM.get()
    if known is None or len(known[0]) != len(leaves):
        return None
    same = all(t is k and t._version == v for t, (k, v) in zip(leaves, known[0]))
    return known[1] if same else None


def global_norm(grads: PyTree) -> torch.Tensor:
    """The L2 norm of all tensor leaves together, as a 0-d fp32 tensor on the first leaf's device
    (summed over ranks inside ``summing_across``; taken as given inside ``known_norm``)."""
    leaves = tree.tensors(grads)
    known = _known_norm_of(leaves)
    if known is not None:
        return known
    device = leaves[0].device if leaves else torch.device("cpu")
    # bf16/fp16 grads (offload hands over autograd's own): their norms accumulated and returned in fp32
    low = any(t.dtype in (torch.bfloat16, torch.float16) for t in leaves)
    if not leaves:
        norms = []
    else:
        norms = torch._foreach_norm(leaves, 2, dtype=torch.float32) if low else torch._foreach_norm(leaves)
    norms = [n.to(device, torch.float32) for n in norms]
    norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=device)
    sum_fn = _SUM_ACROSS_RANKS.get()
    return norm if sum_fn is None else sum_fn(norm * norm).sqrt()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all grads by ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``
    (in place in ``update_``, which ``chain``'s ``apply`` uses)."""
    _check_number("max_norm", max_norm, "a finite float > 0", lambda x: x > 0)

    def coefficient(grads, grad_scale=1.0):
        norm = global_norm(grads)
        return torch.clamp(max_norm / ((norm if grad_scale == 1.0 else norm * grad_scale) + 1e-6), max=1.0)

    def update(grads, state, params=None):
        leaves, treespec = tree.flatten(grads)  # None grads (no grad) are no leaves: kept as they are
        if not leaves:
            return grads, state
        return tree.unflatten(treespec, torch._foreach_mul(leaves, coefficient(grads))), state

    def update_(grads, state, params=None):
        tensors = tree.tensors(grads)
        if tensors:
            torch._foreach_mul_(tensors, coefficient(grads))
        return grads, state

    return GradientTransformation(lambda params: EmptyState(), update, update_=update_, needs_global_norm=True,
                                  grad_factor=coefficient)
