"""Raw CUDA kernels (CUDA C++ source compiled by NVRTC, launched through CuPy on torch's tensors),
picked where the optimizer state lives on a GPU (``zfunc.optim.kernels``: ``backend="auto"``
resolves to ``"cupy"`` for contiguous fp32 CUDA params when CuPy is installed).

``adam``: multi-tensor fused AdamW/Adam (fp32 masters and moments, fp32/bf16/fp16 grads times a
scale, a bf16/fp16 param copy written in the same pass, the grads' sum of squares on request);
``lion``: Lion, likewise; ``lamb``: LAMB with its trust ratios computed on the device; ``norm``: the
global norm and the inf/nan check in one read; ``cast``: scaled multi-tensor casts; ``onebit``: the
1-bit compressor's sign packing; ``quantize``: ZeRO++'s int8/int4 block quantizers. ``program``:
the CUDA source and entry points of each; ``nvrtc``: compiling a program to a cubin with NVRTC
alone (no GPU, no driver), what CI checks and what the runtime loads (the same options);
``runtime``: loading the cubins into CuPy modules and launching on torch's current stream.
Every kernel is compiled in CI (sm_90); what they compute is checked only on a GPU (``pytest -m
gpu``, ``benchmarks/gpu_check.sh``). Modules load on first attribute access; CuPy is imported only
when CUDA tensors first ask for these kernels.
"""
import importlib

_MODULES = ("adam", "cast", "lamb", "lion", "norm", "nvrtc", "onebit", "program", "quantize", "runtime")


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULES])
