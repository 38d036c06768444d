"""The global L2 norm of many CUDA tensors and whether every element is finite, in one read.

``norm_and_finite(tensors, scale)`` returns ``(||scale * x||_2, all finite)`` as 0-d device tensors
(fp32 and bool), read back by nobody: a step can branch on them when it syncs anyway. Each block
sums the squares of its chunk in fp32 and leaves its sum in fp64; one block adds the partial sums
in a fixed order, so equal inputs give equal bits. The fp64 total of fp32 squares cannot overflow,
so it is finite iff every element is (inf and nan propagate): the inf/nan check costs no second
read. Law (``tests/test_gpu_kernels.py``, marked gpu): the norm equals
``torch.linalg.vector_norm`` of the fp64-cast tensors to rtol 1e-6 for fp32, bf16 and fp16 inputs,
and ``finite`` is False iff some element is inf or nan. Cost: one read of the tensors (4 or 2
B/element), one launch per dtype and one to reduce.
"""
from __future__ import annotations

import numpy as np
import torch

from zfunc.ops.gpu import program as prog
from zfunc.ops.gpu import runtime

_BODY = r"""
template <class G>
__device__ __forceinline__ void zf_sumsq(const zf_i64* table, int n_rows, double* partials, const float* scale_ptr,
                                         float scale) {
  zf_chunk c = zf_chunk_of(table, n_rows);
  const void* g = (const void*)c.row[1];
  float s = scale_ptr ? scale * *scale_ptr : scale;
  double sq = 0.0;  // fp64: a square of a large fp32 grad must not overflow
  if (G::BYTES == 2 && (c.flags & ZF_VECTOR) && c.hi - c.lo == ZF_CHUNK) {
    // a whole aligned chunk of a 2-byte dtype: all ZF_ITERS loads (8 bytes each) in flight before the
    // first square, summed in zf_for_chunk's order (fp32's 16-byte loads ran faster one at a time)
    float gv[ZF_ITERS][ZF_VEC];
#pragma unroll
    for (int it = 0; it < ZF_ITERS; ++it)
      G::load4(g, c.lo + ((zf_i64)it * ZF_THREADS + threadIdx.x) * ZF_VEC, gv[it]);
#pragma unroll
    for (int it = 0; it < ZF_ITERS; ++it)
#pragma unroll
      for (int j = 0; j < ZF_VEC; ++j) { double x = gv[it][j] * s; sq = fma(x, x, sq); }
  } else {
    zf_for_chunk(c, [&](zf_i64 i, int k) {
      float gv[ZF_VEC];
      if (k == ZF_VEC) G::load4(g, i, gv); else gv[0] = G::load(g, i);
#pragma unroll
      for (int j = 0; j < ZF_VEC; ++j)
        if (j < k) { double x = gv[j] * s; sq = fma(x, x, sq); }
    });
  }
  double t = zf_block_sum(sq);
  if (threadIdx.x == 0) partials[blockIdx.x] = t;
}
"""
_ENTRY = r"""
extern "C" __global__ void __launch_bounds__(ZF_THREADS) %(name)s(const zf_i64* table, int n_rows,
                                                                   double* partials, const float* scale_ptr,
                                                                   float scale) {
  zf_sumsq<%(g)s>(table, n_rows, partials, scale_ptr, scale);
}
"""
ENTRIES = {g: prog.entry("sumsq", g) for g in prog.DTYPES}
PROGRAM = prog.Program("norm", _BODY + "".join(_ENTRY % dict(name=n, g=g) for g, n in ENTRIES.items()),
                       tuple(ENTRIES.values()))
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sum_of_squares(tensors: list[torch.Tensor], scale: float = 1.0,
                   scale_tensor: torch.Tensor | None = None) -> runtime.Partials:
    """The partial sums of ``(scale * x)**2`` over ``tensors`` (contiguous fp32/bf16/fp16, one CUDA
    device), not yet reduced: ``.sum()`` or ``.norm_and_finite()`` of the result reduces them."""
    if not tensors:
        raise ValueError("tensors: expected at least one tensor, got none")
    device = runtime.cuda_device(tensors[0], "tensors[0]")
    runtime.check_scale(scale_tensor, device)

    def groups() -> dict[str, list[tuple]]:
        found: dict[str, list[tuple]] = {}
        for i, t in enumerate(tensors):
            runtime.check("tensors", i, t, _DTYPES, device)
            flags = prog.VECTOR if runtime.aligned(t) else 0
            found.setdefault(runtime.dtype_name(t.dtype), []).append((0, t.data_ptr(), 0, 0, 0, t.numel(), flags))
        return found

    plan = runtime.planned(("norm",), (tensors,), groups, device)
    return runtime.run("norm", ENTRIES, plan, (runtime.ptr(scale_tensor), np.float32(scale)), sums=True)


def norm_and_finite(tensors: list[torch.Tensor], scale: float = 1.0,
                    scale_tensor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(||scale * x||_2 over all tensors, every element finite)``: a 0-d fp32 and a 0-d bool tensor
    on the tensors' device (module docstring)."""
    return sum_of_squares(tensors, scale, scale_tensor).norm_and_finite()


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``||x||_2`` over all ``tensors``, a 0-d fp32 device tensor (``zf.optim.global_norm`` on CUDA)."""
    return norm_and_finite(tensors)[0]
