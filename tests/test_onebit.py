"""1-bit Adam, 0/1 Adam, 1-bit LAMB (zfunc.optim.onebit): warm-up equal to the full-precision
counterpart exactly; after it, at zf.shard stage 0 on 2 ranks, the grads stay local, the momentum
goes compressed (bytes counted) and every rank ends with the same params; other stages refused;
errors restart when the state given is not the last one returned."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from tests.models import Tiny, batches, local, mesh_shaped
from zfunc import optim
from zfunc.dist import compressed as C
from zfunc.plan.compression import engine_compressed_comm

LR = 1e-2


def _params():
    torch.manual_seed(0)
    return {"w": torch.randn(8, 4), "b": torch.randn(4), "z": torch.zeros(3)}


def _grads(t):
    g = torch.Generator().manual_seed(t)
    return {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g), "z": torch.randn(3, generator=g)}


def _run(tx, steps, params=None):
    params, state = params or _params(), None
    state = tx.init(params)
    for t in range(steps):
        params, state = optim.apply(tx, _grads(t), state, {k: v.clone() for k, v in params.items()})
    return params, state


@pytest.mark.parametrize("onebit, counterpart, warm", [
    (lambda: optim.onebit_adam(LR, weight_decay=0.1, freeze_step=6),
     lambda: optim.adamw(LR, weight_decay=0.1, bias_correction=False), 6),
    (lambda: optim.zero_one_adam(LR, weight_decay=0.1, var_update_scaler=6),
     lambda: optim.adamw(LR, weight_decay=0.1, bias_correction=False), 6),
    # lamb's pure update, bit for bit (its CPU kernel sums the norms in fp64: equal to it to 1e-6, test_cpu_lamb)
    (lambda: optim.onebit_lamb(LR, weight_decay=0.1, freeze_step=6),
     lambda: optim.lamb(LR, weight_decay=0.1, bias_correction=False, backend="torch"), 6),
])
def test_warm_up_equals_the_full_precision_counterpart_exactly(onebit, counterpart, warm):
    got, _ = _run(onebit(), warm)
    ref, _ = _run(counterpart(), warm)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_zero_one_adam_once_frozen_is_adam_on_the_frozen_variance_with_its_decay_once():
    """One rank (the compressed mean is the mean), one local step per sync: each update is
    ``m = b1 m + (1-b1) g; p = p (1 - lr wd) - lr m / (sqrt(v) + eps)`` on the variance frozen after
    update ``var_freeze_step + 1``; the momentum the sync rebuilds carries no weight decay."""
    frozen, late, wd = 3, 5, 0.1
    got, state = _run(optim.zero_one_adam(LR, weight_decay=wd, var_freeze_step=frozen), frozen + 1 + late)
    params, adam = _run(optim.adamw(LR, weight_decay=wd, bias_correction=False), frozen + 1)
    m, v = dict(adam.mu), adam.nu
    for t in range(frozen + 1, frozen + 1 + late):
        g = _grads(t)
        for k in params:
            m[k] = 0.9 * m[k] + 0.1 * g[k]
            params[k] = params[k] * (1 - LR * wd) - LR * m[k] / (v[k].sqrt() + 1e-8)
    for k in params:
        torch.testing.assert_close(got[k], params[k], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state.mu[k], m[k], rtol=1e-6, atol=1e-6)


def test_the_recipes_zero_one_adam_refreshes_the_variance_every_update_for_its_first_64():
    from recipes import cli, engine, gpt

    args = cli.parse_args(gpt.RECIPE, ["--optimizer", "zero_one_adam", "--grad-clip", "0"])
    tx = engine.make_optimizer(args, zf.config.Plan(optimizer=None))  # the recipe brings its own
    params, state, full = _params(), None, []
    state = tx.init(params)
    for t in range(66):
        full.append(not tx.local_grads(state))  # a full-precision update refreshes the variance
        params, state = optim.apply(tx, _grads(t), state, params)
    assert engine.ZERO_ONE_VAR_UPDATE_SCALER == 64 and full == [True] * 64 + [False, True]


def test_adamw_without_bias_correction_is_adam_without_its_factors():
    got, _ = _run(optim.adamw(LR, weight_decay=0.0, bias_correction=False), 1)
    g, p = _grads(0), _params()
    for k in p:  # first step: m = 0.1 g, v = 0.001 g^2
        torch.testing.assert_close(got[k], p[k] - LR * (0.1 * g[k]) / ((0.001 * g[k] ** 2).sqrt() + 1e-8))


def test_local_grads_declares_the_compressed_updates():
    params = _params()
    adam = optim.onebit_adam(LR, freeze_step=2)
    s = adam.init(params)
    assert [adam.local_grads(s._replace(count=c)) for c in range(4)] == [False, False, True, True]
    zo = optim.zero_one_adam(LR, var_update_scaler=2, var_freeze_step=6)
    state, flags = zo.init(params), []
    for t in range(10):
        flags.append(zo.local_grads(state))
        _, state = zo.update(_grads(t), state, params)
    # var_interval 1 for 2 updates, then 2 (every other update full precision), frozen after update 7
    assert flags == [False, False, True, False, True, False, True, True, True, True]
    chained = optim.chain(optim.clip_by_global_norm(1.0), adam)
    assert chained.local_grads(chained.init(params)) is False
    with pytest.raises(ValueError, match="chain: arguments"):
        optim.chain(adam, optim.onebit_lamb(LR))


class _FakeComm:
    """Two ranks whose other rank sends what this one does: records the error buffers it is given."""

    world = 2

    def __init__(self):
        self.seen = []

    def compressed_all_reduce(self, x, errors, label=""):
        self.seen.append(errors)
        return x

    def compressed_all_reduce_many(self, xs, errors, label="", blend=None, then=None):
        if blend is not None:  # the value reduced, x a + b y, is the mean: written into x
            for x, y in zip(xs, blend[0]):
                x.copy_(x * blend[1] + blend[2] * y)
        out = [self.compressed_all_reduce(x, e, label) for x, e in zip(xs, errors)]
        for k in range(len(xs) if then is not None else 0):
            then(k)
        return out


def test_errors_restart_when_the_state_is_not_the_last_returned():
    comm = _FakeComm()
    tx = optim.onebit_adam(LR, freeze_step=1, comm=comm)
    params = _params()
    state = tx.init(params)
    saved = None
    for t in range(4):
        if t == 2:
            saved = state
        _, state = tx.update(_grads(t), state, params)
    n = 3  # one ErrorFeedback per param tensor
    assert all(comm.seen[k] is comm.seen[n + k] is comm.seen[2 * n + k] for k in range(n))  # kept
    tx.update(_grads(9), saved, params)  # an older state (a checkpoint loaded): zero errors again
    assert comm.seen[3 * n] is not comm.seen[2 * n] and not comm.seen[3 * n].worker.any()


def test_momentum_mask_keeps_masked_entries_zero():
    comm = _FakeComm()
    params = _params()
    mask = {"w": torch.ones(8, 4), "b": torch.ones(4), "z": torch.tensor([1.0, 0.0, 1.0])}
    tx = optim.onebit_adam(LR, freeze_step=1, momentum_mask=mask, comm=comm)
    state = tx.init(params)
    for t in range(3):
        _, state = tx.update(_grads(t), state, params)
    assert state.mu["z"][1] == 0 and state.mu["z"][0] != 0


def _apply_against_update(comm, rank=0, steps=4):
    """``onebit_adam``'s in-place ``apply`` and its ``update`` plus the add, side by side on the same grads:
    (params, momenta) of each after ``steps``, weight decay on every leaf but "b", a momentum mask on "z"."""
    mask = {"w": torch.ones(8, 4), "b": torch.ones(4), "z": torch.tensor([1.0, 0.0, 1.0])}
    out = []
    for in_place in (True, False):
        tx = optim.onebit_adam(LR, weight_decay=0.1, freeze_step=2, momentum_mask=mask, comm=comm,
                               mask={"w": True, "b": False, "z": True})
        params = _params()
        state = tx.init(params)
        for t in range(steps):
            grads = {k: g * (1 + rank) for k, g in _grads(t).items()}
            if in_place:
                mu = state.mu["w"]
                params, state = tx.apply(grads, state, params)
                assert (state.mu["w"] is mu) == (t >= 2)  # after warm-up the momentum's own tensor
            else:
                updates, state = tx.update(grads, state, params)
                params = optim.apply_updates(params, updates)
        out.append((params, state.mu))
    return out


def test_the_in_place_apply_is_the_update_bit_for_bit():
    """After warm-up ``apply`` forms the momentum, takes its compressed mean and updates each param in the
    tensors it is given: the bits of ``update`` and ``apply_updates`` (here a comm whose mean is the input)."""
    (got, got_mu), (want, want_mu) = _apply_against_update(_FakeComm())
    for k in want:
        assert torch.equal(got[k], want[k]) and torch.equal(got_mu[k], want_mu[k]), k
    assert got_mu["z"][1] == 0


def _apply_worker(rank, world):
    return _apply_against_update(zf.Mesh().comm, rank)


@pytest.mark.multiprocess
def test_the_in_place_apply_is_the_update_bit_for_bit_over_two_ranks():
    """The same with the real 1-bit compressed mean over 2 ranks (their grads differ)."""
    for (got, got_mu), (want, want_mu) in zf.dist.spawn(_apply_worker, 2, 2):
        for k in want:
            assert torch.equal(got[k], want[k]) and torch.equal(got_mu[k], want_mu[k]), k


def test_shard_refuses_stages_1_to_3_for_a_1bit_optimizer():
    apply, params = zf.functionalize(Tiny())
    step = zf.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]).flatten(0, 1), b[1].flatten()),
                         optim.onebit_adam(LR), "fp32")
    for stage in (1, 2, 3):
        with pytest.raises(ValueError, match=f"stage: the optimizer communicates itself.*got stage {stage}"):
            zf.shard(step, mesh_shaped(dp=2), stage)
    zf.shard(step, mesh_shaped(dp=2), 0)


def _stage0_worker(rank, world, kind):
    torch.manual_seed(0)
    apply, params = zf.functionalize(Tiny())
    mesh = zf.Mesh()
    make = {"onebit_adam": lambda: optim.onebit_adam(LR, freeze_step=2, comm=mesh.comm),
            "zero_one_adam": lambda: optim.zero_one_adam(LR, var_update_scaler=1, var_freeze_step=3, comm=mesh.comm),
            "onebit_lamb": lambda: optim.onebit_lamb(LR, freeze_step=2, comm=mesh.comm),
            "plain": lambda: optim.adamw(LR, weight_decay=0.0, bias_correction=False)}[kind]

    def loss_fn(p, b):
        return F.cross_entropy(apply(p, b[0]).flatten(0, 1), b[1].flatten())

    step = zf.shard(zf.train_step(loss_fn, make(), "fp32"), mesh, 0)
    state = step.init(params)
    out = []
    for batch in batches(world, n=6):
        state, m = step(state, local(batch, rank, world))
        out.append(({k: v.clone() for k, v in state.params.items()}, float(m["loss"]), dict(mesh.comm_bytes())))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_at_stage_0_the_momentum_goes_compressed_and_ranks_agree(kind):
    ranks = zf.dist.spawn(_stage0_worker, 2, 2, kind)
    plain = zf.dist.spawn(_stage0_worker, 2, 2, "plain") if kind == "onebit_adam" else None
    for t in range(6):
        a, b = ranks[0][t][0], ranks[1][t][0]
        assert all(torch.equal(a[k], b[k]) for k in a), (kind, t)  # the compressed mean is the same bits
    bytes_late = ranks[0][5][2]
    assert bytes_late.get(C.KIND, 0) > 0
    grad_bytes = sum(v.numel() for v in ranks[0][0][0].values()) * 4
    assert bytes_late.get("all_reduce", 0) < grad_bytes  # only the loss (and no grads) in full precision
    assert ranks[0][0][2].get("all_reduce", 0) >= 2 * grad_bytes  # warm-up: the grads themselves
    assert ranks[0][5][1] < ranks[0][0][1]  # it trains
    leaves = [tuple(v.shape) for v in ranks[0][0][0].values()]  # zfunc.plan's bytes are the ranks' counts
    assert bytes_late == engine_compressed_comm(leaves, 2, 0, optimizer=kind), (bytes_late, kind)
    if plain is not None:  # warm-up (2 updates) equals the full-precision step exactly
        for t in range(2):
            assert all(torch.equal(ranks[0][t][0][k], plain[0][t][0][k]) for k in plain[0][t][0])


def test_the_frozen_update_kernel_is_the_torch_expression():
    """zfunc.ops.cpu.onebit's one pass against ``p decay - lr m / (sqrt(v) + eps) - p`` in torch: equal but
    for the square root, which it rounds correctly (torch's may be an ulp off)."""
    from zfunc.ops.cpu import onebit as kernel

    g = torch.Generator().manual_seed(0)
    p, m, v = torch.randn(4099, generator=g), torch.randn(4099, generator=g), torch.rand(4099, generator=g)
    for decay in (None, 1 - 1e-3 * 0.1):
        got = kernel.frozen_adam_update(p, m, v, 1e-3, decay, 1e-8)
        new_p = p * decay if decay is not None else p
        want = new_p - 1e-3 * (m / (v.double().sqrt().float() + 1e-8)) - p
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
        torch.testing.assert_close(got, new_p - 1e-3 * (m / (v.sqrt() + 1e-8)) - p, rtol=0, atol=2.4e-7)
