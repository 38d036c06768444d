"""zfunc.ops.gpu on a GPU: each kernel equals its plain-torch reference, the dispatcher picks them,
and no launch syncs the host. Marked gpu: deselected by default, skipped without CUDA and CuPy
(``pytest -m gpu``; ``benchmarks/gpu_check.sh`` runs them on the lent GPU machine).

Tolerances: fp32 updates rtol = atol = 1e-6 after 10 steps (the kernels' fused multiply-adds round
differently from torch's separate ops: an ulp or two of p per step); bf16/fp16 copies and casts,
packed signs, quantized payloads and scales bit-equal; LAMB 1e-5 (its norms are summed in fp64 here,
fp32 in the reference).
"""
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("cupy")

import zfunc as zf  # noqa: E402
from zfunc.dist import compressed, quantized  # noqa: E402
from zfunc.ops.gpu import adam, cast, lamb, lion, norm, onebit, quantize  # noqa: E402
from zfunc.ops.cpu import adam as cpu_adam  # noqa: E402
from zfunc.optim import kernels  # noqa: E402

DEV = torch.device("cuda")
# odd sizes: one element, under a vector, a chunk and a bit (8192 + 1), several chunks with a tail
SIZES = (1, 7, 8193, 100_003)
TOL = dict(rtol=1e-6, atol=1e-6)


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _leaves(seed=0, sizes=SIZES, offset=False):
    """Random fp32 CUDA tensors; with ``offset``, each a view one element into its storage (not
    16-byte aligned: the scalar path)."""
    g = _gen(seed)
    out = []
    for n in sizes:
        t = torch.randn(n + int(offset), generator=g, device=DEV)
        out.append(t[1:] if offset else t)
    return out


def _clone(xs):
    return [x.clone() for x in xs]


@pytest.mark.parametrize("offset", [False, True], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_adam_fp32_matches_torch_fused(decoupled, offset):
    ps = _leaves(0, offset=offset)
    ref = [torch.nn.Parameter(p.clone()) for p in ps]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(ref, lr=1e-3, weight_decay=0.1, fused=True)
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    for t in range(1, 11):
        gs = _leaves(100 + t, offset=offset)
        for r, g in zip(ref, gs):
            r.grad = g.clone()
        opt.step()
        adam.adamw_many_(ps, gs, ms, vs, step=t, lr=1e-3, weight_decay=0.1, decoupled=decoupled)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p, r.detach(), **TOL)
    for m, v, r in zip(ms, vs, ref):
        torch.testing.assert_close(m, opt.state[r]["exp_avg"], **TOL)
        torch.testing.assert_close(v, opt.state[r]["exp_avg_sq"], **TOL)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_adam_is_bit_equal_to_cpu_adam(decoupled, grad_dtype):
    """The same inputs through zfunc's CUDA and CPU kernels give the same bits (p, m, v, the bf16 copy)."""
    ps = _leaves(15)
    decay = [True, False, True, True]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    outs = [torch.empty_like(p, dtype=torch.bfloat16) for p in ps]
    cpu = [[t.cpu() for t in ts] for ts in (ps, ms, vs, outs)]
    for t in range(1, 11):
        gs = [(g * 64).to(grad_dtype) for g in _leaves(600 + t)]
        adam.adamw_many_(ps, gs, ms, vs, step=t, lr=1e-3, weight_decay=0.1, decoupled=decoupled, grad_scale=1 / 64,
                         param_outs=outs, decay=decay)
        for i, g in enumerate(gs):
            cpu_adam.adamw_(cpu[0][i], g.cpu(), cpu[1][i], cpu[2][i], step=t, lr=1e-3,
                            weight_decay=0.1 if decay[i] else 0.0, decoupled=decoupled, grad_scale=1 / 64,
                            param_out=cpu[3][i])
    for got, want in zip((ps, ms, vs, outs), cpu):
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_adam_low_precision_grads_one_pass(low):
    """Low-precision grads times an unscale factor, the low-precision param copy written in the
    same pass, the sum of squares from the same read: equal to torch's update on the grads made
    fp32 and scaled, the copy bit-equal to p.to(low)."""
    ps = _leaves(1)
    ref = [torch.nn.Parameter(p.clone()) for p in ps]
    opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.1, fused=True)
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    outs = [torch.full_like(p, float("nan"), dtype=low) for p in ps]  # poisoned: every element must be written
    scale = 1 / 1024
    for t in range(1, 6):
        gs = [(g * 1024).to(low) for g in _leaves(200 + t)]
        for r, g in zip(ref, gs):
            r.grad = g.float() * scale
        opt.step()
        sq = adam.adamw_many_(ps, gs, ms, vs, step=t, lr=1e-3, weight_decay=0.1, grad_scale=scale, param_outs=outs,
                              grad_sq=True)
        want = sum(((g.float() * scale).double() ** 2).sum() for g in gs)
        torch.testing.assert_close(sq, want, rtol=1e-6, atol=0)
    for p, r, o in zip(ps, ref, outs):
        torch.testing.assert_close(p, r.detach(), **TOL)
        assert torch.equal(o, p.to(low))


def test_adam_scale_tensor_and_decay_flags():
    """A device scalar scale (a clip factor no host reads) and a per-tensor decay mask, in one launch."""
    ps = _leaves(2)
    decay = [True, False, True, False]
    ref = [torch.nn.Parameter(p.clone()) for p in ps]
    opt = torch.optim.AdamW([{"params": [r for r, d in zip(ref, decay) if d], "weight_decay": 0.1},
                             {"params": [r for r, d in zip(ref, decay) if not d], "weight_decay": 0.0}],
                            lr=1e-3, fused=True)
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    factor = torch.tensor([0.25], device=DEV)
    for t in range(1, 6):
        gs = _leaves(300 + t)
        for r, g in zip(ref, gs):
            r.grad = g * 0.25
        opt.step()
        adam.adamw_many_(ps, gs, ms, vs, step=t, lr=1e-3, weight_decay=0.1, scale_tensor=factor, decay=decay)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p, r.detach(), **TOL)


def test_adam_runs_on_torchs_current_stream_without_a_host_sync():
    ps, gs = _leaves(3), _leaves(4)
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    want = _clone(ps)
    adam.adamw_many_(want, _clone(gs), [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps], step=1,
                     lr=1e-3)
    adam.adamw_many_(_clone(ps), _clone(gs), _clone(ms), _clone(vs), step=1, lr=1e-3)  # warm: compile, tables
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream is busy: a launch elsewhere would run first
        grads = [g * 1.0 for g in gs]  # made on the side stream, read by the kernel after it
        torch.cuda.set_sync_debug_mode("error")
        try:
            adam.adamw_many_(ps, grads, ms, vs, step=1, lr=1e-3, grad_sq=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    side.synchronize()
    for p, w in zip(ps, want):
        assert torch.equal(p, w)


def test_lion_is_bit_equal_to_cpu_lion():
    ps = _leaves(5)
    cpu_ps, cpu_ms = [p.cpu() for p in ps], [torch.zeros(p.numel()) for p in ps]
    ms = [torch.zeros_like(p) for p in ps]
    outs = [torch.empty_like(p, dtype=torch.bfloat16) for p in ps]
    decay = [True, False, True, True]
    for t in range(10):
        gs = _leaves(400 + t)
        lion.lion_many_(ps, gs, ms, lr=1e-3, weight_decay=0.1, param_outs=outs, decay=decay)
        for p, g, m, d in zip(cpu_ps, gs, cpu_ms, decay):
            cpu_adam.lion_(p, g.cpu(), m, lr=1e-3, weight_decay=0.1 if d else 0.0)
    for p, m, o, cp_, cm in zip(ps, ms, outs, cpu_ps, cpu_ms):
        assert torch.equal(p.cpu(), cp_) and torch.equal(m.cpu(), cm)
        assert torch.equal(o, p.to(torch.bfloat16))


def test_lion_apply_matches_zfuncs_pure_update():
    """Through zf.optim.lion's apply on CUDA (the kernel) against its pure update: equal but for the
    elements whose sign flips at a rounding of 0 (a step of 2 lr, rare)."""
    params = {str(i): p for i, p in enumerate(_leaves(14))}
    ref = {k: p.clone() for k, p in params.items()}
    tx, pure = zf.optim.lion(1e-3, weight_decay=0.1), zf.optim.lion(1e-3, weight_decay=0.1, backend="torch")
    state, ref_state = tx.init(params), pure.init(ref)
    for t in range(3):
        grads = {k: torch.randn_like(p) for k, p in params.items()}
        params, state = zf.optim.apply(tx, {k: g.clone() for k, g in grads.items()}, state, params)
        ref, ref_state = zf.optim.apply(pure, grads, ref_state, ref)
    for k in params:
        off = (params[k] - ref[k]).abs() > 1e-6
        assert off.float().mean().item() < 1e-4, k


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_matches_zfuncs_pure_update(bias_correction):
    ps = _leaves(6)
    opt = zf.optim.lamb(1e-3, weight_decay=0.01, bias_correction=bias_correction, backend="torch")
    ref_params = {str(i): p.clone() for i, p in enumerate(ps)}
    ref_state = opt.init(ref_params)
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    for t in range(1, 11):
        gs = _leaves(500 + t)
        updates, ref_state = opt.update({str(i): g.clone() for i, g in enumerate(gs)}, ref_state, ref_params)
        ref_params = zf.optim.apply_updates(ref_params, updates)
        lamb.lamb_many_(ps, gs, ms, vs, step=t, lr=1e-3, weight_decay=0.01, bias_correction=bias_correction)
    for i, p in enumerate(ps):
        torch.testing.assert_close(p, ref_params[str(i)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_and_finite_in_one_read(dtype):
    xs = [x.to(dtype) for x in _leaves(7)]
    got, finite = norm.norm_and_finite(xs, scale=0.5)
    want = torch.linalg.vector_norm(torch.cat([x.double().flatten() * 0.5 for x in xs]))
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    assert finite.item() is True
    for bad in (float("inf"), float("nan")):
        ys = _clone(xs)
        ys[2][4096] = bad
        n, f = norm.norm_and_finite(ys)
        assert f.item() is False and not math.isfinite(n.item())


def test_global_norm_goes_through_the_kernel_on_cuda(monkeypatch):
    calls = []
    real = norm.global_norm
    monkeypatch.setattr(norm, "global_norm", lambda xs: calls.append(len(xs)) or real(xs))
    xs = _leaves(8)
    got = zf.optim.global_norm({str(i): x for i, x in enumerate(xs)})
    assert calls == [len(xs)]
    torch.testing.assert_close(got, torch.linalg.vector_norm(torch.cat(xs)), rtol=1e-6, atol=0)


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dst", [torch.float32, torch.bfloat16, torch.float16])
def test_cast_is_bit_equal_to_torchs(src, dst):
    srcs = [x.to(src) for x in _leaves(9)]
    dsts = [torch.full_like(x, float("nan"), dtype=dst) for x in srcs]
    sq = cast.cast_many_(srcs, dsts, scale=0.125, squares=True)
    for s, d in zip(srcs, dsts):
        assert torch.equal(d, (s.float() * 0.125).to(dst))
    want = sum(((s.float() * 0.125).double() ** 2).sum() for s in srcs)
    torch.testing.assert_close(sq, want, rtol=1e-6, atol=0)


def _torch_only(monkeypatch, fn, *args):
    """``fn(*args)`` with zfunc's CUDA kernels turned off: the plain-torch reference."""
    with monkeypatch.context() as m:
        m.setenv("ZFUNC_GPU_KERNELS", "0")
        return fn(*args)


def test_onebit_passes_are_bit_equal_to_torchs(monkeypatch):
    rows = torch.randn(4, 1024, generator=_gen(10), device=DEV)
    rows[0, :8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0, 2.0, -2.0, 0.5], device=DEV)  # -0.0 >= 0: a + sign
    with_nan = rows.clone()
    with_nan[1, 3] = float("nan")  # NaN >= 0 is False: a - sign
    want_signs = _torch_only(monkeypatch, compressed.pack_signs, with_nan)
    assert torch.equal(onebit.pack_signs(with_nan), want_signs)
    assert torch.equal(compressed.pack_signs(with_nan), want_signs)  # zfunc.dist dispatches to the kernel
    packed, scales, residual = onebit.scaled_signs(rows)
    want_packed, want_scales, want_residual = _torch_only(monkeypatch, compressed.scaled_signs, rows)
    assert torch.equal(packed, want_packed) and torch.equal(scales, want_scales)
    assert torch.equal(residual, want_residual)
    want = _torch_only(monkeypatch, compressed.decode, want_packed, want_scales)
    assert torch.equal(onebit.decode(packed, scales), want) and torch.equal(compressed.decode(packed, scales), want)


@pytest.mark.parametrize("bits", [8, 4])
def test_block_quantizers_are_bit_equal_to_torchs(monkeypatch, bits):
    x = torch.randn(3, 4 * quantize.BLOCK, generator=_gen(11), device=DEV)
    x[1, : quantize.BLOCK] = 0.0  # an all-zero block: scale 0, safe divisor 1
    payload, scales = quantize.quantize(x, bits)
    want_payload, want_scales = _torch_only(monkeypatch, quantized.quantize, x, bits)
    assert torch.equal(payload, want_payload) and torch.equal(scales, want_scales)
    assert all(torch.equal(a, b) for a, b in zip(quantized.quantize(x, bits), (want_payload, want_scales)))
    want = _torch_only(monkeypatch, quantized.dequantize, want_payload, want_scales, bits)
    assert torch.equal(quantize.dequantize(payload, scales, bits), want)
    assert torch.equal(quantized.dequantize(payload, scales, bits), want)


# ---- the dispatcher


def test_auto_picks_the_cuda_kernels_for_fp32_cuda_state(monkeypatch):
    ps = _leaves(12)
    assert kernels._resolve_backend("auto", ps) == "cupy"
    assert kernels._resolve_backend("auto", [p.cpu() for p in ps]) == "numba"
    assert kernels._resolve_backend("auto", [p.half() for p in ps]) == "torch"
    monkeypatch.setenv("ZFUNC_GPU_KERNELS", "0")
    assert kernels._resolve_backend("auto", ps) == "torch"


def test_adamw_apply_runs_the_cuda_kernel(monkeypatch):
    calls = []
    real = adam.adamw_many_
    monkeypatch.setattr(adam, "adamw_many_", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    params = {str(i): p for i, p in enumerate(_leaves(13))}
    tx = zf.optim.adamw(1e-3)
    state = tx.init(params)
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    ref = zf.optim.adamw(1e-3, backend="torch")
    ref_params = {k: p.clone() for k, p in params.items()}
    ref_params, _ = zf.optim.apply(ref, {k: g.clone() for k, g in grads.items()}, ref.init(ref_params), ref_params)
    params, _ = zf.optim.apply(tx, grads, state, params)
    assert calls == [len(params)]
    for k in params:
        torch.testing.assert_close(params[k], ref_params[k], **TOL)
