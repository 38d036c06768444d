"""Receive buffers a pipeline step keeps across its calls (``RecvBuffers``), as torch's stages keep theirs.

A stage receives the same shapes every step (activations, their grads, headers, the shared
params); allocating them anew each step costs the kernel a page fault per page of every large
buffer. The pool, held by the ``PipelineStep`` between calls (not in the state: nothing of it is a
value), hands out an alias of a buffer it owns (``base.detach()``: its own tensor over the base's
memory) and takes a buffer again only once nothing else refers to its memory: no alias, view,
autograd-saved tensor, transfer in flight or caller-held ``aux`` (torch counts the tensors on a
storage). So no tensor anybody can still see is written: a received activation that autograd
saved stays untouched until its backward, or its weight-grad op, has dropped the graph.

Cost: between steps the pool holds, per (shape, dtype, device), as many buffers as were in use at
once during a step: on a stage, about its peak of live microbatches' received activations (a
microbatch's input lives until its backward), one or two activation grads, the headers and, on the
last stage, the shared params lent to it; on a rank, at most what one step received. Taking one is a
scan of that key's few buffers.
"""
from __future__ import annotations

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # None: this torch cannot tell; nothing is reused


class RecvBuffers:
    """A pool of receive buffers by ``(shape, dtype, device)``; ``take`` gives a fresh alias of a free one."""

    def __init__(self) -> None:
        self.pools: dict[tuple, list[torch.Tensor]] = {}

    def take(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` on ``device``, uninitialized: a buffer of the pool
        nothing refers to any more, or a new one the pool keeps."""
        shape = torch.Size((shape,) if isinstance(shape, int) else shape)
        pool = self.pools.setdefault((shape, dtype, torch.device(device)), [])
        for base in pool:
            if _free(base):
                return base.detach()
        base = torch.empty(shape, dtype=dtype, device=device)
        if _use_count is not None:
            pool.append(base)
        return base.detach()

    def nbytes(self) -> int:
        """The bytes the pool holds."""
        return sum(b.numel() * b.element_size() for pool in self.pools.values() for b in pool)


def _free(base: torch.Tensor) -> bool:
    """Nothing but the pool refers to ``base``'s memory: its storage's only users are ``base``
    and the temporary ``untyped_storage()`` this call makes."""
    return _use_count(base.untyped_storage()._cdata) <= 2
