"""Settings read from environment variables, checked when zfunc is imported.

A bad value raises ``ValueError`` naming the variable, its value and what was expected, instead of
``int()``'s or ``float()``'s bare message from deep inside an import.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable


def number(name: str, default: float, cast: Callable[[str], float], ok: Callable[[float], bool],
           expected: str) -> float:
    """``cast(os.environ[name])`` where set, else ``default``; ``ok`` must hold for it and it must be
    finite (``expected`` says so in the error)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = cast(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not ok(value):
        raise ValueError(f"environment variable {name}: expected {expected}, got {raw!r}")
    return value


def choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """``os.environ[name]`` where set, else ``default``; it must be one of ``choices``."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"environment variable {name}: expected one of {choices}, got {value!r}")
    return value
