"""The 1-bit compressor's passes on CUDA (``zfunc.dist.compressed``'s ``pack_signs``, ``decode`` and
``scaled_signs``), each one pass over its tensors.

Same layout and results as the torch functions: element 8j + i's sign (``x >= 0``, NaN negative) at
bit i of byte j; ``decode`` gives ``scale[row] * (+-1)``; ``scaled_signs`` gives the packed signs,
``||row||_2 / sqrt(k)`` and the residual ``row - scale * sign`` (``row + scale`` where the sign is
negative, as ``torch.where`` writes it). Law (``tests/test_gpu_kernels.py``, marked gpu): packed bytes
and decoded rows bit-equal to the torch functions' on the same device; residual bit-equal given the
same scales (the scales are torch's ``vector_norm``). Cost: pack reads 4 B and writes 1/8 B per
element; ``scaled_signs`` a norm read plus one pass that writes the signs and the residual (torch:
a norm, a compare, a pack and a where: four passes).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from zfunc.ops.gpu import program as prog
from zfunc.ops.gpu import runtime

_BODY = r"""
// One thread per byte of signs: elements 8j .. 8j+7.
extern "C" __global__ void onebit_pack(const float* x, zf_i64 n_bytes, unsigned char* packed) {
  zf_i64 j = (zf_i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n_bytes) return;
  unsigned b = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) b |= (x[8 * j + i] >= 0.0f ? 1u : 0u) << i;
  packed[j] = (unsigned char)b;
}

// Rows of k elements (k % 8 == 0): signs packed, residual = x - scale * sign, scale per row.
extern "C" __global__ void onebit_compress(const float* rows, zf_i64 k, const float* scales, zf_i64 n_bytes,
                                           unsigned char* packed, float* residual) {
  zf_i64 j = (zf_i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n_bytes) return;
  float s = scales[(8 * j) / k];
  unsigned b = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float x = rows[8 * j + i];
    bool positive = x >= 0.0f;
    b |= (positive ? 1u : 0u) << i;
    residual[8 * j + i] = positive ? x - s : x + s;
  }
  packed[j] = (unsigned char)b;
}

// scale[row] * (+-1) from packed signs; rows of k elements.
extern "C" __global__ void onebit_decode(const unsigned char* packed, const float* scales, zf_i64 k, zf_i64 n_bytes,
                                         float* out) {
  zf_i64 j = (zf_i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n_bytes) return;
  float s = scales[(8 * j) / k];
  unsigned b = packed[j];
#pragma unroll
  for (int i = 0; i < 8; ++i) out[8 * j + i] = ((b >> i) & 1u) ? s : -s;
}
"""
PROGRAM = prog.Program("onebit", _BODY, ("onebit_pack", "onebit_compress", "onebit_decode"))
_BLOCK = 256


def _grid(n: int) -> int:
    return -(-n // _BLOCK)


def _cuda_f32(name: str, x: torch.Tensor) -> None:
    runtime.check(name, None, x, (torch.float32,), runtime.cuda_device(x, name))


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``x >= 0`` as bits, 8 per uint8 (``zfunc.dist.compressed.pack_signs``); x: contiguous fp32 on
    CUDA, ``x.numel() % 8 == 0``."""
    _cuda_f32("x", x)
    if x.numel() % 8:
        raise ValueError(f"x: expected a multiple of 8 elements, got {x.numel()}")
    out = torch.empty(x.numel() // 8, dtype=torch.uint8, device=x.device)
    runtime.launch("onebit", "onebit_pack", x.device, _grid(out.numel()), _BLOCK,
                   (runtime.ptr(x), np.int64(out.numel()), runtime.ptr(out)))
    return out


def decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows ``scale * sign`` from packed signs (rows x k/8 uint8) and their scales (rows fp32)
    (``zfunc.dist.compressed.decode``)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_contiguous():
        raise ValueError(f"packed: expected a contiguous 2-d uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    _cuda_f32("scales", scales)
    if scales.numel() != packed.shape[0] or packed.device != scales.device:
        raise ValueError(f"scales: expected {packed.shape[0]} on {packed.device}, got {scales.numel()} on "
                         f"{scales.device}")
    k = 8 * packed.shape[1]
    out = torch.empty(packed.shape[0], k, dtype=torch.float32, device=packed.device)
    runtime.launch("onebit", "onebit_decode", packed.device, _grid(packed.numel()), _BLOCK,
                   (runtime.ptr(packed), runtime.ptr(scales), np.int64(max(k, 1)), np.int64(packed.numel()),
                    runtime.ptr(out)))
    return out


def scaled_signs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of ``rows`` (chunks x k, k % 8 == 0, contiguous fp32 on CUDA) as ``scale * sign``:
    ``(packed signs (chunks x k/8), scales (chunks), residual rows - scale * sign)``
    (``zfunc.dist.compressed.scaled_signs``)."""
    _cuda_f32("rows", rows)
    if rows.dim() != 2 or rows.shape[1] % 8:
        raise ValueError(f"rows: expected 2-d with a multiple of 8 columns, got {tuple(rows.shape)}")
    k = rows.shape[1]
    scales = torch.linalg.vector_norm(rows, dim=1) / math.sqrt(k)
    packed = torch.empty(rows.shape[0], k // 8, dtype=torch.uint8, device=rows.device)
    residual = torch.empty_like(rows)
    runtime.launch("onebit", "onebit_compress", rows.device, _grid(packed.numel()), _BLOCK,
                   (runtime.ptr(rows), np.int64(max(k, 1)), runtime.ptr(scales), np.int64(packed.numel()),
                    runtime.ptr(packed), runtime.ptr(residual)))
    return packed, scales, residual
