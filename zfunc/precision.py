"""Mixed precision: compute dtypes, casts of the fp32 master params, and the loss scale.

Policy: the ``TrainState`` holds fp32 master params. Each step casts them and the batch's floating
tensors to the compute dtype (bf16/fp16; a no-op alias for fp32), runs forward and backward in it, accumulates the grads in fp32
and hands fp32 grads to the optimizer, which updates the masters.

fp16 needs a loss scale: the loss is multiplied by ``scale`` before backward so small grads do not
flush to zero, and the grads are divided by it after. ``LossScale`` is plain data in the state:
on a non-finite grad the update is skipped and the scale halves; after ``growth_interval`` finite
steps in a row it doubles (the rule of ``torch.amp.GradScaler`` and DeepSpeed). fp32 and bf16
carry a fixed ``LossScale`` of 1.0 (nothing is scaled): in every precision it also counts the
non-finite steps skipped in a row, which the step stops at (``train_step(max_skips=)``).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from zfunc import tree

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Non-finite steps a run may skip in a row before the step raises. fp16's dynamic scale may
# legitimately overflow from its initial 2**16 all the way down to 1 (16 halvings, each a skipped
# step) before it fits the grads, so it gets those on top.
MAX_SKIPS = 10
FP16_MAX_SKIPS = MAX_SKIPS + 16


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype forward/backward run in for ``precision`` ("fp32", "bf16" or "fp16")."""
    try:
        return COMPUTE_DTYPES[precision]
    except (KeyError, TypeError):
        raise ValueError(f"precision: expected one of {sorted(COMPUTE_DTYPES)}, got {precision!r}") from None


def default_max_skips(precision: str) -> int:
    """How many non-finite steps in a row ``precision`` may skip by default (see ``MAX_SKIPS``)."""
    return FP16_MAX_SKIPS if compute_dtype(precision) == torch.float16 else MAX_SKIPS


def cast_floating(params: Any, dtype: torch.dtype) -> Any:
    """``params`` with floating tensors cast to ``dtype`` (the same tensor where already so)."""
    return tree.map(lambda p: p.to(dtype) if isinstance(p, torch.Tensor) and p.is_floating_point() else p, params)


class LossScale(NamedTuple):
    """The loss scale, and the current run of finite or skipped steps.

    ``scale``: what the loss is multiplied by before backward. ``good_steps``: the run the last
    step continued -- ``k > 0``: ``k`` finite steps in a row since the scale last changed;
    ``-k < 0``: ``k`` non-finite steps skipped in a row (``skips``). ``growth_interval``: finite
    steps in a row after which the scale doubles; 0 for a fixed scale (fp32/bf16: 1.0).
    """

    scale: float
    good_steps: int = 0
    growth_interval: int = 2000

    @property
    def skips(self) -> int:
        """Non-finite steps skipped in a row, up to and including the last one."""
        return max(0, -self.good_steps)

    @property
    def dynamic(self) -> bool:
        """Whether the scale adapts (fp16) rather than staying fixed."""
        return self.growth_interval > 0


def init_loss_scale(precision: str, init_scale: float = 2.0**16, growth_interval: int = 2000) -> LossScale:
    """fp16's dynamic ``LossScale``; for fp32/bf16 a fixed scale of 1.0 (only the skip count)."""
    if compute_dtype(precision) != torch.float16:
        return LossScale(1.0, 0, 0)
    if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"init_scale: expected a finite float > 0, got {init_scale!r}")
    if not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"growth_interval: expected an int >= 1, got {growth_interval!r}")
    return LossScale(float(init_scale), 0, growth_interval)


def scale_of(loss_scale: LossScale | None) -> float | None:
    """The factor to multiply the loss by before backward; ``None`` when there is nothing to scale."""
    return None if loss_scale is None or loss_scale.scale == 1.0 else loss_scale.scale


def next_loss_scale(loss_scale: LossScale | None, finite: bool) -> LossScale | None:
    """The scale after a step that was (not) ``finite``: a skip halves a dynamic scale (floor 1)
    and extends the run of skips; a finite step ends it and doubles the scale on growth."""
    if loss_scale is None:
        return None
    if not finite:
        scale = max(loss_scale.scale / 2.0, 1.0) if loss_scale.dynamic else loss_scale.scale
        return loss_scale._replace(scale=scale, good_steps=min(loss_scale.good_steps, 0) - 1)
    if not loss_scale.dynamic:
        return loss_scale._replace(good_steps=0)
    good = max(loss_scale.good_steps, 0) + 1
    if good >= loss_scale.growth_interval:
        return loss_scale._replace(scale=loss_scale.scale * 2.0, good_steps=0)
    return loss_scale._replace(good_steps=good)
