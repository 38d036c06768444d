"""parallelize: a Plan applied in the one order that works trains as the plain step; impossible
plans are refused, one error per refusal naming the plan fields."""
import dataclasses
import re

import pytest
import torch
from torch import nn

import zfunc as zf
from tests.models import Tiny, adamw, assert_same_training, batches, token_loss, train_on
from zfunc.offloading.offloaded import OffloadedStep
from zfunc.sharding.step import ShardedStep
from zfunc.model.tiling import TiledLinear

STEPS = 3


class Headed(Tiny):
    """Tiny with its head named ``lm_head`` (what ``tile_lm_head`` tiles), tied to the embedding."""

    def __init__(self):
        super().__init__(vocab=12, d=6, n=4)
        self.lm_head = self.head
        del self.head

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def build(plan: zf.config.Plan, mesh=None, *, prepare=True):
    """``(step, state, model)``: the plan's step over a Headed model (seed 0), AdamW clipped."""
    torch.manual_seed(0)
    model = Headed()
    if prepare:
        zf.config.prepare(model, plan)
    apply, params = zf.functionalize(model)
    step = zf.parallelize(zf.train_step(token_loss(apply), adamw(), plan.precision, plan.accum), model, plan, mesh)
    return step, step.init(params), model


def train(step, state, rank=0, dp=1):
    return train_on(step, state, batches(dp, n=STEPS, b=8 // dp, vocab=12), rank, dp)


def untiled(params: dict) -> dict:
    """Tiled params (``emb.tiles.2.weight``) joined back under the layer's own name (``emb.weight``)."""
    out, tiles = {}, {}
    for name, value in params.items():
        layer, sep, rest = name.partition(".tiles.")
        if not sep:
            out[name] = value
            continue
        index, _, kind = rest.partition(".")
        tiles.setdefault(f"{layer}.{kind}", {})[int(index)] = value
    return out | {name: torch.cat([parts[i] for i in sorted(parts)]) for name, parts in tiles.items()}


def reference():
    step, state, _ = build(zf.config.Plan(optimizer=None))
    state, losses, norms = train(step, state)
    return losses, norms, state.params


PLANS_1 = [  # one process: each transformation, and their compositions
    dict(zero_stage=1), dict(zero_stage=2), dict(zero_stage=3, units="class:Block"),
    dict(offload_optimizer="cpu"), dict(offload_optimizer="cpu", offload_params="cpu", units="class:Block"),
    dict(zero_stage=3, offload_optimizer="cpu", offload_params="cpu", units="class:Block", remat=True),
    dict(zero_stage=2, offload_optimizer="cpu", remat=True, remat_offload=True, units="class:Block"),
    dict(remat=True, units="class:Block"), dict(tile_lm_head=3),
    dict(zero_stage=3, tile_lm_head=2, units="class:Block"),
]


@pytest.mark.parametrize("fields", PLANS_1, ids=[",".join(f"{k}={v}" for k, v in f.items()) for f in PLANS_1])
def test_a_planned_step_trains_as_the_plain_step(fields):
    plan = zf.config.Plan(optimizer=None, **fields)
    step, state, model = build(plan)
    state, losses, norms = train(step, state)
    assert_same_training((losses, norms, untiled(zf.checkpoint.full_params(state))), reference(), str(fields))


def test_the_order_is_shard_then_offload_then_pipeline():
    step, _, _ = build(zf.config.Plan(optimizer=None, zero_stage=3, offload_optimizer="cpu", units="class:Block"))
    assert isinstance(step, OffloadedStep) and step.stage == 3
    step, _, _ = build(zf.config.Plan(optimizer=None, zero_stage=2))
    assert type(step) is ShardedStep and step.stage == 2
    step, _, _ = build(zf.config.Plan(optimizer=None))
    assert type(step) is zf.Step  # stage 0 on one rank: the plain step itself


def test_prepare_tiles_the_head_and_rematerializes_the_blocks_only():
    model = zf.config.prepare(Headed(), zf.config.Plan(tile_lm_head=3, remat=True, units="class:Block"))
    assert isinstance(model.lm_head, TiledLinear) and len(model.lm_head.tiles) == 3
    assert all("forward" in vars(b) for b in model.blocks)
    assert not any("forward" in vars(m) for m in (model.emb, model.ln_f, model))
    with pytest.raises(ValueError, match="tiled already; prepare the model once"):
        zf.config.prepare(model, zf.config.Plan(tile_lm_head=3))
    with pytest.raises(ValueError, match="remat applied"):
        zf.config.prepare(model, zf.config.Plan(remat=True, units="class:Block"))


def test_a_model_not_prepared_for_the_plan_is_refused_naming_the_field():
    for plan, field in ((zf.config.Plan(optimizer=None, tile_lm_head=2), "plan.tile_lm_head: 2, but the model's "
                         "lm_head has 0 tiles"), (zf.config.Plan(optimizer=None, remat=True), "plan.remat: True")):
        with pytest.raises(ValueError, match=re.escape(field)):
            build(plan, prepare=False)
    with pytest.raises(ValueError, match="tile_lm_head: tiles the model's 'lm_head' nn.Linear, and the model has none"):
        zf.config.prepare(Tiny(), zf.config.Plan(tile_lm_head=2))


def test_the_step_must_be_plain_and_match_the_plan():
    plan = zf.config.Plan(optimizer=None)
    model = Headed()
    apply, params = zf.functionalize(model)
    plain = zf.train_step(lambda p, b: apply(p, b).sum(), zf.optim.sgd(0.1))
    with pytest.raises(TypeError, match="expected the plain step of zf.train_step.*got ShardedStep"):
        zf.parallelize(zf.shard(plain, zf.Mesh(dp=1), 1), model, plan)
    with pytest.raises(ValueError, match=re.escape("plan.precision: 'bf16', but the step computes in 'fp32'")):
        zf.parallelize(plain, model, dataclasses.replace(plan, precision="bf16"))
    with pytest.raises(ValueError, match=re.escape("plan.accum: 2, but the step accumulates 1")):
        zf.parallelize(plain, model, dataclasses.replace(plan, accum=2))
    with pytest.raises(ValueError, match="but the plan says dp=2, pp=1"):
        zf.parallelize(plain, model, dataclasses.replace(plan, dp=2, zero_stage=1), zf.Mesh(dp=1))


REFUSED = [  # (plan fields, the error naming them)
    (dict(dp=2, offload_optimizer="cpu"), "offload_optimizer: over dp=2 ranks each rank offloads the shard it "
     "updates, which needs zero_stage 1, 2 or 3"),
    (dict(zero_stage=3, offload_params="cpu"), "offload_params: zf.offload keeps the optimizer state beside the "
     "offloaded masters; expected offload_optimizer 'cpu' or 'nvme'"),
    (dict(dp=2, pp=2, microbatches=2), "zero_stage: a pipeline over dp=2 ranks per stage shards each stage with "
     "ZeRO stage 1"),
]


@pytest.mark.parametrize("fields, message", REFUSED, ids=[m.split(":")[0] for _, m in REFUSED])
def test_impossible_plans_are_refused_before_anything_is_built(fields, message):
    plan = zf.config.Plan(**fields)
    with pytest.raises(ValueError, match=re.escape(message)):
        zf.config.check(plan)
    with pytest.raises(ValueError, match=re.escape(message)):
        zf.config.prepare(nn.Linear(2, 2), plan)
    with pytest.raises(TypeError, match="plan: expected a zf.config.Plan"):
        zf.config.check(dict(fields))


PLANS_2 = [  # two ranks: dp=2 sharded and offloaded, or a two-stage pipeline (plain or ZeRO-1)
    dict(dp=2, zero_stage=3, offload_optimizer="cpu", offload_params="cpu", remat=True, units="class:Block"),
    dict(dp=2, zero_stage=2, tile_lm_head=2),
    dict(pp=2, microbatches=4, units="class:Block"),
    dict(pp=2, microbatches=2, zero_stage=1, pipeline_schedule="gpipe", tile_lm_head=2, units="class:Block"),
]


def worker(rank, world, plans):
    out = []
    for fields in plans:
        plan = zf.config.Plan(optimizer=None, **fields)
        mesh = zf.Mesh(dp=plan.dp, pp=plan.pp)
        step, state, _ = build(plan, mesh)
        state, losses, norms = train(step, state, mesh.rank, plan.dp)
        params = zf.checkpoint.full_params(state, mesh) if plan.pp == 1 else dict(state.params)
        if plan.pp > 1 and plan.zero_stage:
            stage = zf.TrainState(state.params, state.opt_state, placement=state.placement.inner)  # its dp split
            params = zf.checkpoint.full_params(stage, mesh)
        out.append((losses, norms, untiled(params)))
    return out


@pytest.mark.multiprocess
def test_planned_steps_on_two_ranks_train_as_the_plain_step():
    results = zf.dist.spawn(worker, 2, 2, PLANS_2)
    ref = reference()
    for k, fields in enumerate(PLANS_2):
        for rank, got in enumerate(r[k] for r in results):
            names = got[2].keys()  # a pipeline stage holds its own params
            assert names, fields
            assert_same_training(got, ref, f"{fields}, rank {rank}", names=names)
        if fields.get("pp", 1) > 1:
            assert set().union(*(r[k][2].keys() for r in results)) == set(ref[2]), fields
