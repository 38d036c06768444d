"""offload's grads: over one rank autograd's own (bf16/fp16) grads reach CPU-Adam, unscaled (and
clipped) in its pass; the training is the plain step's, on 1 and 2 ranks."""
import pytest
import torch

import zfunc as zf
from tests.models import batches, train_on
from tests.models import make_offloaded as make
from zfunc.ops.cpu import adam as cpu_adam
from zfunc.checkpoint import full_params
from zfunc.sharding.layout import FlatGroup
from zfunc.offloading.placement import in_ram


def same_training(step, state, clip, precision, accum=1, world=1, rank=0):
    """Train ``step`` and the plain step alike; the plain one's (losses, norms, params) and ours."""
    ref, ref_losses, ref_norms = train_on(*make(clip, precision, accum), batches(world, 4))
    state, losses, norms = train_on(step, state, batches(world, 4), rank, world)
    return (ref_losses, ref_norms, ref.params), (losses, norms, state)


@pytest.mark.parametrize("where, params", [("cpu", None), ("cpu", "cpu"), ("nvme", "nvme")])
@pytest.mark.parametrize("clip, precision, accum", [(False, "bf16", 1), (True, "bf16", 1), (False, "fp16", 1),
                                                    (True, "fp16", 2)])
def test_a_low_precision_offloaded_step_equals_the_plain_step(tmp_path, where, params, clip, precision, accum):
    step, state = make(clip, precision, accum, where, params, tmp_path)
    (ref_losses, ref_norms, ref), (losses, norms, state) = same_training(step, state, clip, precision, accum)
    assert losses == ref_losses and norms == pytest.approx(ref_norms, rel=1e-6)
    got = zf.checkpoint.full_params(state)
    for name, want in ref.items():
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("clip, precision, overlap", [(False, "bf16", True), (True, "bf16", False),
                                                       (False, "fp16", False)])
def test_one_rank_hands_autograd_grads_to_the_kernel_unscaled_in_its_pass(monkeypatch, clip, precision, overlap):
    """No fp32 copy of the grads is packed at one rank: the kernel reads them in the compute dtype
    and multiplies by 1/loss scale (fp16) times the clip factor (with a clip) in its pass."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    step, state = make(clip, precision, 1, "cpu", None)
    assert step.overlap == overlap
    monkeypatch.setattr(FlatGroup, "pack_full", lambda *a: pytest.fail("an fp32 copy of the grads was packed"))
    calls, many = [], cpu_adam.adamw_many_
    monkeypatch.setattr(cpu_adam, "adamw_many_", lambda ps, gs, *a, **k: calls.append((gs, k)) or many(ps, gs, *a, **k))
    multiplies = []
    mul_ = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a: multiplies.append(a) or mul_(*a))
    updated = 0
    for batch in batches(1, 4):
        scale = state.loss_scale.scale
        state, m = step(state, batch)
        if m["skipped"]:  # fp16 halving its initial scale: nothing ran
            assert calls == []
            continue
        updated += 1
        assert calls and all(g.dtype == dtype for gs, _ in calls for g in gs)
        factors = {k["grad_scale"] for _, k in calls}
        if clip:  # the factor differs from 1/scale by the clip's coefficient, the same for every leaf
            assert len(factors) == 1 and factors.pop() < 1.0 / scale
        else:
            assert factors == {1.0 / scale}
        calls.clear()
    assert updated >= 2 and multiplies == []  # neither the unscale nor the clip made a pass of its own


def two_rank_worker(rank, world, path, configs):
    """Per config: (the sharded step's training, the offloaded one's), each (losses, norms, params)."""
    mesh = zf.Mesh(dp=world)
    out = []
    for stage, where, params, clip, precision in configs:
        pair = []
        for kw in ({}, dict(where=where, params=params, path=f"{path}/{stage}-{clip}-{rank}")):
            step, state = make(clip, precision, mesh=mesh, stage=stage, **kw)
            state, losses, norms = train_on(step, state, batches(world, 3), rank, world)
            pair.append((losses, norms, full_params(in_ram(state), mesh)))
        out.append(pair)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("configs", [
    [(2, "cpu", None, False, "bf16")],
    [(3, "nvme", "nvme", True, "fp16"), (2, "cpu", None, True, "bf16")],
], ids=["bf16 overlapped", "fp16 stage 3 clip, bf16 clip"])
def test_low_precision_offload_over_two_ranks_trains_as_the_sharded_step(tmp_path, configs):
    """Two ranks: fp32 reduce-scatters (the sums need them), unscaled in the kernel's pass; the
    reference is the same sharded step without offload (whose bf16 grads of half batches differ
    from the plain step's of whole ones by bf16 rounding, 2e-3)."""
    results = zf.dist.spawn(two_rank_worker, 2, 2, str(tmp_path), configs)
    for k in range(len(configs)):
        for rank in range(2):
            (ref_losses, ref_norms, ref), (losses, norms, got) = results[rank][k]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
            for name, want in ref.items():
                torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6)
