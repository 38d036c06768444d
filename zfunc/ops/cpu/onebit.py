"""The 1-bit optimizers' update on a frozen variance, in Numba: one pass where torch takes seven; and
the local momentum each rank compresses, ``m b1 + (1 - b1) g``, in one pass where torch takes three
(the same bits: fp32 products and sum, as torch's).

``frozen_adam_update(p, m, v, lr, decay, eps)`` returns the update ``u`` of ``p = p decay - lr m /
(sqrt(v) + eps)``, as ``u = new_p - p`` (the ``GradientTransformation`` contract), for fp32 CPU
tensors: one read of p, m and v and one write of u (torch: ``v.sqrt()``, ``+ eps``, ``m /``, ``lr *``,
``p * decay``, ``-``, ``- p``, each a pass and a temporary); ``frozen_adam_apply_`` adds it into ``p``
in the same pass (``optim.apply``'s in-place update: no update tensor, whose fresh pages cost more than
the pass itself). Law: the same fp32 operations per element in the same order as ``zfunc.optim.onebit``'s
torch expression, the square root correctly rounded (torch's vectorized one can be an ulp off it): within
an ulp of ``sqrt(v)`` of the torch result (tests/test_onebit.py). Cost: on the calling thread.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

_JIT = dict(cache=True, fastmath=False, nogil=True, error_model="numpy", boundscheck=False)


@njit(**_JIT)
def _frozen_update(p, m, v, lr, decay, use_decay, eps, out):
    for i in range(p.shape[0]):
        x = p[i]
        new = x * decay if use_decay else x
        out[i] = (new - lr * (m[i] / (np.sqrt(v[i]) + eps))) - x


def usable(*tensors: torch.Tensor) -> bool:
    """Every tensor fp32, on the CPU, contiguous, of one size: the kernel's inputs."""
    n = tensors[0].numel()
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and t.numel() == n
               for t in tensors)


def frozen_adam_update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, decay: float | None,
                       eps: float) -> torch.Tensor:
    """``(p decay - lr (m / (sqrt(v) + eps))) - p`` (``decay`` None: no decay), shaped as ``p``."""
    out = torch.empty_like(p)
    _frozen_update(p.view(-1).numpy(), m.view(-1).numpy(), v.view(-1).numpy(), np.float32(lr),
                   np.float32(1.0 if decay is None else decay), decay is not None, np.float32(eps),
                   out.view(-1).numpy())
    return out


@njit(**_JIT)
def _frozen_apply(p, m, v, lr, decay, use_decay, eps):
    for i in range(p.shape[0]):
        x = p[i]
        new = x * decay if use_decay else x
        p[i] = x + ((new - lr * (m[i] / (np.sqrt(v[i]) + eps))) - x)


def frozen_adam_apply_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, decay: float | None,
                       eps: float) -> None:
    """``p`` <- ``p + frozen_adam_update(p, m, v, lr, decay, eps)``, in place, in the same pass: the bits of
    the update added into ``p`` (``optim.apply``'s ``p + u``), no update tensor."""
    _frozen_apply(p.view(-1).numpy(), m.view(-1).numpy(), v.view(-1).numpy(), np.float32(lr),
                  np.float32(1.0 if decay is None else decay), decay is not None, np.float32(eps))


@njit(**_JIT)
def _momentum(m, g, b1, rest, out):
    for i in range(m.shape[0]):
        out[i] = m[i] * b1 + rest * g[i]


def local_momentum(m: torch.Tensor, g: torch.Tensor, b1: float) -> torch.Tensor:
    """``m * b1 + (1 - b1) * g`` (fp32, one pass; the same bits as torch's), shaped as ``m``."""
    out = torch.empty_like(m)
    _momentum(m.view(-1).numpy(), g.reshape(-1).numpy(), np.float32(b1), np.float32(1 - b1), out.view(-1).numpy())
    return out


def local_momentum_(m: torch.Tensor, g: torch.Tensor, b1: float) -> torch.Tensor:
    """``local_momentum`` written into ``m`` itself (each element read before it is written); returns ``m``."""
    flat = m.view(-1).numpy()
    _momentum(flat, g.reshape(-1).numpy(), np.float32(b1), np.float32(1 - b1), flat)
    return m
