"""ZeRO++'s hpZ (zfunc.sharding.hpz): stage 3 with a secondary param copy in groups of k ranks equals
the plain step, and its re-gathers in backward move their bytes inside the group."""
from __future__ import annotations

import pytest
import torch

import zfunc as zf
from tests.models import Block, Tiny, adamw, assert_same_training, batches, make, mesh_shaped, token_loss, train_on
from zfunc.checkpoint import full_params


def test_shard_refuses_hpz_where_it_does_not_apply():
    step, _ = make()
    with pytest.raises(ValueError, match="hpz: expected None or an int >= 1 dividing the 4 data-parallel ranks, "
                                         "got 3"):
        zf.shard(step, mesh_shaped(dp=4), 3, hpz=3)
    with pytest.raises(ValueError, match="hpz: .*expected stage 3, got stage 2"):
        zf.shard(step, mesh_shaped(dp=4), 2, hpz=2)
    assert zf.shard(step, mesh_shaped(dp=4), 2, hpz=1).hpz is None  # 1: off, as DeepSpeed reads it


def _hpz_worker(rank, world, k):
    mesh = zf.Mesh(dp=world)
    out = {}
    for hpz in (None, k):
        torch.manual_seed(0)
        apply, params = zf.functionalize(Tiny())
        step = zf.shard(zf.train_step(token_loss(apply), adamw(), "fp32"), mesh, 3, units=zf.units.by_class(Block),
                        hpz=hpz)
        state, losses, norms = train_on(step, step.init(params), batches(world), rank, world)
        units = step._flat_groups
        padded = sum(u.segment for u in units) * world
        out[hpz] = ((losses, norms, full_params(state, mesh)), step.memory(state), padded,
                    None if hpz is None else step.hpz_group.world)
    return out


@pytest.mark.multiprocess
def test_hpz_equals_the_plain_step_and_regathers_inside_the_group():
    world, k = 4, 2
    results = zf.dist.spawn(_hpz_worker, world, world, k)
    torch.manual_seed(0)
    apply, params = zf.functionalize(Tiny())
    plain = zf.train_step(token_loss(apply), adamw(), "fp32")
    ref_state, ref_losses, ref_norms = train_on(plain, plain.init(params), batches(world))
    for rank, out in enumerate(results):
        (trained, memory, padded, group) = out[k]
        assert_same_training(trained, (ref_losses, ref_norms, ref_state.params), f"hpz={k}, rank {rank}")
        for name, p in trained[2].items():  # the re-gathers return the first gather's bits
            assert torch.equal(p, out[None][0][2][name]), (rank, name)
        assert group == k
        # the backward re-gathers moved inside the group what the N-rank gathers no longer move
        without, comm = out[None][1]["comm"], memory["comm"]
        assert comm["hpz_all_gather"] > 0
        assert comm["all_gather"] + comm["hpz_all_gather"] == without["all_gather"], (comm, without)
        assert comm["all_gather"] < without["all_gather"]
        assert memory["secondary_params"] == padded // k * 4  # fp32 compute: 4 bytes a value
        assert "secondary_params" not in out[None][1]
