"""zfunc.ops.cpu.adam: the Numba kernels equal torch.optim's updates, casts and errors."""
import math
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from zfunc.ops.cpu import adam as cpu_adam, gomp

# Sizes: 1 and 7 are shorter than one vector (tail path only); 1000 mixes vector body and tail;
# 1_000_003 is over the parallel threshold with an odd tail, so it runs the threaded chunking.
SMALL = (1, 7, 1000)
BIG = 1_000_003
# fp32 tolerance: m and v are bit-equal to torch's; p can differ by an ulp because torch's sqrt
# (MKL) is not always correctly rounded, and that ulp of |p| ~ 1-4 is ~2-5e-7 absolute.
TOL = dict(rtol=1e-6, atol=1e-6)


@pytest.fixture(autouse=True)
def two_threads():
    # The threaded path must be tested even where torch runs on one thread.
    cpu_adam.set_num_threads(2)
    yield
    cpu_adam.set_num_threads(None)


def _grads(n, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(steps)]


def _run_torch(opt_cls, p0, grads, **kw):
    q = torch.nn.Parameter(p0.clone())
    opt = opt_cls([q], foreach=False, **kw)
    for g in grads:
        q.grad = g.clone()
        opt.step()
    return q.detach(), opt.state[q]


def _run_adamw(p0, grads, *, lr, weight_decay, decoupled, **kw):
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, 1):
        cpu_adam.adamw_(p, g, m, v, step=t, lr=lr, weight_decay=weight_decay, decoupled=decoupled,
                        **kw)
    return p, m, v


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("n,steps", [(n, 200) for n in SMALL] + [(BIG, 20)])
def test_adam_matches_torch(n, steps, decoupled):
    # 20 steps at 1M: the per-element math is the same code as the 200-step small cases; the big
    # size is there for the threaded split and its odd tail, which step count does not change.
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
    grads = _grads(n, steps)
    opt_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref, state = _run_torch(opt_cls, p0, grads, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)
    p, m, v = _run_adamw(p0, grads, lr=1e-2, weight_decay=0.1, decoupled=decoupled)
    torch.testing.assert_close(p, ref, **TOL)
    torch.testing.assert_close(m, state["exp_avg"], **TOL)
    torch.testing.assert_close(v, state["exp_avg_sq"], **TOL)


def test_adam_small_beta1_uses_torchs_other_lerp_branch():
    # torch.lerp switches formula at weight >= 0.5; beta1 = 0.3 exercises the second one.
    p0, grads = torch.randn(1000), _grads(1000, 50)
    ref, state = _run_torch(torch.optim.AdamW, p0, grads, lr=1e-3, betas=(0.3, 0.9),
                            weight_decay=0.0)
    p, m, v = p0.clone(), torch.zeros(1000), torch.zeros(1000)
    for t, g in enumerate(grads, 1):
        cpu_adam.adamw_(p, g, m, v, step=t, lr=1e-3, beta1=0.3, beta2=0.9)
    torch.testing.assert_close(p, ref, **TOL)
    assert torch.equal(m, state["exp_avg"])


@pytest.mark.parametrize("n", [1001, 300_007])
def test_subranges_compose_and_leave_the_rest_alone(n):
    p0, grads = torch.randn(n), _grads(n, 3)
    full = _run_adamw(p0, grads, lr=1e-2, weight_decay=0.1, decoupled=True)
    halves = (p0.clone(), torch.zeros(n), torch.zeros(n))
    part = (p0.clone(), torch.zeros(n), torch.zeros(n))
    lo, hi = n // 5, n // 5 + n // 2
    for t, g in enumerate(grads, 1):
        for s, e in ((0, n // 2), (n // 2, None)):
            p, m, v = halves
            cpu_adam.adamw_(p, g, m, v, step=t, lr=1e-2, weight_decay=0.1, start=s, end=e)
        p, m, v = part
        cpu_adam.adamw_(p, g, m, v, step=t, lr=1e-2, weight_decay=0.1, start=lo, end=hi)
    for a, b, c, init in zip(full, halves, part, (p0, torch.zeros(n), torch.zeros(n))):
        assert torch.equal(a, b)
        assert torch.equal(c[lo:hi], a[lo:hi])
        assert torch.equal(c[:lo], init[:lo]) and torch.equal(c[hi:], init[hi:])


def _lion_reference(p, g, m, *, lr, beta1, beta2, weight_decay):
    # lucidrains/lion-pytorch, the reference implementation of Chen et al. 2023.
    p.mul_(1 - lr * weight_decay)
    update = m.clone().mul_(beta1).add(g, alpha=1 - beta1).sign_()
    p.add_(update, alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1 - beta2)


@pytest.mark.parametrize("n,steps", [(7, 200), (1000, 200), (BIG, 10)])
def test_lion_matches_reference(n, steps):
    p0, grads = torch.randn(n), _grads(n, steps)
    ref_p, ref_m, p, m = p0.clone(), torch.zeros(n), p0.clone(), torch.zeros(n)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
    for g in grads:
        _lion_reference(ref_p, g, ref_m, **kw)
        cpu_adam.lion_(p, g, m, **kw)
    torch.testing.assert_close(p, ref_p, **TOL)
    torch.testing.assert_close(m, ref_m, **TOL)


@pytest.mark.parametrize("momentum,dampening,nesterov", [(0.0, 0.0, False), (0.9, 0.1, False),
                                                         (0.9, 0.0, True)])
@pytest.mark.parametrize("n,steps", [(7, 200), (1000, 200), (BIG, 10)])
def test_sgd_matches_torch(n, steps, momentum, dampening, nesterov):
    p0, grads = torch.randn(n), _grads(n, steps)
    kw = dict(lr=1e-2, momentum=momentum, dampening=dampening, nesterov=nesterov,
              weight_decay=0.01)
    ref, state = _run_torch(torch.optim.SGD, p0, grads, **kw)
    p, buf = p0.clone(), (torch.empty(n) if momentum else None)
    for t, g in enumerate(grads, 1):
        cpu_adam.sgd_(p, g, buf, first_step=t == 1, **kw)
    torch.testing.assert_close(p, ref, **TOL)
    if momentum:
        torch.testing.assert_close(buf, state["momentum_buffer"], **TOL)


def _special_values():
    """fp32 values at the edges of bf16/fp16 rounding, repeated so both vector body and tail see
    them, plus random normals and values in fp16's range."""
    bits = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF818000,  # bf16 ties / near ties
            0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF,  # largest floats: round to inf or not
            0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0x7F800001,  # inf / NaN
            0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x807FFFFF, 0x00400000,  # subnormal
            0x00000000, 0x80000000, 0x3F800000,
            0x477FE000, 0x477FF000, 0x47800000, 0x33800000, 0x33000000, 0x387FC000,  # fp16 edges
            0x3F801000, 0x3F803000]  # fp16 ties (half-ulp 2^-11 at 1.0)
    special = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits],
                           dtype=torch.int32).view(torch.float32)
    gen = torch.Generator().manual_seed(3)
    scaled = torch.randn(500, generator=gen) * torch.logspace(-9, 6, 500)
    return torch.cat([special.repeat(33), scaled, torch.randn(97, generator=gen), special])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_param_out_is_bit_equal_to_torchs_cast(out_dtype):
    vals = _special_values()
    # lr=0 SGD leaves every value as it is (NaNs quieted), so param_out is the cast of vals.
    p, out = vals.clone(), torch.empty(len(vals), dtype=out_dtype)
    cpu_adam.sgd_(p, torch.zeros_like(p), None, lr=0.0, first_step=True, param_out=out)
    ref = p.to(out_dtype)
    # bf16 NaN comes out 0xFFFF in both: torch's vectorized CPU cast writes it that way.
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    # ...and after real updates, on every optimizer.
    n = 100_003
    p, g = torch.randn(n) * 3, torch.randn(n)
    outs = [torch.empty(n, dtype=out_dtype) for _ in range(3)]
    cpu_adam.adamw_(p, g, torch.zeros(n), torch.zeros(n), step=1, lr=1e-2, param_out=outs[0])
    assert torch.equal(outs[0].view(torch.int16), p.to(out_dtype).view(torch.int16))
    cpu_adam.lion_(p, g, torch.zeros(n), lr=1e-2, param_out=outs[1])
    assert torch.equal(outs[1].view(torch.int16), p.to(out_dtype).view(torch.int16))
    cpu_adam.sgd_(p, g, torch.zeros(n), lr=1e-2, momentum=0.9, first_step=True, param_out=outs[2])
    assert torch.equal(outs[2].view(torch.int16), p.to(out_dtype).view(torch.int16))


def _all_optimizers(p, g, state, **kw):
    cpu_adam.adamw_(p[0], g, state[0], state[1], step=3, lr=1e-2, weight_decay=0.1, **kw)
    cpu_adam.lion_(p[1], g, state[2], lr=1e-2, weight_decay=0.1, **kw)
    cpu_adam.sgd_(p[2], g, state[3], lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1,
                  first_step=False, **kw)


@pytest.mark.parametrize("n", [1000, 100_003])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_dtype_and_scale_equal_upcast_then_unscale(n, grad_dtype):
    scale = 0.37  # not a power of two, so a different rounding order would show
    g_low = (torch.randn(n) * 100).to(grad_dtype)
    base = [torch.randn(n) for _ in range(3)], [torch.rand(n) for _ in range(4)]
    fused = [t.clone() for t in base[0]], [t.clone() for t in base[1]]
    plain = [t.clone() for t in base[0]], [t.clone() for t in base[1]]
    _all_optimizers(*fused[:1], g_low, fused[1], grad_scale=scale)
    _all_optimizers(*plain[:1], g_low.float() * scale, plain[1])
    for a, b in zip(fused[0] + fused[1], plain[0] + plain[1]):
        assert torch.equal(a, b)


def test_thread_count_does_not_change_results():
    n = 300_007
    p0, g = torch.randn(n), torch.randn(n).bfloat16()
    results = []
    for threads in (1, 2):
        cpu_adam.set_num_threads(threads)
        assert cpu_adam.get_num_threads() == threads
        p, out = p0.clone(), torch.empty(n, dtype=torch.bfloat16)
        cpu_adam.adamw_(p, g, torch.zeros(n), torch.zeros(n), step=1, lr=1e-2, param_out=out)
        results.append((p, out))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    cpu_adam.set_num_threads(None)
    assert cpu_adam.get_num_threads() == min(torch.get_num_threads(),
                                             cpu_adam.numba.config.NUMBA_NUM_THREADS)
    with pytest.raises(ValueError, match="positive int"):
        cpu_adam.set_num_threads(0)


def _step_all(n, seed, steps=1):
    """Every buffer after ``steps`` AdamW, Lion and SGD steps on bf16 grads with a bf16 copy-out."""
    gen = torch.Generator().manual_seed(seed)
    p = [torch.randn(n, generator=gen) for _ in range(3)]
    state = [torch.rand(n, generator=gen) for _ in range(4)]
    g, out = torch.randn(n, generator=gen).bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    for _ in range(steps):
        _all_optimizers(p, g, state, param_out=out)
    return p + state + [out]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_param_out_equals_stored_bit_for_bit(monkeypatch, out_dtype, threads):
    # Past _STREAM_MIN elements param_out is written by non-temporal stores, a line at a time
    # from its first 64-byte boundary; here every call streams, over ranges that start and end
    # inside a line (and one shorter than a line), on one thread and on two.
    cpu_adam.set_num_threads(threads)
    n = 40_003
    for start, end in [(0, n), (1, n - 1), (17, 17 + 31), (33, 20_000 + 5)]:
        results = []
        for stream_min in (n + 1, 0):  # stored, then streamed
            monkeypatch.setattr(cpu_adam, "_STREAM_MIN", stream_min)
            gen = torch.Generator().manual_seed(start)
            p = [torch.randn(n, generator=gen) for _ in range(3)]
            state = [torch.rand(n, generator=gen) for _ in range(4)]
            g, out = torch.randn(n, generator=gen).to(out_dtype), torch.full((n,), 7.0, dtype=out_dtype)
            _all_optimizers(p, g, state, param_out=out, start=start, end=end)
            results.append(p + state + [out.view(torch.int16)])
        for stored, streamed in zip(*results):
            assert torch.equal(stored, streamed), (start, end)
        assert (results[1][-1][:start] == torch.tensor(7.0, dtype=out_dtype).view(torch.int16)).all()


def _no_library(name, *args, **kwargs):
    raise OSError(f"{name}: cannot open shared object file: No such file or directory")


def test_without_libgomp_the_kernels_fall_back_to_numba_prange(monkeypatch):
    with_team = _step_all(BIG, seed=4)
    monkeypatch.setattr(gomp.ctypes, "CDLL", _no_library)
    monkeypatch.setattr(gomp, "AVAILABLE", gomp._bind())
    assert gomp.AVAILABLE is False
    for a, b in zip(with_team, _step_all(BIG, seed=4)):
        assert torch.equal(a, b)


def test_concurrent_calls_from_python_threads():
    # Kernels run from several Python threads at once (GIL released); each caller gets its own team.
    seeds = range(4)
    alone = [_step_all(300_007, seed, steps=5) for seed in seeds]
    with ThreadPoolExecutor(len(seeds)) as pool:
        together = list(pool.map(lambda seed: _step_all(300_007, seed, steps=5), seeds))
    for a, b in zip(alone, together):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _python(code: str, **env) -> None:
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env},
                   check=True, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.skipif(not gomp.AVAILABLE, reason="libgomp not loadable: no teams to test")
def test_a_team_smaller_than_asked_still_takes_every_chunk():
    # OMP_THREAD_LIMIT=1: libgomp runs every team on its caller alone, which must do both chunks.
    _python("""
        import ctypes, torch
        from zfunc.ops.cpu import adam as cpu_adam
        assert ctypes.CDLL("libgomp.so.1").omp_get_thread_limit() == 1
        n = 300_007
        p0, g = torch.randn(n), torch.randn(n)
        p = [p0.clone(), p0.clone()]
        for threads, q in zip((1, 2), p):
            cpu_adam.set_num_threads(threads)
            cpu_adam.adamw_(q, g, torch.zeros(n), torch.zeros(n), step=1, lr=1e-2)
        assert torch.equal(*p) and not torch.equal(p[0], p0)
        """, OMP_THREAD_LIMIT="1")


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_forked_child_steps_on_one_thread():
    # The parent's OpenMP worker threads do not exist in a forked child: a team there would wait
    # for them forever (the subprocess timeout catches that).
    _python("""
        import os, torch
        from zfunc.ops.cpu import adam as cpu_adam
        cpu_adam.set_num_threads(2)
        n = 300_007
        p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
        cpu_adam.adamw_(p, g, m, v, step=1, lr=1e-2)
        pid = os.fork()
        if pid == 0:
            cpu_adam.adamw_(p, g, m, v, step=2, lr=1e-2)
            os._exit(0 if cpu_adam.get_num_threads() == 1 else 1)
        assert os.waitpid(pid, 0)[1] == 0 and cpu_adam.get_num_threads() == 2
        """)


def test_params_that_require_grad_and_numpy_ints_are_accepted():
    """A Parameter with numpy ints for step/start/end steps as a plain tensor with Python ints."""
    g, p0 = torch.randn(10), torch.randn(10)
    p, m, v = torch.nn.Parameter(p0.clone()), torch.zeros(10), torch.zeros(10)
    cpu_adam.adamw_(p, g, m, v, step=np.int64(1), lr=1e-2, start=np.int32(2), end=np.int64(8))
    q, m_ref, v_ref = p0.clone(), torch.zeros(10), torch.zeros(10)
    cpu_adam.adamw_(q, g, m_ref, v_ref, step=1, lr=1e-2, start=2, end=8)
    assert torch.equal(p.detach(), q) and torch.equal(m, m_ref) and torch.equal(v, v_ref)
    assert torch.equal(q[:2], p0[:2]) and torch.equal(q[8:], p0[8:]) and (q[2:8] != p0[2:8]).all()


def _adamw(n=8, **over):
    args = dict(param=torch.randn(n), grad=torch.randn(n), exp_avg=torch.zeros(n),
                exp_avg_sq=torch.zeros(n))
    kw = dict(step=1, lr=1e-3)
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    cpu_adam.adamw_(*args.values(), **kw)


@pytest.mark.parametrize("over,err,words", [
    (dict(exp_avg=torch.zeros(16)[::2]), ValueError, ["exp_avg", "contiguous", "(2,)"]),
    (dict(param=torch.zeros(2, 4)), ValueError, ["param", "1-D", "(2, 4)"]),
    (dict(grad=torch.zeros(9)), ValueError, ["grad", "9 elements", "expected 8"]),
    (dict(exp_avg_sq=torch.zeros(7)), ValueError, ["exp_avg_sq", "7 elements"]),
    (dict(param=torch.zeros(8, dtype=torch.float64)), TypeError, ["param", "torch.float64",
                                                                  "torch.float32"]),
    (dict(grad=torch.zeros(8, dtype=torch.int32)), TypeError, ["grad", "torch.int32",
                                                               "bfloat16"]),
    (dict(exp_avg=torch.zeros(8, dtype=torch.bfloat16)), TypeError, ["exp_avg", "bfloat16"]),
    (dict(param_out=torch.zeros(8)), TypeError, ["param_out", "torch.float32", "bfloat16"]),
    (dict(grad=torch.zeros(8, device="meta")), ValueError, ["grad", "CPU", "meta"]),
    (dict(param=torch.zeros(8, device="meta")), ValueError, ["param", "CPU", "meta"]),
    (dict(exp_avg=[0.0] * 8), TypeError, ["exp_avg", "torch.Tensor", "list"]),
    (dict(start=-1), ValueError, ["start=-1", "<= 8"]),
    (dict(start=5, end=3), ValueError, ["start=5", "end=3"]),
    (dict(end=9), ValueError, ["end=9", "<= 8"]),
    (dict(start=1.0), ValueError, ["start=1.0"]),
    (dict(step=0), ValueError, ["step", "got 0"]),
    (dict(step=2.0), ValueError, ["step", "got 2.0"]),
])
def test_bad_input_gets_a_clear_error(over, err, words):
    with pytest.raises(err) as info:
        _adamw(**over)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_bad_input_other_kernels():
    p = torch.zeros(8)
    with pytest.raises(ValueError, match="momentum_buf.*contiguous"):
        cpu_adam.sgd_(p, p, torch.zeros(16)[::2], lr=1.0, momentum=0.9, first_step=True)
    with pytest.raises(ValueError, match="nesterov"):
        cpu_adam.sgd_(p, p, torch.zeros(8), lr=1.0, momentum=0.9, dampening=0.1, nesterov=True,
                      first_step=True)
    with pytest.raises(TypeError, match="lion_: exp_avg must have dtype torch.float32"):
        cpu_adam.lion_(p, p, torch.zeros(8, dtype=torch.float16), lr=1.0)


@pytest.mark.multiprocess
def test_importing_zfunc_ops_does_not_load_the_kernels():
    code = ("import sys, zfunc.ops; assert 'zfunc.ops.cpu.adam' not in sys.modules; "
            "zfunc.ops.cpu.adam.adamw_")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_many_leaves_in_one_call_equal_leaf_by_leaf_calls_bit_for_bit(out_dtype):
    """adamw_many_ (small leaves through one table call, big ones threaded) == adamw_ per leaf."""
    shapes = [(3, 5), (7,), (cpu_adam._PARALLEL_MIN + 3,), (1,), (4, 1, 2), (0,)]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32) for i, s in enumerate(shapes)]
    runs = []
    for many in (True, False):
        ps = [torch.linspace(-1, 1, math.prod(s)).reshape(s) for s in shapes]
        ms, vs = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
        outs = [None if out_dtype is None else torch.empty(s, dtype=out_dtype) for s in shapes]
        for step in (1, 2, 3):
            kw = dict(step=step, lr=1e-2, weight_decay=0.1, grad_scale=0.5)
            if many:
                cpu_adam.adamw_many_(ps, grads, ms, vs, param_outs=None if out_dtype is None else outs, **kw)
            else:
                for p, g, m, v, o in zip(ps, grads, ms, vs, outs):
                    cpu_adam.adamw_(p.view(-1), g.view(-1), m.view(-1), v.view(-1),
                                    param_out=None if o is None else o.view(-1), **kw)
        runs.append(ps + ms + vs + [o for o in outs if o is not None])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_many_leaves_name_what_is_wrong():
    p, g = torch.zeros(4, 4), torch.zeros(4, 4)
    with pytest.raises(ValueError, match="lists of one length"):
        cpu_adam.adamw_many_([p], [g], [], [], step=1, lr=1e-3)
    with pytest.raises(ValueError, match="grad must be 1-D and contiguous"):
        cpu_adam.adamw_many_([p], [g.t()], [torch.zeros(4, 4)], [torch.zeros(4, 4)], step=1, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg has 15 elements, expected 16"):
        cpu_adam.adamw_many_([p], [g], [torch.zeros(15)], [torch.zeros(4, 4)], step=1, lr=1e-3)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [7, 1000, BIG])
def test_grad_sq_is_the_squared_norm_of_the_grads_read_and_changes_nothing_else(n, grad_dtype):
    """grad_sq=True returns sum((grad * grad_scale)**2) (what global_norm squares), read in the
    update's own pass: the update and param_out are bit-equal to a call without it, on one or
    two threads, streamed or not."""
    gen = torch.Generator().manual_seed(1)
    g = (torch.randn(n, generator=gen) * 10).to(grad_dtype)
    p0 = torch.randn(n, generator=gen)
    ref = torch.linalg.vector_norm(g.double() * 0.25).item() ** 2
    runs = []
    for grad_sq in (True, False):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        sq = cpu_adam.adamw_(p, g, m, v, step=1, lr=1e-2, weight_decay=0.1, grad_scale=0.25, param_out=out,
                             grad_sq=grad_sq)
        runs.append((p, m, v, out))
        if grad_sq:
            assert sq == pytest.approx(ref, rel=1e-6)
        else:
            assert sq is None
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_many_leaves_grad_sq_sums_every_leaf():
    shapes = [(3, 5), (cpu_adam._PARALLEL_MIN + 3,), (1,), (0,), (40, 40)]
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(s, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32) for i, s in enumerate(shapes)]
    ps = [torch.randn(s, generator=gen) for s in shapes]
    ms, vs = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    sq = cpu_adam.adamw_many_(ps, grads, ms, vs, step=1, lr=1e-3, grad_scale=2.0, grad_sq=True)
    ref = sum(torch.linalg.vector_norm(g.double() * 2.0).item() ** 2 for g in grads)
    assert sq == pytest.approx(ref, rel=1e-6)
    assert cpu_adam.adamw_many_(ps, grads, ms, vs, step=2, lr=1e-3) is None


@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
def test_low_precision_grads_unscaled_into_the_update_equal_torchs_adamw_then_cast(grad_dtype, out_dtype):
    """The fused pass an offloaded bf16/fp16 step runs: compute-dtype grads in, the unscale (and a
    clip factor) applied, fp32 masters and moments updated, the compute copy written -- equals
    torch's path: upcast, multiply, torch.optim.AdamW, cast (p within TOL, the copy the cast of p)."""
    n, factor = 100_003, 0.37 / 1024  # an unscale by 1024 times a clip factor
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 1024).to(grad_dtype) for _ in range(5)]
    q, state = _run_torch(torch.optim.AdamW, p0, [g.float() * factor for g in grads], lr=1e-2, weight_decay=0.1)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    for t, g in enumerate(grads, 1):
        cpu_adam.adamw_many_([p], [g], [m], [v], step=t, lr=1e-2, weight_decay=0.1, grad_scale=factor,
                             param_outs=[out])
    torch.testing.assert_close(p, q, **TOL)
    torch.testing.assert_close(m, state["exp_avg"], rtol=0, atol=0)
    assert torch.equal(out.view(torch.int16), p.to(out_dtype).view(torch.int16))
