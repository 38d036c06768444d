"""compose: every refused order of transformations says so up front, naming both and the order
that works; every allowed order trains as the plain step.

Allowed orders and where their law is tested against the plain step:
- shard 0-3: test_shard.test_sharded_step_equals_plain_step (1, 2, 4 ranks)
- offload(step): test_offload.test_offloaded_step_equals_the_plain_step
- offload(shard 1-3): test_offload.test_offload_composes_with_shard_stages_1_2_and_3
- pipeline(step), pipeline(shard 1): test_pipeline.test_pipelined_step_equals_plain_step,
  test_pipeline.test_dp2_x_pp2_with_shard_stage_1_equals_plain_step; pipeline(shard 2, 3) and pipeline units
  under zf.remat: test_pipeline_compose
- remat / tile inside plain, shard 3, offload and pipeline steps: below (and test_remat, test_tile)
"""
import collections

import pytest
import torch
from torch import nn

import zfunc as zf
from tests.models import (Block, Tiny, assert_same_training, batches, local, mesh_shaped, token_loss, train_on,
                          untile)
from zfunc.core import compose
from zfunc.offloading.placement import in_ram
from zfunc.checkpoint import full_params


def plain_step(**kw):
    torch.manual_seed(0)
    apply, params = zf.functionalize(Tiny(**kw))
    return zf.train_step(token_loss(apply), zf.optim.adamw(1e-2)), params


def pipelined(step, mesh):
    return zf.pipeline(step, stages=mesh.pp, microbatches=2, model=nn.Sequential(Block(2), Block(2)),
                       units=zf.units.by_class(Block), mesh=None if compose.applied(step, "shard") else mesh)


# ------------------------------------------------------------------------------------ refused orders

def refused_cases(mesh):
    """(what, build, error type, pattern) of every refused order on a one-rank mesh."""
    step, _ = plain_step()
    shard1 = zf.shard(step, mesh, 1)
    return [
        ("shard(shard)", lambda: zf.shard(shard1, mesh, 1), ValueError,
         r"zf.shard\(zf.shard\(step\)\) is refused: zf.shard cannot wrap zf.shard: the step is sharded already; "
         r"the order that works: shard the plain step once"),
        ("shard(offload)", lambda: zf.shard(zf.offload(step), mesh, 1), ValueError,
         r"zf.shard\(zf.offload\(step\)\) is refused: zf.shard cannot wrap zf.offload: .*"
         r"the order that works: zf.offload\(zf.shard\(step, mesh, stage\), ...\)"),
        ("shard(pipeline)", lambda: zf.shard(pipelined(step, mesh), mesh, 1), ValueError,
         r"zf.shard\(zf.pipeline\(step\)\) is refused: zf.shard cannot wrap zf.pipeline: .* must be applied last; "
         r"the order that works: zf.pipeline\(zf.shard\(step, zf.Mesh\(dp=d, pp=p\), stage=1\), ...\)"),
        ("offload(offload)", lambda: zf.offload(zf.offload(step)), ValueError,
         r"zf.offload\(zf.offload\(step\)\) is refused: .* offloaded already; the order that works: offload the "
         r"plain or sharded step once"),
        ("offload(pipeline)", lambda: zf.offload(pipelined(step, mesh)), ValueError,
         r"zf.offload\(zf.pipeline\(step\)\) is refused: .* must be applied last"),
        ("offload(shard 0)", lambda: zf.offload(zf.shard(step, mesh, 0)), ValueError,
         r"zf.offload\(zf.shard\(step\)\) is refused: .*offloading a stage-0 \(replicated\) step is not supported "
         r"yet.*the order that works: zf.offload\(step, ...\) of a plain step on one rank, or .*stage 1, 2 or 3"),
        ("pipeline(pipeline)", lambda: pipelined(pipelined(step, mesh), mesh), ValueError,
         r"zf.pipeline\(zf.pipeline\(step\)\) is refused: .* pipelined already"),
        ("pipeline(shard 0)", lambda: pipelined(zf.shard(step, mesh, 0), mesh), ValueError,
         r"zf.pipeline\(zf.shard\(step\)\) is refused: .*pipeline composes with ZeRO stage 1, 2 or 3 over the dp "
         r"axis, got stage 0; the order that works: zf.pipeline\(zf.shard\(step, zf.Mesh\(dp=d, pp=p\), stage=1\)"),
        ("remat(step)", lambda: zf.remat(step), ValueError,
         r"fn: zf.remat\(step\) is refused: zf.remat wraps a model's function or layer, not a step"),
        ("tile(step)", lambda: zf.tile(zf.shard(step, mesh, 2), tiles=2), ValueError,
         r"module_or_fn: zf.tile\(zf.shard\(step\)\) is refused: zf.tile wraps a model's function or layer"),
        ("shard(function)", lambda: zf.shard(zf.remat(lambda x: x), mesh, 1), TypeError,
         r"step: zf.shard transforms a Step from zf.train_step .* got function"),
    ]


def test_every_refused_order_names_both_transformations_and_the_order_that_works():
    for what, build, error, pattern in refused_cases(zf.Mesh()):
        with pytest.raises(error, match=pattern):
            build()
        print(what, "refused")


def test_the_table_has_a_verdict_for_every_pair():
    for outer in compose.STEP_TRANSFORMS:
        for inner in ("train_step", *compose.STEP_TRANSFORMS):
            assert (outer, inner) in compose.TABLE, (outer, inner)


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_pipeline_of_an_offloaded_sharded_step_is_built_with_or_without_its_params_offloaded(pp_rank):
    """pipeline(offload(shard(step, Mesh(dp=1, pp=2), stage))) is built on every rank (each stage's
    slices offloaded), with the params offloaded too at stage 3."""
    step, _ = plain_step()
    mesh = mesh_shaped(dp=1, pp=2, pp_rank=pp_rank)
    model, units = nn.Sequential(Block(2), Block(2)), zf.units.by_class(Block)
    for offloaded in (zf.offload(zf.shard(step, mesh, stage=1)),
                      zf.offload(zf.shard(step, mesh, stage=3, units=units), params="cpu")):
        built = zf.pipeline(offloaded, stages=2, microbatches=2, model=model, units=units)
        assert built.layers == ("train_step", "shard", "offload", "pipeline")


def test_layers_record_how_a_step_was_built():
    step, _ = plain_step()
    mesh = zf.Mesh()
    assert compose.layers(step) == ("train_step",)
    assert compose.layers(zf.offload(zf.shard(step, mesh, 3))) == ("train_step", "shard", "offload")
    assert compose.layers(zf.offload(step)) == ("train_step", "offload")
    assert compose.layers(pipelined(zf.shard(step, mesh, 1), mesh)) == ("train_step", "shard", "pipeline")
    assert compose.spelled(zf.offload(zf.shard(step, mesh, 3))) == "zf.offload(zf.shard(step))"


# ------------------------------------------------------------------------------------ remat and tile inside steps

def model_step(remat_blocks: bool, tile_head: bool, inside=False):
    """The untied Tiny with its blocks (``inside``: their fc) rematerialized and its head tiled (or
    not), and its step."""
    torch.manual_seed(0)
    model = Tiny(tie=False)
    if tile_head:
        zf.tile(model, tiles=2, modules=["head"])
    if remat_blocks:
        for b in model.blocks:
            m = b.fc if inside else b
            m.forward = zf.remat(m.forward)
    apply, params = zf.functionalize(model)
    tx = zf.optim.chain(zf.optim.clip_by_global_norm(0.1), zf.optim.adamw(1e-2, weight_decay=0.1))
    return model, zf.train_step(token_loss(apply), tx), params


def reference(world, n=3):
    _, step, params = model_step(False, False)
    state, losses, norms = train_on(step, step.init(params), batches(world, n))
    return losses, norms, state.params


def inside_worker(rank, world):
    """remat'ed blocks and a tiled head under stage 3, offload(stage 2) and a 2-stage pipeline."""
    out = {}
    mesh = zf.Mesh(dp=world)
    for what in ("shard 3", "offload(shard 2)"):
        model, step, params = model_step(True, True)
        step = zf.shard(step, mesh, 3 if what == "shard 3" else 2,
                        units=zf.units.by_class(Block) if what == "shard 3" else None)
        step = zf.offload(step, "cpu") if what.startswith("offload") else step
        data = [local(b, rank, world) for b in batches(world, 3)]
        state, losses, norms = train_on(step, step.init(params), data)
        out[what] = (losses, norms, untile(full_params(in_ram(state), mesh)))
    return out


def pipeline_worker(rank, world):
    model, step, params = model_step(True, True, inside=True)  # a remat'ed unit is refused (above)
    mesh = zf.Mesh(pp=world)
    step = zf.pipeline(step, stages=world, microbatches=2, model=model, units=zf.units.by_class(Block), mesh=mesh)
    state, losses, norms = train_on(step, step.init(params), batches(1, 3) * 1)
    return losses, norms, untile(zf.checkpoint.full_params(state))


def test_remat_and_tile_inside_plain_and_offloaded_steps_train_as_the_plain_step():
    ref1 = reference(1)
    model, step, params = model_step(True, True)
    state, losses, norms = train_on(step, step.init(params), batches(1, 3))
    assert_same_training((losses, norms, untile(state.params)), ref1, "plain, remat + tile")
    model, step, params = model_step(True, True)
    step = zf.offload(step, "cpu")
    state, losses, norms = train_on(step, step.init(params), batches(1, 3))
    assert_same_training((losses, norms, untile(in_ram(state).params)), ref1, "offload, remat + tile")


@pytest.mark.multiprocess
def test_remat_and_tile_inside_sharded_and_offloaded_sharded_steps_train_as_the_plain_step():
    ref2 = reference(2)
    for rank, got in enumerate(zf.dist.spawn(inside_worker, 2, 2)):
        for what, result in got.items():
            assert_same_training(result, ref2, f"{what}, remat + tile, rank {rank}")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_remat_and_tile_inside_a_pipelined_step_train_as_the_plain_step():
    ref1 = reference(1)
    for rank, got in enumerate(zf.dist.spawn(pipeline_worker, 2, 2)):
        assert_same_training(got, ref1, f"pipeline, remat + tile, rank {rank}")


# ------------------------------------------------------------------------------------ one step object, many states

def two_states(build, rank=0, world=1, n=3):
    """Two independent trainings (different initial params, different batches) through one step
    object alternated step by step, and through two step objects: ``(alternated, separate)``,
    each a pair of ``(losses, params)``."""
    def start(step, seed):
        _, params = plain_step()
        params = {k: v + 0.01 * seed for k, v in params.items()}  # another model's starting point
        return step.init(params)

    data = [[local(b, rank, world) for b in batches(world, n)],
            [local(b, rank, world) for b in batches(world, 2 * n)][n:]]

    def result(step, state, losses):
        return losses, full_params(in_ram(state), step.mesh) if compose.applied(step, "shard") else state.params

    one = build()
    states, losses = [start(one, 0), start(one, 1)], [[], []]
    for k in range(n):
        for j in (0, 1):
            states[j], m = one(states[j], data[j][k])
            losses[j].append(m["loss"].item())
    alternated = [result(one, s, l) for s, l in zip(states, losses)]
    separate = []
    for j in (0, 1):
        own = build()
        state, ls = start(own, j), []
        for k in range(n):
            state, m = own(state, data[j][k])
            ls.append(m["loss"].item())
        separate.append(result(own, state, ls))
    return alternated, separate


def assert_identical(alternated, separate, what):
    for (la, pa), (ls, ps) in zip(alternated, separate):
        assert la == ls, what
        for name in ps:
            assert torch.equal(pa[name], ps[name]), f"{what}: {name}"


def offloaded(params_on, clip):
    step, _ = plain_step()
    if clip:
        step = zf.train_step(step.loss_fn, zf.optim.chain(zf.optim.clip_by_global_norm(0.1), zf.optim.adamw(1e-2)))
    return zf.offload(step, "cpu", params_on, units=zf.units.by_class(Block) if params_on else None)


def test_one_step_object_drives_two_states_alternately_as_two_step_objects_do():
    assert_identical(*two_states(lambda: plain_step()[0]), "plain")
    for params_on, clip in ((None, True), ("cpu", False)):  # held update; overlapped, params fetched
        assert_identical(*two_states(lambda: offloaded(params_on, clip)), f"offload, params {params_on}, clip {clip}")


def alternate_worker(rank, world):
    mesh = zf.Mesh(dp=world)
    return two_states(lambda: zf.shard(plain_step()[0], mesh, 3, units=zf.units.by_class(Block)), rank, world)


@pytest.mark.multiprocess
def test_one_stage_3_step_object_drives_two_states_alternately_on_2_ranks():
    for rank, (alternated, separate) in enumerate(zf.dist.spawn(alternate_worker, 2, 2)):
        assert_identical(alternated, separate, f"stage 3, rank {rank}")


# ------------------------------------------------------------------------------------ roles swapped without subclassing

class Counted:
    """Test-only role wrapping ``inner`` (a role, or the sink a grad sink opens): each method call is
    counted in ``counts[f"{name}.{method}"]`` and passed on; a grad sink's ``open`` returns its sink
    wrapped too, so the reducer's deliveries are counted."""

    def __init__(self, inner, counts, name):
        self.inner, self.counts, self.name = inner, counts, name

    def __getattr__(self, attr):
        value = getattr(self.inner, attr)
        if not callable(value):
            return value

        def counted(*args, **kwargs):
            self.counts[f"{self.name}.{attr}"] += 1
            out = value(*args, **kwargs)
            return Counted(out, self.counts, "sink") if attr == "open" else out

        return counted


@pytest.mark.parametrize("what", ["shard 0", "shard 2", "offload"])
def test_a_role_is_swapped_without_subclassing_and_the_step_trains_the_same(what):
    """A step's roles come from its ``roles(context, state)`` provider: replacing it on one step
    object with roles that wrap the default params source and grad sink (and count their calls)
    leaves every bit of the training as it was; no class is subclassed. Stage 0 too opens the grad
    sink its roles give (its reducer delivers the all-reduced buckets there)."""
    def build():
        step, params = plain_step()
        if what.startswith("shard"):
            return zf.shard(step, zf.Mesh.alone(), int(what[-1])), params
        return zf.offload(step, "cpu", "cpu", units=zf.units.by_class(Block)), params

    counts = collections.Counter()
    step, params = build()
    default = step.roles

    def counting(run, state):
        roles = default(run, state)
        return roles.replace(params=Counted(roles.params, counts, "params"),
                             grads=Counted(roles.grads, counts, "grads"))

    step.roles = counting
    state, losses, norms = train_on(step, step.init(params), batches(1, 3))
    ref_step, ref_params = build()
    ref_state, ref_losses, ref_norms = train_on(ref_step, ref_step.init(ref_params), batches(1, 3))
    assert (losses, norms) == (ref_losses, ref_norms)
    got, ref = in_ram(state).params, in_ram(ref_state).params
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert counts["params.pieces"] == counts["grads.open"] == counts["sink.result"] == 3
    assert counts["params.finish"] == counts["grads.finish"] == 3 and counts["sink.deliver"] >= 3


def test_stage_0_delivers_its_grads_to_a_swapped_grad_sink():
    """The grad sink a stage-0 step's roles give receives its reduced grads: one that keeps them
    and hands back zeros leaves the params where weight decay alone puts them."""
    class ZeroGrads:
        def __init__(self, sink):
            self.sink, self.delivered = sink, []

        def __getattr__(self, attr):
            return getattr(self.sink, attr)

        def deliver(self, group, slices):
            self.delivered.append(group.name)
            self.sink.deliver(group, slices)

        def result(self):
            return [torch.zeros_like(g) for g in self.sink.result()]

    class Opens:
        def __init__(self, role):
            self.role, self.sinks = role, []

        def __getattr__(self, attr):
            return getattr(self.role, attr)

        def open(self, pieces):
            self.sinks.append(ZeroGrads(self.role.open(pieces)))
            return self.sinks[-1]

    step, params = plain_step()
    step = zf.shard(zf.train_step(step.loss_fn, zf.optim.sgd(0.1)), zf.Mesh.alone(), 0)
    default, opened = step.roles, []

    def zero_grads(context, state):
        roles = default(context, state)
        opened.append(Opens(roles.grads))
        return roles.replace(grads=opened[-1])

    step.roles = zero_grads
    state = step.init(params)
    before = {k: v.clone() for k, v in state.params.items()}
    state, _ = step(state, batches(1, 1)[0])
    assert len(opened) == 1 and len(opened[0].sinks) == 1 and opened[0].sinks[0].delivered
    assert all(torch.equal(state.params[k], before[k]) for k in before)  # sgd without decay: zero grads move nothing


@pytest.mark.parametrize("what", ["shard 0", "shard 3", "offload"])
def test_roles_read_a_frozen_context_and_a_call_hands_what_it_learned_to_step_learn(what):
    """The roles provider gets the call's ``RunContext`` (frozen: the placement, the grad divisor,
    the sum over the ranks, the finite check), not the run; nothing is written onto the step
    during a call; what the call learned reaches the step once, through ``step.learn``."""
    import dataclasses

    from zfunc.core.roles import RunContext

    step, params = plain_step()
    if what.startswith("shard"):
        stage = int(what[-1])
        step = zf.shard(step, zf.Mesh.alone(), stage, units=zf.units.by_class(Block) if stage == 3 else None)
    else:
        step = zf.offload(step, "cpu", "cpu", units=zf.units.by_class(Block))
    state = step.init(params)
    default, learn, contexts, learned = step.roles, step.learn, [], []

    def roles(context, state):
        contexts.append(context)
        return default(context, state)

    def fields():  # each attribute of the step (and of the sharded step it wraps), and a copy of lists
        objs = {"step": step, "sharded": step.sharded}
        return {(o, k): (v, list(v) if isinstance(v, list) else None)
                for o, obj in objs.items() for k, v in vars(obj).items() if k != "learn"}

    def learning(what_it_learned):
        now = fields()
        assert now.keys() == before.keys() and all(now[k][0] is before[k][0] and now[k][1] == before[k][1]
                                                   for k in now), "a call wrote onto the step"
        learned.append(what_it_learned)
        learn(what_it_learned)

    step.roles, step.learn = roles, learning
    for batch in batches(1, 2):
        before = fields()
        state, _ = step(state, batch)
    assert len(learned) == len(contexts) == 2
    context = contexts[0]
    assert isinstance(context, RunContext) and context.spec == state.placement and context.grad_divisor == 1.0
    assert (context.sum_across is None) == (what == "shard 0")  # stage 0's loss and grads are totals already
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.grad_divisor = 2.0
    first = learned[0]
    assert {"peak_gathered_bytes", "peak_whole_grad_bytes", "groups"} <= first.keys()
    assert ("grad_order" in first) == (what == "shard 0") and ("unit_order" in first) == (what != "shard 0")
    assert ("fetch_order" in first) == (what == "offload")
    assert step.sharded._flat_groups is [got["groups"] for got in learned if "groups" in got][-1]  # kept as learned


def test_the_schedules_are_roles_with_one_interface_and_1f1b_on_one_stage_is_accumulation():
    from zfunc.pipelining.stage import PipelineSchedule
    from zfunc.core.roles import Accumulation

    batch = torch.arange(12.0).reshape(6, 2)
    for m in (1, 3):
        acc, gpipe, one_f_one_b = Accumulation(m), PipelineSchedule("gpipe", m), PipelineSchedule("1f1b", m)
        assert acc.ops() == one_f_one_b.ops(1, 0) and sorted(gpipe.ops(1, 0)) == sorted(acc.ops())
        assert all(torch.equal(a, b) for a, b in zip(acc.split(batch), one_f_one_b.split(batch)))
    assert PipelineSchedule("1f1b", 2).ops(2, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(ValueError, match="microbatches=4 must divide"):
        PipelineSchedule("1f1b", 4).split(batch)


def test_one_microbatch_loop_runs_each_steps_schedule_by_its_ops(monkeypatch):
    """Plain, sharded and offloaded steps run their microbatches in the order their schedule's
    ``ops`` gives (one loop, ``zfunc.core.microbatches``): counted once per call; and the plain
    step given GPipe's order on one stage (every forward, then every backward) trains bit for bit
    as with accumulation's."""
    from zfunc.core.roles import Accumulation
    from zfunc.pipelining.stage import PipelineSchedule

    calls = collections.Counter()
    ops = Accumulation.ops

    def counted(self, stages=1, stage=0):
        calls[self.count] += 1
        return ops(self, stages, stage)

    monkeypatch.setattr(Accumulation, "ops", counted)

    def build(what):
        torch.manual_seed(0)
        apply, params = zf.functionalize(Tiny())
        step = zf.train_step(token_loss(apply), zf.optim.adamw(1e-2), accum=2)
        if what == "shard 1":
            step = zf.shard(step, zf.Mesh.alone(), 1)
        elif what == "offload":
            step = zf.offload(step, "cpu")
        return step, params

    for what in ("plain", "shard 1", "offload"):
        step, params = build(what)
        calls.clear()
        train_on(step, step.init(params), batches(1, 2))
        assert calls == {2: 2}, (what, calls)
    step, params = build("plain")
    ref_state, ref_losses, _ = train_on(step, step.init(params), batches(1, 3))
    step, params = build("plain")
    step.schedule = PipelineSchedule("gpipe", 2)
    state, losses, _ = train_on(step, step.init(params), batches(1, 3))
    assert losses == ref_losses and all(torch.equal(state.params[k], ref_state.params[k]) for k in params)


def test_replacing_an_unknown_role_names_it_and_the_roles_there_are():
    from zfunc.core.roles import Accumulation, Roles

    roles = Roles(None, None, None, Accumulation(1))
    with pytest.raises(TypeError, match="unknown role 'grad'; expected params, grads, update or schedule"):
        roles.replace(grad=object())
