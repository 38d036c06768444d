"""Which fused kernel runs an optimizer's in-place ``apply``: torch's multi-tensor kernels or zfunc's
Numba CPU kernels (``zfunc.ops.cpu.adam``), chosen by ``backend`` ("auto": by where the state lives).

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
    from zfunc.ops.cpu import adam as cpu_adam

    n = len(ps)
    outs = [None] * n if outs is None else outs
    plain = decay is None and all(g is not None and g.dtype in _GRAD_DTYPES and g.is_contiguous() for g in gs)
    if plain and all(o is None for o in outs):  # the common case: one group, nothing to fix up
        return cpu_adam.adamw_many_(ps, gs, ms, vs, step=count, lr=lr, beta1=b1, beta2=b2, eps=eps,
                                    weight_decay=weight_decay, decoupled=decoupled, grad_sq=grad_sq,
                                    grad_scale=grad_scale)
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


def _copy_pairs(ps: list[torch.Tensor], outs: list[torch.Tensor | None]) -> None:
    for p, o in zip(ps, outs):
        if o is not None:
            o.copy_(p)


# "auto": the kernel follows where the state lives. Contiguous fp32 tensors in CPU RAM (a plain or
# sharded step on the CPU, offload's leaves) go to zfunc's Numba CPU-Adam, each leaf viewed 1-D;
# everything else (CUDA, other dtypes, strided views) to torch's fused multi-tensor kernel.
_BACKENDS = ("auto", "torch", "numba")


def _resolve_backend(backend: str, params: PyTree) -> str:
    """``backend``, with "auto" resolved for ``params`` (a pytree or a list of its leaves)."""
    if backend != "auto":
        return backend
    leaves = params if isinstance(params, list) else tree.tensors(params)
    on_cpu = bool(leaves) and all(not isinstance(p, torch.Tensor) or (p.dtype is torch.float32 and p.is_cpu
                                                                     and p.is_contiguous()) for p in leaves)
    return "numba" if on_cpu else "torch"


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


def _kernel_apply(backend: str, update, numba_apply):
    """``apply`` for optimizers whose only fused kernel is Numba's: it where ``backend`` resolves
    to numba for these params, else ``update`` plus an in-place add."""

    def apply_(grads, state, params):
        if _resolve_backend(backend, params) == "numba":
            _check_fused_leaves(params, "numba")
            return numba_apply(grads, state, params)
        return _update_in_place(update, grads, state, params)

    return apply_
