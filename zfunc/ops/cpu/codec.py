"""The codecs of the compressed collectives on CPU tensors, in Numba: one pass each where torch takes
several (``zfunc.dist.compressed``'s signs, ``zfunc.dist.quantized``'s int8/int4 blocks).

Law: every function returns the same bits as the torch expressions it replaces (stated per function;
tests/test_compressed.py and tests/test_quantized.py compare them): the arithmetic is the same fp32
operations, in the same order per element, and rounding is half to even as ``torch.round``. Cost:
one read of the input and one write of each output, on the calling thread (the ranks of a CPU run
each have their own cores); ~5-20x faster than the torch expressions on one thread (``torch.where``
with a broadcast scale and a table lookup per byte are what they replace). Every inner loop runs over a
1-D view from index 0 (a row, a block, a chunk of ``_CHUNK`` values that stays in L1): indexed so, LLVM
vectorizes it; with a 2-D index or an offset start, Numba's negative-index wraparound keeps it scalar
(2-20x slower per value).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

_JIT = dict(cache=True, fastmath=False, nogil=True, error_model="numpy", boundscheck=False)
_CHUNK = 2048  # values per inner loop where a kernel makes two passes over its data (8 KiB: in L1)


@njit(**_JIT)
def _add_blend(e, x, y, a, b):
    for i in range(e.shape[0]):
        e[i] = e[i] + (x[i] * a + b * y[i])


def add_blend_(e: torch.Tensor, x: torch.Tensor, y: torch.Tensor, a: float, b: float) -> None:
    """``e += x * a + b * y`` (fp32, contiguous, one size) in one pass: the bits of that torch expression."""
    _add_blend(e.view(-1).numpy(), x.view(-1).numpy(), y.view(-1).numpy(), np.float32(a), np.float32(b))


@njit(**_JIT)
def _pack_chunk(x, packed):
    for j in range(packed.shape[0]):
        byte = 0
        for b in range(8):
            byte |= (x[8 * j + b] >= 0) << b
        packed[j] = byte


@njit(**_JIT)
def _residual_chunk(x, s, out):
    ns = -s  # v - (-s) is v + s exactly
    for i in range(x.shape[0]):
        v = x[i]
        out[i] = v - (s if v >= 0 else ns)


@njit(**_JIT)
def _sign_residual(rows, scales, packed, residual):
    k = rows.shape[1]
    for r in range(rows.shape[0]):
        for c in range(0, k, _CHUNK):  # the chunk's signs packed before its residual may overwrite it
            e = min(c + _CHUNK, k)
            _pack_chunk(rows[r, c:e], packed[r, c // 8:e // 8])
            _residual_chunk(rows[r, c:e], scales[r], residual[r, c:e])


def sign_residual(rows: torch.Tensor, scales: torch.Tensor,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, residual)`` of fp32 ``rows`` (R x k, k % 8 == 0) and their ``scales`` (R): the bits of
    ``pack_signs(rows)`` (element 8j + i at bit i of byte j, set where ``x >= 0``) and of
    ``torch.where(rows >= 0, rows - s, rows + s)``; ``out`` (contiguous, ``rows`` itself allowed: each
    element is read before it is written) receives the residual."""
    rows = rows.contiguous()
    packed = torch.empty(rows.shape[0], rows.shape[1] // 8, dtype=torch.uint8)
    residual = torch.empty_like(rows) if out is None else out.view(rows.shape)
    _sign_residual(rows.numpy(), scales.contiguous().numpy(), packed.numpy(), residual.numpy())
    return packed, residual


@njit(**_JIT)
def _signs(packed, s, out):
    ns = -s
    for j in range(packed.shape[0]):
        byte = packed[j]
        for b in range(8):
            out[8 * j + b] = s if (byte >> b) & 1 else ns


@njit(**_JIT)
def _add_signs(packed, s, out):
    ns = -s
    for j in range(packed.shape[0]):
        byte = packed[j]
        for b in range(8):
            out[8 * j + b] += s if (byte >> b) & 1 else ns


@njit(**_JIT)
def _sum_into(a, b, out):
    for i in range(out.shape[0]):
        out[i] = a[i] + b[i]


@njit(**_JIT)
def _decode(packed, scales, out):
    for r in range(packed.shape[0]):
        _signs(packed[r], scales[r], out[r])


def decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows ``scale * sign`` (R x 8n) from packed signs (R x n uint8) and their fp32 scales (R): the bits of
    ``unpack_signs(packed) * scales[:, None]``."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 8, dtype=torch.float32)
    _decode(packed.contiguous().numpy(), scales.contiguous().numpy(), out.numpy())
    return out


@njit(**_JIT)
def _decode_sum(packed, scales, add, out):
    k = packed.shape[1] * 8
    acc = np.empty(min(_CHUNK, k), np.float32)
    for c in range(0, k, _CHUNK):  # per chunk: the rows' signs summed in order in acc, then + add
        e = min(c + _CHUNK, k)
        part = acc[: e - c]
        _signs(packed[0, c // 8:e // 8], scales[0], part)
        for r in range(1, packed.shape[0]):
            _add_signs(packed[r, c // 8:e // 8], scales[r], part)
        _sum_into(part, add[c:e], out[c:e])


def decode_sum(packed: torch.Tensor, scales: torch.Tensor, add: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The rows ``scale * sign`` summed, plus ``add`` (8n fp32): the bits of
    ``decode(packed, scales).sum(0) + add``, rows summed in order (as torch sums a few rows); written
    into ``out`` (8n fp32 contiguous; ``add`` itself allowed: each element is read before it is written)
    where given, else a new tensor."""
    out = torch.empty(packed.shape[1] * 8, dtype=torch.float32) if out is None else out
    _decode_sum(packed.contiguous().numpy(), scales.contiguous().numpy(), add.contiguous().numpy(),
                out.view(-1).numpy())
    return out


@njit(**_JIT)
def _decode_into(packed, scales, out):
    k, n = packed.shape[1] * 8, out.shape[0]
    for r in range(packed.shape[0]):
        s, base = scales[r], r * k
        if base + k <= n:  # a whole row
            _signs(packed[r], s, out[base:base + k])
        else:
            for c in range(max(n - base, 0)):
                out[base + c] = s if (packed[r, c // 8] >> (c % 8)) & 1 else -s


def decode_into(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """The first ``out.numel()`` values of ``decode(packed, scales)`` (flattened) written into ``out``
    (fp32, contiguous): the same bits, no whole decoded copy."""
    _decode_into(packed.contiguous().numpy(), scales.contiguous().numpy(), out.view(-1).numpy())


@njit(**_JIT)
def _quantize_block(x, s, qmax, bits, payload):
    """One block ``x`` divided by ``s``, rounded, clamped and offset into its ``payload`` bytes."""
    # the offset value is a whole number in [0, 255]: through int32 the conversion vectorizes (to uint8 it does not)
    if bits == 8:
        for i in range(x.shape[0]):
            payload[i] = np.uint8(np.int32(min(max(np.rint(x[i] / s), -qmax), qmax) + np.float32(128)))
    else:
        for j in range(payload.shape[0]):
            q0 = min(max(np.rint(x[2 * j] / s), -qmax), qmax)
            q1 = min(max(np.rint(x[2 * j + 1] / s), -qmax), qmax)
            payload[j] = np.uint8(np.int32((q0 + 8) * 16 + (q1 + 8)))


@njit(**_JIT)
def _quantize(x, safe, block, qmax, bits, payload):
    per = block * bits // 8
    for r in range(x.shape[0]):
        for blk in range(safe.shape[1]):
            _quantize_block(x[r, blk * block:(blk + 1) * block], safe[r, blk], qmax, bits,
                            payload[r, blk * per:(blk + 1) * per])


def quantize(x: torch.Tensor, safe: torch.Tensor, block: int, qmax: int, bits: int) -> torch.Tensor:
    """The payload of fp32 rows ``x`` (R x n) in blocks of ``block`` with per-block divisors ``safe``
    (R x n/block; the scale, 1 where it is 0): the bits of ``round(x / safe).clamp(-qmax, qmax)``
    offset into uint8 (int8: + 128; int4: + 8, two to a byte, the first high), as
    ``zfunc.dist.quantized.quantize`` writes them."""
    x = x.contiguous()
    payload = torch.empty(x.shape[0], x.shape[1] * bits // 8, dtype=torch.uint8)
    _quantize(x.numpy(), safe.contiguous().numpy(), block, np.float32(qmax), bits, payload.numpy())
    return payload


@njit(**_JIT)
def _dequantize_block(payload, s, bits, out):
    """One block's values ``q * s`` from its payload bytes into ``out`` (as many as ``out`` holds)."""
    if bits == 8:
        for i in range(out.shape[0]):
            out[i] = (np.float32(payload[i]) - np.float32(128)) * s
    else:
        for j in range(out.shape[0] // 2):
            byte = payload[j]
            out[2 * j] = (np.float32(byte >> 4) - np.float32(8)) * s
            out[2 * j + 1] = (np.float32(byte & 15) - np.float32(8)) * s


@njit(**_JIT)
def _add_dequantized_block(payload, s, bits, out):
    """``out += q * s`` for one block (as many values as ``out`` holds; int4: an even count)."""
    if bits == 8:
        for i in range(out.shape[0]):
            out[i] += (np.float32(payload[i]) - np.float32(128)) * s
    else:
        for j in range(out.shape[0] // 2):
            byte = payload[j]
            out[2 * j] += (np.float32(byte >> 4) - np.float32(8)) * s
            out[2 * j + 1] += (np.float32(byte & 15) - np.float32(8)) * s


@njit(**_JIT)
def _dequantize(payload, scales, block, bits, out):
    per = block * bits // 8
    for r in range(out.shape[0]):
        for blk in range(scales.shape[1]):
            _dequantize_block(payload[r, blk * per:(blk + 1) * per], scales[r, blk], bits,
                              out[r, blk * block:(blk + 1) * block])


@njit(**_JIT)
def _dequantize_into(payload, scales, block, out):
    k = out.shape[1]
    for r in range(out.shape[0]):
        for blk in range(scales.shape[1]):
            lo, hi = blk * block, min((blk + 1) * block, k)
            if lo < hi:
                _dequantize_block(payload[r, lo:hi], scales[r, blk], 8, out[r, lo:hi])


def dequantize_into(payload: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """``out`` (R x k fp32, contiguous, k at most the payload's row) <- the first k values of each int8 row of
    ``dequantize(payload, scales, block, 8)``: the same bits, no whole dequantized copy."""
    _dequantize_into(payload.contiguous().numpy(), scales.contiguous().numpy(), block, out.numpy())


def dequantize(payload: torch.Tensor, scales: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """fp32 rows from a payload and its per-block scales: the bits of ``(q * scale)``, ``q`` the signed
    value ``zfunc.dist.quantized.quantize`` offset into each byte or nibble."""
    out = torch.empty(payload.shape[0], payload.shape[1] * 8 // bits, dtype=torch.float32)
    _dequantize(payload.contiguous().numpy(), scales.contiguous().numpy(), block, bits, out.numpy())
    return out


@njit(**_JIT)
def _amax(x, bits, word):
    """``max |x|`` (``bits``: ``x``'s int32 view; ``word``: a 1-element int32 array, its float32 view read
    back); where there is a NaN, the last one's ``|x|`` (as torch's amax propagates a NaN). The max runs
    over the bits of ``|x|``, an integer max (which vectorizes; a float one does not without fast-math):
    for floats >= 0 the bits order as the values, and every NaN's exceed inf's."""
    top = np.int32(0)
    for i in range(bits.shape[0]):
        a = bits[i] & np.int32(0x7FFFFFFF)
        top = a if a > top else top
    if top > np.int32(0x7F800000):
        for i in range(x.shape[0] - 1, -1, -1):
            if x[i] != x[i]:
                return abs(x[i])
    word[0] = top
    return word.view(np.float32)[0]


@njit(**_JIT)
def _quantize_blocks(x, block, qmax, bits, scales, payload):
    per = block * bits // 8
    xbits, word = x.view(np.int32), np.empty(1, np.int32)
    for r in range(x.shape[0]):
        for blk in range(scales.shape[1]):
            xb = x[r, blk * block:(blk + 1) * block]
            amax = _amax(xb, xbits[r, blk * block:(blk + 1) * block], word)
            s = amax * (np.float32(1) / qmax)  # the reciprocal's product, as the torch and CUDA paths compute it
            scales[r, blk] = s
            _quantize_block(xb, s if s > 0 else np.float32(1), qmax, bits, payload[r, blk * per:(blk + 1) * per])


def quantize_blocks(x: torch.Tensor, block: int, qmax: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload, scales)`` of fp32 rows ``x`` (R x n, n a multiple of ``block``) in one pass per block:
    ``scales = amax |x| * (1 / qmax)`` per block and the payload of ``quantize`` (0 scales dividing by 1): the
    bits of ``zfunc.dist.quantized.quantize``'s torch expressions."""
    x = x.contiguous()
    scales = torch.empty(x.shape[0], x.shape[1] // block, dtype=torch.float32)
    payload = torch.empty(x.shape[0], x.shape[1] * bits // 8, dtype=torch.uint8)
    _quantize_blocks(x.numpy(), block, np.float32(qmax), bits, scales.numpy(), payload.numpy())
    return payload, scales


@njit(**_JIT)
def _dequantize_sum(payload, scales, block, bits, out):
    k, per = out.shape[0], block * bits // 8
    tail = np.empty(block, np.float32)  # an odd-length int4 tail, dequantized whole
    for blk in range(scales.shape[1]):  # per block: row 0 written, the later rows added in order
        lo, hi = blk * block, min((blk + 1) * block, k)
        if lo >= hi:
            break
        pb = blk * per
        if bits == 4 and (hi - lo) % 2:
            for r in range(payload.shape[0]):
                _dequantize_block(payload[r, pb:pb + per], scales[r, blk], bits, tail)
                for i in range(hi - lo):
                    out[lo + i] = tail[i] if r == 0 else out[lo + i] + tail[i]
            continue
        _dequantize_block(payload[0, pb:pb + per], scales[0, blk], bits, out[lo:hi])
        for r in range(1, payload.shape[0]):
            _add_dequantized_block(payload[r, pb:pb + per], scales[r, blk], bits, out[lo:hi])


def dequantize_sum(payload: torch.Tensor, scales: torch.Tensor, block: int, bits: int, out: torch.Tensor) -> None:
    """``out`` (its numel k, fp32 contiguous) <- the first k values of every dequantized row, summed over
    the rows in order: the bits of ``dequantize(payload, scales)[:, :k].sum(0)`` (torch sums a few rows
    in order)."""
    _dequantize_sum(payload.contiguous().numpy(), scales.contiguous().numpy(), block, bits, out.view(-1).numpy())
