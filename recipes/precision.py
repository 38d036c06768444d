"""The precision a recipe trains in: its default for the machine, the line that says why, and the
warning for a half precision this CPU emulates.

Default: bf16 on CUDA; on a CPU, bf16 where it multiplies bf16 matrices natively
(``zfunc.ops.cpu.units``: AMX, AVX512-BF16, Arm BF16), fp32 elsewhere -- an emulated bf16 step is
slower than fp32, never faster. A bf16 or fp16 asked for (``--precision``, or ``fp16.enabled`` /
``bf16.enabled`` in a ``--deepspeed`` config) on a CPU without native units for it trains as asked,
after one warning naming the slowdown measured on such a CPU (``EMULATED_SLOWDOWN``).
"""
from __future__ import annotations

import argparse
from typing import Iterable

from zfunc.ops.cpu import units as cpu_units

# fp32 tokens/s over the precision's on a CPU that emulates it, the least and the most measured over
# the recipes and layouts (README, Results: "precision on a CPU", its commands).
EMULATED_SLOWDOWN = {"bf16": (2, 4), "fp16": (3, 17)}
UNITS_SHOWN = "AMX, AVX512-BF16, Arm BF16"


def default(device_type: str, flags: Iterable[str] | None = None) -> tuple[str, str]:
    """``(precision, why)`` when none is asked for: bf16 on CUDA and on a CPU whose ``flags``
    (default: this CPU's) hold a native bf16 unit, fp32 on any other CPU."""
    if device_type == "cuda":
        return "bf16", "default on CUDA"
    if device_type != "cpu":
        return "fp32", f"default on {device_type}"
    units = cpu_units.native_units("bf16", flags)
    if units:
        return "bf16", f"default: this CPU has native bf16 matrix units: {', '.join(units)}"
    return "fp32", f"default: this CPU has no native bf16 matrix units ({UNITS_SHOWN})"


def source(args: argparse.Namespace, precision: str, device_type: str, flags: Iterable[str] | None = None) -> str:
    """Who asked for ``precision``, the run's resolved precision: "--precision", the ``--deepspeed``
    config's key, or "" (the default, ``default``)."""
    if "precision" in getattr(args, "given", frozenset()):
        return "--precision"
    if getattr(args, "deepspeed", None) is not None and precision != default(device_type, flags)[0]:
        key = "fp16.enabled / bf16.enabled" if precision == "fp32" else f"{precision}.enabled"
        return f"{key} in --deepspeed {args.deepspeed}"
    return ""


def first_line(args: argparse.Namespace, precision: str, device_type: str,
               flags: Iterable[str] | None = None) -> str:
    """What the recipe picked and why, the first line it prints: "precision fp32 (default: this CPU
    has no native bf16 matrix units (...))", "precision fp16 (--precision)"."""
    asked = source(args, precision, device_type, flags)
    return f"precision {precision} ({asked or default(device_type, flags)[1]})"


def emulation_warning(args: argparse.Namespace, precision: str, device_type: str,
                      flags: Iterable[str] | None = None) -> str | None:
    """One line for a bf16 or fp16 run on a CPU whose ``flags`` hold no native unit for it (None
    otherwise): who asked, the slowdown measured on such a CPU, and how to train at full speed."""
    if device_type != "cpu" or precision not in EMULATED_SLOWDOWN or cpu_units.native_units(precision, flags):
        return None
    asked = source(args, precision, device_type, flags)
    if asked == "--precision":
        who, fix = f"--precision {precision}", "leave --precision out for this CPU's default"
    elif asked:
        who, fix = asked, "set it to false or \"auto\" for this CPU's default"
    else:
        who, fix = f"precision {precision}", "pass --precision fp32"
    low, high = EMULATED_SLOWDOWN[precision]
    return (f"warning: {who}: this CPU has no native {precision} arithmetic, so it trains {low}-{high}x "
            f"slower than fp32; {fix}")
