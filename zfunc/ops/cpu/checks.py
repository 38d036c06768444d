"""The checks of a CPU optimizer kernel's buffers: the dtypes a grad and a param_out may have (their
element tags), and the slow path that names what is wrong with a buffer, a range or a step."""
from __future__ import annotations

import operator

import numpy as np
import torch

from zfunc.ops.cpu.intrinsics import _F32


_FLOAT32 = torch.float32
_GRAD = {torch.float32: _F32, torch.bfloat16: np.uint16(0), torch.float16: np.int16(0)}
_OUT = {torch.bfloat16: np.uint16(0), torch.float16: np.int16(0)}
_UNIT = (1,)


def _reject(t, name: str, dtypes, n: int, fn: str) -> None:
    """Raise the error that says what is wrong with ``t``, if anything."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{fn}: {name} must have dtype {want}, got {t.dtype}")
    if not t.is_cpu:
        raise ValueError(f"{fn}: {name} must be a CPU tensor, got device {t.device} (these "
                         "kernels update state in CPU RAM; move it with .cpu() or use a GPU optimizer)")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be 1-D and contiguous, got shape {tuple(t.shape)} "
                         f"with strides {t.stride()}; pass a flat buffer (e.g. .reshape(-1))")
    if t.numel() != n:
        raise ValueError(f"{fn}: {name} has {t.numel()} elements, expected {n} (the size of param)")


def _check_range(fn: str, start, end, n: int) -> tuple[int, int]:
    """``start, end`` as ints (numpy ints are fine) if 0 <= start <= end <= n, else ValueError."""
    try:
        start, end = operator.index(start), operator.index(end)
    except TypeError:
        pass
    else:
        if 0 <= start <= end <= n:
            return start, end
    raise ValueError(f"{fn}: need integers 0 <= start <= end <= {n} (the size of param), "
                     f"got start={start!r}, end={end!r}")


def _check_step(step) -> int:
    """``step`` as an int (numpy ints are fine) if it is >= 1, else ValueError."""
    try:
        if operator.index(step) >= 1:
            return operator.index(step)
    except TypeError:
        pass
    raise ValueError(f"adamw_: step must be an int >= 1 (bias correction is 1 - beta**step), "
                     f"got {step!r}")


def _leaf_ok(t, n: int, dtypes) -> bool:
    """``t`` is a contiguous CPU tensor of ``n`` elements of one of ``dtypes`` (any shape)."""
    return t.dtype in dtypes and t.is_cpu and t.is_contiguous() and t.numel() == n
