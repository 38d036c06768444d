"""Mixed precision: compute dtypes, casts of the fp32 master params, and the fp16 dynamic loss scale.

Policy: the ``TrainState`` holds fp32 master params. Each step casts them and the batch's floating
tensors to the compute dtype (bf16/fp16; a no-op alias for fp32), runs forward and backward in it, accumulates the grads in fp32
and hands fp32 grads to the optimizer, which updates the masters.

fp16 needs a loss scale: the loss is multiplied by ``scale`` before backward so small grads do not
flush to zero, and the grads are divided by it after. ``LossScale`` is plain data in the state:
on a non-finite grad the update is skipped and the scale halves; after ``growth_interval`` finite
steps in a row it doubles (the rule of ``torch.amp.GradScaler`` and DeepSpeed).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zfunc import tree

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype forward/backward run in for ``precision`` ("fp32", "bf16" or "fp16")."""
    try:
        return COMPUTE_DTYPES[precision]
    except (KeyError, TypeError):
        raise ValueError(f"precision: expected one of {sorted(COMPUTE_DTYPES)}, got {precision!r}") from None


def cast_floating(params: Any, dtype: torch.dtype) -> Any:
    """``params`` with floating tensors cast to ``dtype`` (the same tensor where already so)."""
    return tree.map(lambda p: p.to(dtype) if isinstance(p, torch.Tensor) and p.is_floating_point() else p, params)


class LossScale(NamedTuple):
    """fp16 dynamic loss scale: the current ``scale`` and the finite steps in a row since it changed."""

    scale: float
    good_steps: int = 0
    growth_interval: int = 2000


def init_loss_scale(precision: str, init_scale: float = 2.0**16, growth_interval: int = 2000) -> LossScale | None:
    """A ``LossScale`` for fp16, ``None`` for precisions that need none."""
    if compute_dtype(precision) != torch.float16:
        return None
    if not init_scale > 0 or growth_interval < 1:
        raise ValueError(f"init_scale, growth_interval: expected > 0 and >= 1, got {init_scale}, {growth_interval}")
    return LossScale(float(init_scale), 0, growth_interval)


def next_loss_scale(loss_scale: LossScale | None, finite: bool) -> LossScale | None:
    """The scale after a step whose grads were (not) ``finite``: halve on overflow, double on growth."""
    if loss_scale is None:
        return None
    if not finite:
        return loss_scale._replace(scale=max(loss_scale.scale / 2.0, 1.0), good_steps=0)
    if loss_scale.good_steps + 1 >= loss_scale.growth_interval:
        return loss_scale._replace(scale=loss_scale.scale * 2.0, good_steps=0)
    return loss_scale._replace(good_steps=loss_scale.good_steps + 1)
