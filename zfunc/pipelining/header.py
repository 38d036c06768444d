"""The header a pipeline stage sends before its first activation of a step, and what it checks.

Each boundary between virtual stages on two ranks carries, per step, ``SIZE`` int64s (104 bytes):
the step's number and microbatch count, a digest of the batch (every rank of a pipeline must call
the step with the same one), the activation's dtype and shape. ``pack`` writes them, ``read``
checks the first three against the receiving stage's own and returns the shape. The shapes of a
step are kept (``signature``: what they follow from), so a later step with the same batch shapes
posts its receives before its header arrives and checks it before reading the first activation.
"""
from __future__ import annotations

import zlib
from typing import Any

import torch

from zfunc.core import tree

PyTree = Any
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_DIMS = 8
SIZE = 5 + MAX_DIMS  # int64s: step, microbatches, batch digest, dtype, ndim, shape
Meta = tuple[tuple[int, ...], torch.dtype]


def pack(out: torch.Tensor, stage: int, number: int, m: int, digest: int) -> list[int]:
    """The header of stage ``stage``'s output ``out`` at step ``number``."""
    if out.dim() > MAX_DIMS or out.dtype not in DTYPES:
        raise ValueError(f"pipeline: stage {stage} output has shape {tuple(out.shape)} {out.dtype}; expected at "
                         f"most {MAX_DIMS} dims and one of {DTYPES}")
    header = [number, m, digest, DTYPES.index(out.dtype), out.dim(), *out.shape]
    return header + [0] * (SIZE - len(header))


def read(header: list[int], peer: int, stage: int, number: int, m: int, digest: int) -> Meta:
    """The shape and dtype in ``header`` from ``peer``, once its step, microbatches and batch
    digest are checked against stage ``stage``'s ``number``, ``m`` and ``digest``."""
    got_number, got_m, got_digest, code, ndim = header[:5]
    if (got_number, got_m) != (number, m):
        raise ValueError(f"pipeline: stage {peer} runs step {got_number} with {got_m} microbatches but stage "
                         f"{stage} runs step {number} with {m}: the ranks' steps diverged")
    if got_digest != digest:
        raise ValueError(f"pipeline: stages {peer} and {stage} were given different batches at step {number}; "
                         "every rank of a pipeline must call the step with the same batch")
    return tuple(header[5 : 5 + ndim]), DTYPES[code]


def changed(rank: int, k: int, was: Meta, now: Meta, number: int) -> str:
    """The error of stage ``k``'s output shape changing under the same batch shapes."""
    return (f"pipeline: stage {k}'s output (rank {rank}) is {now[0]} {now[1]} at step {number} but was {was[0]} "
            f"{was[1]} at the last step with this batch's shapes: a stage's output shape must follow from the batch's")


def signature(batch: PyTree) -> tuple:
    """What a stage's output shapes follow from: the batch's structure, its tensors' shapes and
    dtypes, its other leaves."""
    leaves, spec = tree.flatten(batch)
    return str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)


def digest(batch: PyTree) -> int:
    """crc32 of the batch's tensors' bytes: adjacent stages compare it (cheap: the batch is small)."""
    crc = 0
    for x in tree.leaves(batch):
        if isinstance(x, torch.Tensor):
            crc = zlib.crc32(x.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc
