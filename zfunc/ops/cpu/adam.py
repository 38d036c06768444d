"""CPU optimizer kernels (AdamW/Adam, Lion, SGD) in Numba: one memory pass per step.

An optimizer step on CPU is memory-bound (AdamW moves 28 bytes/param; the arithmetic is free), so
these kernels win by moving fewer bytes than a chain of torch ops: one pass reads the gradient in
its training dtype (fp32, bf16 or fp16), unscales it, updates param and state, and writes the
low-precision param copy for the next forward.

Law: ``adamw_`` performs ``torch.optim.AdamW``/``Adam`` (foreach=False)'s fp32 ops in the same
order, with the same fused multiply-adds (torch's lerp/addcmul/add(alpha=) compile to fma) and
scalars rounded from float64 as torch rounds them, except that it multiplies by 1/sqrt(1-beta2^t)
where torch divides; m and v come out bit-equal, p within an ulp per step (torch's MKL sqrt is
not correctly rounded either): 200 steps agree to rtol = atol = 1e-6. ``sgd_`` likewise follows
``torch.optim.SGD``; ``lion_`` is Chen et al. 2023 ("Symbolic Discovery of Optimization
Algorithms", Alg. 2). ``param_out`` is bit-equal to ``param.to(bfloat16 | float16)``.
Cost: bytes/param = 8 per fp32 buffer updated (param and state) + 4 or 2 (grad) + 0 or 2 (out):
AdamW fp32 28, AdamW bf16 grad + bf16 out 28; no temporaries. Calls of ``_STREAM_MIN`` elements
or more write param_out with non-temporal stores, so that it costs no read either (_sweep_of).

Tensors are 1-D contiguous CPU buffers (an offload engine's flat per-group buffers) that must not
overlap one another (unchecked); ``start`` and ``end`` restrict the update to ``[start, end)`` so
a caller can stream chunks. Large calls run on ``get_num_threads()`` threads, a libgomp team the
kernel starts itself (Numba's prange where libgomp cannot be loaded); the GIL is released.
Fixed cost per call: ~2.8 us on one thread (64 elements; the Python checks are ~1.5 of it, the
call into the compiled kernel ~0.3); a threaded call adds ~1.0 us to start its team.
"""
from __future__ import annotations

import operator
import os

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from zfunc.ops.cpu import gomp

__all__ = ["adamw_", "adamw_many_", "get_num_threads", "lion_", "set_num_threads", "sgd_"]

# fastmath stays off: its approximate reciprocal/rsqrt in place of the divider gains only on
# cache-resident sizes, and moves p further from torch than the 1e-6 promised. error_model="numpy":
# x/0 gives inf like torch instead of a branch that raises, which would also stop the loop from
# vectorizing.
_JIT = dict(cache=True, fastmath=False, nogil=True, error_model="numpy", boundscheck=False)
# Below this many elements one thread is as fast as two: a team launch costs ~1 us, about the time
# of 8-16K elements of AdamW, Lion or SGD on one thread.
_PARALLEL_MIN = 1 << 14
_num_threads: int | None = None
_POOL_SIZE = numba.config.NUMBA_NUM_THREADS  # fixed once Numba starts (1 after a fork, below)


def set_num_threads(n: int | None) -> None:
    """Fix the kernels' thread count to ``n``; ``None`` (default) follows torch.get_num_threads()."""
    global _num_threads
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"set_num_threads: expected a positive int or None, got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    """Threads the next large kernel call will use (capped by Numba's pool size; 1 in a child
    made by ``os.fork``)."""
    return min(_num_threads or torch.get_num_threads(), _POOL_SIZE)


def _one_thread_after_fork() -> None:
    # A forked child has none of its parent's OpenMP worker threads, and a team started there
    # waits for them forever (torch's own parallel ops hang likewise; Numba's prange aborts).
    global _POOL_SIZE
    _POOL_SIZE = 1


os.register_at_fork(after_in_child=_one_thread_after_fork)


# ---- pointers and bit-level conversions ----
# Buffers reach the kernels as raw addresses plus a numpy-scalar *tag* whose Numba type says the
# element type: float32 = fp32, uint16 = bf16 bits, int16 = fp16 bits, None = no buffer. Ints and
# numpy scalars are the cheapest arguments for Numba to type (~0.4 us per call in all, against
# ~0.7 us per tensor for ``Tensor.numpy()``), which matters at 100K params (~40 us of work).
@intrinsic
def _ptr(typingctx, addr, tag):
    if isinstance(tag, types.NoneType):
        return types.none(addr, tag), lambda context, builder, sig, args: context.get_dummy_value()
    ptr_type = types.CPointer(tag)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr_type))
    return ptr_type(addr, tag), codegen


@intrinsic
def _f32_as_u32(typingctx, x):
    return types.uint32(types.float32), lambda ctx, b, sig, args: b.bitcast(args[0], ir.IntType(32))


@intrinsic
def _u32_as_f32(typingctx, x):
    return types.float32(types.uint32), lambda ctx, b, sig, args: b.bitcast(args[0], ir.FloatType())


@intrinsic
def _f16_bits_to_f32(typingctx, h):
    # Numba has no float16 on CPU; LLVM's half lowers to F16C vcvtph2ps, torch's instruction too.
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def _f32_to_f16_bits(typingctx, x):
    # fptrunc rounds to nearest even (vcvtps2ph) and keeps NaN payloads, as torch's cast does.
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.int16(types.float32), codegen


@intrinsic
def _fma(typingctx, a, b, c):
    # torch's vectorized lerp, addcmul and add(alpha=) compile to fmadd; so do we, to agree.
    f32 = types.float32
    return f32(f32, f32, f32), lambda context, builder, sig, args: builder.fma(*args)


@intrinsic
def _sqrt(typingctx, x):
    # llvm.sqrt rather than libm's sqrtf (what np.sqrt lowers to): only this one vectorizes.
    def codegen(context, builder, sig, args):
        return builder.call(builder.module.declare_intrinsic("llvm.sqrt", [ir.FloatType()]), args)
    return types.float32(types.float32), codegen


@njit(**_JIT)  # not inline="always": inlined thrice in a sweep, it trips a Numba IR check (LLVM inlines it)
def _f32_to_bf16_bits(x):
    # Round to nearest even on the bits; NaN -> 0xFFFF, as torch's vectorized CPU cast (AVX2 and
    # AVX512) writes it. The bias add cannot carry past bit 31 for any non-NaN input.
    b = _f32_as_u32(x)
    r = np.uint32((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    return np.uint16(0xFFFF) if np.isnan(x) else np.uint16(r)


# Not inline="always" (LLVM inlines them anyway): inlined at Numba's IR level into an element
# function that unpacks its pointers from a tuple, they made the stores after them vanish.
def _load(g, i):
    raise NotImplementedError  # only called inside jitted code, where the overload replaces it


def _store(out, i, x):
    raise NotImplementedError


@overload(_load)
def _load_impl(g, i):
    if g.dtype == types.float32:
        return lambda g, i: g[i]
    if g.dtype == types.uint16:
        return lambda g, i: _u32_as_f32(np.uint32(np.uint32(g[i]) << np.uint32(16)))
    if g.dtype == types.int16:
        return lambda g, i: _f16_bits_to_f32(g[i])
    return None


@overload(_store)
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


_F32 = np.float32(0)
_F64 = np.float64(0)


@intrinsic
def _add_square(typingctx, acc, x):
    """``acc + x*x`` in fp32 with the add marked reassociable, which lets LLVM vectorize a loop
    that sums it (a partial sum per lane, added at the end) at the loop's own width: the sum of
    squares costs an fma per element. (Summed in fp64 the loop ran at the doubles' width, half,
    and the whole update 1.5x slower.) Only this add is reassociated; the update's own arithmetic
    is untouched. Callers sum at most ``_SQ_BLOCK`` elements so, then add that in fp64."""
    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], builder.fmul(args[1], args[1]), flags=("reassoc", "nsz"))
    return types.float32(types.float32, types.float32), codegen


# Elements per fp32 partial sum of squares: per lane (8 or 16) at most 128 adds, <= 8e-6 relative
# error however the grads are spread, ~1e-7 typically; the partials are summed in fp64.
_SQ_BLOCK = 1024


def _sum_square(sq, acc, x):
    raise NotImplementedError  # jitted code only: ``acc + x*x`` where ``sq`` is a buffer, else ``acc``


def _put(sq, at, acc):
    raise NotImplementedError  # jitted code only: ``sq[at] = acc`` where ``sq`` is a buffer


@overload(_sum_square)
def _sum_square_impl(sq, acc, x):
    if isinstance(sq, types.NoneType):
        return lambda sq, acc, x: acc
    return lambda sq, acc, x: _add_square(acc, x)


@overload(_put)
def _put_impl(sq, at, acc):
    if isinstance(sq, types.NoneType):
        return lambda sq, at, acc: None

    def put(sq, at, acc):
        sq[at] = acc
    return put


# ---- the sweep: each kernel is an element update ``one(i, args) -> new param``, run over
# [lo, hi) by a sweep (``_sweep_of``), which also writes param_out. Streamed (``stream``, for calls whose
# footprint is past the caches), param_out's 64-byte lines are written by non-temporal stores:
# param_out is only written, so an ordinary store first reads each line for ownership (30 bytes
# per param move where 28 must) and evicts p, m and v to make room for it. Each line is built in
# a register-sized buffer and stored whole (vmovntdq); the head up to param_out's first line
# boundary and the tail are stored as usual. Streamed or not, the results are the same bits.
_LINE = 32  # 16-bit elements per 64-byte line


@intrinsic
def _line_buffer(typingctx, out):
    """A 64-byte-aligned buffer of one line of ``out``'s 16-bit elements, in the caller's frame."""
    def codegen(context, builder, sig, args):
        with builder.goto_entry_block():
            buf = builder.alloca(ir.VectorType(ir.IntType(16), _LINE))  # a vector: 64-byte aligned
        return builder.bitcast(buf, context.get_value_type(out))
    return out(out), codegen


@intrinsic
def _stream_line(typingctx, out, at, line):
    """Store ``line`` to ``out[at : at + _LINE]`` (64-byte aligned) with a non-temporal store."""
    def codegen(context, builder, sig, args):
        vec = ir.VectorType(ir.IntType(16), _LINE).as_pointer()
        value = builder.load(builder.bitcast(args[2], vec), align=64)
        store = builder.store(value, builder.bitcast(builder.gep(args[0], [args[1]]), vec), align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return types.none(out, at, line), codegen


@intrinsic
def _fence(typingctx):
    """Order this thread's non-temporal stores before what it does next (they are weakly ordered):
    a sequentially consistent fence, mfence or a locked instruction on x86, either of which drains
    the write-combining buffers."""
    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.none(), codegen


def _sweep_of(one):
    """``sweep(lo, hi, out, out_at, stream, sq, args) -> float64``: ``pi, gi = one(i, args)`` for
    i in [lo, hi), each ``pi`` stored to ``out[i]`` (None: nowhere), streamed or not (above);
    returns the sum of ``gi**2`` where ``sq`` is a buffer (0.0 for None: not computed). A
    factory, not a function taking ``one``: Numba cannot cache code that receives a function as
    an argument."""
    def sweep(lo, hi, out, out_at, stream, sq, args):
        lo, hi = np.uintp(lo), np.uintp(hi)  # unsigned: no wraparound check, so loops vectorize
        acc = np.float64(0.0)
        if out is None or not stream:
            for a in range(lo, hi, np.uintp(_SQ_BLOCK)):
                part = np.float32(0.0)
                for i in range(a, min(a + np.uintp(_SQ_BLOCK), hi)):
                    pi, gi = one(i, args)
                    _store(out, i, pi)
                    part = _sum_square(sq, part, gi)
                acc += np.float64(part)
            return acc
        head = min(hi, lo + np.uintp((-(out_at + 2 * lo) % 64) // 2))  # to out's first line boundary
        part = np.float32(0.0)
        for i in range(lo, head):
            pi, gi = one(i, args)
            _store(out, i, pi)
            part = _sum_square(sq, part, gi)
        acc += np.float64(part)
        line = _line_buffer(out)
        lines = (hi - head) // np.uintp(_LINE)
        for b in range(lines):
            at = head + b * np.uintp(_LINE)
            part = np.float32(0.0)
            for j in range(np.uintp(_LINE)):
                pi, gi = one(at + j, args)
                _store(line, j, pi)
                part = _sum_square(sq, part, gi)
            acc += np.float64(part)
            _stream_line(out, at, line)
        part = np.float32(0.0)
        for i in range(head + lines * np.uintp(_LINE), hi):
            pi, gi = one(i, args)
            _store(out, i, pi)
            part = _sum_square(sq, part, gi)
        acc += np.float64(part)
        _fence()
        return acc
    return njit(**_JIT)(sweep)


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
# Calls with param_out and at least this many elements stream it: past the last-level cache (32
# MiB here; AdamW moves 28 B/param), where the read for ownership costs bandwidth. Smaller calls
# store it as usual, so it stays in cache for the copy to the device.
_STREAM_MIN = 1 << 21


# ---- Python side: checks run on every call (~1.5 us, ~2.4 at 100K params where the kernel has
# just evicted the tensors' metadata from cache; the whole call takes ~20 us there), so the
# passing path is one chain of attribute reads and the error path finds and names the culprit ----
_FLOAT32 = torch.float32
_GRAD = {torch.float32: _F32, torch.bfloat16: np.uint16(0), torch.float16: np.int16(0)}
_OUT = {torch.bfloat16: np.uint16(0), torch.float16: np.int16(0)}
_UNIT = (1,)


def _reject(t, name: str, dtypes, n: int, fn: str) -> None:
    """Raise the error that says what is wrong with ``t``, if anything."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{fn}: {name} must have dtype {want}, got {t.dtype}")
    if not t.is_cpu:
        raise ValueError(f"{fn}: {name} must be a CPU tensor, got device {t.device} (these "
                         "kernels update state in CPU RAM; move it with .cpu() or use a GPU optimizer)")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be 1-D and contiguous, got shape {tuple(t.shape)} "
                         f"with strides {t.stride()}; pass a flat buffer (e.g. .reshape(-1))")
    if t.numel() != n:
        raise ValueError(f"{fn}: {name} has {t.numel()} elements, expected {n} (the size of param)")


def _check_range(fn: str, start, end, n: int) -> tuple[int, int]:
    """``start, end`` as ints (numpy ints are fine) if 0 <= start <= end <= n, else ValueError."""
    try:
        start, end = operator.index(start), operator.index(end)
    except TypeError:
        pass
    else:
        if 0 <= start <= end <= n:
            return start, end
    raise ValueError(f"{fn}: need integers 0 <= start <= end <= {n} (the size of param), "
                     f"got start={start!r}, end={end!r}")


def _check_step(step) -> int:
    """``step`` as an int (numpy ints are fine) if it is >= 1, else ValueError."""
    try:
        if operator.index(step) >= 1:
            return operator.index(step)
    except TypeError:
        pass
    raise ValueError(f"adamw_: step must be an int >= 1 (bias correction is 1 - beta**step), "
                     f"got {step!r}")


def _prepare(fn: str, names: tuple, param, grad, m, v, param_out, start, end):
    """Check every buffer (m, v: fp32 state called ``names`` in errors, or None where the kernel
    has fewer); return (threads, start, end, addresses of param, grad, m, v and param_out (0 for
    None), grad tag, param_out tag)."""
    # stride() == (1,) is 1-D and contiguous in one read; a 1-D tensor of <= 1 element may be
    # contiguous with another stride, so it takes the slow path, which lets it through. Each
    # buffer's reads are written out: a loop or a helper call costs ~0.04 us more per buffer.
    try:
        n = param.numel()
        g_tag = _GRAD.get(grad.dtype)
        out_tag = None if param_out is None else _OUT.get(param_out.dtype)
        ok = (param.dtype is _FLOAT32 and param.is_cpu and param.stride() == _UNIT
              and g_tag is not None and grad.is_cpu and grad.stride() == _UNIT and grad.numel() == n
              and (m is None or m.dtype is _FLOAT32 and m.is_cpu and m.stride() == _UNIT
                   and m.numel() == n)
              and (v is None or v.dtype is _FLOAT32 and v.is_cpu and v.stride() == _UNIT
                   and v.numel() == n)
              and (param_out is None or out_tag is not None and param_out.is_cpu
                   and param_out.stride() == _UNIT and param_out.numel() == n))
    except AttributeError:  # not a tensor
        ok = False
    if not ok:
        n = param.numel() if isinstance(param, torch.Tensor) else -1
        _reject(param, "param", (_FLOAT32,), n, fn)
        _reject(grad, "grad", _GRAD, n, fn)
        for name, t in zip(names, (m, v)):
            if t is not None:
                _reject(t, name, (_FLOAT32,), n, fn)
        if param_out is not None:
            _reject(param_out, "param_out", _OUT, n, fn)
        g_tag = _GRAD[grad.dtype]
        out_tag = None if param_out is None else _OUT[param_out.dtype]
    if end is None:
        end = n
    if type(start) is not int or type(end) is not int or not 0 <= start <= end <= n:
        start, end = _check_range(fn, start, end, n)
    k = 1
    if end - start >= _PARALLEL_MIN:  # get_num_threads(), inlined: the call costs ~0.1 us
        k = min(_num_threads or torch.get_num_threads(), _POOL_SIZE)
    return (k, start, end, param.data_ptr(), grad.data_ptr(), 0 if m is None else m.data_ptr(),
            0 if v is None else v.data_ptr(), 0 if param_out is None else param_out.data_ptr(),
            g_tag, out_tag)


_entry_points: dict = {}  # (kernel, grad tag type, param_out tag type) -> compiled entry point


def _run(block, threaded, k: int, args: tuple, g_tag, out_tag, sq_tag=None) -> None:
    """``block(*args)`` if k == 1, else ``threaded(k, args)``.

    Numba's dispatcher types every argument on every call (~0.5 us for the ~18 here); once the
    overload is compiled, its entry point is called directly, which only unboxes them. The tags
    are the only arguments whose types vary (the rest are always ints, floats, bools and tuples
    of them), so the kernel and their types pick the entry point."""
    kernel, args = (block, args) if k == 1 else (threaded, (k, args))
    key = (kernel, type(g_tag), type(out_tag), type(sq_tag))
    entry = _entry_points.get(key)
    if entry is not None:
        entry(*args)
        return
    kernel(*args)
    overload = kernel.overloads.get(tuple(map(numba.typeof, args)))
    if overload is not None:
        _entry_points[key] = overload.entry_point


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
           exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
           beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
           decoupled: bool = True, grad_scale: float = 1.0,
           param_out: torch.Tensor | None = None, start: int = 0, end: int | None = None,
           grad_sq: bool = False) -> float | None:
    """One AdamW (``decoupled=True``) or Adam-with-L2 (``decoupled=False``) step, in place.

    param, exp_avg, exp_avg_sq: fp32 [n]; grad: fp32/bf16/fp16 [n]; param_out: bf16/fp16 [n] or
    None. ``step`` counts from 1. With g = grad * grad_scale, on elements [start, end) only:
        p *= 1 - lr*wd (decoupled)  |  g += wd*p (L2);   m = lerp(m, g, 1 - beta1)
        v = beta2*v + (1 - beta2)*g*g;   p -= lr/(1 - beta1^step) * m / (sqrt(v / (1 - beta2^step)) + eps)
        param_out = p.to(param_out.dtype)
    ``grad_sq``: return the sum of the squares of g (grad * grad_scale, in fp64) over the
    elements updated, read in the same pass (``global_norm``'s square, without a second read of
    the grads); else None.
    """
    k, lo, hi, p, g, m, v, out, g_tag, out_tag = _prepare(
        "adamw_", ("exp_avg", "exp_avg_sq"), param, grad, exp_avg, exp_avg_sq, param_out, start,
        end)
    if type(step) is not int or step < 1:
        step = _check_step(step)
    # Scalars in float64 exactly as torch.optim computes them (the kernel rounds them to fp32);
    # float() first, because an int or numpy scalar would make Numba compile another signature.
    lr, beta1, beta2, wd = float(lr), float(beta1), float(beta2), float(weight_decay)
    decay, l2 = (1.0 - lr * wd, 0.0) if decoupled else (1.0, wd)
    sq, sq_at, sq_tag, per = _squares(grad_sq, k, lo, hi)
    args = (lo, hi, p, g, m, v, out, g_tag, out_tag, hi - lo >= _STREAM_MIN, sq_at, sq_tag, lo, per,
            float(grad_scale), decay, l2, 1.0 - beta1, beta2, 1.0 - beta2, (1.0 - beta2 ** step) ** 0.5, float(eps),
            -(lr / (1.0 - beta1 ** step)))
    _run(_adamw_block, _adamw_team, k, args, g_tag, out_tag, sq_tag)
    return None if sq is None else float(sq.sum())


def _slots(wanted: bool, rows: int) -> tuple:
    """``_squares``' answer for a table: a float64 slot per row."""
    slots = np.zeros(rows, dtype=np.float64) if wanted else None
    return slots, 0 if slots is None else slots.ctypes.data, _F64 if wanted else None, 1


def _squares(wanted: bool, k: int, lo: int, hi: int) -> tuple:
    """``(slots, address, tag, per)`` for a call over [lo, hi) on k threads: a float64 slot per
    chunk (``gomp.chunk_length``) when the sum of squares is ``wanted``, else nothing to write."""
    per = max(((hi - lo + k - 1) // k + gomp.ALIGN - 1) // gomp.ALIGN * gomp.ALIGN if k > 1 else hi - lo, 1)
    if not wanted:
        return None, 0, None, per
    slots = np.zeros(k, dtype=np.float64)
    return slots, slots.ctypes.data, _F64, per


def _adamw_scalars(step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale) -> tuple:
    """``(scale, decay, l2, 1-beta1, beta2, 1-beta2, sqrt(1-beta2^step), eps, -lr/(1-beta1^step))``
    in float64, exactly as torch.optim computes them (the kernel rounds them to fp32); float()
    first, because an int or numpy scalar would make Numba compile another signature."""
    if type(step) is not int or step < 1:
        step = _check_step(step)
    lr, beta1, beta2, wd = float(lr), float(beta1), float(beta2), float(weight_decay)
    decay, l2 = (1.0 - lr * wd, 0.0) if decoupled else (1.0, wd)
    return (float(grad_scale), decay, l2, 1.0 - beta1, beta2, 1.0 - beta2, (1.0 - beta2 ** step) ** 0.5, float(eps),
            -(lr / (1.0 - beta1 ** step)))


def _leaf_ok(t, n: int, dtypes) -> bool:
    """``t`` is a contiguous CPU tensor of ``n`` elements of one of ``dtypes`` (any shape)."""
    return t.dtype in dtypes and t.is_cpu and t.is_contiguous() and t.numel() == n


def adamw_many_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float = 0.9,
                beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True,
                grad_scale: float = 1.0, param_outs: list[torch.Tensor | None] | None = None,
                grad_sq: bool = False) -> float | None:
    """``adamw_`` on every leaf of the lists, with the same hyperparameters: the multi-tensor form.

    Leaves may have any shape (each is updated as its flat elements) but must be contiguous CPU
    tensors, each ``grads[i]``/``exp_avgs[i]``/``param_outs[i]`` the size of ``params[i]``
    (dtypes as in ``adamw_``; ``param_outs[i]`` None: no copy). Same results, bit for bit, as
    ``adamw_`` leaf by leaf. Cost: leaves of ``_PARALLEL_MIN`` elements or more run one threaded
    call each; all smaller ones run in one call on the calling thread, over a table of their
    addresses, so a model's many biases and norms cost ~0.1 us each instead of ~3 us.
    ``grad_sq``: return the sum of squares of all the grads read (times ``grad_scale``, fp64,
    summed leaf by leaf in list order for the big leaves, then the small ones), else None.
    """
    outs = [None] * len(params) if param_outs is None else param_outs
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(outs):
        raise ValueError(f"adamw_many_: expected lists of one length, got params {len(params)}, grads {len(grads)}, "
                         f"exp_avgs {len(exp_avgs)}, exp_avg_sqs {len(exp_avg_sqs)}, param_outs {len(outs)}")
    consts = _adamw_scalars(step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale)
    small: dict[tuple, list] = {}  # (grad tag type, out tag type) -> rows of small leaves
    total = 0.0
    for p, g, m, v, o in zip(params, grads, exp_avgs, exp_avg_sqs, outs):
        n = p.numel()
        g_tag, out_tag = _GRAD.get(g.dtype), None if o is None else _OUT.get(o.dtype)
        if not (_leaf_ok(p, n, (_FLOAT32,)) and g_tag is not None and _leaf_ok(g, n, _GRAD)
                and _leaf_ok(m, n, (_FLOAT32,)) and _leaf_ok(v, n, (_FLOAT32,))
                and (o is None or out_tag is not None and _leaf_ok(o, n, _OUT))):
            flat = [None if t is None else t.reshape(-1) if t.is_contiguous() else t for t in (p, g, m, v, o)]
            _prepare("adamw_many_", ("exp_avg", "exp_avg_sq"), *flat, 0, None)  # raises, naming the culprit
        if n >= _PARALLEL_MIN:
            k = min(_num_threads or torch.get_num_threads(), _POOL_SIZE)
            sq, sq_at, sq_tag, per = _squares(grad_sq, k, 0, n)
            args = (0, n, p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if o is None else o.data_ptr(),
                    g_tag, out_tag, n >= _STREAM_MIN, sq_at, sq_tag, 0, per) + consts
            _run(_adamw_block, _adamw_team, k, args, g_tag, out_tag, sq_tag)
            if grad_sq:
                total += float(sq.sum())
        elif n:
            small.setdefault((type(g_tag), type(out_tag)), [g_tag, out_tag]).append(
                (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if o is None else o.data_ptr(), n))
    for g_tag, out_tag, *rows in small.values():
        sq, sq_at, sq_tag, _ = _squares(grad_sq, 1, 0, 0) if len(rows) == 1 else _slots(grad_sq, len(rows))
        if len(rows) == 1:  # one leaf: no table to build (~1 us)
            p, g, m, v, o, n = rows[0]
            args = (0, n, p, g, m, v, o, g_tag, out_tag, False, sq_at, sq_tag, 0, max(n, 1)) + consts
            _run(_adamw_block, None, 1, args, g_tag, out_tag, sq_tag)
        else:
            args = (np.array(rows, dtype=np.int64), g_tag, out_tag, sq_at, sq_tag) + consts
            _run(_adamw_table, None, 1, args, g_tag, out_tag, sq_tag)
        if grad_sq:
            total += float(sq.sum())
    return total if grad_sq else None


def lion_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
          beta1: float = 0.9, beta2: float = 0.99, weight_decay: float = 0.0,
          grad_scale: float = 1.0, param_out: torch.Tensor | None = None, start: int = 0,
          end: int | None = None) -> None:
    """One Lion step, in place.

    param, exp_avg: fp32 [n]; grad: fp32/bf16/fp16 [n]; param_out: bf16/fp16 [n] or None.
    With g = grad * grad_scale, on elements [start, end) only:
        p = p*(1 - lr*wd) - lr*sign(beta1*m + (1 - beta1)*g);   m = beta2*m + (1 - beta2)*g
    """
    k, lo, hi, p, g, m, _, out, g_tag, out_tag = _prepare(
        "lion_", ("exp_avg",), param, grad, exp_avg, None, param_out, start, end)
    lr, beta1, beta2, wd = float(lr), float(beta1), float(beta2), float(weight_decay)
    args = (lo, hi, p, g, m, out, g_tag, out_tag, hi - lo >= _STREAM_MIN, float(grad_scale), 1.0 - lr * wd, -lr,
            beta1, 1.0 - beta1, beta2, 1.0 - beta2)
    _run(_lion_block, _lion_team, k, args, g_tag, out_tag)


def sgd_(param: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor | None, *,
         lr: float, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
         weight_decay: float = 0.0, first_step: bool, grad_scale: float = 1.0,
         param_out: torch.Tensor | None = None, start: int = 0, end: int | None = None) -> None:
    """One SGD step with optional momentum / Nesterov, in place (``torch.optim.SGD`` semantics).

    param, momentum_buf: fp32 [n] (momentum_buf unused, may be None, when momentum == 0);
    grad: fp32/bf16/fp16 [n]; param_out: bf16/fp16 [n] or None. On elements [start, end) only,
    with g = grad * grad_scale + wd*p:
        buf = g if first_step else momentum*buf + (1 - dampening)*g
        p -= lr * (g + momentum*buf if nesterov else buf)          (p -= lr*g when momentum == 0)
    """
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"sgd_: nesterov needs momentum > 0 and dampening == 0, got "
                         f"momentum={momentum!r}, dampening={dampening!r}")
    k, lo, hi, p, g, buf, _, out, g_tag, out_tag = _prepare(
        "sgd_", ("momentum_buf",), param, grad, momentum_buf if momentum != 0 else None, None,
        param_out, start, end)
    buf = buf or p  # never read when momentum == 0, but a valid address all the same
    args = (lo, hi, p, g, buf, out, g_tag, out_tag, hi - lo >= _STREAM_MIN, float(grad_scale), -float(lr),
            float(weight_decay), float(momentum), 1.0 - float(dampening), bool(nesterov),
            bool(first_step))
    _run(_sgd_block, _sgd_team, k, args, g_tag, out_tag)
