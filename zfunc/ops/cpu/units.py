"""Which half precisions this CPU multiplies matrices in natively.

A CPU without bf16 (fp16) matrix instructions runs a bf16 (fp16) matmul by converting to fp32 and
back around scalar or emulated arithmetic: the step is slower than in fp32, not faster. The
instructions are read from the CPU's feature flags, as Linux's ``/proc/cpuinfo`` names them
(``flags`` on x86, ``Features`` on aarch64); where that file is missing or unreadable no native
unit is assumed (fp32 is then the safe choice). ``native_units`` is pure: tests pass the flags.
"""
from __future__ import annotations

import functools
from typing import Iterable

# The feature flags that give each half precision native matrix arithmetic, as /proc/cpuinfo
# names them: Intel AMX tiles, AVX-512 dot products (x86), the Armv8.6 BF16 and Armv8.2 FP16
# extensions (aarch64).
NATIVE_UNITS = {
    "bf16": ("amx_bf16", "avx512_bf16", "bf16"),
    "fp16": ("amx_fp16", "avx512_fp16", "asimdhp"),
}
CPUINFO = "/proc/cpuinfo"


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags in the text of ``/proc/cpuinfo`` (every ``flags`` / ``Features`` line)."""
    found: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            found.update(value.split())
    return frozenset(found)


@functools.lru_cache(maxsize=None)
def cpu_flags(path: str = CPUINFO) -> frozenset[str]:
    """This machine's CPU feature flags (``parse_flags`` of ``path``; empty where it cannot be read).
    Reads the file once per process."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_flags(f.read())
    except OSError:
        return frozenset()


def native_units(precision: str, flags: Iterable[str] | None = None) -> tuple[str, ...]:
    """The units among ``NATIVE_UNITS[precision]`` that ``flags`` (default: this CPU's) hold, in
    that order; ``()`` for a precision this CPU emulates, and for fp32 (native everywhere)."""
    have = cpu_flags() if flags is None else frozenset(flags)
    return tuple(unit for unit in NATIVE_UNITS.get(precision, ()) if unit in have)
