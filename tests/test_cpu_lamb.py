"""zfunc.ops.cpu.lamb (zf.optim.lamb's Numba kernel): equals the pure update's torch ops (m, v bit for bit,
p to 1e-6) over several steps, threaded and table paths, fp32/bf16/fp16 grads; backend="auto" picks it
for contiguous fp32 CPU params only."""
from __future__ import annotations

import pytest
import torch

from zfunc import optim
from zfunc.ops.cpu import adam as cpu_adam, lamb as cpu_lamb


@pytest.fixture
def two_threads():
    cpu_adam.set_num_threads(2)
    yield
    cpu_adam.set_num_threads(None)


def _params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"big": torch.randn(40_000),  # past _PARALLEL_MIN: a threaded call per pass
            "w": torch.randn(16, 8), "b": torch.zeros(8),  # small: one table call per pass; b's ||p|| = 0 at step 1
            "huge": torch.randn(5) * 1e3, "tiny": torch.randn(7) * 1e-6}  # ratios clamped to max_coeff, min_coeff


def _run(tx, params, grads_per_step):
    state, p = tx.init(params), {k: x.clone() for k, x in params.items()}
    for g in grads_per_step:
        p, state = tx.apply(g, state, p)
    return p, state


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_correction, wd", [(True, 0.01), (False, 0.0), (True, 0.0)])
def test_numba_lamb_equals_the_pure_update(two_threads, grad_dtype, bias_correction, wd):
    params = _params()
    steps = [{k: torch.randn_like(p).to(grad_dtype) for k, p in params.items()} for _ in range(5)]
    steps[0]["w"] = torch.zeros_like(steps[0]["w"])  # ||u|| = 0 where wd is 0: ratio 1
    mask = lambda p: {k: k != "w" for k in p}  # noqa: E731
    make = lambda backend: optim.lamb(1e-2, weight_decay=wd, bias_correction=bias_correction, mask=mask,  # noqa: E731
                                      backend=backend)
    (p_k, s_k), (p_t, s_t) = _run(make("numba"), params, steps), _run(make("torch"), params, steps)
    for k in params:
        assert torch.equal(s_k.mu[k], s_t.mu[k]) and torch.equal(s_k.nu[k], s_t.nu[k]), k
        torch.testing.assert_close(p_k[k], p_t[k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert s_k.count == s_t.count == 5


def test_numba_lamb_clamps_the_trust_ratio():
    # one step from zero moments with bias correction: u = g / (|g| + eps) = sign(g) -> ||u|| = sqrt(n)
    p = {"a": torch.full((4,), 100.0), "z": torch.full((4,), 1e-6), "0": torch.zeros(4)}
    g = {k: torch.ones(4) for k in p}
    tx = optim.lamb(1.0, backend="numba")
    new, _ = tx.apply(g, tx.init(p), {k: x.clone() for k, x in p.items()})
    torch.testing.assert_close(new["a"], p["a"] - 10.0, rtol=1e-6, atol=1e-6)  # ratio 100 -> max_coeff 10
    torch.testing.assert_close(new["z"], p["z"] - 0.01, rtol=1e-6, atol=1e-6)  # ratio 1e-6 -> min_coeff 0.01
    torch.testing.assert_close(new["0"], -torch.ones(4), rtol=1e-6, atol=1e-6)  # ||p|| = 0 -> ratio 1


def test_auto_backend_runs_the_numba_lamb_on_contiguous_fp32_cpu_params(monkeypatch):
    calls = []
    kernel = cpu_lamb.lamb_many_
    monkeypatch.setattr(cpu_lamb, "lamb_many_", lambda ps, *a, **k: calls.extend(ps) or kernel(ps, *a, **k))
    tx = optim.lamb(1e-3)
    cpu = {"a": torch.randn(1000), "b": torch.randn(7), "w": torch.randn(3, 4)}
    tx.apply(cpu, tx.init(cpu), cpu)
    assert len(calls) == 3
    for other in ({"w": torch.randn(4, 3).t()}, {"w": torch.randn(3, 4, dtype=torch.float64)}):  # strided, fp64
        tx.apply(other, tx.init(other), other)
    forced = optim.lamb(1e-3, backend="torch")
    forced.apply(cpu, forced.init(cpu), cpu)
    assert len(calls) == 3


def test_lamb_many_names_what_it_cannot_update():
    p, m, v = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="grad has 7 elements, expected 8"):
        cpu_lamb.lamb_many_([p], [torch.zeros(7)], [m], [v], step=1, lr=1e-3)
    with pytest.raises(TypeError, match="exp_avg_sq must have dtype torch.float32, got torch.float64"):
        cpu_lamb.lamb_many_([p], [torch.zeros(8)], [m], [v.double()], step=1, lr=1e-3)
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        cpu_lamb.lamb_many_([p], [torch.zeros(8)], [m], [v], step=0, lr=1e-3)
    with pytest.raises(ValueError, match="backend='numba': expected contiguous fp32 CPU params"):
        tx = optim.lamb(1e-3, backend="numba")
        d = {"w": torch.zeros(3, dtype=torch.float64)}
        tx.apply(d, tx.init(d), d)


def test_lamb_and_the_norm_run_one_thread_after_a_fork(two_threads, monkeypatch):
    # os.fork leaves a child without its OpenMP workers (zfunc.ops.cpu.adam._one_thread_after_fork): every
    # kernel family reads the pool size per call, so none starts a team of 2 there
    from zfunc.ops.cpu import norm as cpu_norm

    teams = []
    real_run = cpu_lamb._run
    monkeypatch.setattr(cpu_lamb, "_run", lambda block, team, k, a: (teams.append(k), real_run(block, team, k, a)))
    p = {"big": torch.randn(40_000)}
    tx = optim.lamb(1e-2, backend="numba")
    _run(tx, p, [{"big": torch.randn(40_000)}])
    monkeypatch.setattr(cpu_adam, "_POOL_SIZE", 1)
    _run(tx, p, [{"big": torch.randn(40_000)}])
    assert teams[0] == 2 and teams[-1] == 1, teams
    assert cpu_adam.get_num_threads() == 1
    g = torch.randn(40_000)
    assert cpu_norm.sum_squares([g]) == pytest.approx(float((g.double() ** 2).sum()), rel=1e-6)  # on one thread
