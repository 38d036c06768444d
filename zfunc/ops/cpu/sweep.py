"""``_sweep_of``: a kernel's element update run over ``[lo, hi)``, param_out written (by non-temporal
stores, ``stream``, for calls of ``_STREAM_MIN`` elements or more) and the grads' squares summed in
``_SQ_BLOCK`` fp32 partials."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from zfunc.ops.cpu.intrinsics import _JIT, _SQ_BLOCK, _store, _sum_square


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


# Calls with param_out and at least this many elements stream it: past the last-level cache (32
# MiB here; AdamW moves 28 B/param), where the read for ownership costs bandwidth. Smaller calls
# store it as usual, so it stays in cache for the copy to the device.
_STREAM_MIN = 1 << 21
