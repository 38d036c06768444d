"""Multi-tensor fused AdamW/Adam on CUDA: one pass over fp32 masters and moments per step.

Per element, with ``g = grad * scale`` (``scale``: the host ``grad_scale`` times the device scalar
``scale_tensor`` where given, e.g. a clip factor, so no host sync reads it):

    AdamW:  p *= 1 - lr wd            Adam (L2): g += wd p
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
    p -= lr/(1-b1^t) * m / (sqrt(v) / sqrt(1-b2^t) + eps);   out = p.to(out.dtype)

in fp32, ``wd`` only on tensors the mask decays, with the operations of zfunc's CPU-Adam
(``zfunc.ops.cpu.adam``) one for one: its fused multiply-adds and nothing else fused. Law
(``tests/test_gpu_kernels.py``, marked gpu): p, m and v bit-equal to CPU-Adam's (``adamw_``) on the
same inputs, so a state trains to the same bits on either device; equal to ``torch.optim.AdamW`` /
``Adam`` (fused=True) over 10 steps within rtol = atol = 1e-6; with bf16/fp16 grads, equal to torch's
update on the grads cast to fp32 and scaled, to the same tolerance; ``out`` bit-equal to
``p.to(out.dtype)``; the sum of squares of ``g`` equal to ``sum(g.double()**2)`` to 1e-6 relative.

Cost: one read of p, g, m, v and one write of p, m, v (+ out): fp32 grads 28 B/param, bf16 grads
with a bf16 out 28 B/param (torch's passes for that: the grads cast to fp32 6, unscaled in place 8,
the update 28, the params cast to bf16 6: 48).
One launch per (grad dtype, out dtype) group of tensors, 4-wide loads where a tensor's addresses
allow; the sum of squares costs nothing in bytes (one fp64 partial per block, one reducing launch).
"""
from __future__ import annotations

import numpy as np
import torch

from zfunc.ops.gpu import program as prog
from zfunc.ops.gpu import runtime

_BODY = r"""
// The element update of zfunc.ops.cpu.adam's _adamw_one, op for op: explicit fused multiply-adds where
// it has them and round-to-nearest ops (__fmul_rn, __fadd_rn, ...) everywhere else, so that the compiler
// contracts nothing it does not: the CPU and CUDA kernels give the same bits.
template <class G, class O>
__device__ __forceinline__ void zf_adam(const zf_i64* table, int n_rows, double* partials, const float* scale_ptr,
                                        float scale, float decay, float l2, float coeff, int small, float b2,
                                        float omb2, float inv_bc2s, float eps, float neg_step) {
  zf_chunk c = zf_chunk_of(table, n_rows);
  float* p = (float*)c.row[0];
  const void* g = (const void*)c.row[1];
  float* m = (float*)c.row[2];
  float* v = (float*)c.row[3];
  void* out = (void*)c.row[4];
  bool decays = (c.flags & ZF_DECAY) != 0;
  float s = scale_ptr ? __fmul_rn(scale, *scale_ptr) : scale;
  float d = decays ? decay : 1.0f, w = decays ? l2 : 0.0f;
  double sq = 0.0;  // fp64: a square of a large fp32 grad must not overflow
  zf_for_chunk(c, [&](zf_i64 i, int k) {
    float pv[ZF_VEC], gv[ZF_VEC], mv[ZF_VEC], vv[ZF_VEC];
    if (k == ZF_VEC) { F32::load4(p, i, pv); G::load4(g, i, gv); F32::load4(m, i, mv); F32::load4(v, i, vv); }
    else { pv[0] = F32::load(p, i); gv[0] = G::load(g, i); mv[0] = F32::load(m, i); vv[0] = F32::load(v, i); }
#pragma unroll
    for (int j = 0; j < ZF_VEC; ++j) {
      if (j < k) {
        float gj = __fmul_rn(gv[j], s);
        sq = fma((double)gj, (double)gj, sq);
        float pj = __fmul_rn(pv[j], d);
        if (w != 0.0f) gj = fmaf(pj, w, gj);
        float mj = fmaf(coeff, __fsub_rn(gj, mv[j]), small ? mv[j] : gj);
        float vj = fmaf(__fmul_rn(omb2, gj), gj, __fmul_rn(vv[j], b2));
        float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vj), inv_bc2s), eps);
        pv[j] = __fadd_rn(pj, __fdiv_rn(__fmul_rn(neg_step, mj), denom));
        mv[j] = mj; vv[j] = vj;
      }
    }
    if (k == ZF_VEC) { F32::store4(p, i, pv); F32::store4(m, i, mv); F32::store4(v, i, vv); O::store4(out, i, pv); }
    else { F32::store(p, i, pv[0]); F32::store(m, i, mv[0]); F32::store(v, i, vv[0]); O::store(out, i, pv[0]); }
  });
  if (partials) {
    double t = zf_block_sum(sq);
    if (threadIdx.x == 0) partials[blockIdx.x] = t;
  }
}
"""
_ENTRY = r"""
extern "C" __global__ void __launch_bounds__(ZF_THREADS) %(name)s(
    const zf_i64* table, int n_rows, double* partials, const float* scale_ptr, float scale, float decay, float l2,
    float coeff, int small, float b2, float omb2, float inv_bc2s, float eps, float neg_step) {
  zf_adam<%(g)s, %(o)s>(table, n_rows, partials, scale_ptr, scale, decay, l2, coeff, small, b2, omb2, inv_bc2s, eps,
                       neg_step);
}
"""
ENTRIES = {(g, o): prog.entry("adam", g, o) for g in prog.DTYPES for o in prog.OUTS}
PROGRAM = prog.Program("adam", _BODY + "".join(_ENTRY % dict(name=n, g=g, o=o) for (g, o), n in ENTRIES.items()),
                       tuple(ENTRIES.values()))


def scalars(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
            decoupled: bool) -> tuple:
    """The kernel's scalar arguments, rounded as ``zfunc.ops.cpu.adam`` rounds them: ``(decay, l2,
    coeff, small, b2, 1-b2, 1/sqrt(1-b2^step), eps, -lr/(1-b1^step))``, computed in float64 as
    torch.optim computes them and rounded to fp32; ``m`` moves by ``lerp(m, g, 1-b1)`` in torch's
    form (``small``: ``coeff * (g - m) + m``, else ``coeff * (g - m) + g``, ``coeff = (1-b1) - 1``)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step: expected an int >= 1 (updates so far, this one included), got {step!r}")
    lr, wd = float(lr), float(weight_decay)
    decay, l2 = (1.0 - lr * wd, 0.0) if decoupled else (1.0, wd)
    w = np.float32(1.0 - beta1)
    small = bool(abs(w) < np.float32(0.5))  # torch's lerp picks its formula by this
    coeff = w if small else np.float32(w - np.float32(1.0))
    return (np.float32(decay), np.float32(l2), coeff, np.int32(small), np.float32(beta2), np.float32(1.0 - beta2),
            np.float32(1.0 / (1.0 - beta2 ** step) ** 0.5), np.float32(eps), np.float32(-(lr / (1.0 - beta1 ** step))))


_F32 = (torch.float32,)
_GRADS = (torch.float32, torch.bfloat16, torch.float16)
_OUTS = (torch.bfloat16, torch.float16)


def moment_rows(params, grads, exp_avgs, exp_avg_sqs, outs, flags, device) -> dict[tuple[str, str], list[tuple]]:
    """The launch table of a two-moment update (Adam, LAMB), checked: per (grad dtype, out dtype), one row per
    tensor, ``(p, g, m, v, out addresses, n, flags)``; ``ValueError`` naming the list, the index and what is
    wrong (dtype, device, size)."""
    found: dict[tuple[str, str], list[tuple]] = {}
    for i, (p, g, m, v, o, d) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, outs, flags)):
        runtime.check("params", i, p, _F32, device)
        runtime.check("grads", i, g, _GRADS, device, p.numel())
        runtime.check("exp_avgs", i, m, _F32, device, p.numel())
        runtime.check("exp_avg_sqs", i, v, _F32, device, p.numel())
        if o is not None:
            runtime.check("param_outs", i, o, _OUTS, device, p.numel())
        vec = all(runtime.aligned(t) for t in (p, g, m, v, o))
        row = (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if o is None else o.data_ptr(),
               p.numel(), (prog.DECAY if d else 0) | (prog.VECTOR if vec else 0))
        key = (runtime.dtype_name(g.dtype), "NONE" if o is None else runtime.dtype_name(o.dtype))
        found.setdefault(key, []).append(row)
    return found


def adamw_many_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True,
                grad_scale: float = 1.0, scale_tensor: torch.Tensor | None = None,
                param_outs: list[torch.Tensor | None] | None = None, decay: list[bool] | None = None,
                grad_sq: bool = False) -> torch.Tensor | None:
    """AdamW (``decoupled``) or Adam with L2 decay on every tensor of the lists, in place, on their
    CUDA device and torch's current stream (module docstring). params, exp_avgs, exp_avg_sqs:
    contiguous fp32; grads: contiguous fp32/bf16/fp16 of the same sizes; ``param_outs[i]``: a
    contiguous bf16/fp16 tensor receiving the new param, or None. ``decay[i]`` False: no weight
    decay on tensor i (None: all decay). ``grad_sq``: returns the sum of squares of
    ``grad * scale`` as a 0-d fp64 device tensor (not read back), else None."""
    n = len(params)
    outs = [None] * n if param_outs is None else param_outs
    flags = [True] * n if decay is None else decay
    if not len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(outs) == len(flags) == n:
        raise ValueError(f"adamw_many_: expected lists of one length, got params {n}, grads {len(grads)}, exp_avgs "
                         f"{len(exp_avgs)}, exp_avg_sqs {len(exp_avg_sqs)}, param_outs {len(outs)}, decay {len(flags)}")
    consts = scalars(step, lr, beta1, beta2, eps, weight_decay, decoupled)
    if n == 0:
        return None
    device = runtime.cuda_device(params[0], "params[0]")
    runtime.check_scale(scale_tensor, device)

    def groups() -> dict[tuple[str, str], list[tuple]]:
        return moment_rows(params, grads, exp_avgs, exp_avg_sqs, outs, flags, device)

    plan = runtime.planned(("adam", *map(bool, flags)), (params, grads, exp_avgs, exp_avg_sqs, outs), groups, device,
                           fit=True)
    args = (runtime.ptr(scale_tensor), np.float32(grad_scale)) + consts
    partials = runtime.run("adam", ENTRIES, plan, args, sums=grad_sq)
    return partials.sum() if partials is not None else None
