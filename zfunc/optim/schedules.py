"""Learning-rate schedules ``count -> float`` (re-exported by ``zfunc.optim``); ``count`` is the
number of updates already applied (0 on the first step). Every value a schedule returns is checked
when used (``_as_schedule``: finite and >= 0, naming the count).
"""
from __future__ import annotations

import math

from zfunc.optim.base import ScalarOrSchedule, Schedule, _check_int, _check_non_negative, _check_number


def _as_schedule(learning_rate: ScalarOrSchedule) -> Schedule:
    """``learning_rate`` as a schedule whose every value is checked to be finite and >= 0 when
    used (a negative rate would ascend the loss, a nan one poison every param)."""
    if not callable(learning_rate):
        _check_number("learning_rate", learning_rate, "a finite float >= 0 or a schedule", lambda x: x >= 0)
        return constant_schedule(float(learning_rate))

    def schedule(count: int) -> float:
        value = learning_rate(count)
        try:
            ok = math.isfinite(value) and value >= 0
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"learning_rate: the schedule returned {value!r} at update count {count}; "
                             "expected a finite float >= 0")
        return value

    return schedule


def constant_schedule(value: float) -> Schedule:
    """``count -> value``."""
    _check_non_negative(value=value)
    return lambda count: value


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """Linear from ``init_value`` at count 0 to ``end_value`` at ``transition_steps``, then flat."""
    _check_non_negative(init_value=init_value, end_value=end_value)
    _check_int("transition_steps", transition_steps, 1)

    def schedule(count: int) -> float:
        frac = min(count, transition_steps) / transition_steps
        return init_value + frac * (end_value - init_value)

    return schedule


def linear_warmup(peak_value: float, warmup_steps: int) -> Schedule:
    """``peak * (count + 1) / warmup_steps`` for the first ``warmup_steps`` updates, then ``peak``."""
    _check_non_negative(peak_value=peak_value)
    _check_int("warmup_steps", warmup_steps, 0)
    return lambda count: peak_value * min(1.0, (count + 1) / warmup_steps) if warmup_steps else peak_value


def warmup_cosine(peak_value: float, warmup_steps: int, total_steps: int, end_value: float = 0.0) -> Schedule:
    """Linear warmup to ``peak_value`` (``linear_warmup``), then a cosine decay to ``end_value``.

    ``lr(count) = end + (peak - end) * (1 + cos(pi * t)) / 2`` with
    ``t = (count - warmup_steps) / (total_steps - warmup_steps)`` clipped to [0, 1].
    """
    _check_non_negative(peak_value=peak_value, end_value=end_value)
    _check_int("total_steps", total_steps, 1)
    _check_int("warmup_steps", warmup_steps, 0)
    if not warmup_steps < total_steps:
        raise ValueError(
            f"warmup_steps, total_steps: expected 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}"
        )
    warmup = linear_warmup(peak_value, warmup_steps)

    def schedule(count: int) -> float:
        if count < warmup_steps:
            return warmup(count)
        t = min(1.0, (count - warmup_steps) / (total_steps - warmup_steps))
        return end_value + (peak_value - end_value) * 0.5 * (1.0 + math.cos(math.pi * t))

    return schedule
