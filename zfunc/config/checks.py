"""The value checks of zf.config: each names the field (or key path), the value received and what was
expected, in one ``ValueError``."""
from __future__ import annotations

import math
from typing import Any


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


def _check_number(name: str, value: Any, minimum: float = 0.0, below: float | None = None) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (below is not None and value >= below):
        bound = f" and < {below}" if below is not None else ""
        raise ValueError(f"{name}: expected a number >= {minimum}{bound}, got {value!r}")
    return float(value)


def _check_positive(name: str, value: Any) -> float:
    _check_number(name, value)
    if value <= 0:
        raise ValueError(f"{name}: expected a number > 0, got {value!r}")
    return float(value)


def _check_fraction(name: str, value: Any) -> float:
    _check_number(name, value)
    if value > 1:
        raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
    return float(value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected true or false, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def _check_betas(name: str, value: Any) -> list[float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{name}: expected two numbers [b1, b2], got {value!r}")
    for i, b in enumerate(value):
        _check_number(f"{name}[{i}]", b, 0.0, 1.0)
    return [float(b) for b in value]
