"""Global grad norms and clipping by them (re-exported by ``zfunc.optim``).

``global_norm`` is the L2 norm of the grad tensors it is given, together. It reads nothing but its
arguments: where the grads are one rank's share (a sharded step), the step sums the squares over
the ranks itself (``zfunc.core.totals.sum_over_ranks``, one all-reduce of its own scalars) and hands
the total to the optimizer as a ``KnownNorm`` (``known_norm``, ``optim.apply(norm=)``), which
clipping then takes instead of reading the grads again.
"""
from __future__ import annotations

import math

import torch

from zfunc.core import tree
from zfunc.optim.base import EmptyState, GradientTransformation, KnownNorm, PyTree, _check_number
from zfunc.optim.kernels import _gpu_kernels_usable


def known_norm(grads: PyTree, norm: torch.Tensor) -> KnownNorm:
    """``norm`` as the global norm of ``grads`` (over every rank, where they are one rank's share; a
    leaf-by-leaf update passes one leaf's grads with the norm of all of them), for the optimizer to
    take (``optim.apply(norm=)``, ``global_norm(known=)``)."""
    return KnownNorm(tree.tensors(grads), norm)


def global_norm(grads: PyTree, known: KnownNorm | None = None) -> torch.Tensor:
    """The L2 norm of all tensor leaves together, as a 0-d fp32 tensor on the first leaf's device;
    ``known``'s norm instead where it is that of these very grads (``KnownNorm.of``). Leaves on one
    GPU go through zfunc's CUDA kernel where CuPy is installed (``zfunc.ops.gpu.norm``: one read,
    the squares summed in fp64); contiguous fp32/bf16/fp16 CPU leaves through zfunc's CPU kernel
    (``zfunc.ops.cpu.norm``: one read, ~3 us a call where ``torch._foreach_norm`` and the ops
    around it take ~15, and bf16/fp16 read as such, ~25x faster than torch's upcasting norm);
    anything else through ``torch._foreach_norm``. inf or nan iff some element is."""
    leaves = tree.tensors(grads)
    if known is not None:
        norm = known.of_tensors(leaves)
        if norm is not None:
            return norm
    if leaves and _in_ram(leaves):
        return torch.scalar_tensor(math.sqrt(sum_squares_in_ram(leaves)), dtype=torch.float32)
    if leaves and _on_one_gpu(leaves):
        from zfunc.ops.gpu import norm as gpu_norm

        return gpu_norm.global_norm([t if t.is_contiguous() else t.contiguous() for t in leaves])
    device = leaves[0].device if leaves else torch.device("cpu")
    # bf16/fp16 grads (offload hands over autograd's own): their norms accumulated and returned in fp32
    low = any(t.dtype in (torch.bfloat16, torch.float16) for t in leaves)
    if not leaves:
        norms = []
    else:
        norms = torch._foreach_norm(leaves, 2, dtype=torch.float32) if low else torch._foreach_norm(leaves)
    norms = [n.to(device, torch.float32) for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=device)


def sum_squares_in_ram(leaves: list[torch.Tensor]) -> float:
    """The sum of the squares of ``leaves`` (contiguous fp32/bf16/fp16 CPU tensors, ``_in_ram``)
    in one read (``zfunc.ops.cpu.norm``), as a float: inf or nan iff some element is."""
    global _cpu_norm
    if _cpu_norm is None:  # Numba loads on first use
        from zfunc.ops.cpu import norm as _cpu_norm
    return _cpu_norm.sum_squares(leaves)


_cpu_norm = None


def squares_in_ram(grads: list[torch.Tensor | None]) -> float | None:
    """The sum of the squares of ``grads`` (a list of leaves, None for a leaf without grad) in one
    read by zfunc's CPU kernel (``sum_squares_in_ram``: inf or nan iff some element is) where every
    tensor among them is a contiguous fp32/bf16/fp16 CPU tensor; None elsewhere (or with no tensor),
    for the caller to take the norm itself (``global_norm``). Takes the list as it is: no walk over
    a pytree, no tensor made."""
    leaves = []
    for g in grads:  # ``_in_ram`` in the same loop: no generator or further call on every step's path
        if g is not None:
            if not (g.is_cpu and g.dtype in _KERNEL_DTYPES and g.is_contiguous()):
                return None
            leaves.append(g)
    return sum_squares_in_ram(leaves) if leaves else None


def add_with_squares(into: list[torch.Tensor | None], grads: list[torch.Tensor | None]) -> float | None:
    """``into[i] += grads[i]`` in place, for every i, and the sum of the squares of the sums (a
    float: the global norm's square, inf or nan iff a sum is), in one pass: zfunc's CPU kernel
    where ``into`` are contiguous fp32 CPU tensors and ``grads`` contiguous fp32/bf16/fp16 CPU
    tensors, none None (bit-equal to ``torch._foreach_add_``). Elsewhere nothing is done and the
    answer is None: the caller adds and takes the norm itself."""
    if not into or len(into) != len(grads) or any(a is None or g is None for a, g in zip(into, grads)):
        return None
    if not (_in_ram(grads) and all(a.dtype is torch.float32 and a.is_cpu and a.is_contiguous() for a in into)):
        return None
    global _cpu_norm
    if _cpu_norm is None:
        from zfunc.ops.cpu import norm as _cpu_norm
    return _cpu_norm.sum_squares(grads, add_to=into)


def _in_ram(leaves: list[torch.Tensor]) -> bool:
    """Whether zfunc's CPU norm kernel takes these leaves: contiguous fp32/bf16/fp16 CPU tensors."""
    return all(t.is_cpu and t.dtype in _KERNEL_DTYPES and t.is_contiguous() for t in leaves)


def _on_one_gpu(leaves: list[torch.Tensor]) -> bool:
    """Whether zfunc's CUDA norm kernel takes these leaves: fp32/bf16/fp16 on one GPU, CuPy installed."""
    return (all(t.is_cuda and t.dtype in _KERNEL_DTYPES for t in leaves) and len({t.device for t in leaves}) == 1
            and _gpu_kernels_usable())


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all grads by ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``
    (in place in ``update_``, which ``chain``'s ``apply`` uses). ``norm``: the global norm, as the
    step computed it (a ``KnownNorm``; ``needs_global_norm``), else computed from the grads."""
    _check_number("max_norm", max_norm, "a finite float > 0", lambda x: x > 0)

    def coefficient(grads, grad_scale=1.0, norm=None):
        norm = global_norm(grads, norm)
        return torch.clamp(max_norm / ((norm if grad_scale == 1.0 else norm * grad_scale) + 1e-6), max=1.0)

    def update(grads, state, params=None, norm=None):
        leaves, treespec = tree.flatten(grads)  # None grads (no grad) are no leaves: kept as they are
        if not leaves:
            return grads, state
        return tree.unflatten(treespec, torch._foreach_mul(leaves, coefficient(grads, norm=norm))), state

    def update_(grads, state, params=None, norm=None):
        tensors = tree.tensors(grads)
        if tensors:
            torch._foreach_mul_(tensors, coefficient(grads, norm=norm))
        return grads, state

    return GradientTransformation(lambda params: EmptyState(), update, update_=update_, needs_global_norm=True,
                                  grad_factor=coefficient)
