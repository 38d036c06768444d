"""Mixed precision: compute dtypes, casts of the fp32 master params, and the loss scale.

Policy: the ``TrainState`` holds fp32 master params. Each step casts them and the batch's floating
tensors to the compute dtype (bf16/fp16; a no-op alias for fp32), runs forward and backward in it,
accumulates the grads in fp32 and hands fp32 grads to the optimizer, which updates the masters.

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

from zfunc.core import tree

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
    DeepSpeed's rule (``fp16`` in its config): the scale never halves below ``min_scale``, and
    only at the ``hysteresis``-th overflow; ``tolerance`` is how many more overflows it takes
    (1: the next one halves), refilled to ``hysteresis`` when the scale grows, or by every finite
    step with ``consecutive_hysteresis``. The defaults (1.0, 1, False) are torch's GradScaler rule.
    """

    scale: float
    good_steps: int = 0
    growth_interval: int = 2000
    min_scale: float = 1.0
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    tolerance: int = 1

    @property
    def skips(self) -> int:
        """Non-finite steps skipped in a row, up to and including the last one."""
        return max(0, -self.good_steps)

    @property
    def dynamic(self) -> bool:
        """Whether the scale adapts (fp16) rather than staying fixed."""
        return self.growth_interval > 0


def deepspeed_loss_scale(initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                         min_loss_scale: float = 1.0, consecutive_hysteresis: bool = False) -> LossScale:
    """fp16's ``LossScale`` with DeepSpeed's ``fp16`` settings (and their defaults): starts at
    ``2**initial_scale_power``, doubles after ``loss_scale_window`` finite steps in a row, halves
    at the ``hysteresis``-th overflow, never below ``min_loss_scale``."""
    for name, value, low in (("initial_scale_power", initial_scale_power, 0),
                             ("loss_scale_window", loss_scale_window, 1), ("hysteresis", hysteresis, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if not (isinstance(min_loss_scale, (int, float)) and math.isfinite(min_loss_scale) and min_loss_scale > 0):
        raise ValueError(f"min_loss_scale: expected a finite number > 0, got {min_loss_scale!r}")
    return LossScale(2.0**initial_scale_power, 0, loss_scale_window, float(min_loss_scale), hysteresis,
                     bool(consecutive_hysteresis), hysteresis)


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
    """The scale after a step that was (not) ``finite``: a skip extends the run of skips and
    halves a dynamic scale (at the ``hysteresis``-th overflow, floor ``min_scale``); a finite step
    ends the run and doubles the scale after ``growth_interval`` of them (``LossScale``)."""
    if loss_scale is None:
        return None
    if not finite:
        ls = loss_scale._replace(good_steps=min(loss_scale.good_steps, 0) - 1)
        if not ls.dynamic:
            return ls
        if ls.tolerance > 1:  # DeepSpeed's hysteresis: this overflow is tolerated
            return ls._replace(tolerance=ls.tolerance - 1)
        return ls._replace(scale=max(ls.scale / 2.0, ls.min_scale))
    if not loss_scale.dynamic:  # a fixed scale: the same (immutable) one unless a run of skips ends
        return loss_scale if loss_scale.good_steps == 0 else loss_scale._replace(good_steps=0)
    ls = loss_scale._replace(tolerance=loss_scale.hysteresis) if loss_scale.consecutive_hysteresis else loss_scale
    good = max(ls.good_steps, 0) + 1
    if good >= ls.growth_interval:
        return ls._replace(scale=ls.scale * 2.0, good_steps=0, tolerance=ls.hysteresis)
    return ls._replace(good_steps=good)
