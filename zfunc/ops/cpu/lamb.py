"""LAMB on CPU in Numba: CPU-Adam's kernel family (``zfunc.ops.cpu.adam``) with a trust ratio per tensor.

Per tensor, with ``bc1 = 1-b1^t``, ``bc2 = 1-b2^t`` (1 without bias correction), as ``zfunc.optim.lamb``
(DeepSpeed FusedLamb's formulas):

    m = m b1 + (1-b1) g;  v = v b2 + ((1-b2) g) g;  u = (m / bc1) / (sqrt(v / bc2) + eps) + wd p
    p = p + (-(lr * clamp(||p|| / ||u||, min_coeff, max_coeff))) u        (ratio 1 where a norm is 0)

Two passes per tensor: the moments, with ``||p||^2`` and ``||u||^2`` summed on the way (fp32 partials of
``_SQ_BLOCK`` elements, added in fp64); then the step, ``u`` recomputed from the new moments by the same
code (the same bits). Law (tests/test_cpu_lamb.py): m and v bit-equal to the pure update's torch ops, p
within 1e-6 over several steps (the norms are summed in fp64 here, in fp32 there; 1/bc1 and 1/bc2 are
multiplied where torch divides). Cost: reads g, p, m, v
and writes m, v, then reads p, m, v and writes p: 40 B/param with fp32 grads (Adam's pass moves 28); no
temporaries. Large tensors run on ``adam.get_num_threads()`` threads (a libgomp team), the small ones on
the calling thread over a table of their addresses, one call per pass.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from zfunc.ops.cpu import gomp
from zfunc.ops.cpu import adam as _adam
from zfunc.ops.cpu.adam import _PARALLEL_MIN
from zfunc.ops.cpu.blocks import _prange_of
from zfunc.ops.cpu.checks import _GRAD, _leaf_ok, _reject
from zfunc.ops.cpu.intrinsics import _F32, _JIT, _SQ_BLOCK, _add_square, _load, _ptr, _sqrt

__all__ = ["lamb_many_", "trust_ratio"]


def trust_ratio(w_sq: float, u_sq: float, min_coeff: float, max_coeff: float) -> float:
    """``sqrt(w_sq) / sqrt(u_sq)`` clamped to ``[min_coeff, max_coeff]``; 1 where either is 0."""
    w, r = math.sqrt(w_sq), math.sqrt(u_sq)
    if w == 0.0 or r == 0.0:
        return 1.0
    return min(max(w / r, min_coeff), max_coeff)


@njit(inline="always")
def _direction(mi, vi, pi, inv_bc1, inv_bc2, eps, wd, use_wd):
    # torch's ops in its order (no fused multiply-adds: the pure update's are separate kernels), except
    # that it multiplies by 1/bc1 and 1/bc2 where torch divides (as zfunc.ops.gpu.lamb does): the loop is
    # divider-bound, and two divisions fewer of three make it ~1.5x faster, at <= 1 ulp on u.
    u = (mi * inv_bc1) / (_sqrt(vi * inv_bc2) + eps)
    return u + wd * pi if use_wd else u


@njit(**_JIT)
def _moments_block(lo, hi, p_at, g_at, m_at, v_at, g_tag, sq_at, lo0, per, b1, omb1, b2, omb2, bc1, bc2, eps, wd):
    """Moments on [lo, hi); ``||p||^2`` and ``||u||^2`` over it to ``sq[2c]``, ``sq[2c + 1]``,
    ``c = (lo - lo0) // per`` (one slot pair per chunk of a team's range, summed by the caller)."""
    p, m, v, g = _ptr(p_at, _F32), _ptr(m_at, _F32), _ptr(v_at, _F32), _ptr(g_at, g_tag)
    b1, omb1, b2, omb2 = np.float32(b1), np.float32(omb1), np.float32(b2), np.float32(omb2)
    inv_bc1, inv_bc2, eps, wd = np.float32(1.0 / bc1), np.float32(1.0 / bc2), np.float32(eps), np.float32(wd)
    use_wd = wd != np.float32(0.0)
    lo, hi = np.uintp(lo), np.uintp(hi)  # unsigned: no wraparound check, so loops vectorize
    w_acc, u_acc = np.float64(0.0), np.float64(0.0)
    for a in range(lo, hi, np.uintp(_SQ_BLOCK)):
        w_part, u_part = np.float32(0.0), np.float32(0.0)
        for i in range(a, min(a + np.uintp(_SQ_BLOCK), hi)):
            gi = _load(g, i)
            mi = m[i] * b1 + omb1 * gi
            vi = v[i] * b2 + (omb2 * gi) * gi
            m[i] = mi
            v[i] = vi
            pi = p[i]
            ui = _direction(mi, vi, pi, inv_bc1, inv_bc2, eps, wd, use_wd)
            w_part = _add_square(w_part, pi)
            u_part = _add_square(u_part, ui)
        w_acc += np.float64(w_part)
        u_acc += np.float64(u_part)
    if hi > lo:  # an empty chunk (a team's range cut short) owns no slot
        sq = _ptr(sq_at, np.float64(0.0))
        c = (lo - np.uintp(lo0)) // np.uintp(per)
        sq[2 * c] = w_acc
        sq[2 * c + 1] = u_acc


@njit(**_JIT)
def _step_block(lo, hi, p_at, m_at, v_at, neg_step, bc1, bc2, eps, wd):
    """``p += neg_step * u`` on [lo, hi), u from the moments as ``_moments_block`` made it."""
    p, m, v = _ptr(p_at, _F32), _ptr(m_at, _F32), _ptr(v_at, _F32)
    neg_step, inv_bc1, inv_bc2 = np.float32(neg_step), np.float32(1.0 / bc1), np.float32(1.0 / bc2)
    eps, wd = np.float32(eps), np.float32(wd)
    use_wd = wd != np.float32(0.0)
    for i in range(np.uintp(lo), np.uintp(hi)):
        pi = p[i]
        p[i] = pi + neg_step * _direction(m[i], v[i], pi, inv_bc1, inv_bc2, eps, wd, use_wd)


@njit(**_JIT)
def _moments_rows(table, wds, g_tag, sq_at, b1, omb1, b2, omb2, bc1, bc2, eps):
    """``_moments_block`` over each row ``(p, g, m, v, n)`` of ``table`` with weight decay
    ``wds[r]``, on the calling thread; row r's sums to ``sq[2r]``, ``sq[2r + 1]``."""
    for r in range(table.shape[0]):
        n = table[r, 4]
        _moments_block(0, n, table[r, 0], table[r, 1], table[r, 2], table[r, 3], g_tag, sq_at + 16 * r, 0,
                       max(n, 1), b1, omb1, b2, omb2, bc1, bc2, eps, wds[r])


@njit(**_JIT)
def _step_rows(table, wds, neg_steps, bc1, bc2, eps):
    """``_step_block`` over each row ``(p, g, m, v, n)`` of ``table`` with ``wds[r]``, ``neg_steps[r]``."""
    for r in range(table.shape[0]):
        _step_block(0, table[r, 4], table[r, 0], table[r, 2], table[r, 3], neg_steps[r], bc1, bc2, eps, wds[r])


@njit(**_JIT)
def _moments_gomp(k, args):
    gomp.parallel_range(_moments_block, k, args)


@njit(**_JIT)
def _step_gomp(k, args):
    gomp.parallel_range(_step_block, k, args)


if gomp.AVAILABLE:
    _moments_team, _step_team = _moments_gomp, _step_gomp
else:
    _moments_team, _step_team = _prange_of(_moments_block), _prange_of(_step_block)


def lamb_many_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 0.0, bias_correction: bool = True, min_coeff: float = 0.01,
               max_coeff: float = 10.0, decay: list[bool] | None = None) -> None:
    """LAMB on every leaf of the lists, in place (module docstring). ``step`` counts from 1; ``decay``:
    per leaf, whether ``weight_decay`` applies (None: all). Leaves: contiguous CPU tensors of any shape,
    params, exp_avgs, exp_avg_sqs fp32, grads fp32/bf16/fp16, each the size of its param."""
    n = len(params)
    flags = [True] * n if decay is None else decay
    if not len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(flags) == n:
        raise ValueError(f"lamb_many_: expected lists of one length, got params {n}, grads {len(grads)}, exp_avgs "
                         f"{len(exp_avgs)}, exp_avg_sqs {len(exp_avg_sqs)}, decay {len(flags)}")
    if type(step) is not int or step < 1:
        raise ValueError(f"lamb_many_: step must be an int >= 1 (bias correction is 1 - beta**step), got {step!r}")
    b1, b2, lr = float(beta1), float(beta2), float(lr)
    bc1, bc2 = (1.0 - b1 ** step, 1.0 - b2 ** step) if bias_correction else (1.0, 1.0)
    moments = (b1, 1.0 - b1, b2, 1.0 - b2, bc1, bc2, float(eps))
    wd = float(weight_decay)
    small: dict[type, list] = {}  # grad tag type -> [tag, rows of small leaves]
    for p, g, m, v, d in zip(params, grads, exp_avgs, exp_avg_sqs, flags):
        size = p.numel()
        g_tag = _GRAD.get(g.dtype)
        if not (_leaf_ok(p, size, (torch.float32,)) and g_tag is not None and _leaf_ok(g, size, _GRAD)
                and _leaf_ok(m, size, (torch.float32,)) and _leaf_ok(v, size, (torch.float32,))):
            f32 = (torch.float32,)
            for name, t, dtypes in (("param", p, f32), ("grad", g, _GRAD), ("exp_avg", m, f32), ("exp_avg_sq", v, f32)):
                flat = t.reshape(-1) if isinstance(t, torch.Tensor) and t.is_contiguous() else t
                _reject(flat, name, dtypes, size, "lamb_many_")  # raises, naming the culprit
        leaf_wd = wd if d else 0.0
        if size >= _PARALLEL_MIN:
            k = _adam.get_num_threads()  # read per call: 1 in a forked child
            per = _chunk(size, k)
            sq = np.zeros(2 * k, dtype=np.float64)
            _run(_moments_block, _moments_team, k, (0, size, p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
                                                   g_tag, sq.ctypes.data, 0, per) + moments + (leaf_wd,))
            ratio = trust_ratio(float(sq[0::2].sum()), float(sq[1::2].sum()), min_coeff, max_coeff)
            _run(_step_block, _step_team, k, (0, size, p.data_ptr(), m.data_ptr(), v.data_ptr(), -(lr * ratio),
                                             bc1, bc2, float(eps), leaf_wd))
        elif size:
            small.setdefault(type(g_tag), [g_tag]).append(
                (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), size, leaf_wd))
    for g_tag, *rows in small.values():
        table = np.array([r[:5] for r in rows], dtype=np.int64)
        wds = np.array([r[5] for r in rows], dtype=np.float64)
        sq = np.zeros(2 * len(rows), dtype=np.float64)
        _moments_rows(table, wds, g_tag, sq.ctypes.data, *moments)
        steps = np.array([-(lr * trust_ratio(float(sq[2 * r]), float(sq[2 * r + 1]), min_coeff, max_coeff))
                          for r in range(len(rows))], dtype=np.float64)
        _step_rows(table, wds, steps, bc1, bc2, float(eps))


def _chunk(size: int, k: int) -> int:
    """Elements per chunk of a k-thread team over [0, size) (``gomp.chunk_length``); size on one thread."""
    return max(((size + k - 1) // k + gomp.ALIGN - 1) // gomp.ALIGN * gomp.ALIGN if k > 1 else size, 1)


def _run(block, team, k: int, args: tuple) -> None:
    if k == 1:
        block(*args)
    else:
        team(k, args)
