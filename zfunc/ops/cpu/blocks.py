"""The compiled updates of AdamW/Adam, Lion and SGD: each one's element update (``_*_one``), its block
over ``[lo, hi)`` on the calling thread (``_*_block``; AdamW's also over a table of small leaves,
``_adamw_table``) and its thread team (``_*_team``: libgomp's, or Numba's prange by ``_prange_of``).
The Python entry points and their law are ``zfunc.ops.cpu.adam``'s."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from zfunc.ops.cpu import gomp
from zfunc.ops.cpu.intrinsics import _F32, _JIT, _fma, _load, _ptr, _put, _sqrt
from zfunc.ops.cpu.sweep import _sweep_of


# ---- kernels: *_block updates [lo, hi) on the calling thread ----
@njit(inline="always")
def _adamw_one(i, args):
    p, g, m, v, scale, decay, l2, use_l2, small, coeff, b2, omb2, inv_bc2s, eps, neg_step = args
    read = _load(g, i) * scale
    gi = read
    pi = p[i] * decay
    if use_l2:
        gi = _fma(pi, l2, gi)
    mi = m[i]
    mi = _fma(coeff, gi - mi, mi if small else gi)
    vi = _fma(omb2 * gi, gi, v[i] * b2)
    pi = pi + neg_step * mi / (_sqrt(vi) * inv_bc2s + eps)
    p[i] = pi
    m[i] = mi
    v[i] = vi
    return pi, read


_adamw_sweep = _sweep_of(_adamw_one)


@njit(**_JIT)
def _adamw_block(lo, hi, p_at, g_at, m_at, v_at, out_at, g_tag, out_tag, stream, sq_at, sq_tag, lo0, per,
                 scale, decay, l2, w, b2, omb2, bc2s, eps, neg_step):
    """AdamW on [lo, hi); where ``sq_tag`` is float64, the sum of squares of the grads read
    (times ``scale``) goes to ``sq[(lo - lo0) // per]``: one slot per chunk of a team's range
    [lo0, ...) cut every ``per`` elements, summed by the caller in a fixed order."""
    p, m, v = _ptr(p_at, _F32), _ptr(m_at, _F32), _ptr(v_at, _F32)
    g, out = _ptr(g_at, g_tag), _ptr(out_at, out_tag)
    # float64 -> float32 once, as torch rounds Python scalars to the tensor dtype.
    scale, decay, l2, w = np.float32(scale), np.float32(decay), np.float32(l2), np.float32(w)
    # sqrt(v) * (1/bc2s), where torch divides: one division fewer makes the loop 25% faster in
    # cache (it is divider-bound there), at <= 1 ulp on the denominator, the size of the error
    # of torch's own (MKL) sqrt. m and v stay bit-equal.
    b2, omb2, inv_bc2s = np.float32(b2), np.float32(omb2), np.float32(1.0 / bc2s)
    eps, neg_step = np.float32(eps), np.float32(neg_step)
    small = abs(w) < np.float32(0.5)  # torch's lerp picks its formula by this
    coeff = w if small else w - np.float32(1.0)
    acc = _adamw_sweep(lo, hi, out, out_at, stream, _ptr(sq_at, sq_tag),
                       (p, g, m, v, scale, decay, l2, l2 != np.float32(0.0), small, coeff, b2, omb2, inv_bc2s, eps,
                        neg_step))
    if hi > lo:  # an empty chunk (a team's range cut short) owns no slot
        _put(_ptr(sq_at, sq_tag), (lo - lo0) // per, acc)


@njit(**_JIT)
def _adamw_table(table, g_tag, out_tag, sq_at, sq_tag, scale, decay, l2, w, b2, omb2, bc2s, eps, neg_step):
    """``_adamw_block`` over each row ``(p, g, m, v, out, n)`` of ``table`` (addresses, 0 for no
    out; n elements each), on the calling thread: many small leaves in one call; row r's sum of
    squares (``sq_tag`` float64) to ``sq[r]``."""
    for r in range(table.shape[0]):
        _adamw_block(0, table[r, 5], table[r, 0], table[r, 1], table[r, 2], table[r, 3], table[r, 4], g_tag, out_tag,
                     False, sq_at + 8 * r, sq_tag, 0, max(table[r, 5], 1), scale, decay, l2, w, b2, omb2, bc2s, eps,
                     neg_step)


@njit(inline="always")
def _lion_one(i, args):
    p, g, m, scale, decay, neg_lr, b1, omb1, b2, omb2 = args
    gi = _load(g, i) * scale
    mi = m[i]
    c = _fma(gi, omb1, mi * b1)
    s = np.float32(1.0) if c > 0 else (np.float32(-1.0) if c < 0 else c)  # sign; NaN stays
    pi = _fma(s, neg_lr, p[i] * decay)
    p[i] = pi
    m[i] = _fma(gi, omb2, mi * b2)
    return pi, gi


_lion_sweep = _sweep_of(_lion_one)


@njit(**_JIT)
def _lion_block(lo, hi, p_at, g_at, m_at, out_at, g_tag, out_tag, stream,
                scale, decay, neg_lr, b1, omb1, b2, omb2):
    p, m, g, out = _ptr(p_at, _F32), _ptr(m_at, _F32), _ptr(g_at, g_tag), _ptr(out_at, out_tag)
    consts = (np.float32(scale), np.float32(decay), np.float32(neg_lr), np.float32(b1), np.float32(omb1),
              np.float32(b2), np.float32(omb2))
    _lion_sweep(lo, hi, out, out_at, stream, None, (p, g, m) + consts)


@njit(inline="always")
def _sgd_one(i, args):
    p, g, buf, scale, neg_lr, wd, use_wd, mom, omd, use_mom, nesterov, first = args
    gi = _load(g, i) * scale
    pi = p[i]
    if use_wd:
        gi = _fma(pi, wd, gi)
    if use_mom:
        bi = gi if first else _fma(gi, omd, buf[i] * mom)
        buf[i] = bi
        gi = _fma(bi, mom, gi) if nesterov else bi
    pi = _fma(gi, neg_lr, pi)
    p[i] = pi
    return pi, gi


_sgd_sweep = _sweep_of(_sgd_one)


@njit(**_JIT)
def _sgd_block(lo, hi, p_at, g_at, buf_at, out_at, g_tag, out_tag, stream,
               scale, neg_lr, wd, mom, omd, nesterov, first):
    p, buf, g, out = _ptr(p_at, _F32), _ptr(buf_at, _F32), _ptr(g_at, g_tag), _ptr(out_at, out_tag)
    wd, mom = np.float32(wd), np.float32(mom)
    _sgd_sweep(lo, hi, out, out_at, stream, None, (p, g, buf, np.float32(scale), np.float32(neg_lr), wd,
                                             wd != np.float32(0.0), mom, np.float32(omd),
                                             mom != np.float32(0.0), nesterov, first))


# ---- threads: a libgomp team (zfunc.ops.cpu.gomp), or Numba's prange where libgomp cannot be loaded ----
# *_gomp(k, args) and _prange_of(*_block)(k, args): *_block(*args), args = (lo, hi, ...), on k > 1
# threads; *_team is whichever of the two this process can run.
@njit(**_JIT)
def _adamw_gomp(k, args):
    gomp.parallel_range(_adamw_block, k, args)


@njit(**_JIT)
def _lion_gomp(k, args):
    gomp.parallel_range(_lion_block, k, args)


@njit(**_JIT)
def _sgd_gomp(k, args):
    gomp.parallel_range(_sgd_block, k, args)


def _prange_of(block):
    """``par(k, args)``: ``block(*args)`` on k threads of Numba's own pool (where libgomp is not
    loadable), in the chunks ``gomp.parallel_range`` uses."""
    def par(k, args):
        lo, hi = args[0], args[1]
        per = gomp.chunk_length(lo, hi, k)
        for c in prange(k):
            a = min(lo + c * per, hi)
            block(a, min(a + per, hi), *args[2:])
    return njit(parallel=True, **_JIT)(par)


if gomp.AVAILABLE:
    _adamw_team, _lion_team, _sgd_team = _adamw_gomp, _lion_gomp, _sgd_gomp
else:
    _adamw_team, _lion_team, _sgd_team = map(_prange_of, (_adamw_block, _lion_block, _sgd_block))
