"""Multi-tensor fused Lion on CUDA (Chen et al., 2023, Alg. 2): one pass over fp32 params and momentum.

Per element, with ``g = grad * scale`` (``scale_tensor``, a device scalar, multiplied in where given):

    c = b1 m + (1-b1) g;  p = p (1 - lr wd) - lr sign(c);  m = b2 m + (1-b2) g;  out = p.to(out.dtype)

with the fused multiply-adds of ``zfunc.ops.cpu.adam.lion_`` and nothing else fused (sign(0) = 0,
NaN stays NaN). Law (``tests/test_gpu_kernels.py``, marked gpu): p and m bit-equal to ``lion_``'s on
the same inputs over 10 steps, ``out`` bit-equal to ``p.to(out.dtype)``. (Against ``zf.optim.lion``'s
pure update, whose lerp rounds ``c`` differently, an element with ``c`` within rounding of 0 can
take the other sign: a step of 2 lr.)
Cost: reads p, g, m, writes p, m (+ out): 20 B/param with fp32 grads; one launch per (grad dtype,
out dtype) group.
"""
from __future__ import annotations

import numpy as np
import torch

from zfunc.ops.gpu import program as prog
from zfunc.ops.gpu import runtime

_BODY = r"""
template <class G, class O>
__device__ __forceinline__ void zf_lion(const zf_i64* table, int n_rows, double* partials, const float* scale_ptr,
                                        float scale, float decay, float neg_lr, float b1, float omb1, float b2,
                                        float omb2) {
  zf_chunk c = zf_chunk_of(table, n_rows);
  float* p = (float*)c.row[0];
  const void* g = (const void*)c.row[1];
  float* m = (float*)c.row[2];
  void* out = (void*)c.row[4];
  float s = scale_ptr ? __fmul_rn(scale, *scale_ptr) : scale;
  float d = (c.flags & ZF_DECAY) ? decay : 1.0f;
  zf_for_chunk(c, [&](zf_i64 i, int k) {
    float pv[ZF_VEC], gv[ZF_VEC], mv[ZF_VEC];
    if (k == ZF_VEC) { F32::load4(p, i, pv); G::load4(g, i, gv); F32::load4(m, i, mv); }
    else { pv[0] = F32::load(p, i); gv[0] = G::load(g, i); mv[0] = F32::load(m, i); }
#pragma unroll
    for (int j = 0; j < ZF_VEC; ++j) {
      if (j < k) {
        float gj = __fmul_rn(gv[j], s);
        float cj = fmaf(gj, omb1, __fmul_rn(mv[j], b1));
        float sj = cj > 0.0f ? 1.0f : (cj < 0.0f ? -1.0f : cj);
        pv[j] = fmaf(sj, neg_lr, __fmul_rn(pv[j], d));
        mv[j] = fmaf(gj, omb2, __fmul_rn(mv[j], b2));
      }
    }
    if (k == ZF_VEC) { F32::store4(p, i, pv); F32::store4(m, i, mv); O::store4(out, i, pv); }
    else { F32::store(p, i, pv[0]); F32::store(m, i, mv[0]); O::store(out, i, pv[0]); }
  });
}
"""
_ENTRY = r"""
extern "C" __global__ void __launch_bounds__(ZF_THREADS) %(name)s(
    const zf_i64* table, int n_rows, double* partials, const float* scale_ptr, float scale, float decay,
    float neg_lr, float b1, float omb1, float b2, float omb2) {
  zf_lion<%(g)s, %(o)s>(table, n_rows, partials, scale_ptr, scale, decay, neg_lr, b1, omb1, b2, omb2);
}
"""
ENTRIES = {(g, o): prog.entry("lion", g, o) for g in prog.DTYPES for o in prog.OUTS}
PROGRAM = prog.Program("lion", _BODY + "".join(_ENTRY % dict(name=n, g=g, o=o) for (g, o), n in ENTRIES.items()),
                       tuple(ENTRIES.values()))

_F32 = (torch.float32,)
_GRADS = (torch.float32, torch.bfloat16, torch.float16)
_OUTS = (torch.bfloat16, torch.float16)


def lion_many_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], *, lr: float,
               beta1: float = 0.9, beta2: float = 0.99, weight_decay: float = 0.0, grad_scale: float = 1.0,
               scale_tensor: torch.Tensor | None = None, param_outs: list[torch.Tensor | None] | None = None,
               decay: list[bool] | None = None) -> None:
    """Lion on every tensor of the lists, in place, on their CUDA device and torch's current
    stream (module docstring). Tensors as ``zfunc.ops.gpu.adam.adamw_many_``'s."""
    n = len(params)
    outs = [None] * n if param_outs is None else param_outs
    flags = [True] * n if decay is None else decay
    if not len(grads) == len(exp_avgs) == len(outs) == len(flags) == n:
        raise ValueError(f"lion_many_: expected lists of one length, got params {n}, grads {len(grads)}, exp_avgs "
                         f"{len(exp_avgs)}, param_outs {len(outs)}, decay {len(flags)}")
    if n == 0:
        return
    device = runtime.cuda_device(params[0], "params[0]")
    runtime.check_scale(scale_tensor, device)

    def groups() -> dict[tuple[str, str], list[tuple]]:
        found: dict[tuple[str, str], list[tuple]] = {}
        for i, (p, g, m, o, d) in enumerate(zip(params, grads, exp_avgs, outs, flags)):
            runtime.check("params", i, p, _F32, device)
            runtime.check("grads", i, g, _GRADS, device, p.numel())
            runtime.check("exp_avgs", i, m, _F32, device, p.numel())
            if o is not None:
                runtime.check("param_outs", i, o, _OUTS, device, p.numel())
            vec = all(runtime.aligned(t) for t in (p, g, m, o))
            row = (p.data_ptr(), g.data_ptr(), m.data_ptr(), 0, 0 if o is None else o.data_ptr(), p.numel(),
                   (prog.DECAY if d else 0) | (prog.VECTOR if vec else 0))
            key = (runtime.dtype_name(g.dtype), "NONE" if o is None else runtime.dtype_name(o.dtype))
            found.setdefault(key, []).append(row)
        return found

    plan = runtime.planned(("lion", *map(bool, flags)), (params, grads, exp_avgs, outs), groups, device)
    lr, b1, b2 = float(lr), float(beta1), float(beta2)
    args = (runtime.ptr(scale_tensor), np.float32(grad_scale), np.float32(1.0 - lr * float(weight_decay)),
            np.float32(-lr), np.float32(b1), np.float32(1.0 - b1), np.float32(b2), np.float32(1.0 - b2))
    runtime.run("lion", ENTRIES, plan, args)
