"""Multi-tensor casts on CUDA with a scale, the offload path's conversions: fp32 masters to the bf16/fp16
compute copy, bf16/fp16 grads to fp32 unscaled, in one launch per dtype pair.

``cast_many_(srcs, dsts, scale)``: ``dst = (src * scale).to(dst.dtype)`` for every pair (fp32, bf16,
fp16 either side; ``scale_tensor`` a device scalar multiplied in where given), and on request the sum
of squares of ``src * scale`` from the same read. Law (``tests/test_gpu_kernels.py``, marked gpu):
bit-equal to ``(src.float() * scale).to(dst.dtype)``. Cost: one read of src and one write of dst
(fp32 -> bf16: 6 B/element), where torch's scaled cast is a multiply pass and a cast pass.
"""
from __future__ import annotations

import numpy as np
import torch

from zfunc.ops.gpu import program as prog
from zfunc.ops.gpu import runtime

_BODY = r"""
template <class S, class D>
__device__ __forceinline__ void zf_cast(const zf_i64* table, int n_rows, double* partials, const float* scale_ptr,
                                        float scale) {
  zf_chunk c = zf_chunk_of(table, n_rows);
  const void* src = (const void*)c.row[0];
  void* dst = (void*)c.row[1];
  float s = scale_ptr ? scale * *scale_ptr : scale;
  double sq = 0.0;
  zf_for_chunk(c, [&](zf_i64 i, int k) {
    float x[ZF_VEC];
    if (k == ZF_VEC) S::load4(src, i, x); else x[0] = S::load(src, i);
#pragma unroll
    for (int j = 0; j < ZF_VEC; ++j)
      if (j < k) { x[j] *= s; sq = fma((double)x[j], (double)x[j], sq); }
    if (k == ZF_VEC) D::store4(dst, i, x); else D::store(dst, i, x[0]);
  });
  if (partials) {
    double t = zf_block_sum(sq);
    if (threadIdx.x == 0) partials[blockIdx.x] = t;
  }
}
"""
_ENTRY = r"""
extern "C" __global__ void __launch_bounds__(ZF_THREADS) %(name)s(const zf_i64* table, int n_rows,
                                                                   double* partials, const float* scale_ptr,
                                                                   float scale) {
  zf_cast<%(s)s, %(d)s>(table, n_rows, partials, scale_ptr, scale);
}
"""
ENTRIES = {(s, d): prog.entry("cast", s, d) for s in prog.DTYPES for d in prog.DTYPES}
PROGRAM = prog.Program("cast", _BODY + "".join(_ENTRY % dict(name=n, s=s, d=d) for (s, d), n in ENTRIES.items()),
                       tuple(ENTRIES.values()))
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cast_many_(srcs: list[torch.Tensor], dsts: list[torch.Tensor], scale: float = 1.0,
               scale_tensor: torch.Tensor | None = None, squares: bool = False) -> torch.Tensor | None:
    """``dst.copy_((src * scale).to(dst.dtype))`` for each pair (contiguous, one CUDA device, equal
    sizes, fp32/bf16/fp16, not overlapping), on torch's current stream. ``squares``: returns the
    sum of squares of ``src * scale`` as a 0-d fp64 device tensor, else None."""
    if len(srcs) != len(dsts):
        raise ValueError(f"cast_many_: expected lists of one length, got srcs {len(srcs)}, dsts {len(dsts)}")
    if not srcs:
        return None
    device = runtime.cuda_device(srcs[0], "srcs[0]")
    runtime.check_scale(scale_tensor, device)

    def groups() -> dict[tuple[str, str], list[tuple]]:
        found: dict[tuple[str, str], list[tuple]] = {}
        for i, (s, d) in enumerate(zip(srcs, dsts)):
            runtime.check("srcs", i, s, _DTYPES, device)
            runtime.check("dsts", i, d, _DTYPES, device, s.numel())
            flags = prog.VECTOR if runtime.aligned(s) and runtime.aligned(d) else 0
            key = (runtime.dtype_name(s.dtype), runtime.dtype_name(d.dtype))
            found.setdefault(key, []).append((s.data_ptr(), d.data_ptr(), 0, 0, 0, s.numel(), flags))
        return found

    plan = runtime.planned(("cast",), (srcs, dsts), groups, device)
    partials = runtime.run("cast", ENTRIES, plan, (runtime.ptr(scale_tensor), np.float32(scale)), sums=squares)
    return partials.sum() if partials is not None else None
