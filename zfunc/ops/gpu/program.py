"""A kernel program: CUDA C++ source and the ``extern "C"`` entry points compiled from it.

Each kernel module (``adam``, ``lion``, ``lamb``, ``norm``, ``cast``, ``onebit``, ``quantize``)
defines one ``Program``; ``every()`` lists them, so that the runtime (``zfunc.ops.gpu.runtime``,
through CuPy) and the driver-free compile check (``zfunc.ops.gpu.nvrtc``) build the same source
with the same options. Template instantiations are spelled out as ``extern "C"`` wrappers (one
per dtype combination the dispatcher can pick), so an entry point is a plain name, never a
mangled one, and the compile check sees every instantiation.

The shared header (``HEADER``) is self-contained: no CUDA header is included, so NVRTC needs no
CUDA toolkit beside it. bf16 and fp16 are carried as 16-bit integers and converted with PTX
``cvt`` (round to nearest even, as torch's casts).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

# Compile options, the same for CuPy's runtime compile and the NVRTC check (the check adds the
# architecture; CuPy adds the device's own).
OPTIONS = ("--std=c++17",)

# One block of THREADS threads updates one chunk of one tensor, VEC elements a thread per pass: CHUNK
# elements (ITERS passes; a 1B-param step is ~122K blocks), or a smaller multiple of THREADS * VEC where
# the launch plan fits the chunk to the call (runtime.fitted_chunk). A table row carries its chunk.
THREADS = 256
VEC = 4
ITERS = 8
CHUNK = THREADS * VEC * ITERS
REDUCE_THREADS = 1024  # the one block that sums the per-block partial sums
ROW = 8  # int64 words per tensor row of a table: up to 5 addresses, n, flags, chunk

# Flag bits of a table row.
DECAY = 1  # this tensor decays (the weight-decay mask)
VECTOR = 2  # every address of the row is aligned for VEC-element loads and stores

DTYPES = ("F32", "BF16", "F16")  # the element types a kernel is instantiated for
OUTS = ("NONE", "BF16", "F16")  # a low-precision copy written in the same pass, or none

HEADER = r"""
typedef unsigned short zf_u16;
typedef long long zf_i64;

#define ZF_THREADS %(THREADS)d
#define ZF_VEC %(VEC)d
#define ZF_ITERS %(ITERS)d
#define ZF_CHUNK %(CHUNK)d
#define ZF_ROW %(ROW)d
#define ZF_DECAY %(DECAY)d
#define ZF_VECTOR %(VECTOR)d

struct alignas(16) zf_f4 { float a, b, c, d; };
struct alignas(8) zf_h4 { zf_u16 a, b, c, d; };

__device__ __forceinline__ float zf_bf16_to_f32(zf_u16 h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ zf_u16 zf_f32_to_bf16(float x) {
#if __CUDA_ARCH__ >= 800
  zf_u16 r;
  asm("cvt.rn.bf16.f32 %%0, %%1;" : "=h"(r) : "f"(x));
  return r;
#else
  unsigned u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (zf_u16)0x7fff;
  return (zf_u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}
__device__ __forceinline__ float zf_f16_to_f32(zf_u16 h) {
  float r;
  asm("cvt.f32.f16 %%0, %%1;" : "=f"(r) : "h"(h));
  return r;
}
__device__ __forceinline__ zf_u16 zf_f32_to_f16(float x) {
  zf_u16 r;
  asm("cvt.rn.f16.f32 %%0, %%1;" : "=h"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ bool zf_finite(double x) {
  return (__double_as_longlong(x) & 0x7ff0000000000000ll) != 0x7ff0000000000000ll;
}

// Element types: load/store one element, or ZF_VEC (=4) consecutive ones (aligned: the caller checked).
struct F32 {
  static constexpr int BYTES = 4;
  static __device__ __forceinline__ float load(const void* b, zf_i64 i) { return ((const float*)b)[i]; }
  static __device__ __forceinline__ void store(void* b, zf_i64 i, float x) { ((float*)b)[i] = x; }
  static __device__ __forceinline__ void load4(const void* b, zf_i64 i, float* x) {
    zf_f4 v = *(const zf_f4*)((const float*)b + i);
    x[0] = v.a; x[1] = v.b; x[2] = v.c; x[3] = v.d;
  }
  static __device__ __forceinline__ void store4(void* b, zf_i64 i, const float* x) {
    zf_f4 v; v.a = x[0]; v.b = x[1]; v.c = x[2]; v.d = x[3];
    *(zf_f4*)((float*)b + i) = v;
  }
};
struct BF16Bits {
  static __device__ __forceinline__ float to(zf_u16 h) { return zf_bf16_to_f32(h); }
  static __device__ __forceinline__ zf_u16 from(float x) { return zf_f32_to_bf16(x); }
};
struct F16Bits {
  static __device__ __forceinline__ float to(zf_u16 h) { return zf_f16_to_f32(h); }
  static __device__ __forceinline__ zf_u16 from(float x) { return zf_f32_to_f16(x); }
};
template <class C>
struct Half {
  static constexpr int BYTES = 2;
  static __device__ __forceinline__ float load(const void* b, zf_i64 i) { return C::to(((const zf_u16*)b)[i]); }
  static __device__ __forceinline__ void store(void* b, zf_i64 i, float x) { ((zf_u16*)b)[i] = C::from(x); }
  static __device__ __forceinline__ void load4(const void* b, zf_i64 i, float* x) {
    zf_h4 v = *(const zf_h4*)((const zf_u16*)b + i);
    x[0] = C::to(v.a); x[1] = C::to(v.b); x[2] = C::to(v.c); x[3] = C::to(v.d);
  }
  static __device__ __forceinline__ void store4(void* b, zf_i64 i, const float* x) {
    zf_h4 v; v.a = C::from(x[0]); v.b = C::from(x[1]); v.c = C::from(x[2]); v.d = C::from(x[3]);
    *(zf_h4*)((zf_u16*)b + i) = v;
  }
};
typedef Half<BF16Bits> BF16;
typedef Half<F16Bits> F16;
struct NONE {  // no output: stores vanish
  static __device__ __forceinline__ void store(void*, zf_i64, float) {}
  static __device__ __forceinline__ void store4(void*, zf_i64, const float*) {}
};

// The table a multi-tensor launch reads: n_rows rows of ZF_ROW int64 (addresses, n, flags, chunk), then
// n_rows + 1 chunk starts (row r's chunks are blocks [starts[r], starts[r+1]) of the launch).
struct zf_chunk { const zf_i64* row; zf_i64 lo, hi; int flags, r; };

__device__ __forceinline__ zf_chunk zf_chunk_of(const zf_i64* table, int n_rows) {
  const zf_i64* starts = table + (zf_i64)ZF_ROW * n_rows;
  zf_i64 b = blockIdx.x;
  int lo = 0, hi = n_rows - 1;  // the last row r with starts[r] <= b
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (starts[mid] <= b) lo = mid; else hi = mid - 1;
  }
  zf_chunk c;
  c.r = lo;
  c.row = table + (zf_i64)ZF_ROW * lo;
  zf_i64 n = c.row[5], chunk = c.row[7];
  c.lo = (b - starts[lo]) * chunk;
  c.hi = c.lo + chunk < n ? c.lo + chunk : n;
  c.flags = (int)c.row[6];
  return c;
}

// The sum of x over the block, in thread 0 (a fixed order: the same inputs give the same bits).
__device__ __forceinline__ double zf_block_sum(double x) {
  __shared__ double warp_sums[32];
  __syncthreads();  // a previous call's reads of warp_sums are done
  for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  x = (int)threadIdx.x < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0.0;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  return x;
}

// Runs body(i, count) over a chunk: count = ZF_VEC elements from i where the row is aligned for
// them, else 1; each thread takes every blockDim.x-th group, so the warp's accesses are contiguous.
template <class Body>
__device__ __forceinline__ void zf_for_chunk(const zf_chunk& c, Body body) {
  zf_i64 start = c.lo;
  if (c.flags & ZF_VECTOR) {
    zf_i64 whole = c.lo + ((c.hi - c.lo) / ZF_VEC) * ZF_VEC;
    for (zf_i64 i = c.lo + (zf_i64)threadIdx.x * ZF_VEC; i < whole; i += (zf_i64)blockDim.x * ZF_VEC) body(i, ZF_VEC);
    start = whole;
  }
  for (zf_i64 i = start + threadIdx.x; i < c.hi; i += blockDim.x) body(i, 1);
}

// The per-block partial sums of a launch (or of several launches into one buffer), summed by one
// block in a fixed order: sum (fp64), its square root (fp32) and whether it is finite, each where
// its address is not null. A sum of squares is finite iff every term was.
extern "C" __global__ void zf_reduce_partials(const double* partials, zf_i64 n, double* sum_out, float* norm_out,
                                              unsigned char* finite_out) {
  double x = 0.0;
  for (zf_i64 i = threadIdx.x; i < n; i += blockDim.x) x += partials[i];
  x = zf_block_sum(x);
  if (threadIdx.x == 0) {
    if (sum_out) *sum_out = x;
    if (norm_out) *norm_out = (float)sqrt(x);
    if (finite_out) *finite_out = zf_finite(x) ? 1 : 0;
  }
}
""" % dict(THREADS=THREADS, VEC=VEC, ITERS=ITERS, CHUNK=CHUNK, ROW=ROW, DECAY=DECAY, VECTOR=VECTOR)

REDUCE = "zf_reduce_partials"  # in every program: HEADER defines it


@dataclass(frozen=True)
class Program:
    """``name``: the kernel family; ``body``: its CUDA source after ``HEADER``; ``entries``: the
    ``extern "C"`` kernels it defines (``HEADER``'s ``zf_reduce_partials`` is in every program)."""

    name: str
    body: str
    entries: tuple[str, ...]

    @property
    def source(self) -> str:
        return HEADER + self.body

    @property
    def every_entry(self) -> tuple[str, ...]:
        return (*self.entries, REDUCE)


def entry(family: str, *types: str) -> str:
    """The entry point of ``family`` for these element types, e.g. ``adam_F32_BF16``."""
    return "_".join((family, *types))


MODULES = ("adam", "lion", "lamb", "norm", "cast", "onebit", "quantize")


def every() -> list[Program]:
    """Every kernel program zfunc launches (each module's ``PROGRAM``)."""
    return [importlib.import_module(f"zfunc.ops.gpu.{m}").PROGRAM for m in MODULES]
