"""The Numba toolkit the CPU kernels share (``adam``, ``lamb``, ``norm``): the compile options (``_JIT``),
raw buffer addresses typed by an element tag (``_ptr``), fp32/bf16/fp16 loads and stores bit-equal to torch's
casts, torch's fused multiply-add and a vectorizing sqrt, and the fp32 sum of squares a kernel folds into its
pass (``_add_square``, ``_SQ_BLOCK``)."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload


# fastmath stays off: its approximate reciprocal/rsqrt in place of the divider gains only on
# cache-resident sizes, and moves p further from torch than the 1e-6 promised. error_model="numpy":
# x/0 gives inf like torch instead of a branch that raises, which would also stop the loop from
# vectorizing.
_JIT = dict(cache=True, fastmath=False, nogil=True, error_model="numpy", boundscheck=False)


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
