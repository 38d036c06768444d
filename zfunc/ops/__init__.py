"""Kernels, by the device they run on: ``zfunc.ops.cpu`` (Numba) and ``zfunc.ops.gpu`` (CuPy RawKernels).

Subpackages load on first attribute access, and their modules likewise: importing Numba costs ~0.3 s
and most steps never touch a CPU kernel, so ``import zfunc`` does not pay for it.
"""
import importlib

_SUBPACKAGES = ("cpu", "gpu")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SUBPACKAGES])
