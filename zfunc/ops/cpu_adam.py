"""CPU optimizer kernels (AdamW/Adam, Lion, SGD) in Numba: one memory pass per step.

An optimizer step on CPU is memory-bound (AdamW moves 28 bytes/param; the arithmetic is free), so
the kernels win by moving fewer bytes than a chain of torch ops: each reads the gradient in its
training dtype (fp32, bf16 or fp16), unscales it, updates param and state, and writes the
low-precision param copy for the next forward, all in the one pass.

Law: on fp32 inputs ``adamw_`` follows ``torch.optim.AdamW``/``Adam`` (foreach=False) op for op in
fp32 (lerp as fma, scalar constants rounded from float64 as torch rounds them), so results agree
to float rounding (bit-equal on the vectorized path); ``sgd_`` follows ``torch.optim.SGD``;
``lion_`` follows the Lion paper's update (Chen et al. 2023, Alg. 2, decoupled decay).
``param_out`` is bit-equal to ``param.to(bfloat16/float16)`` after the update.
Cost: bytes/param = 4*(1 + 2*state) read+write for param/state + grad bytes (4 or 2) + out bytes
(0 or 2); no temporaries, so no extra memory.

All tensors are 1-D contiguous CPU buffers (an offload engine's flat per-group buffers); ``start``
and ``end`` restrict the update to ``[start, end)`` so a caller can stream chunks.
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

__all__ = ["adamw_", "lion_", "sgd_", "set_num_threads", "get_num_threads"]

# fastmath buys nothing here (the loop waits on DRAM, not on div/sqrt; see benchmarks/cpu_adam.py)
# and would let LLVM reassociate away the equality with torch, so it stays off.
_JIT = dict(cache=True, fastmath=False, nogil=True, error_model="numpy", boundscheck=False)
# Below this many elements a parallel launch costs more than it saves (measured: ~10 us launch vs
# ~0.3 ns/element of work per thread).
_PARALLEL_MIN = 1 << 15
_ALIGN = 64  # chunk boundaries on whole cache lines for every dtype (64 elements >= 64 bytes)
_num_threads: int | None = None


def set_num_threads(n: int | None) -> None:
    """Fix the kernels' thread count to ``n``; ``None`` follows ``torch.get_num_threads()``."""
    global _num_threads
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"set_num_threads: expected a positive int or None, got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    """Threads the next kernel call will use (capped by Numba's pool size)."""
    return min(_num_threads or torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)


# ---- bit-level conversions (Numba has no float16/bfloat16 scalars on CPU) ----
@intrinsic
def _f32_as_u32(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _u32_as_f32(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _f16_bits_to_f32(typingctx, h):
    # LLVM's half type lowers to F16C vcvtph2ps: exact, NaN payloads kept like torch's cast.
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def _f32_to_f16_bits(typingctx, x):
    # fptrunc rounds to nearest even (vcvtps2ph), the same instruction torch's cast uses.
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.int16(types.float32), codegen


@intrinsic
def _fma(typingctx, a, b, c):
    # torch's vectorized lerp and add(alpha=) use fmadd; matching it keeps us bit-equal.
    def codegen(context, builder, sig, args):
        return builder.fma(*args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@njit(inline="always")
def _bf16_bits_to_f32(h):
    return _u32_as_f32(np.uint32(np.uint32(np.uint16(h)) << np.uint32(16)))


@njit(inline="always")
def _f32_to_bf16_bits(x):
    # Round to nearest even on the bits. NaN -> 0xFFFF, as torch's vectorized CPU cast (AVX2 and
    # AVX512) writes it; the bias add cannot overflow for any non-NaN input.
    b = _f32_as_u32(x)
    r = np.uint32((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    return np.uint16(0xFFFF) if x != x else np.uint16(r)


# Buffer dtypes are told apart by their numpy view: float32 = fp32, uint16 = bf16 bits,
# int16 = fp16 bits; None = no low-precision copy. Numba compiles one loop per combination.
def _load(g, i):
    raise NotImplementedError  # replaced by the overload inside jitted code


def _store(out, i, x):
    raise NotImplementedError


@overload(_load, inline="always")
def _load_impl(g, i):
    if g.dtype == types.float32:
        return lambda g, i: g[i]
    if g.dtype == types.uint16:
        return lambda g, i: _bf16_bits_to_f32(g[i])
    if g.dtype == types.int16:
        return lambda g, i: _f16_bits_to_f32(g[i])
    return None


@overload(_store, inline="always")
def _store_impl(out, i, x):
    if isinstance(out, types.NoneType):
        return lambda out, i, x: None
    if out.dtype == types.uint16:
        def store_bf16(out, i, x):
            out[i] = _f32_to_bf16_bits(x)
        return store_bf16
    if out.dtype == types.int16:
        def store_f16(out, i, x):
            out[i] = _f32_to_f16_bits(x)
        return store_f16
    return None


# ---- kernels: *_block updates [lo, hi) serially; *_par splits [lo, hi) over k threads ----
@njit(**_JIT)
def _adamw_block(lo, hi, p, g, m, v, out, scale, decay, l2, w, b2, omb2, bc2s, eps, neg_step):
    # float64 -> float32 once, as torch rounds Python scalars to the tensor dtype.
    scale, decay, l2, w = np.float32(scale), np.float32(decay), np.float32(l2), np.float32(w)
    b2, omb2, bc2s = np.float32(b2), np.float32(omb2), np.float32(bc2s)
    eps, neg_step = np.float32(eps), np.float32(neg_step)
    small = abs(w) < np.float32(0.5)  # torch's lerp picks its formula by this
    coeff = w if small else w - np.float32(1.0)
    use_l2 = l2 != np.float32(0.0)
    for i in range(lo, hi):
        gi = _load(g, i) * scale
        pi = p[i] * decay
        if use_l2:
            gi = _fma(pi, l2, gi)
        mi = m[i]
        mi = _fma(coeff, gi - mi, mi if small else gi)
        vi = _fma(omb2 * gi, gi, v[i] * b2)  # torch's addcmul compiles to this fma
        pi = pi + neg_step * mi / (np.sqrt(vi) / bc2s + eps)
        p[i] = pi
        m[i] = mi
        v[i] = vi
        _store(out, i, pi)


@njit(parallel=True, **_JIT)
def _adamw_par(k, lo, hi, p, g, m, v, out, scale, decay, l2, w, b2, omb2, bc2s, eps, neg_step):
    per = ((hi - lo + k - 1) // k + _ALIGN - 1) // _ALIGN * _ALIGN
    for c in prange(k):
        a = lo + c * per
        _adamw_block(a, min(a + per, hi), p, g, m, v, out, scale, decay, l2, w, b2, omb2, bc2s,
                     eps, neg_step)


@njit(**_JIT)
def _lion_block(lo, hi, p, g, m, out, scale, decay, neg_lr, b1, omb1, b2, omb2):
    scale, decay, neg_lr = np.float32(scale), np.float32(decay), np.float32(neg_lr)
    b1, omb1, b2, omb2 = np.float32(b1), np.float32(omb1), np.float32(b2), np.float32(omb2)
    for i in range(lo, hi):
        gi = _load(g, i) * scale
        mi = m[i]
        c = _fma(gi, omb1, mi * b1)
        s = np.float32(1.0) if c > 0 else (np.float32(-1.0) if c < 0 else c)  # sign, keeps NaN
        pi = _fma(s, neg_lr, p[i] * decay)
        p[i] = pi
        m[i] = _fma(gi, omb2, mi * b2)
        _store(out, i, pi)


@njit(parallel=True, **_JIT)
def _lion_par(k, lo, hi, p, g, m, out, scale, decay, neg_lr, b1, omb1, b2, omb2):
    per = ((hi - lo + k - 1) // k + _ALIGN - 1) // _ALIGN * _ALIGN
    for c in prange(k):
        a = lo + c * per
        _lion_block(a, min(a + per, hi), p, g, m, out, scale, decay, neg_lr, b1, omb1, b2, omb2)


@njit(**_JIT)
def _sgd_block(lo, hi, p, g, buf, out, scale, neg_lr, wd, mom, omd, nesterov, first):
    scale, neg_lr, wd = np.float32(scale), np.float32(neg_lr), np.float32(wd)
    mom, omd = np.float32(mom), np.float32(omd)
    use_wd = wd != np.float32(0.0)
    use_mom = mom != np.float32(0.0)
    for i in range(lo, hi):
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
        _store(out, i, pi)


@njit(parallel=True, **_JIT)
def _sgd_par(k, lo, hi, p, g, buf, out, scale, neg_lr, wd, mom, omd, nesterov, first):
    per = ((hi - lo + k - 1) // k + _ALIGN - 1) // _ALIGN * _ALIGN
    for c in prange(k):
        a = lo + c * per
        _sgd_block(a, min(a + per, hi), p, g, buf, out, scale, neg_lr, wd, mom, omd, nesterov,
                   first)


# ---- Python side: cheap checks (they run on every call, also for 100K-param tensors) ----
_STATE = {torch.float32: None}
_GRAD = {torch.float32: None, torch.bfloat16: torch.uint16, torch.float16: torch.int16}
_OUT = {torch.bfloat16: torch.uint16, torch.float16: torch.int16}
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _array(t, name: str, dtypes: dict, n: int | None, fn: str) -> np.ndarray:
    """Zero-copy numpy view of a 1-D contiguous CPU tensor with ``n`` elements, or a clear error."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(_NAMES[d] for d in dtypes)
        raise TypeError(f"{fn}: {name} must be {want}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} must be on the CPU, got device {t.device}; "
                         "these kernels update optimizer state that lives in CPU RAM")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be a 1-D contiguous tensor, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}; pass a flat buffer")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{fn}: {name} has {t.shape[0]} elements, expected {n} like param")
    if t.requires_grad:
        t = t.detach()
    view = dtypes[t.dtype]
    return (t if view is None else t.view(view)).numpy()


def _prepare(fn: str, param, grad, states: dict, param_out, start, end):
    p = _array(param, "param", _STATE, None, fn)
    n = p.shape[0]
    g = _array(grad, "grad", _GRAD, n, fn)
    arrays = [_array(t, name, _STATE, n, fn) for name, t in states.items()]
    out = None if param_out is None else _array(param_out, "param_out", _OUT, n, fn)
    if end is None:
        end = n
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= n):
        raise ValueError(f"{fn}: need integers 0 <= start <= end <= {n} (param size), "
                         f"got start={start!r}, end={end!r}")
    k = get_num_threads() if end - start >= _PARALLEL_MIN else 1
    return p, g, arrays, out, start, end, k


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
           exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
           beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
           decoupled: bool = True, grad_scale: float = 1.0,
           param_out: torch.Tensor | None = None, start: int = 0, end: int | None = None) -> None:
    """One AdamW (``decoupled=True``) or Adam-with-L2 (``decoupled=False``) step, in place.

    param, exp_avg, exp_avg_sq: fp32 [n]; grad: fp32/bf16/fp16 [n]; param_out: bf16/fp16 [n] or
    None. ``step`` counts from 1 (bias correction ``1 - beta**step``). With g = grad*grad_scale:
        p *= 1 - lr*wd (decoupled) | g += wd*p (L2);  m = lerp(m, g, 1-beta1)
        v = beta2*v + (1-beta2)*g*g;  p -= lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps)
    Only elements ``[start, end)`` are read or written.
    """
    p, g, (m, v), out, lo, hi, k = _prepare("adamw_", param, grad,
                                            {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
                                            param_out, start, end)
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"adamw_: step must be an int >= 1 (bias correction), got {step!r}")
    # Constants in float64 exactly as torch.optim computes them, rounded to fp32 in the kernel.
    # float() first: an int or numpy scalar would make Numba compile another signature.
    lr, beta1, beta2, weight_decay = float(lr), float(beta1), float(beta2), float(weight_decay)
    decay = 1.0 - lr * weight_decay if decoupled else 1.0
    l2 = 0.0 if decoupled else weight_decay
    bc2s = (1.0 - beta2 ** step) ** 0.5
    neg_step = -(lr / (1.0 - beta1 ** step))
    args = (p, g, m, v, out, float(grad_scale), decay, l2, 1.0 - beta1, beta2, 1.0 - beta2, bc2s,
            float(eps), neg_step)
    if k > 1:
        _adamw_par(k, lo, hi, *args)
    else:
        _adamw_block(lo, hi, *args)


def lion_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
          beta1: float = 0.9, beta2: float = 0.99, weight_decay: float = 0.0,
          grad_scale: float = 1.0, param_out: torch.Tensor | None = None, start: int = 0,
          end: int | None = None) -> None:
    """One Lion step, in place (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    param, exp_avg: fp32 [n]; grad: fp32/bf16/fp16 [n]; param_out: bf16/fp16 [n] or None.
    With g = grad*grad_scale:  p = p*(1 - lr*wd) - lr*sign(beta1*m + (1-beta1)*g);
    m = beta2*m + (1-beta2)*g.  Only elements ``[start, end)`` are read or written.
    """
    p, g, (m,), out, lo, hi, k = _prepare("lion_", param, grad, {"exp_avg": exp_avg},
                                          param_out, start, end)
    lr, beta1, beta2, weight_decay = float(lr), float(beta1), float(beta2), float(weight_decay)
    args = (p, g, m, out, float(grad_scale), 1.0 - lr * weight_decay, -lr, beta1, 1.0 - beta1,
            beta2, 1.0 - beta2)
    if k > 1:
        _lion_par(k, lo, hi, *args)
    else:
        _lion_block(lo, hi, *args)


def sgd_(param: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor | None, *,
         lr: float, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
         weight_decay: float = 0.0, first_step: bool, grad_scale: float = 1.0,
         param_out: torch.Tensor | None = None, start: int = 0, end: int | None = None) -> None:
    """One SGD step with optional momentum/Nesterov, in place (``torch.optim.SGD`` semantics).

    param, momentum_buf: fp32 [n] (momentum_buf may be None when momentum == 0); grad:
    fp32/bf16/fp16 [n]; param_out: bf16/fp16 [n] or None. With g = grad*grad_scale + wd*p:
    buf = g on ``first_step`` else momentum*buf + (1-dampening)*g; g = g + momentum*buf
    (nesterov) or buf; p -= lr*g.  Only elements ``[start, end)`` are read or written.
    """
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"sgd_: nesterov needs momentum > 0 and dampening == 0, got "
                         f"momentum={momentum!r}, dampening={dampening!r}")
    states = {"momentum_buf": momentum_buf} if momentum != 0 else {}
    p, g, arrays, out, lo, hi, k = _prepare("sgd_", param, grad, states, param_out, start, end)
    buf = arrays[0] if arrays else p  # never read or written when momentum == 0
    args = (p, g, buf, out, float(grad_scale), -float(lr), float(weight_decay), float(momentum),
            1.0 - float(dampening), bool(nesterov), bool(first_step))
    if k > 1:
        _sgd_par(k, lo, hi, *args)
    else:
        _sgd_block(lo, hi, *args)
