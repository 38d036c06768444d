"""Which fused kernel runs an optimizer's in-place ``apply``: torch's multi-tensor kernels, zfunc's
Numba CPU kernels (``zfunc.ops.cpu.adam``) or zfunc's CUDA kernels (``zfunc.ops.gpu``, through CuPy),
chosen by ``backend`` ("auto": by where the state lives).

Cost: zfunc's CPU-Adam reads fp32 or bf16/fp16 grads and can write a bf16/fp16 copy of the new
params in the same pass (``_numba_adam``'s ``outs``); optimizer state is allocated on huge pages
where the host allows (``_zeros_like``), where the kernels run faster.
"""
from __future__ import annotations

import torch

from zfunc.core import tree
from zfunc.ops.cpu import hostmem
from zfunc.optim.base import PyTree, _update_in_place


def _zeros_like(params: PyTree) -> PyTree:
    """Zero state shaped like ``params``; CPU state on huge pages, where the kernels run faster."""
    return tree.map(hostmem.zeros_like, params)


_LOW = (torch.bfloat16, torch.float16)  # the dtypes the kernel writes as param_out
_GRAD_DTYPES = (torch.float32, *_LOW)  # the grad dtypes it reads


def _numba_adam(ps, gs, ms, vs, outs, decay, count, lr, b1, b2, eps, weight_decay, decoupled, grad_sq=False,
                grad_scale=1.0):
    """The leaves through zfunc's CPU-Adam (``adamw_many_``: big leaves threaded, small ones in one
    call), in two groups where ``decay`` (per-leaf flags; None: all decay) differs; a leaf whose
    grad is None is left alone. An ``out`` leaf is written in the same pass where the kernel can
    write it (a contiguous bf16/fp16 CPU tensor), else copied after. ``grad_sq``: returns the sum
    of the squares of the grads read (else None). ``grad_scale``: the kernel updates with (and
    sums the squares of) ``grad * grad_scale``, multiplied in its pass."""
    global _cpu_adam
    if _cpu_adam is None:  # Numba loads on first use
        from zfunc.ops.cpu import adam as _cpu_adam
    cpu_adam = _cpu_adam
    n = len(ps)
    plain = decay is None  # loops, not all(): no generator made on every step's path
    if plain:
        for g in gs:
            if g is None or g.dtype not in _GRAD_DTYPES or not g.is_contiguous():
                plain = False
                break
    if plain and outs is not None:
        for o in outs:
            if o is not None:
                plain = False
                break
    if plain:  # the common case: one group, nothing to fix up
        return cpu_adam.adamw_many_(ps, gs, ms, vs, step=count, lr=lr, beta1=b1, beta2=b2, eps=eps,
                                    weight_decay=weight_decay, decoupled=decoupled, grad_sq=grad_sq,
                                    grad_scale=grad_scale)
    outs = [None] * n if outs is None else outs
    total = 0.0
    for flag in (True, False):
        idx = [i for i in range(n) if gs[i] is not None and (decay is None or decay[i]) is flag]
        if not idx:
            continue
        g_ = [gs[i] if gs[i].dtype in _GRAD_DTYPES and gs[i].is_contiguous() else gs[i].float().contiguous()
              for i in idx]
        o_ = [outs[i] for i in idx]
        fused = [o if o is not None and o.dtype in _LOW and o.is_cpu and o.is_contiguous() else None for o in o_]
        sq = cpu_adam.adamw_many_([ps[i] for i in idx], g_, [ms[i] for i in idx], [vs[i] for i in idx], step=count,
                                  lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay if flag else 0.0,
                                  decoupled=decoupled, param_outs=fused, grad_sq=grad_sq, grad_scale=grad_scale)
        total += sq or 0.0
        _copy_pairs([ps[i] for i in idx], [o if f is None else None for o, f in zip(o_, fused)])
    _copy_pairs(ps, [o if g is None else None for o, g in zip(outs, gs)])  # no grad: the param unchanged
    return total if grad_sq else None


_cpu_adam = None


def _copy_pairs(ps: list[torch.Tensor], outs: list[torch.Tensor | None]) -> None:
    for p, o in zip(ps, outs):
        if o is not None:
            o.copy_(p)


def _cupy_adam(ps, gs, ms, vs, outs, decay, count, lr, b1, b2, eps, weight_decay, decoupled, grad_sq=False,
               grad_scale=1.0):
    """The leaves through zfunc's CUDA AdamW (``zfunc.ops.gpu.adam.adamw_many_``: one launch per
    grad/out dtype pair, the decay mask a flag per leaf); ``outs``, ``grad_sq`` and ``grad_scale``
    as ``_numba_adam``'s, except that the sum of squares is a 0-d fp64 device tensor (no host sync)."""
    from zfunc.ops.gpu import adam as gpu_adam

    n = len(ps)
    outs = [None] * n if outs is None else outs
    idx = [i for i in range(n) if gs[i] is not None]
    device = ps[0].device if ps else None
    g_ = [_as_kernel_grad(gs[i], device) for i in idx]
    o_ = [outs[i] for i in idx]
    fused = [o if o is not None and o.dtype in _LOW and o.device == device and o.is_contiguous() else None for o in o_]
    sq = gpu_adam.adamw_many_([ps[i] for i in idx], g_, [ms[i] for i in idx], [vs[i] for i in idx], step=count,
                              lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
                              grad_scale=grad_scale, param_outs=fused, decay=[decay is None or decay[i] for i in idx],
                              grad_sq=grad_sq)
    _copy_pairs([ps[i] for i in idx], [o if f is None else None for o, f in zip(o_, fused)])
    _copy_pairs(ps, [o if g is None else None for o, g in zip(outs, gs)])  # no grad: the param unchanged
    if grad_sq and sq is None:  # no leaf had a grad
        sq = torch.zeros((), dtype=torch.float64, device=device)
    return sq


def _as_kernel_grad(g: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``g`` as the CUDA kernels read it: contiguous fp32/bf16/fp16 on ``device``."""
    if g.device != device:
        g = g.to(device)
    return g if g.dtype in _GRAD_DTYPES and g.is_contiguous() else g.float().contiguous()


# "auto": the kernel follows where the state lives. Contiguous fp32 tensors in CPU RAM (a plain or
# sharded step on the CPU, offload's leaves) go to zfunc's Numba CPU-Adam, each leaf viewed 1-D;
# contiguous fp32 tensors on one GPU to zfunc's CUDA kernels where CuPy is installed (the ``gpu``
# extra; ZFUNC_GPU_KERNELS=0 turns them off); everything else (other dtypes, strided views, no
# CuPy) to torch's fused multi-tensor kernel.
_BACKENDS = ("auto", "torch", "numba", "cupy")


def _resolve_backend(backend: str, params: PyTree) -> str:
    """``backend``, with "auto" resolved for ``params`` (a pytree or a list of its leaves)."""
    if backend != "auto":
        return backend
    leaves = params if isinstance(params, list) else tree.tensors(params)
    in_ram = bool(leaves)
    for p in leaves:  # a loop, not all(): no generator made on every step's path
        if isinstance(p, torch.Tensor) and not (p.dtype is torch.float32 and p.is_cpu and p.is_contiguous()):
            in_ram = False
            break
    if in_ram:
        return "numba"
    tensors = [p for p in leaves if isinstance(p, torch.Tensor)]
    if tensors and all(p.dtype is torch.float32 and p.is_cuda and p.is_contiguous() for p in tensors) and (
            len({p.device for p in tensors}) == 1 and _gpu_kernels_usable()):
        return "cupy"
    return "torch"


def _gpu_kernels_usable() -> bool:
    from zfunc.ops.gpu import runtime

    return runtime.usable()


def _check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")


def _check_fused_leaves(params: PyTree, backend: str) -> None:
    for p in tree.tensors(params):
        if not p.is_floating_point():
            raise TypeError(f"params: the optimizer kernels need floating-point params, got {p.dtype}")
        if p.device.type == "meta":  # shapes only (zf.checkpoint.load lays a state out this way): no kernel runs
            continue
        if backend == "numba" and (p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous()):
            raise ValueError(
                f"backend='numba': expected contiguous fp32 CPU params, got {p.dtype} on {p.device}"
                f"{'' if p.is_contiguous() else ' (non-contiguous)'}; use backend='torch'"
            )
        if backend == "cupy" and (p.device.type != "cuda" or p.dtype != torch.float32 or not p.is_contiguous()):
            raise ValueError(
                f"backend='cupy': expected contiguous fp32 CUDA params, got {p.dtype} on {p.device}"
                f"{'' if p.is_contiguous() else ' (non-contiguous)'}; use backend='torch'"
            )


def _kernel_apply(backend: str, update, numba_apply, cupy_apply=None):
    """``apply`` for optimizers with fused kernels of zfunc's own: ``numba_apply`` where ``backend``
    resolves to numba for these params, ``cupy_apply`` where it resolves to cupy, else (or where
    that kernel is None) ``update`` plus an in-place add."""

    def apply_(grads, state, params):
        resolved = _resolve_backend(backend, params)
        kernel = {"numba": numba_apply, "cupy": cupy_apply}.get(resolved)
        if kernel is not None:
            _check_fused_leaves(params, resolved)
            return kernel(grads, state, params)
        return _update_in_place(update, grads, state, params)

    return apply_
