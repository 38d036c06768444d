"""DeepSpeed's learning-rate schedulers as zf.optim schedules: ``warmup_lr``, ``warmup_decay_lr``,
``warmup_cosine_lr``.

Schedules are DeepSpeed's formulas at DeepSpeed's step: the scheduler is made at iteration -1 and
stepped after each applied update, so update ``n`` (zfunc's ``count = n``) uses DeepSpeed's
iteration ``n - 1`` (WarmupLR/WarmupDecayLR: ``warmup_min_lr``; WarmupCosineLR: 0). Warmup lengths
below 2 count as 2, as there. An unknown ``warmup_type`` is refused (DeepSpeed warns and uses
"log"). zf.optim's ``linear_warmup``/``warmup_cosine`` count differently, hence the schedules here.
"""
from __future__ import annotations

import math

from zfunc import optim
from zfunc.config.checks import _check_choice, _check_int
from zfunc.config.params import WARMUP_TYPES


def _warmup_fraction(it: int, steps: int, warmup_type: str) -> float:
    """DeepSpeed's warmup gamma at iteration ``0 <= it < steps``."""
    return math.log(it + 1) / math.log(steps) if warmup_type == "log" else it / steps


def warmup_lr(warmup_min_lr: float, warmup_max_lr: float, warmup_num_steps: int = 1000,
              warmup_type: str = "log") -> optim.Schedule:
    """DeepSpeed's WarmupLR as a zf.optim schedule: at iteration ``it = count - 1`` (DeepSpeed
    steps its scheduler after each update; ``it < 0`` gives ``min``), ``min + (max - min) * g`` with
    ``g = log(it + 1) / log(W)`` ("log") or ``it / W`` ("linear") while ``it < W = max(2, steps)``, then 1."""
    _check_choice("warmup_type", warmup_type, WARMUP_TYPES)
    _check_int("warmup_num_steps", warmup_num_steps, 1)
    steps = max(2, warmup_num_steps)

    def schedule(count: int) -> float:
        it = count - 1
        if it < 0:
            return warmup_min_lr
        gamma = _warmup_fraction(it, steps, warmup_type) if it < steps else 1.0
        return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma

    return schedule


def warmup_decay_lr(total_num_steps: int, warmup_min_lr: float, warmup_max_lr: float, warmup_num_steps: int = 1000,
                    warmup_type: str = "log") -> optim.Schedule:
    """DeepSpeed's WarmupDecayLR: ``warmup_lr``, then ``g = max(0, (T - it) / max(1, T - W))``
    (linear from max at the end of warmup to ``min`` at ``it = T = total_num_steps``)."""
    _check_int("total_num_steps", total_num_steps, 1)
    warmup = warmup_lr(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
    steps = max(2, warmup_num_steps)

    def schedule(count: int) -> float:
        it = count - 1
        if it < steps:
            return warmup(count)
        gamma = max(0.0, (total_num_steps - it) / max(1.0, total_num_steps - steps))
        return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma

    return schedule


def warmup_cosine_lr(lr: float, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                     cos_min_ratio: float = 0.0001, warmup_type: str = "log") -> optim.Schedule:
    """DeepSpeed's WarmupCosineLR: ``lr * ratio``; ``ratio`` rises from ``warmup_min_ratio`` to 1
    like ``warmup_lr``'s gamma, then ``cos_min + (1 - cos_min) (1 + cos(pi p)) / 2`` with
    ``p = min(1, (it - W + 1) / max(1, T - W))``; 0 before the first scheduler step (``it < 0``)."""
    _check_int("total_num_steps", total_num_steps, 1)
    _check_choice("warmup_type", warmup_type, WARMUP_TYPES)
    _check_int("warmup_num_steps", warmup_num_steps, 1)
    steps = max(2, warmup_num_steps)

    def schedule(count: int) -> float:
        it = count - 1
        if it < 0:
            return 0.0
        if it < steps:
            ratio = warmup_min_ratio + _warmup_fraction(it, steps, warmup_type) * (1.0 - warmup_min_ratio)
        else:
            progress = min(1.0, (it - steps + 1) / max(1, total_num_steps - steps))
            ratio = max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)
        return lr * ratio

    return schedule
