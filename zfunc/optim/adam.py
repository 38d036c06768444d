"""Adam and AdamW (re-exported by ``zfunc.optim``): the pure ``update`` in the order of
``torch.optim.AdamW``'s single-tensor loop, and the fused in-place ``apply`` (one kernel call per
(device, dtype, decays?) group; ``zfunc.optim.kernels`` picks the kernel).
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import optree
import torch

from zfunc.core import tree
from zfunc.optim.base import (GradientTransformation, MaskOrFn, PyTree, ScalarOrSchedule, _check_betas,
                              _check_non_negative, _check_number, _grad_leaves, _mask_leaves)
from zfunc.optim.kernels import (_check_backend, _check_fused_leaves, _copy_pairs, _cupy_adam, _numba_adam,
                                 _resolve_backend, _zeros_like)
from zfunc.optim.schedules import _as_schedule


class AdamState(NamedTuple):
    """``count``: updates applied so far; ``mu``/``nu``: first/second moments, shaped and typed like params."""

    count: int
    mu: PyTree
    nu: PyTree


def _adam_update(grads, state, params, *, lr, b1, b2, eps, weight_decay, decoupled, mask, bias_correction=True):
    """Pure Adam/AdamW in the order of ``torch.optim.AdamW``'s single-tensor loop (without bias
    correction: ``bc1 = bc2 = 1``)."""
    if params is None:
        raise ValueError("params: adam/adamw need the current params for weight decay, got None")
    g_leaves, treespec = _grad_leaves(grads, params)
    p_leaves, m_leaves, v_leaves = tree.leaves(params), tree.leaves(state.mu), tree.leaves(state.nu)
    decay = _mask_leaves(mask, params, len(p_leaves))
    count = state.count + 1
    step_lr = lr(state.count)
    bc1, bc2_sqrt = (1 - b1**count, math.sqrt(1 - b2**count)) if bias_correction else (1.0, 1.0)
    updates, mus, nus = [], [], []
    for g, p, m, v, d in zip(g_leaves, p_leaves, m_leaves, v_leaves, decay):
        if g is None:  # no grad: left alone, as torch does
            updates.append(None)
            mus.append(m)
            nus.append(v)
            continue
        g = g.to(m.dtype)
        p32 = p.to(m.dtype)
        if weight_decay and d and not decoupled:
            g = g + weight_decay * p32
        m = m.lerp(g, 1 - b1)
        v = v * b2 + (1 - b2) * g * g
        denom = v.sqrt() / bc2_sqrt + eps
        new_p = p32 * (1 - step_lr * weight_decay) if (weight_decay and d and decoupled) else p32
        new_p = new_p - (step_lr / bc1) * (m / denom)
        updates.append(new_p - p32)
        mus.append(m)
        nus.append(v)
    unflat = lambda xs: tree.unflatten(treespec, xs)  # noqa: E731
    return unflat(updates), AdamState(count, unflat(mus), unflat(nus))


def _adam_apply_fused(grads, state, params, *, lr, b1, b2, eps, weight_decay, decoupled, mask, backend, out=None,
                      squares=None, grad_scale=None):
    """In-place Adam/AdamW: one fused kernel call per (device, dtype, decays?) group (torch's
    multi-tensor kernel; zfunc's CPU-Adam or CUDA AdamW over all the leaves: ``adamw_many_``, the
    decay mask a flag per leaf); ``out``, ``squares`` (zfunc's kernels only: a float from CPU-Adam, a
    0-d fp64 device tensor from the CUDA kernel) and ``grad_scale`` (zfunc's kernels: in their pass;
    torch: a multiply of the grads cast to the params' dtype) as in ``apply``."""
    p_leaves, treespec = optree.tree_flatten(params, namespace=tree.NAMESPACE)
    backend = _resolve_backend(backend, p_leaves)
    g_leaves = treespec.flatten_up_to(grads)
    try:  # the moments along the params' treespec (~10x cheaper than a flatten); flattened where containers differ
        m_leaves, v_leaves = treespec.flatten_up_to(state.mu), treespec.flatten_up_to(state.nu)
    except ValueError:
        m_leaves, v_leaves = _leaves_like(treespec, state.mu), _leaves_like(treespec, state.nu)
    o_leaves = None if out is None else treespec.flatten_up_to(out)
    decay = None if mask is None else _mask_leaves(mask, params, len(p_leaves))
    count = state.count + 1
    step_lr = float(lr(state.count))
    if backend == "numba" or backend == "cupy":  # updated in place: the same trees
        kernel = _numba_adam if backend == "numba" else _cupy_adam
        sq = kernel(p_leaves, g_leaves, m_leaves, v_leaves, o_leaves, decay, count, step_lr, b1, b2, eps,
                    weight_decay, decoupled, squares is not None, 1.0 if grad_scale is None else grad_scale)
        if squares is not None:
            squares.append(sq)
        return params, AdamState(count, state.mu, state.nu)
    groups: dict[tuple, list[int]] = {}
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves)):
        if g is not None:  # a param without grad is left alone
            groups.setdefault((p.device, p.dtype, decay is None or decay[i]), []).append(i)
        elif o_leaves is not None and o_leaves[i] is not None:
            o_leaves[i].copy_(p)
    for key, idx in groups.items():
        wd = weight_decay if key[-1] else 0.0
        ps, ms, vs = [p_leaves[i] for i in idx], [m_leaves[i] for i in idx], [v_leaves[i] for i in idx]
        gs = [g_leaves[i].to(ps[0].dtype) for i in idx]
        if grad_scale is not None and grad_scale != 1.0:
            torch._foreach_mul_(gs, grad_scale)  # apply owns the grads: in place where the cast kept them
        steps = [torch.tensor(float(count), device=key[0])] * len(ps)
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel(ps, gs, ms, vs, [], steps, lr=step_lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
               amsgrad=False, maximize=False)
        _copy_pairs(ps, [None] * len(idx) if o_leaves is None else [o_leaves[i] for i in idx])
    mu, nu = tree.unflatten(treespec, m_leaves), tree.unflatten(treespec, v_leaves)
    return tree.unflatten(treespec, p_leaves), AdamState(count, mu, nu)


def _leaves_like(treespec: optree.PyTreeSpec, moments: PyTree) -> list[Any]:
    """The leaves of ``moments``, a tree shaped like the params (``treespec``): read along that
    treespec (~10x cheaper than a flatten), or flattened where its containers differ."""
    try:
        return treespec.flatten_up_to(moments)
    except ValueError:
        return tree.leaves(moments)


def _adam_family(learning_rate, b1, b2, eps, weight_decay, mask, backend, decoupled,
                 bias_correction=True) -> GradientTransformation:
    _check_betas(b1=b1, b2=b2)
    if not isinstance(bias_correction, bool):
        raise ValueError(f"bias_correction: expected a bool, got {bias_correction!r}")
    _check_number("eps", eps, "a finite float > 0", lambda x: x > 0)
    _check_non_negative(weight_decay=weight_decay)
    _check_backend(backend)
    hyper = dict(lr=_as_schedule(learning_rate), b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                 decoupled=decoupled, mask=mask)

    def init(params):
        _check_fused_leaves(params, backend)
        return AdamState(0, _zeros_like(params), _zeros_like(params))

    def update(grads, state, params=None):
        return _adam_update(grads, state, params, bias_correction=bias_correction, **hyper)

    if not bias_correction:  # the fused kernels always correct: the pure update runs
        return GradientTransformation(init, update, None, lambda state: hyper["lr"](state.count))

    # apply(grads, state, params, out=None, squares=None, grad_scale=None): a partial, no Python frame of its own
    apply_ = functools.partial(_adam_apply_fused, backend=backend, **hyper)
    return GradientTransformation(init, update, apply_, lambda state: hyper["lr"](state.count), writes_out=True,
                                  sums_squares=True, scales_grads=True)


def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-2, mask: MaskOrFn = None, backend: str = "auto",
          bias_correction: bool = True) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter, 2019), equal to ``torch.optim.AdamW`` with the same arguments.

    ``m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  p = p (1 - lr wd) - lr/(1-b1^t) * m / (sqrt(v/(1-b2^t)) + eps)``

    Args:
      mask: which params decay: a pytree of bools shaped like params, or a function of params
        returning one (e.g. ``decay_mask``); ``None`` decays all, as torch does.
      backend: the fused in-place kernel: ``"torch"`` (``torch._fused_adamw_``, CPU or CUDA),
        ``"numba"`` (zfunc's CPU-Adam; contiguous fp32 CPU params only), ``"cupy"`` (zfunc's CUDA
        AdamW, ``zfunc.ops.gpu.adam``; contiguous fp32 CUDA params, CuPy installed) or ``"auto"``:
        the placement picks: numba where every param is a contiguous fp32 CPU tensor (any shape:
        each leaf is viewed 1-D; a plain or sharded step on the CPU, offload), cupy where every
        param is a contiguous fp32 tensor on one GPU and CuPy is installed (``ZFUNC_GPU_KERNELS=0``:
        never), torch otherwise.
        The two agree to rtol = atol = 1e-6 over 20 steps (``zfunc.ops.cpu.adam``'s law).
      bias_correction: False drops ``1-b1^t`` and ``1-b2^t`` (DeepSpeed's 1-bit optimizers' Adam,
        ``zfunc.optim.onebit``); the pure ``update`` runs then, no fused kernel.
    State: ``AdamState(count, mu, nu)``, moments in the params' dtype (8 bytes per fp32 param).
    """
    return _adam_family(learning_rate, b1, b2, eps, weight_decay, mask, backend, decoupled=True,
                        bias_correction=bias_correction)


def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         weight_decay: float = 0.0, mask: MaskOrFn = None, backend: str = "auto") -> GradientTransformation:
    """Adam (Kingma & Ba, 2015) with L2 weight decay added to the grad, as ``torch.optim.Adam``.

    Arguments as ``adamw``.
    """
    return _adam_family(learning_rate, b1, b2, eps, weight_decay, mask, backend, decoupled=False)
