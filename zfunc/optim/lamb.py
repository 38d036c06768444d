"""LAMB (re-exported by ``zfunc.optim``): Adam's direction scaled per param tensor by a trust ratio,
as DeepSpeed's FusedLamb and You et al., 2020 ("Large Batch Optimization for Deep Learning").
"""
from __future__ import annotations

import torch

from zfunc.core import tree
from zfunc.optim.adam import AdamState
from zfunc.optim.base import (GradientTransformation, MaskOrFn, ScalarOrSchedule, _check_betas, _check_non_negative,
                              _check_number, _grad_leaves, _mask_leaves)
from zfunc.optim.kernels import _GRAD_DTYPES, _as_kernel_grad, _check_backend, _kernel_apply, _zeros_like
from zfunc.optim.schedules import _as_schedule


def trust_ratio(p: torch.Tensor, u: torch.Tensor, min_coeff: float, max_coeff: float) -> float:
    """``||p|| / ||u||`` clamped to ``[min_coeff, max_coeff]``; 1 where either norm is 0 (a zero
    param or a zero update: nothing to scale against), as FusedLamb's kernel does."""
    w, r = float(torch.linalg.vector_norm(p)), float(torch.linalg.vector_norm(u))
    if w == 0.0 or r == 0.0:
        return 1.0
    return min(max(w / r, min_coeff), max_coeff)


def lamb_direction(m: torch.Tensor, v: torch.Tensor, p: torch.Tensor, *, eps: float, weight_decay: float,
                   bc1: float = 1.0, bc2: float = 1.0) -> torch.Tensor:
    """The per-element LAMB direction ``(m / bc1) / (sqrt(v / bc2) + eps) + wd p`` (fp32)."""
    u = (m / bc1) / ((v / bc2).sqrt() + eps) if (bc1, bc2) != (1.0, 1.0) else m / (v.sqrt() + eps)
    return u + weight_decay * p if weight_decay else u


def _as_cpu_grad(g: torch.Tensor) -> torch.Tensor:
    """``g`` as the CPU kernel reads it: contiguous fp32/bf16/fp16 in CPU RAM (else an fp32 copy)."""
    return g if g.dtype in _GRAD_DTYPES and g.is_cpu and g.is_contiguous() else g.float().cpu().contiguous()


def _check_coeffs(min_coeff: float, max_coeff: float) -> None:
    _check_number("min_coeff", min_coeff, "a finite float > 0", lambda x: x > 0)
    _check_number("max_coeff", max_coeff, f"a finite float >= min_coeff ({min_coeff})", lambda x: x >= min_coeff)


def lamb(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         weight_decay: float = 0.0, bias_correction: bool = True, max_coeff: float = 10.0, min_coeff: float = 0.01,
         mask: MaskOrFn = None, backend: str = "auto") -> GradientTransformation:
    """LAMB with DeepSpeed FusedLamb's arguments and defaults. Per param tensor:

    ``m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  u = m^ / (sqrt(v^) + eps) + wd p;
    p = p - lr * clamp(||p|| / ||u||, min_coeff, max_coeff) * u``

    where ``m^ = m / (1 - b1^t)`` and ``v^ = v / (1 - b2^t)`` with ``bias_correction`` (else ``m``,
    ``v``), and the trust ratio is 1 where ``||p||`` or ``||u||`` is 0. ``mask``: which params decay,
    as ``adamw``'s. Law: equals a plain-torch LAMB of these formulas to 1e-6 (tests/test_lamb.py).
    State: ``AdamState(count, mu, nu)`` (8 bytes per fp32 param). Cost: Adam's passes plus two norms
    per tensor (each a host sync: the ratio is a Python float, as FusedLamb reads it back). ``backend``:
    on contiguous fp32 CPU params, ``"auto"`` (or ``"numba"``) runs zfunc's Numba LAMB in place
    (``zfunc.ops.cpu.lamb``: two passes per tensor, no temporaries; grads fp32/bf16/fp16); on contiguous
    fp32 params on one GPU, ``"auto"`` (or ``"cupy"``) runs zfunc's CUDA LAMB in place
    (``zfunc.ops.gpu.lamb``: the ratios on the device, no host sync) where CuPy is installed; any
    other resolution (``"torch"``, other dtypes, strided params) runs the pure update.
    """
    _check_betas(b1=b1, b2=b2)
    _check_number("eps", eps, "a finite float > 0", lambda x: x > 0)
    _check_non_negative(weight_decay=weight_decay)
    _check_coeffs(min_coeff, max_coeff)
    _check_backend(backend)
    if not isinstance(bias_correction, bool):
        raise ValueError(f"bias_correction: expected a bool, got {bias_correction!r}")
    lr = _as_schedule(learning_rate)

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("params: lamb needs the current params for its trust ratio, got None")
        g_leaves, treespec = _grad_leaves(grads, params)
        p_leaves, m_leaves, v_leaves = tree.leaves(params), tree.leaves(state.mu), tree.leaves(state.nu)
        decay = _mask_leaves(mask, params, len(p_leaves))
        count = state.count + 1
        bc1, bc2 = (1 - b1**count, 1 - b2**count) if bias_correction else (1.0, 1.0)
        step_lr = lr(state.count)
        updates, mus, nus = [], [], []
        for g, p, m, v, d in zip(g_leaves, p_leaves, m_leaves, v_leaves, decay):
            if g is None:  # no grad: left alone, as torch does
                updates.append(None)
                mus.append(m)
                nus.append(v)
                continue
            g, p32 = g.to(m.dtype), p.to(m.dtype)
            m = m * b1 + (1 - b1) * g
            v = v * b2 + (1 - b2) * g * g
            u = lamb_direction(m, v, p32, eps=eps, weight_decay=weight_decay if d else 0.0, bc1=bc1, bc2=bc2)
            updates.append(-(step_lr * trust_ratio(p32, u, min_coeff, max_coeff)) * u)
            mus.append(m)
            nus.append(v)
        unflat = lambda xs: tree.unflatten(treespec, xs)  # noqa: E731
        return unflat(updates), AdamState(count, unflat(mus), unflat(nus))

    def fused(kernel, as_grad):
        """``apply`` by ``kernel()`` (a ``lamb_many_``: zfunc's CPU or CUDA LAMB, imported when first called), each
        grad given as ``as_grad(grad, param)``: the params and moments updated in place, leaves without a grad
        left alone."""

        def apply(grads, state, params):
            p_leaves, treespec = tree.flatten(params)
            g_leaves = _grad_leaves(grads, params)[0]
            m_leaves, v_leaves = tree.leaves(state.mu), tree.leaves(state.nu)
            decay = _mask_leaves(mask, params, len(p_leaves))
            idx = [i for i, g in enumerate(g_leaves) if g is not None]
            kernel()([p_leaves[i] for i in idx], [as_grad(g_leaves[i], p_leaves[i]) for i in idx],
                     [m_leaves[i] for i in idx], [v_leaves[i] for i in idx], step=state.count + 1,
                     lr=float(lr(state.count)), beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay,
                     bias_correction=bias_correction, min_coeff=min_coeff, max_coeff=max_coeff,
                     decay=[bool(decay[i]) for i in idx])
            return tree.unflatten(treespec, p_leaves), AdamState(state.count + 1, state.mu, state.nu)

        return apply

    def cpu_kernel():
        from zfunc.ops.cpu import lamb as cpu_lamb

        return cpu_lamb.lamb_many_

    def gpu_kernel():
        from zfunc.ops.gpu import lamb as gpu_lamb

        return gpu_lamb.lamb_many_

    numba_apply = fused(cpu_kernel, lambda g, p: _as_cpu_grad(g))
    cupy_apply = fused(gpu_kernel, lambda g, p: _as_kernel_grad(g, p.device))
    apply_ = _kernel_apply(backend, update, numba_apply, cupy_apply)
    return GradientTransformation(lambda params: AdamState(0, _zeros_like(params), _zeros_like(params)), update,
                                  apply_, lambda state: lr(state.count))

