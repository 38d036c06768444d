"""A run's state on disk: the state it starts from (OUT/ckpt/latest under --resume, else a fresh one
made from the model's init) and the checkpoints it saves under OUT/ckpt.

Every checkpoint carries, beside the state, the model's config, the flags that shape training
(recipes/cli.py's ``training_flags``: --resume is refused under others), the lr schedule (--resume
continues it, recipes/lr_schedule.py) and the last eval's metrics. A checkpoint loads into any layout
and number of processes (``zf.checkpoint.load`` reshards it).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import torch

from recipes import lr_schedule
from recipes.layout import FlagError
from recipes.recipe import Built


def first_state(args: argparse.Namespace, step, built: Built, params: dict, plan,
                device: torch.device) -> tuple[Any, Path | None]:
    """The state to train from and the checkpoint it was loaded from: OUT/ckpt/latest loaded into this
    layout (--resume), or a fresh state (None) from meta-device ``params`` by ``built.materialize``
    (``fresh_state``). FlagError naming --resume when the checkpoint cannot be loaded."""
    import zfunc as zf

    if args.resume:
        latest = zf.checkpoint.latest(Path(args.out) / "ckpt")
        if latest is None:
            raise FlagError(f"--resume: no checkpoint under {Path(args.out) / 'ckpt'}")  # removed since check_args
        try:  # zf.checkpoint.load checks the model's params against the checkpoint's
            return zf.checkpoint.load(latest, step, params=params, device=device), latest
        except zf.checkpoint.CheckpointError as e:
            raise FlagError(f"--resume: {e}") from e
    # the init is written for the model untiled; --tile-lm-head (zf.tile) has split its head since
    materialize = zf.tiling.materializer(built.materialize(args.seed), built.module)
    state = fresh_state(step, params, materialize)
    if plan.precision == "fp16":  # the plan's (a DeepSpeed config's) loss-scale rule
        state = state.replace(loss_scale=zf.precision.deepspeed_loss_scale(
            plan.initial_scale_power, plan.loss_scale_window, plan.hysteresis, plan.min_loss_scale,
            plan.consecutive_hysteresis))
    return state, None


def fresh_state(step, params: dict, materialize: Callable):
    """``step.init`` of the meta-device ``params``, their values made by ``materialize``: the one
    place a run initializes its step. Every step makes one leaf at a time where it keeps it (a
    sharded or offloaded step only this rank's rows), never the whole model at once."""
    return step.init(params, materialize=materialize)


def saver(args: argparse.Namespace, config: dict, flags: dict, schedule: dict) -> Callable[..., Path]:
    """``save(state, n, metrics)``: every rank's part of ``state`` saved as OUT/ckpt/<n, 6 digits>
    (blocking), the last --keep-last kept, with ``config``, the training ``flags``, the lr
    ``schedule`` and ``metrics`` in its extra; returns its folder."""
    import zfunc as zf

    def save(state, n: int, metrics: dict) -> Path:
        return zf.checkpoint.save(state, Path(args.out) / "ckpt" / f"{n:06d}", keep_last=args.keep_last,
                                  extra={"config": config, "flags": flags, lr_schedule.KEY: schedule, **metrics})

    return save
