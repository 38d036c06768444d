"""Optimizer kernels, chosen by where the optimizer state lives.

``zfunc.ops.cpu_adam``: Numba kernels for state in CPU RAM (AdamW/Adam, Lion, SGD);
``zfunc.ops.gomp``: the libgomp thread teams they run on; ``zfunc.ops.hostmem``: CPU tensors on
transparent huge pages, where the optimizer state lives (the kernels run up to 1.3x faster there).
Submodules load on first attribute access: importing Numba costs ~0.3 s and most steps never
touch a CPU kernel, so ``import zfunc`` must not pay for it.
"""
import importlib

_SUBMODULES = ("cpu_adam", "gomp", "hostmem")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SUBMODULES])
