"""CPU kernels and the host facts they depend on.

``adam``: Numba optimizer kernels for state in CPU RAM (AdamW/Adam, Lion, SGD), one memory pass per step (its
compiled updates in ``blocks``, run over a range by ``sweep``; the Numba toolkit they share with ``lamb`` and ``norm``
in ``intrinsics``; their buffers' checks in ``checks``); ``lamb``:
LAMB in the same family, two passes per tensor; ``norm``: the sum of squares of CPU grads in one read (a step's
global grad norm);
``codec``: the compressed collectives' sign packing and int8/int4 blocks in one pass each;
``onebit``: the 1-bit optimizers' frozen-variance update in one pass; ``gomp``: the libgomp thread teams
they run on; ``hostmem``: CPU tensors on transparent huge pages, where
the optimizer state lives (fewer TLB misses for the kernels' streams); ``units``: which half precisions this
CPU multiplies matrices in natively. Modules load on first attribute access (Numba's import is ~0.3 s).
"""
import importlib

_MODULES = ("adam", "blocks", "checks", "codec", "gomp", "hostmem", "intrinsics", "lamb", "norm", "onebit", "sweep",
            "units")


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULES])
