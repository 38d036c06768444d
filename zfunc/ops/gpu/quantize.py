"""ZeRO++'s block quantizers on CUDA (``zfunc.dist.quantized``'s ``quantize`` and ``dequantize``):
symmetric int8 or int4 per block of ``BLOCK`` = 256 values, one warp per block.

Same layout and results as the torch functions: ``scale = max|x| * (1 / qmax)`` (127 or 7),
``q = round_half_even(x / scale)`` clamped to ``[-qmax, qmax]`` (scale 1 where the block is all
zeros), int8 stored offset by 128, int4 as two offset nibbles a byte (the first value high).
Law (``tests/test_gpu_kernels.py``, marked gpu): payload, scales and dequantized values bit-equal to
the torch functions' on finite inputs (IEEE division and rounding, as NVRTC compiles by default).
Cost: quantize reads 4 B and writes 1 (int8) or 0.5 (int4) B per value plus 4 B per block, one pass
(torch: abs, amax, divide, round, clamp, add, cast: seven); dequantize the reverse, one pass.
"""
from __future__ import annotations

import numpy as np
import torch

from zfunc.ops.gpu import program as prog
from zfunc.ops.gpu import runtime

BLOCK = 256
_QMAX = {8: 127, 4: 7}

_BODY = r"""
#define ZF_QBLOCK 256
#define ZF_PER_LANE (ZF_QBLOCK / 32)

// One warp per block of 256 values; lane l holds values 8l .. 8l+7.
template <int BITS>
__device__ __forceinline__ void zf_quantize(const float* x, zf_i64 n_blocks, unsigned char* payload, float* scales) {
  const float qmax = BITS == 8 ? 127.0f : 7.0f;
  zf_i64 blk = ((zf_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (blk >= n_blocks) return;
  const float* src = x + blk * ZF_QBLOCK + lane * ZF_PER_LANE;
  float v[ZF_PER_LANE];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < ZF_PER_LANE; ++i) { v[i] = src[i]; amax = fmaxf(amax, fabsf(v[i])); }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  float scale = amax * (1.0f / qmax);  // the reciprocal, bit-equal to the torch path's
  float safe = scale > 0.0f ? scale : 1.0f;
  if (lane == 0) scales[blk] = scale;
  float q[ZF_PER_LANE];
#pragma unroll
  for (int i = 0; i < ZF_PER_LANE; ++i) q[i] = fminf(fmaxf(rintf(v[i] / safe), -qmax), qmax);
  if (BITS == 8) {
    unsigned char* dst = payload + blk * ZF_QBLOCK + lane * ZF_PER_LANE;
#pragma unroll
    for (int i = 0; i < ZF_PER_LANE; ++i) dst[i] = (unsigned char)(int)(q[i] + 128.0f);
  } else {
    unsigned char* dst = payload + blk * (ZF_QBLOCK / 2) + lane * (ZF_PER_LANE / 2);
#pragma unroll
    for (int i = 0; i < ZF_PER_LANE / 2; ++i)
      dst[i] = (unsigned char)((int)(q[2 * i] + 8.0f) * 16 + (int)(q[2 * i + 1] + 8.0f));
  }
}

template <int BITS>
__device__ __forceinline__ void zf_dequantize(const unsigned char* payload, const float* scales, zf_i64 n_blocks,
                                              float* out) {
  zf_i64 blk = ((zf_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (blk >= n_blocks) return;
  float s = scales[blk];
  float* dst = out + blk * ZF_QBLOCK + lane * ZF_PER_LANE;
  if (BITS == 8) {
    const unsigned char* src = payload + blk * ZF_QBLOCK + lane * ZF_PER_LANE;
#pragma unroll
    for (int i = 0; i < ZF_PER_LANE; ++i) dst[i] = ((float)src[i] - 128.0f) * s;
  } else {
    const unsigned char* src = payload + blk * (ZF_QBLOCK / 2) + lane * (ZF_PER_LANE / 2);
#pragma unroll
    for (int i = 0; i < ZF_PER_LANE / 2; ++i) {
      int b = src[i];
      dst[2 * i] = (float)((b >> 4) - 8) * s;
      dst[2 * i + 1] = (float)((b & 15) - 8) * s;
    }
  }
}

extern "C" __global__ void quantize_int8(const float* x, zf_i64 n_blocks, unsigned char* payload, float* scales) {
  zf_quantize<8>(x, n_blocks, payload, scales);
}
extern "C" __global__ void quantize_int4(const float* x, zf_i64 n_blocks, unsigned char* payload, float* scales) {
  zf_quantize<4>(x, n_blocks, payload, scales);
}
extern "C" __global__ void dequantize_int8(const unsigned char* payload, const float* scales, zf_i64 n_blocks,
                                           float* out) {
  zf_dequantize<8>(payload, scales, n_blocks, out);
}
extern "C" __global__ void dequantize_int4(const unsigned char* payload, const float* scales, zf_i64 n_blocks,
                                           float* out) {
  zf_dequantize<4>(payload, scales, n_blocks, out);
}
"""
PROGRAM = prog.Program("quantize", _BODY, ("quantize_int8", "quantize_int4", "dequantize_int8", "dequantize_int4"))
_THREADS = 256  # 8 warps: 8 quantization blocks per CUDA block


def _grid(n_blocks: int) -> int:
    return -(-n_blocks * 32 // _THREADS)


def _bits(bits: int) -> None:
    if bits not in _QMAX:
        raise ValueError(f"bits: expected 4 or 8, got {bits!r}")


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (rows x n, n a multiple of ``BLOCK``; contiguous fp32 on CUDA) as ``(payload
    uint8, scales fp32)``, as ``zfunc.dist.quantized.quantize``: per row n bytes (int8) or n/2 (int4),
    and n / BLOCK scales."""
    _bits(bits)
    runtime.cuda_device(x, "x")
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"x: expected a 2-d CUDA tensor with a multiple of {BLOCK} columns, got "
                         f"{tuple(x.shape)} on {x.device}")
    runtime.check("x", None, x, (torch.float32,), x.device)
    rows, n = x.shape
    n_blocks = rows * n // BLOCK
    payload = torch.empty(rows, n if bits == 8 else n // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, n // BLOCK, dtype=torch.float32, device=x.device)
    runtime.launch("quantize", f"quantize_int{bits}", x.device, _grid(n_blocks), _THREADS,
                   (runtime.ptr(x), np.int64(n_blocks), runtime.ptr(payload), runtime.ptr(scales)))
    return payload, scales


def dequantize(payload: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """``quantize``'s inverse: rows of fp32 values (rows x n), as ``zfunc.dist.quantized.dequantize``."""
    _bits(bits)
    runtime.cuda_device(payload, "payload")
    if payload.dim() != 2 or payload.dtype != torch.uint8:
        raise ValueError(f"payload: expected a 2-d uint8 CUDA tensor, got {payload.dtype} {tuple(payload.shape)} on "
                         f"{payload.device}")
    runtime.check("payload", None, payload, (torch.uint8,), payload.device)
    rows = payload.shape[0]
    n = payload.shape[1] * (1 if bits == 8 else 2)
    runtime.check("scales", None, scales, (torch.float32,), payload.device, rows * n // BLOCK)
    out = torch.empty(rows, n, dtype=torch.float32, device=payload.device)
    runtime.launch("quantize", f"dequantize_int{bits}", payload.device, _grid(rows * n // BLOCK), _THREADS,
                   (runtime.ptr(payload), runtime.ptr(scales), np.int64(rows * n // BLOCK), runtime.ptr(out)))
    return out
