"""The sum of the squares of CPU grads in Numba: ``sum_squares(tensors)``, one read of each.

What a step's global grad norm (and its non-finite check: the sum is inf or nan iff an element is)
costs on the CPU when it must be known before the update writes anything: one read of the grads
in their own dtype (fp32, bf16 or fp16; 4 or 2 B/element), nothing written; or nothing more than
an add the step makes anyway: ``sum_squares(grads, add_to=sums)`` adds a microbatch's grads to
the sums so far and sums the squares of the results in the same pass.

Law: the result is the sum over every element x of ``x*x``, within 1e-5 relative of the fp64 sum
(per 1024 elements an fp32 partial sum per SIMD lane, as CPU-Adam's ``grad_sq``; the partials
summed in fp64; ~1e-7 on random data), the same for any shape of the leaves, and inf or nan
where some element is, or where some |x| > 1.8e19, whose fp32 square overflows (a step then
counts as non-finite). Cost: leaves of ``_PARALLEL_MIN`` elements or more run one threaded call
each (a libgomp team, as CPU-Adam's), a lone small leaf one call (~1 us), several small ones one
call over a table of their addresses; each call's range read as four runs side by side (one
core keeps more lines in flight: ~1.3x the rate of one stream from DRAM, ``torch._foreach_norm``'s),
bf16/fp16 read as such (torch's norm upcasts them, ~25x slower).
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from numba import njit, types
from numba.extending import overload

from zfunc.ops.cpu import adam, gomp
from zfunc.ops.cpu.adam import _PARALLEL_MIN
from zfunc.ops.cpu.blocks import _prange_of
from zfunc.ops.cpu.checks import _GRAD
from zfunc.ops.cpu.intrinsics import _F32, _F64, _JIT, _SQ_BLOCK, _add_square, _load, _ptr

__all__ = ["sum_squares"]

_STREAMS = 4  # runs of a range read side by side (``_sum_squares_range``, whose loop writes out four)


def _summand(a, g, i):
    raise NotImplementedError  # jitted code only: ``g[i]``, or ``a[i] += g[i]`` and the sum where ``a`` is a buffer


@overload(_summand)
def _summand_impl(a, g, i):
    if isinstance(a, types.NoneType):
        return lambda a, g, i: _load(g, i)

    def add(a, g, i):
        x = a[i] + _load(g, i)  # one fp32 rounding, as torch's add_ of fp32 (or upcast bf16/fp16) grads
        a[i] = x
        return x
    return add


@njit(**_JIT)
def _sum_squares_range(lo, hi, g_at, g_tag, a_at, a_tag):
    """The sum of squares of ``g[lo:hi]`` (``a_tag`` None), or of ``a[lo:hi] += g[lo:hi]`` (fp32
    ``a``), on the calling thread: the range's whole ``_SQ_BLOCK`` blocks cut into ``_STREAMS``
    equal runs read side by side (block j of every run in one loop), then the rest block by block.
    One core reads four streams from DRAM ~1.3x faster than one (more lines in flight, where a sum
    over one stream waits on each line's latency); in cache it is as fast. Each block is one fp32
    partial, summed in fp64 per run; the runs' sums are added in run order."""
    g, a = _ptr(g_at, g_tag), _ptr(a_at, a_tag)
    lo, hi = np.uintp(lo), np.uintp(hi)  # unsigned: no wraparound check, so the loop vectorizes
    block = np.uintp(_SQ_BLOCK)
    run = (hi - lo) // (block * np.uintp(_STREAMS)) * block  # elements per run: whole blocks
    r1, r2, r3 = lo + run, lo + 2 * run, lo + 3 * run
    s0 = s1 = s2 = s3 = np.float64(0.0)
    for b in range(np.uintp(0), run, block):
        p0 = p1 = p2 = p3 = np.float32(0.0)
        for i in range(b, b + block):
            p0 = _add_square(p0, _summand(a, g, lo + i))
            p1 = _add_square(p1, _summand(a, g, r1 + i))
            p2 = _add_square(p2, _summand(a, g, r2 + i))
            p3 = _add_square(p3, _summand(a, g, r3 + i))
        s0 += np.float64(p0)
        s1 += np.float64(p1)
        s2 += np.float64(p2)
        s3 += np.float64(p3)
    acc = ((s0 + s1) + s2) + s3
    for b in range(lo + np.uintp(_STREAMS) * run, hi, block):
        part = np.float32(0.0)
        for i in range(b, min(b + block, hi)):
            part = _add_square(part, _summand(a, g, i))
        acc += np.float64(part)
    return acc


@njit(**_JIT)
def _sum_squares_block(lo, hi, g_at, g_tag, a_at, a_tag, sq_at, lo0, per):
    """A team's chunk: ``_sum_squares_range`` over [lo, hi) to ``sq[(lo - lo0) // per]``."""
    if hi > lo:  # an empty chunk (a team's range cut short) owns no slot
        _ptr(sq_at, _F64)[(lo - lo0) // per] = _sum_squares_range(lo, hi, g_at, g_tag, a_at, a_tag)


@njit(**_JIT)
def _sum_squares_table(table, g_tag, a_tag):
    """The sum of ``_sum_squares_range`` over each row ``(g address, n, a address)`` of ``table``,
    in row order."""
    total = np.float64(0.0)
    for r in range(table.shape[0]):
        total += _sum_squares_range(0, table[r, 1], table[r, 0], g_tag, table[r, 2], a_tag)
    return total


@njit(**_JIT)
def _sum_squares_gomp(k, args):
    gomp.parallel_range(_sum_squares_block, k, args)


_sum_squares_team = _sum_squares_gomp if gomp.AVAILABLE else _prange_of(_sum_squares_block)
_entry: dict = {}  # (kernel, grad tag type, add tag type) -> compiled entry point (as CPU-Adam's ``_run``)


def _call(kernel, args: tuple, g_tag, a_tag):
    """``kernel(*args)``, through its compiled entry point once there is one (no argument typing)."""
    key = (kernel, type(g_tag), type(a_tag))
    entry = _entry.get(key)
    if entry is not None:
        return entry(*args)
    result = kernel(*args)
    overload = kernel.overloads.get(tuple(map(numba.typeof, args)))
    if overload is not None:
        _entry[key] = overload.entry_point
    return result


def sum_squares(tensors: list[torch.Tensor], add_to: list[torch.Tensor] | None = None) -> float:
    """The sum of the squares of every element of ``tensors`` (contiguous fp32/bf16/fp16 CPU
    tensors, any shape), in fp64, in a fixed order: the big ones' chunks, the lone small one or
    the small ones' table. A big leaf (``_PARALLEL_MIN`` elements or more) costs one threaded call.

    ``add_to``: contiguous fp32 CPU tensors, one per tensor and of its size (e.g. the sums of the
    microbatches' grads so far): each gets its tensor added in place in the same pass (bit-equal to
    ``torch._foreach_add_(add_to, tensors)``), and the squares summed are those of the sums."""
    adding = add_to is not None
    if adding and len(add_to) != len(tensors):
        raise ValueError(f"sum_squares: add_to has {len(add_to)} tensors, expected one per tensor ({len(tensors)})")
    a_tag = _F32 if adding else None
    if len(tensors) == 1 and not adding:  # a lone leaf: the checks and one call, nothing else (~1 us)
        t = tensors[0]
        g_tag = _GRAD.get(t.dtype)
        if g_tag is not None and t.is_cpu and t.is_contiguous() and t.numel() < _PARALLEL_MIN:
            return _call(_sum_squares_range, (0, t.numel(), t.data_ptr(), g_tag, 0, None), g_tag, None)
    total, slots, used = 0.0, None, 0  # slots: the threaded calls' chunks' sums, one array for all
    small: dict[type, list] = {}
    for j, t in enumerate(tensors):
        g_tag = _GRAD.get(t.dtype)
        if g_tag is None or not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"sum_squares: expected contiguous fp32/bf16/fp16 CPU tensors, got {t.dtype} on "
                             f"{t.device}{'' if t.is_contiguous() else ' (non-contiguous)'}")
        n, a_at = t.numel(), 0
        if adding:
            a = add_to[j]
            if not (a.dtype is torch.float32 and a.is_cpu and a.is_contiguous() and a.numel() == n):
                raise ValueError(f"sum_squares: add_to[{j}] must be a contiguous fp32 CPU tensor of {n} elements, "
                                 f"got {a.dtype} on {a.device}, {a.numel()} elements"
                                 f"{'' if a.is_contiguous() else ', non-contiguous'}")
            a_at = a.data_ptr()
        # the kernels' count (1 in a forked child): ``adam.get_num_threads()``, inlined as ``adamw_many_`` does
        k = min(adam._num_threads or torch.get_num_threads(), adam._POOL_SIZE) if n >= _PARALLEL_MIN else 1
        if k > 1:
            per = ((n + k - 1) // k + gomp.ALIGN - 1) // gomp.ALIGN * gomp.ALIGN  # gomp.chunk_length
            if slots is None:
                slots = np.zeros(k * len(tensors), dtype=np.float64)
            at = slots.ctypes.data + 8 * used
            _call(_sum_squares_team, (k, (0, n, t.data_ptr(), g_tag, a_at, a_tag, at, 0, per)), g_tag, a_tag)
            used += k
        elif n >= _PARALLEL_MIN or len(tensors) == 1:  # one call, no table to build (~1 us)
            total += _call(_sum_squares_range, (0, n, t.data_ptr(), g_tag, a_at, a_tag), g_tag, a_tag)
        elif n:
            small.setdefault(type(g_tag), [g_tag]).append((t.data_ptr(), n, a_at))
    if slots is not None:
        total += float(slots.sum())
    for g_tag, *rows in small.values():
        total += _call(_sum_squares_table, (np.array(rows, dtype=np.int64), g_tag, a_tag), g_tag, a_tag)
    return total
