"""placement: each transformation registers how its state is saved, loaded and made whole, and the
checkpoint asks the registry alone: a spec without a placement is refused by name, a subclass of a
spec is placed as its parent unless it registers its own."""
from dataclasses import dataclass

import pytest
import torch

import zfunc as zf
from tests.models import make
from zfunc.core import placement
from zfunc.offloading.placement import OffloadPlacement, OffloadSpec
from zfunc.pipelining.placement import PipelinePlacement, PipelineSpec
from zfunc.sharding.layout import LeafShard, ShardPlacement, ShardSpec


def test_every_spec_of_zfunc_has_its_placement_and_a_subclass_takes_its_parents():
    shard = ShardSpec(1, 2, 1, (LeafShard((5, 3), 3),))
    assert placement.of(None) is placement.PLAIN
    assert type(placement.of(shard)) is ShardPlacement
    assert type(placement.of(OffloadSpec(*shard.__dict__.values()))) is OffloadPlacement  # its own, not shard's
    assert type(placement.of(PipelineSpec(2, 1, ("a",), ((5, 3),), ("a",), shard))) is PipelinePlacement

    @dataclass(frozen=True)
    class Sub(ShardSpec):
        pass

    assert type(placement.of(Sub(*shard.__dict__.values()))) is ShardPlacement
    pipe = PipelineSpec(2, 1, ("a",), ((5, 3),), ("a",), shard)
    assert placement.of(pipe).processes(pipe) == (4, 3)  # global rank stage * dp + dp rank
    assert placement.of(pipe).describe(pipe) == {"world": 4, "pipeline": 2, "stage": 1}
    assert placement.of(pipe).rows(pipe, 0, (2, 3)) == placement.Rows((5, 3), 3, (3, 5))


def test_a_state_whose_spec_has_no_placement_is_refused_naming_it(tmp_path):
    @dataclass(frozen=True)
    class Unknown:
        world: int = 2

    step, state = make()
    odd = zf.TrainState(state.params, state.opt_state, placement=Unknown())
    said = (r"state: its placement .*Unknown\(world=2\) \(Unknown\) has no registered Placement \(expected None "
            r"or one of: .*PipelineSpec, ShardSpec, TensorParallelSpec; see zfunc.core.placement.register\)")
    with pytest.raises(TypeError, match=said):
        zf.checkpoint.save(odd, tmp_path / "ckpt" / "000001")
    with pytest.raises(TypeError, match=said):
        zf.checkpoint.full_params(odd)
    assert not (tmp_path / "ckpt").exists()  # refused before anything is written
    with pytest.raises(TypeError, match="placement: expected a zfunc.core.placement.Placement, got dict"):
        placement.register(Unknown, {})
    with pytest.raises(TypeError, match="spec_type: expected a class, got 'Unknown'"):
        placement.register("Unknown", placement.Placement())
    assert torch.equal(zf.checkpoint.full_params(state)["emb.weight"], state.params["emb.weight"])
