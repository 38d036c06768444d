"""Multi-tensor fused LAMB on CUDA: Adam's direction scaled per tensor by a trust ratio computed on
the device (no host sync, where ``zf.optim.lamb``'s pure update reads two norms per tensor back).

Per tensor, with ``g = grad * scale``, as ``zfunc.optim.lamb`` (DeepSpeed FusedLamb's formulas):

    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  u = (m / bc1) / (sqrt(v / bc2) + eps) + wd p
    p -= lr * clamp(||p|| / ||u||, min_coeff, max_coeff) * u       (ratio 1 where a norm is 0)

(``bc1 = 1-b1^t``, ``bc2 = 1-b2^t`` with bias correction, else 1). Three launches per (grad dtype,
out dtype) group: the moments and each block's partial ``||p||^2``, ``||u||^2`` (fp64); one thread per
tensor sums its blocks into its trust ratio; the update, ``u`` recomputed from the new moments by the
same code (the same bits). Law (``tests/test_gpu_kernels.py``, marked gpu): equal to
``zf.optim.lamb``'s pure update over 10 steps within rtol = atol = 1e-5 (the norms are summed in
fp64 here, in fp32 there). Cost: reads g, p, m, v and writes m, v, then reads p, m, v and writes p
(+ out): 40 B/param with fp32 grads, against Adam's 28.
"""
from __future__ import annotations

import numpy as np
import torch

from zfunc.ops.gpu import program as prog
from zfunc.ops.gpu import runtime
from zfunc.ops.gpu.adam import moment_rows

_BODY = r"""
__device__ __forceinline__ float zf_lamb_dir(float m, float v, float p, float inv_bc1, float inv_bc2, float eps,
                                             float wd) {
  return fmaf(wd, p, (m * inv_bc1) / (sqrtf(v * inv_bc2) + eps));
}

template <class G>
__device__ __forceinline__ void zf_lamb_moments(const zf_i64* table, int n_rows, double* partials,
                                                const float* scale_ptr, float scale, float b1, float omb1, float b2,
                                                float omb2, float inv_bc1, float inv_bc2, float eps, float wd) {
  zf_chunk c = zf_chunk_of(table, n_rows);
  const float* p = (const float*)c.row[0];
  const void* g = (const void*)c.row[1];
  float* m = (float*)c.row[2];
  float* v = (float*)c.row[3];
  float s = scale_ptr ? scale * *scale_ptr : scale;
  float w = (c.flags & ZF_DECAY) ? wd : 0.0f;
  double pp = 0.0, uu = 0.0;
  zf_for_chunk(c, [&](zf_i64 i, int k) {
    float pv[ZF_VEC], gv[ZF_VEC], mv[ZF_VEC], vv[ZF_VEC];
    if (k == ZF_VEC) { F32::load4(p, i, pv); G::load4(g, i, gv); F32::load4(m, i, mv); F32::load4(v, i, vv); }
    else { pv[0] = F32::load(p, i); gv[0] = G::load(g, i); mv[0] = F32::load(m, i); vv[0] = F32::load(v, i); }
#pragma unroll
    for (int j = 0; j < ZF_VEC; ++j) {
      if (j < k) {
        float gj = gv[j] * s;
        mv[j] = fmaf(mv[j], b1, omb1 * gj);
        vv[j] = fmaf(vv[j], b2, omb2 * gj * gj);
        float u = zf_lamb_dir(mv[j], vv[j], pv[j], inv_bc1, inv_bc2, eps, w);
        pp = fma((double)pv[j], (double)pv[j], pp);
        uu = fma((double)u, (double)u, uu);
      }
    }
    if (k == ZF_VEC) { F32::store4(m, i, mv); F32::store4(v, i, vv); }
    else { F32::store(m, i, mv[0]); F32::store(v, i, vv[0]); }
  });
  double tp = zf_block_sum(pp);
  double tu = zf_block_sum(uu);
  if (threadIdx.x == 0) { partials[2 * blockIdx.x] = tp; partials[2 * blockIdx.x + 1] = tu; }
}

template <class O>
__device__ __forceinline__ void zf_lamb_update(const zf_i64* table, int n_rows, const float* ratios, float neg_lr,
                                               float inv_bc1, float inv_bc2, float eps, float wd) {
  zf_chunk c = zf_chunk_of(table, n_rows);
  float* p = (float*)c.row[0];
  const float* m = (const float*)c.row[2];
  const float* v = (const float*)c.row[3];
  void* out = (void*)c.row[4];
  float w = (c.flags & ZF_DECAY) ? wd : 0.0f;
  float step = neg_lr * ratios[c.r];
  zf_for_chunk(c, [&](zf_i64 i, int k) {
    float pv[ZF_VEC], mv[ZF_VEC], vv[ZF_VEC];
    if (k == ZF_VEC) { F32::load4(p, i, pv); F32::load4(m, i, mv); F32::load4(v, i, vv); }
    else { pv[0] = F32::load(p, i); mv[0] = F32::load(m, i); vv[0] = F32::load(v, i); }
#pragma unroll
    for (int j = 0; j < ZF_VEC; ++j)
      if (j < k) pv[j] = fmaf(step, zf_lamb_dir(mv[j], vv[j], pv[j], inv_bc1, inv_bc2, eps, w), pv[j]);
    if (k == ZF_VEC) { F32::store4(p, i, pv); O::store4(out, i, pv); }
    else { F32::store(p, i, pv[0]); O::store(out, i, pv[0]); }
  });
}

// One thread per tensor: its blocks' partial sums -> clamp(||p|| / ||u||, lo, hi), 1 where a norm is 0.
extern "C" __global__ void lamb_ratio(const zf_i64* table, int n_rows, const double* partials, float* ratios,
                                      float min_coeff, float max_coeff) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= n_rows) return;
  const zf_i64* starts = table + (zf_i64)ZF_ROW * n_rows;
  double pp = 0.0, uu = 0.0;
  for (zf_i64 b = starts[r]; b < starts[r + 1]; ++b) { pp += partials[2 * b]; uu += partials[2 * b + 1]; }
  float wn = (float)sqrt(pp), un = (float)sqrt(uu);
  ratios[r] = (wn == 0.0f || un == 0.0f) ? 1.0f : fminf(fmaxf(wn / un, min_coeff), max_coeff);
}
"""
_MOMENTS = r"""
extern "C" __global__ void __launch_bounds__(ZF_THREADS) %(name)s(
    const zf_i64* table, int n_rows, double* partials, const float* scale_ptr, float scale, float b1, float omb1,
    float b2, float omb2, float inv_bc1, float inv_bc2, float eps, float wd) {
  zf_lamb_moments<%(t)s>(table, n_rows, partials, scale_ptr, scale, b1, omb1, b2, omb2, inv_bc1, inv_bc2, eps, wd);
}
"""
_UPDATE = r"""
extern "C" __global__ void __launch_bounds__(ZF_THREADS) %(name)s(
    const zf_i64* table, int n_rows, const float* ratios, float neg_lr, float inv_bc1, float inv_bc2, float eps,
    float wd) {
  zf_lamb_update<%(t)s>(table, n_rows, ratios, neg_lr, inv_bc1, inv_bc2, eps, wd);
}
"""
MOMENTS = {g: prog.entry("lamb_moments", g) for g in prog.DTYPES}
UPDATES = {o: prog.entry("lamb_update", o) for o in prog.OUTS}
RATIO = "lamb_ratio"
PROGRAM = prog.Program(
    "lamb", _BODY + "".join(_MOMENTS % dict(name=n, t=t) for t, n in MOMENTS.items())
    + "".join(_UPDATE % dict(name=n, t=t) for t, n in UPDATES.items()),
    (*MOMENTS.values(), *UPDATES.values(), RATIO))



def lamb_many_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 0.0, bias_correction: bool = True, min_coeff: float = 0.01,
               max_coeff: float = 10.0, grad_scale: float = 1.0, scale_tensor: torch.Tensor | None = None,
               param_outs: list[torch.Tensor | None] | None = None, decay: list[bool] | None = None) -> None:
    """LAMB on every tensor of the lists, in place, on their CUDA device and torch's current stream
    (module docstring). Tensors as ``zfunc.ops.gpu.adam.adamw_many_``'s."""
    n = len(params)
    outs = [None] * n if param_outs is None else param_outs
    flags = [True] * n if decay is None else decay
    if not len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(outs) == len(flags) == n:
        raise ValueError(f"lamb_many_: expected lists of one length, got params {n}, grads {len(grads)}, exp_avgs "
                         f"{len(exp_avgs)}, exp_avg_sqs {len(exp_avg_sqs)}, param_outs {len(outs)}, decay {len(flags)}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step: expected an int >= 1 (updates so far, this one included), got {step!r}")
    if n == 0:
        return
    device = runtime.cuda_device(params[0], "params[0]")
    runtime.check_scale(scale_tensor, device)

    def groups() -> dict[tuple[str, str], list[tuple]]:
        return moment_rows(params, grads, exp_avgs, exp_avg_sqs, outs, flags, device)

    plan = runtime.planned(("lamb", *map(bool, flags)), (params, grads, exp_avgs, exp_avg_sqs, outs), groups, device)
    b1, b2 = float(beta1), float(beta2)
    bc1, bc2 = (1.0 - b1 ** step, 1.0 - b2 ** step) if bias_correction else (1.0, 1.0)
    shared = (np.float32(1.0 / bc1), np.float32(1.0 / bc2), np.float32(eps), np.float32(weight_decay))
    for (g_name, o_name), tab, blocks, n_rows in plan.launches:
        runtime.keep_for_stream(tab, plan.device)
        partials = torch.empty(2 * blocks, dtype=torch.float64, device=plan.device)
        ratios = torch.empty(n_rows, dtype=torch.float32, device=plan.device)
        head = (runtime.ptr(tab), np.int32(n_rows))
        runtime.launch("lamb", MOMENTS[g_name], plan.device, blocks, prog.THREADS,
                       head + (runtime.ptr(partials), runtime.ptr(scale_tensor), np.float32(grad_scale), np.float32(b1),
                               np.float32(1.0 - b1), np.float32(b2), np.float32(1.0 - b2)) + shared)
        runtime.launch("lamb", RATIO, plan.device, -(-n_rows // 256), 256,
                       head + (runtime.ptr(partials), runtime.ptr(ratios), np.float32(min_coeff),
                               np.float32(max_coeff)))
        runtime.launch("lamb", UPDATES[o_name], plan.device, blocks, prog.THREADS,
                       head + (runtime.ptr(ratios), np.float32(-float(lr))) + shared)
