"""parallelize: a ``zf.config.Plan`` applied to a plain step, in the one order that works.

    plan = zf.config.Plan(dp=2, zero_stage=3, offload_optimizer="cpu", remat=True, units="class:Block")
    model = zf.config.prepare(model, plan)          # model transformations: before functionalize
    apply, params = zf.functionalize(model)
    step = zf.train_step(loss_fn, zf.config.optimizer(plan, total_steps), plan.precision, plan.accum)
    step = zf.parallelize(step, model, plan)             # shard -> offload -> pipeline
    state = step.init(params)

**The order, and why it is the only one.**
1. ``prepare(model, plan)``: the model transformations. ``zf.tile`` of the LM head replaces the
   head (and a tied embedding) by tile modules, which renames their params
   (``lm_head.tiles.3.weight``): it must come before ``zf.functionalize``, whose params dict names
   them. ``zf.tiling.tile_tokens`` runs each unit's ``mlp`` over ``tile_mlp`` token tiles and
   ``zf.remat`` replaces each unit's ``forward``; both keep the names and go here too, so that the
   model the step runs is the one the plan describes.
   ``parallelize`` applies the one model transformation that needs the mesh, ``zf.sequence_parallel``
   (``sp_size > 1``): it replaces the model's ``forward`` and keeps the names, so after functionalize.
2. ``zf.shard(step, mesh, stage, units)``: ZeRO over the dp ranks (the dp x sp ranks with
   ``sp_size > 1``: stage 0 at least, which all-reduces their grads). It takes only a plain step.
3. ``zf.offload(step, optimizer, params, path)``: takes a plain or sharded step (it replaces the
   update); params offload needs stage 3 (or a plain step on one rank).
4. ``zf.pipeline(step, stages, microbatches, schedule)``: outermost; it takes a plain step or a
   stage-1 sharded one, nothing else wraps it.

**Law.** The returned step trains as the plain step on the global batch (each transformation's
law, composed): a dp rank feeds it its ``1/dp`` slice of the global batch, every rank of a
pipeline or of a sequence group the same slice (with ``sp_size > 1`` the loss is
``zfunc.sequence.cross_entropy`` of the model's tokens, ``zf.sequence.layout_in_force(model)``).
The step brings its optimizer, precision and accumulation: those of the plan must be the step's
(``zf.config.optimizer(plan, total_steps)`` builds the plan's optimizer, clipping included);
precision and accumulation are checked.

**Cost.** Nothing of its own: each transformation's cost, as its docstring states.

``check(plan)`` refuses, before anything is built, the plans no order can run: those that break
a rule of ``zfunc.core.compose``'s rulebook (``Plan`` itself refuses those inconsistent as data;
``check`` also those zfunc does not run: optimizer offload at stage 0 over several ranks, params
offload without optimizer offload, a pipeline over replicas at stage 0, tensor parallelism), one
``ValueError`` naming the plan field, its value and what was expected.
"""
from __future__ import annotations

from torch import nn

from zfunc.config import plan as config_mod
from zfunc.core import compose
from zfunc.model import units as units_mod
from zfunc.dist import Mesh
from zfunc.offloading.step import offload
from zfunc.pipelining.step import pipeline
from zfunc.model.rematerialize import remat
from zfunc.sharding.step import shard
from zfunc.core.step import Step
from zfunc.model.tiling import TiledLinear, tile, tile_tokens
from zfunc.sequence.parallel import sequence_parallel
from zfunc.tensor.layout import layout_of
from zfunc.tensor.step import tensor_parallel_step
from zfunc.tensor.transform import tensor_parallel

__all__ = ["parallelize", "prepare", "check"]

LM_HEAD = "lm_head"  # the module ``tile_lm_head`` tiles (GPT's and Hugging Face's causal LMs' name)


def check(plan: config_mod.Plan) -> None:
    """Refuse a plan that breaks a rule of ``zfunc.core.compose``'s rulebook (either kind): a
    ``ValueError`` naming the plan field, its value and what would work."""
    if not isinstance(plan, config_mod.Plan):
        raise TypeError(f"plan: expected a zf.config.Plan, got {type(plan).__name__}")
    refusal = compose.check_plan(plan)
    if refusal is not None:
        raise ValueError(refusal)


def _selector(plan: config_mod.Plan) -> units_mod.Selector:
    return config_mod.selector(plan.units) if plan.units is not None else units_mod.auto()


def _remat_modules(model: nn.Module, plan: config_mod.Plan) -> list[str]:
    """The units worth recomputing: those that are more than one module's own params (the blocks,
    not ``by_class``'s leftover embeddings and norms), as ``zf.pipeline`` counts its units; all of
    them if every unit is a single module."""
    found = _selector(plan)(model)
    blocks = [u.name for u in found if not all(p.rpartition(".")[0] == u.name for p in u.params)]
    return blocks or [u.name for u in found]


def _units(model: nn.Module, plan: config_mod.Plan) -> list[nn.Module]:
    modules = dict(model.named_modules())
    return [modules[n] for n in _remat_modules(model, plan)]


def prepare(model: nn.Module, plan: config_mod.Plan, mesh: Mesh | None = None) -> nn.Module:
    """The plan's model transformations, applied in place before ``zf.functionalize``: the LM head
    (``model.lm_head``, and an embedding tied to it) tiled into ``plan.tile_lm_head`` tiles
    (``zf.tile``); with ``plan.tp > 1`` the layers sliced over ``mesh``'s tp group
    (``zf.tensor_parallel``, the plan found from the module graph, each head tile a vocab-parallel
    layer of its own; ``plan.sp``: sequence parallelism; ``mesh`` default ``zf.Mesh(dp=plan.dp,
    pp=plan.pp, sp=plan.sp_size, tp=plan.tp)``, give ``parallelize`` the same one); each unit's
    ``mlp`` over ``plan.tile_mlp`` token tiles, then each unit's ``forward`` rematerialized
    (``zf.remat``, ``plan.remat_offload``).
    Returns the model. A model prepared already is refused (its units would be wrapped twice)."""
    check(plan)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    modules = dict(model.named_modules())
    if plan.tile_lm_head:  # before the slicing: each tile is then sliced as a vocabulary of its own
        head = modules.get(LM_HEAD)
        if isinstance(head, TiledLinear):
            raise ValueError(f"model: {LM_HEAD} is tiled already; prepare the model once")
        if not isinstance(head, nn.Linear):
            raise ValueError(f"tile_lm_head: tiles the model's {LM_HEAD!r} nn.Linear, and the model has "
                             f"{'a ' + type(head).__name__ if head is not None else 'none'}; got tile_lm_head="
                             f"{plan.tile_lm_head}")
        tile(model, tiles=plan.tile_lm_head, modules=[LM_HEAD])
    if plan.tp > 1:
        tensor_parallel(model, _mesh(plan, mesh), sequence_parallel=plan.sp)
    if plan.tile_mlp:
        mlps = [m.mlp for m in _units(model, plan) if isinstance(getattr(m, "mlp", None), nn.Module)]
        if not mlps:
            raise ValueError(f"tile_mlp: tiles each unit's 'mlp' submodule, and the model's units have none; got "
                             f"tile_mlp={plan.tile_mlp}")
        for mlp in mlps:
            tile_tokens(mlp, tiles=plan.tile_mlp)
    if plan.remat:
        names = _remat_modules(model, plan)
        modules = dict(model.named_modules())
        if any("forward" in vars(modules[n]) for n in names):
            raise ValueError("model: its units' forward is replaced already (remat applied?); prepare the model once")
        for name in names:
            unit = modules[name]
            unit.forward = remat(unit.forward, offload=plan.remat_offload)
    return model


def _check_prepared(model: nn.Module, plan: config_mod.Plan) -> None:
    layout = layout_of(model)
    if (layout.tp if layout is not None else 1) != plan.tp:
        raise ValueError(f"plan.tp: {plan.tp}, but the model is sliced over tp={layout.tp if layout else 1}; build the "
                         "step from zf.config.prepare(model, plan, mesh) (before zf.functionalize)")
    modules = dict(model.named_modules())
    head = modules.get(LM_HEAD)
    tiles = len(head.tiles) if isinstance(head, TiledLinear) else 0
    if tiles != plan.tile_lm_head:
        raise ValueError(f"plan.tile_lm_head: {plan.tile_lm_head}, but the model's {LM_HEAD} has {tiles} tiles; build "
                         "the step from zf.config.prepare(model, plan) (before zf.functionalize)")
    if plan.remat and not all("forward" in vars(modules[n]) for n in _remat_modules(model, plan)):
        raise ValueError("plan.remat: True, but the model's units run their own forward; build the step from "
                         "zf.config.prepare(model, plan) (before zf.functionalize)")


def _check_step(step: Step, plan: config_mod.Plan) -> None:
    if type(step) is not Step:
        raise TypeError(f"step: expected the plain step of zf.train_step (parallelize applies the transformations), "
                        f"got {type(step).__name__}")
    if step.precision != plan.precision:
        raise ValueError(f"plan.precision: {plan.precision!r}, but the step computes in {step.precision!r}; build it "
                         f"with zf.train_step(..., precision=plan.precision)")
    if step.accum != plan.accum:
        raise ValueError(f"plan.accum: {plan.accum}, but the step accumulates {step.accum} microbatches; build it with "
                         "zf.train_step(..., accum=plan.accum)")


def _mesh(plan: config_mod.Plan, mesh: Mesh | None) -> Mesh:
    if mesh is None:
        return Mesh(dp=plan.dp, pp=plan.pp, sp=plan.sp_size, tp=plan.tp)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a zf.Mesh, got {type(mesh).__name__}")
    if (mesh.dp, mesh.pp, mesh.sp, mesh.tp) != (plan.dp, plan.pp, plan.sp_size, plan.tp):
        raise ValueError(f"mesh: dp={mesh.dp}, pp={mesh.pp}, sp={mesh.sp}, tp={mesh.tp}, but the plan says "
                         f"dp={plan.dp}, pp={plan.pp}, sp_size={plan.sp_size}, tp={plan.tp}")
    return mesh


def parallelize(step: Step, model: nn.Module, plan: config_mod.Plan, mesh: Mesh | None = None) -> Step:
    """``step`` transformed as ``plan`` says: ``zf.tensor_parallel.step`` (``plan.tp > 1``: the model
    sliced by ``prepare``), ``zf.shard`` (ZeRO ``plan.zero_stage`` over ``plan.dp`` ranks; stage 0 on
    one rank is the plain step), then ``zf.offload``, then ``zf.pipeline``.

    Args:
      step: the plain step of ``zf.train_step``, with the plan's precision and accum.
      model: the module the loss runs (through ``zf.functionalize``'s apply), prepared by
        ``prepare(model, plan)`` when the plan tiles or rematerializes (checked).
      plan: a ``zf.config.Plan``; ``plan.units`` (default ``zf.units.auto()``) are the units of
        ZeRO-3, params offload, remat and the pipeline.
      mesh: default ``zf.Mesh(dp=plan.dp, pp=plan.pp, sp=plan.sp_size, tp=plan.tp)`` (``zf.dist``
        initialised first when there are several ranks); one given must have those sizes (with tp,
        the one ``prepare`` had).
    Law, cost and the refusals: the module docstring.
    """
    check(plan)
    _check_step(step, plan)
    _check_prepared(model, plan)
    mesh, units = _mesh(plan, mesh), _selector(plan)
    if plan.tp > 1:
        step = tensor_parallel_step(step, model)
    if plan.sp_size > 1:
        sequence_parallel(model, mesh, plan.sp_kind)
    if plan.zero_stage > 0 or plan.dp > 1 or plan.sp_size > 1:
        step = shard(step, mesh, plan.zero_stage, units=units if plan.zero_stage == 3 else None,
                     quantize_weights=plan.quantized_weights, quantize_grads=plan.quantized_grads or False,
                     hpz=plan.hpz_partition if plan.zero_stage == 3 else None)
    if plan.offload_optimizer != "none":
        params = None if plan.offload_params == "none" else plan.offload_params
        step = offload(step, optimizer=plan.offload_optimizer, params=params, path=plan.nvme_path,
                       units=units if params is not None and plan.zero_stage == 0 else None)
    if plan.pp > 1:
        sharded = plan.zero_stage > 0 or plan.dp > 1
        step = pipeline(step, plan.pp, plan.microbatches, plan.pipeline_schedule, model=model, units=units,
                        mesh=None if sharded else mesh, virtual_stages=plan.virtual_stages)
    return step
