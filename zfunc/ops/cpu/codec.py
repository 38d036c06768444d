"""The codecs of the compressed collectives on CPU tensors, in Numba: one pass each where torch takes
several (``zfunc.dist.compressed``'s signs, ``zfunc.dist.quantized``'s int8/int4 blocks).

Law: every function returns the same bits as the torch expressions it replaces (stated per function;
tests/test_compressed.py and tests/test_quantized.py compare them): the arithmetic is the same fp32
operations, in the same order per element, and rounding is half to even as ``torch.round``. Cost:
one read of the input and one write of each output, on the calling thread (the ranks of a CPU run
each have their own cores); ~5-20x faster than the torch expressions on one thread (``torch.where``
with a broadcast scale and a table lookup per byte are what they replace).
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

_JIT = dict(cache=True, fastmath=False, nogil=True, error_model="numpy", boundscheck=False)


@njit(**_JIT)
def _add_blend(e, x, y, a, b):
    for i in range(e.shape[0]):
        e[i] = e[i] + (x[i] * a + b * y[i])


def add_blend_(e: torch.Tensor, x: torch.Tensor, y: torch.Tensor, a: float, b: float) -> None:
    """``e += x * a + b * y`` (fp32, contiguous, one size) in one pass: the bits of that torch expression."""
    _add_blend(e.view(-1).numpy(), x.view(-1).numpy(), y.view(-1).numpy(), np.float32(a), np.float32(b))


@njit(**_JIT)
def _sign_residual(rows, scales, packed, residual):
    for r in range(rows.shape[0]):
        s = scales[r]
        for j in range(packed.shape[1]):
            byte = 0
            for b in range(8):
                v = rows[r, 8 * j + b]
                if v >= 0:
                    byte |= 1 << b
                    residual[r, 8 * j + b] = v - s
                else:
                    residual[r, 8 * j + b] = v + s
            packed[r, j] = byte


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
def _decode(packed, scales, out):
    for r in range(packed.shape[0]):
        s = scales[r]
        for j in range(packed.shape[1]):
            byte = packed[r, j]
            for b in range(8):
                out[r, 8 * j + b] = s if (byte >> b) & 1 else -s


def decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows ``scale * sign`` (R x 8n) from packed signs (R x n uint8) and their fp32 scales (R): the bits of
    ``unpack_signs(packed) * scales[:, None]``."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 8, dtype=torch.float32)
    _decode(packed.contiguous().numpy(), scales.contiguous().numpy(), out.numpy())
    return out


@njit(**_JIT)
def _decode_sum(packed, scales, add, out):
    for j in range(packed.shape[1]):
        for b in range(8):
            acc = scales[0] if (packed[0, j] >> b) & 1 else -scales[0]
            for r in range(1, packed.shape[0]):
                acc += scales[r] if (packed[r, j] >> b) & 1 else -scales[r]
            out[8 * j + b] = acc + add[8 * j + b]


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
        if base + k <= n:  # a whole row: 8 stores per byte, no bounds to test
            for j in range(packed.shape[1]):
                byte = packed[r, j]
                for b in range(8):
                    out[base + 8 * j + b] = s if (byte >> b) & 1 else -s
        else:
            for c in range(max(n - base, 0)):
                out[base + c] = s if (packed[r, c // 8] >> (c % 8)) & 1 else -s


def decode_into(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """The first ``out.numel()`` values of ``decode(packed, scales)`` (flattened) written into ``out``
    (fp32, contiguous): the same bits, no whole decoded copy."""
    _decode_into(packed.contiguous().numpy(), scales.contiguous().numpy(), out.view(-1).numpy())


@njit(**_JIT)
def _quantize_block(x, r, blk, block, s, qmax, bits, payload):
    """Block ``blk`` of row ``r`` divided by ``s``, rounded, clamped and offset into ``payload``."""
    for i in range(blk * block, (blk + 1) * block, 2):
        q0 = min(max(np.rint(x[r, i] / s), -qmax), qmax)
        q1 = min(max(np.rint(x[r, i + 1] / s), -qmax), qmax)
        if bits == 8:
            payload[r, i] = np.uint8(q0 + 128)
            payload[r, i + 1] = np.uint8(q1 + 128)
        else:
            payload[r, i // 2] = np.uint8((q0 + 8) * 16 + (q1 + 8))


@njit(**_JIT)
def _quantize(x, safe, block, qmax, bits, payload):
    for r in range(x.shape[0]):
        for blk in range(safe.shape[1]):
            _quantize_block(x, r, blk, block, safe[r, blk], qmax, bits, payload)


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
def _dequantize(payload, scales, block, bits, out):
    for r in range(out.shape[0]):
        for blk in range(scales.shape[1]):
            s = scales[r, blk]
            if bits == 8:
                for i in range(blk * block, (blk + 1) * block):
                    out[r, i] = (np.float32(payload[r, i]) - np.float32(128)) * s
            else:
                for j in range(blk * block // 2, (blk + 1) * block // 2):
                    byte = payload[r, j]
                    out[r, 2 * j] = (np.float32(byte >> 4) - np.float32(8)) * s
                    out[r, 2 * j + 1] = (np.float32(byte & 15) - np.float32(8)) * s


@njit(**_JIT)
def _dequantize_into(payload, scales, block, out):
    k = out.shape[1]
    for r in range(out.shape[0]):
        for blk in range(scales.shape[1]):
            s = scales[r, blk]
            for i in range(blk * block, min((blk + 1) * block, k)):
                out[r, i] = (np.float32(payload[r, i]) - np.float32(128)) * s


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
def _quantize_blocks(x, block, qmax, bits, scales, payload):
    for r in range(x.shape[0]):
        for blk in range(scales.shape[1]):
            amax = np.float32(0)
            for i in range(blk * block, (blk + 1) * block):
                a = abs(x[r, i])
                if a > amax or a != a:
                    amax = a
            s = amax * (np.float32(1) / qmax)  # the reciprocal's product, as the torch and CUDA paths compute it
            scales[r, blk] = s
            _quantize_block(x, r, blk, block, s if s > 0 else np.float32(1), qmax, bits, payload)


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
    for i in range(out.shape[0]):
        acc = np.float32(0)
        for r in range(payload.shape[0]):
            s = scales[r, i // block]
            if bits == 8:
                q = np.float32(payload[r, i]) - np.float32(128)
            elif i % 2 == 0:
                q = np.float32(payload[r, i // 2] >> 4) - np.float32(8)
            else:
                q = np.float32(payload[r, i // 2] & 15) - np.float32(8)
            acc = q * s if r == 0 else acc + q * s
        out[i] = acc


def dequantize_sum(payload: torch.Tensor, scales: torch.Tensor, block: int, bits: int, out: torch.Tensor) -> None:
    """``out`` (its numel k, fp32 contiguous) <- the first k values of every dequantized row, summed over
    the rows in order: the bits of ``dequantize(payload, scales)[:, :k].sum(0)`` (torch sums a few rows
    in order)."""
    _dequantize_sum(payload.contiguous().numpy(), scales.contiguous().numpy(), block, bits, out.view(-1).numpy())
