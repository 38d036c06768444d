"""What trains: the recipe's model built on the meta device and prepared for the plan, and the zfunc
step laid out by it.

The model is built on the meta device (no memory: each leaf is made once, later, where the layout
keeps it: recipes/checkpoints.py), prepared by ``zf.config.prepare`` (the LM head tiled, the
units rematerialized) and functionalized; the step is ``zf.train_step`` of the task's loss with the
recipe's optimizer, laid out by ``zf.parallelize`` (shard, offload, pipeline, as the plan says).
"""
from __future__ import annotations

import argparse
import copy
from typing import Callable

import torch
import torch.nn as nn

from recipes import layout, lr_schedule
from recipes.layout import FlagError
from recipes.recipe import Built, Recipe
from recipes import task as task_mod
from recipes.task import Task


def build_model(recipe: Recipe, args: argparse.Namespace, vocab_size: int) -> Built:
    """``recipe.build`` on the meta device for ``vocab_size`` ids; FlagError for a model the flags
    cannot make, or whose context is shorter than --block-size."""
    with torch.device("meta"):
        try:
            built = recipe.build(args, vocab_size)
        except ValueError as e:
            raise FlagError(str(e)) from None
    if args.block_size > built.context:
        raise FlagError(f"--block-size: {args.block_size} exceeds the model's context of {built.context} "
                        "(expected at most that)")
    return built


def make_mesh(plan, planned: bool = False):
    """The mesh the plan lays the processes on (``zf.Mesh``: dp x pp x sp x tp); ``planned``: rank 0's
    place in it without a process group (``zf.Mesh.planned``: a dry run in one process slices the
    model on the meta device as rank 0 would, and runs nothing)."""
    import zfunc as zf

    if planned:
        return zf.Mesh.planned(dp=plan.dp, pp=plan.pp, sp=plan.sp_size, tp=plan.tp, rank=0)
    return zf.Mesh(dp=plan.dp, pp=plan.pp, sp=plan.sp_size, tp=plan.tp)


def unsliced(model: nn.Module, plan) -> nn.Module | None:
    """With --tp, a copy of ``model`` made before ``zf.tensor_parallel`` slices it (on the meta device:
    nothing allocated), its LM head tiled as the plan tiles it (--tile-lm-head: the whole params are
    the tiles'): what rank 0 runs on the whole params (eval, the sample); None without --tp."""
    if plan.tp == 1:
        return None
    import zfunc as zf

    whole = copy.deepcopy(model)
    return zf.tile(whole, tiles=plan.tile_lm_head, modules=["lm_head"]) if plan.tile_lm_head else whole


COMPILE_REFUSES = (("pp", lambda p: p.pp > 1), ("tp", lambda p: p.tp > 1), ("sp", lambda p: p.sp_size > 1),
                   ("remat", lambda p: p.remat), ("zero", lambda p: p.zero_stage == 3),
                   ("offload-params", lambda p: p.offload_params != "none"),
                   ("tile-lm-head", lambda p: bool(p.tile_lm_head)), ("tile-mlp", lambda p: bool(p.tile_mlp)))


def compile_units(model: nn.Module, plan) -> int:
    """Each module of the plan's unit classes in ``model`` compiled in place (``nn.Module.compile``: its params,
    buffers and forward's meaning unchanged; one graph serves every identical block), before
    ``functional``. Returns how many; FlagError naming the flags of a layout that moves, wraps or
    slices the units (those run eagerly, untested compiled)."""
    refused = [f"--{flag}" for flag, applies in COMPILE_REFUSES if applies(plan)]
    if refused:
        raise FlagError(f"--compile: not with {', '.join(refused)} (expected the plain layout, --zero 0-2 or "
                        f"--offload-optimizer)")
    kind, _, classes = (plan.units or "").partition(":")
    if kind != "class":
        raise FlagError(f"--compile: expected units named by class ('class:<Name>'), got {plan.units!r}")
    blocks = [m for m in model.modules() if type(m).__name__ in classes.split(",")]
    for block in blocks:
        block.compile()
    return len(blocks)


def functional(model: nn.Module, plan, mesh=None) -> tuple[Callable, dict]:
    """``zf.functionalize`` of ``model`` once the plan's model transformations are applied to it in
    place (its layers sliced over ``mesh``'s tp ranks, the head tiled, the units rematerialized: they
    rename or reshape params, so before functionalize); FlagError naming the flags when the model
    cannot take them."""
    import zfunc as zf

    try:
        zf.config.prepare(model, plan, mesh)
    except ValueError as e:
        raise FlagError(layout.name_flags(str(e))) from None
    return zf.functionalize(model)


def loss_fn(task: Task, apply: Callable, model: nn.Module) -> Callable:
    """``loss(params, batch)``: the task's loss of the model's output on the batch's inputs; a
    sequence-parallel model's (--sp) outputs hold its rank's tokens, whose share of the whole
    sequences' loss is the task's ``sequence_loss`` (default: ``zf.sequence.cross_entropy`` of the
    labels, ``batch[1]``)."""
    import zfunc as zf

    def loss(params: dict, batch: tuple) -> torch.Tensor:
        out = apply(params, *batch[:task.inputs])
        layout = zf.sequence.layout_in_force(model)
        if layout is None:
            return task.loss(out, batch)
        if task.sequence_loss is not None:
            return task.sequence_loss(out, batch, layout)
        return zf.sequence.cross_entropy(task_mod.logits_of(out), batch[1], layout)

    return loss


ZERO_ONE_VAR_UPDATE_SCALER = 64  # zero_one_adam's var_update_scaler on the recipes' b2 = 0.95 (make_optimizer)


def make_optimizer(args: argparse.Namespace, plan):
    """AdamW(0.9, 0.95) on a warmup-cosine, decaying matrices only (--optimizer: a 1-bit one on the same
    betas, schedule and decay, after --freeze-step full-precision steps; zero_one_adam's variance refreshed
    every update for its first ``ZERO_ONE_VAR_UPDATE_SCALER``); a --deepspeed config's optimizer
    and scheduler when it names them (a config without a scheduler keeps its lr constant, as in
    DeepSpeed). Clipping at the plan's gradient_clipping (--grad-clip, or the config's; 0: none)."""
    import zfunc as zf

    if plan.optimizer is not None:
        return zf.config.optimizer(plan, lr_schedule.spec(args, plan)["total_steps"], mask=zf.optim.decay_mask)
    lr = lr_schedule.function(lr_schedule.spec(args, plan))  # laid over lr_schedule.total(args)
    common = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=args.weight_decay, mask=zf.optim.decay_mask)
    kind, freeze = getattr(args, "optimizer", "adamw"), getattr(args, "freeze_step", 0)
    if kind == "onebit_adam":
        opt = zf.optim.onebit_adam(lr, freeze_step=freeze, **common)
    elif kind == "zero_one_adam":
        # DeepSpeed's var_update_scaler of 16 suits b2 = 0.999; at b2 = 0.95 the variance has a memory of ~20
        # updates, and one refreshed only every 2-4 updates from update 17 on lags the falling grads
        opt = zf.optim.zero_one_adam(lr, var_freeze_step=freeze, var_update_scaler=ZERO_ONE_VAR_UPDATE_SCALER,
                                     **common)
    elif kind == "onebit_lamb":
        opt = zf.optim.onebit_lamb(lr, freeze_step=freeze, **common)
    else:
        opt = zf.optim.adamw(lr, **common)
    if plan.gradient_clipping > 0:
        return zf.optim.chain(zf.optim.clip_by_global_norm(plan.gradient_clipping), opt)
    return opt


def build_step(loss: Callable, model: nn.Module, args: argparse.Namespace, plan, mesh=None):
    """The step that trains ``model`` on ``loss`` and the mesh it runs on (``mesh``, the one the model
    was sliced over with --tp; default ``make_mesh``): ``zf.train_step`` with ``make_optimizer``'s
    optimizer, the plan's precision and accumulation and --seed, laid out by ``zf.parallelize``
    (tensor parallel -> shard -> offload -> pipeline)."""
    import zfunc as zf

    step = zf.train_step(loss, make_optimizer(args, plan), precision=plan.precision, accum=plan.accum, seed=args.seed)
    mesh = make_mesh(plan) if mesh is None else mesh
    return zf.parallelize(step, model, plan, mesh), mesh


def on_whole_params(task: Task, apply: Callable, loss: Callable, model: nn.Module, whole: nn.Module | None
                    ) -> tuple[Callable, Callable, nn.Module]:
    """``(apply, loss, model)`` that rank 0 runs on the whole params (eval, the sample): the trained
    model's, or with --tp those of its unsliced copy (``unsliced``), whose params are the whole ones."""
    import zfunc as zf

    if whole is None:
        return apply, loss, model
    whole_apply = zf.functionalize(whole)[0]
    return whole_apply, loss_fn(task, whole_apply, whole), whole
