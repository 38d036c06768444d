"""SGD with momentum and Lion, the optimizers with one trace buffer per param (re-exported by
``zfunc.optim``): a pure ``update`` as torch's, and an in-place ``apply`` through zfunc's Numba kernels
where the state is contiguous fp32 on the CPU (``zfunc.optim.kernels``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from zfunc.core import tree
from zfunc.ops.cpu import hostmem
from zfunc.optim.base import (GradientTransformation, MaskOrFn, PyTree, ScalarOrSchedule, _check_betas,
                              _check_non_negative, _grad_leaves, _mask_leaves)
from zfunc.optim.kernels import _as_kernel_grad, _check_backend, _kernel_apply, _zeros_like
from zfunc.optim.schedules import _as_schedule


class TraceState(NamedTuple):
    """``count``: updates applied so far; ``trace``: momentum buffers shaped like params."""

    count: int
    trace: PyTree


def sgd(learning_rate: ScalarOrSchedule, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, mask: MaskOrFn = None, backend: str = "auto") -> GradientTransformation:
    """SGD with momentum, as ``torch.optim.SGD``: ``g += wd p; b = mu b + (1-damp) g`` (``b = g`` at
    the first step); ``d = g + mu b`` if nesterov else ``b``; ``p -= lr d``.

    ``backend`` as ``adamw``: ``"numba"`` updates in place with zfunc's CPU kernel, ``"torch"``
    through ``update``."""
    _check_betas(momentum=momentum, dampening=dampening)
    _check_non_negative(weight_decay=weight_decay)
    _check_backend(backend)
    if not isinstance(nesterov, bool):
        raise ValueError(f"nesterov: expected a bool, got {nesterov!r}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov: needs momentum > 0 and dampening == 0")
    lr = _as_schedule(learning_rate)

    def init(params):
        return TraceState(0, tree.map(lambda p: hostmem.zeros_like(p) if momentum else None, params))

    def update(grads, state, params=None):
        g_leaves, treespec = _grad_leaves(grads, params)
        if weight_decay and params is None:
            raise ValueError("params: sgd with weight_decay needs the current params, got None")
        p_leaves = tree.leaves(params) if params is not None else [None] * len(g_leaves)
        decay = _mask_leaves(mask, params, len(g_leaves)) if weight_decay else [False] * len(g_leaves)
        traces = tree.leaves(state.trace) if momentum else [None] * len(g_leaves)
        step_lr = lr(state.count)
        updates, new_traces = [], []
        for g, p, d, b in zip(g_leaves, p_leaves, decay, traces):
            if g is None:  # no grad: left alone, momentum untouched, as torch does
                updates.append(None)
                new_traces.append(b)
                continue
            if d:
                g = g + weight_decay * p
            if momentum:
                b = g.clone() if state.count == 0 else b * momentum + (1 - dampening) * g
                g = g + momentum * b if nesterov else b
            updates.append(-step_lr * g)
            new_traces.append(b)
        trace = tree.unflatten(treespec, new_traces) if momentum else state.trace
        return tree.unflatten(treespec, updates), TraceState(state.count + 1, trace)

    def numba_apply(grads, state, params):
        from zfunc.ops.cpu import adam as cpu_adam

        p_leaves, treespec = tree.flatten(params)
        decay = _mask_leaves(mask, params, len(p_leaves))
        traces = tree.leaves(state.trace) if momentum else [None] * len(p_leaves)
        for p, g, b, d in zip(p_leaves, _grad_leaves(grads, params)[0], traces, decay):
            if g is None:
                continue
            cpu_adam.sgd_(p.view(-1), g.contiguous().view(-1), None if b is None else b.view(-1),
                          lr=float(lr(state.count)), momentum=momentum, dampening=dampening, nesterov=nesterov,
                          weight_decay=weight_decay if d else 0.0, first_step=state.count == 0)
        return tree.unflatten(treespec, p_leaves), TraceState(state.count + 1, state.trace)

    return GradientTransformation(init, update, _kernel_apply(backend, update, numba_apply),
                                  lambda state: lr(state.count))


def lion(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 0.0,
         mask: MaskOrFn = None, backend: str = "auto") -> GradientTransformation:
    """Lion (Chen et al., 2023): ``p = p (1 - lr wd) - lr sign(b1 m + (1-b1) g);  m = b2 m + (1-b2) g``.

    ``backend`` as ``sgd``, and on contiguous fp32 params on one GPU ``"auto"`` (or ``"cupy"``)
    updates in place with zfunc's CUDA kernel (``zfunc.ops.gpu.lion``) where CuPy is installed."""
    _check_betas(b1=b1, b2=b2)
    _check_non_negative(weight_decay=weight_decay)
    _check_backend(backend)
    lr = _as_schedule(learning_rate)

    def init(params):
        return TraceState(0, _zeros_like(params))

    def update(grads, state, params=None):
        g_leaves, treespec = _grad_leaves(grads, params)
        p_leaves, m_leaves = tree.leaves(params), tree.leaves(state.trace)
        decay = _mask_leaves(mask, params, len(g_leaves))
        step_lr = lr(state.count)
        updates, new_m = [], []
        for g, p, m, d in zip(g_leaves, p_leaves, m_leaves, decay):
            if g is None:  # no grad: left alone
                updates.append(None)
                new_m.append(m)
                continue
            g = g.to(m.dtype)
            u = -step_lr * torch.sign(m.lerp(g, 1 - b1))
            if weight_decay and d:
                u = u - step_lr * weight_decay * p
            updates.append(u)
            new_m.append(m.lerp(g, 1 - b2))
        return tree.unflatten(treespec, updates), TraceState(state.count + 1, tree.unflatten(treespec, new_m))

    def numba_apply(grads, state, params):
        from zfunc.ops.cpu import adam as cpu_adam

        p_leaves, treespec = tree.flatten(params)
        decay = _mask_leaves(mask, params, len(p_leaves))
        for p, g, m, d in zip(p_leaves, _grad_leaves(grads, params)[0], tree.leaves(state.trace), decay):
            if g is None:
                continue
            cpu_adam.lion_(p.view(-1), g.contiguous().view(-1), m.view(-1), lr=float(lr(state.count)), beta1=b1,
                           beta2=b2, weight_decay=weight_decay if d else 0.0)
        return tree.unflatten(treespec, p_leaves), TraceState(state.count + 1, state.trace)

    def cupy_apply(grads, state, params):
        from zfunc.ops.gpu import lion as gpu_lion

        p_leaves, treespec = tree.flatten(params)
        decay = _mask_leaves(mask, params, len(p_leaves))
        g_leaves, m_leaves = _grad_leaves(grads, params)[0], tree.leaves(state.trace)
        idx = [i for i, g in enumerate(g_leaves) if g is not None]
        gpu_lion.lion_many_([p_leaves[i] for i in idx], [_as_kernel_grad(g_leaves[i], p_leaves[i].device) for i in idx],
                            [m_leaves[i] for i in idx], lr=float(lr(state.count)), beta1=b1, beta2=b2,
                            weight_decay=weight_decay, decay=[bool(decay[i]) for i in idx])
        return tree.unflatten(treespec, p_leaves), TraceState(state.count + 1, state.trace)

    return GradientTransformation(init, update, _kernel_apply(backend, update, numba_apply, cupy_apply),
                                  lambda state: lr(state.count))
