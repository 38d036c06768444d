"""The channel a 1-bit optimizer sends its momentum through (``zfunc.optim.onebit``): each tensor's
compressed mean over the data-parallel ranks, with the error-feedback buffers the transformation keeps
between updates (zero again whenever the state it is given is not the one its last update returned).

Cost: one ``ErrorFeedback`` per tensor (its worker error, the tensor's size, and its server error, 1/N of
it) held between updates; a call sends every tensor's signs and scales in one all-to-all and one
all-gather (``Comm.compressed_all_reduce_many``), or one message for all (``together``).
"""
from __future__ import annotations

from typing import Any

import torch

from zfunc.dist.compressed import error_feedback, padded_numel


class _Channel:
    """The compressed all-reduce of one optimizer: its comm (made on first use where None) and its
    error feedback, reset whenever the state given is not the one last returned (``expect``)."""

    def __init__(self, comm: Any):
        self.comm, self.errors, self.expect = comm, None, None

    def check(self, count: int) -> None:
        if count != self.expect:  # a loaded checkpoint, a fresh process, or another state: errors restart
            self.errors = None

    def done(self, count: int) -> None:
        self.expect = count

    def reset(self) -> None:
        self.errors = None

    def mean(self, tensors: list[torch.Tensor], label: str, together: bool = False,
             own: bool = False, blend: tuple | None = None, then=None) -> list[torch.Tensor]:
        """The compressed mean over ranks of each of ``tensors``: each compressed on its own (scales,
        errors), as DeepSpeed's 1-bit and 0/1 Adam do, so that a small-magnitude tensor keeps its own
        scale, the messages sent together (``onebit_all_reduce_many``: 2 collectives in all); ``together``
        (1-bit LAMB, whose momenta are scaled to one magnitude first): one message for all. ``blend`` ``(ys,
        a, b)`` (``own`` tensors, not ``together``): the mean of ``t a + b y`` for each t, written into t
        (``onebit_all_reduce_many``'s ``blend``: formed in the compression's first pass). ``then(k)``
        (not ``together``): run on tensor k's mean as soon as it is decoded (``onebit_all_reduce_many``)."""
        comm = self._comm()
        if blend is not None and (comm.world == 1 or not own or together):
            ys, a, b = blend
            tensors = [t.copy_(t * a + b * y) if own else t * a + b * y for t, y in zip(tensors, ys)]
            blend = None
        if comm.world == 1 or not tensors:
            out = [t.float() for t in tensors]
            for k in range(len(out) if then is not None else 0):
                then(k)
            return out
        if together:
            flat = torch.cat([t.reshape(-1).float() for t in tensors])
            return [piece.view_as(t) for piece, t in zip(self._one(comm, 0, flat, label).split(
                [t.numel() for t in tensors]), tensors)]
        # each tensor is overwritten by its mean: a copy, unless it is a temporary of the caller's (``own``)
        flats = [t.reshape(-1).float() if own else t.reshape(-1).float().clone() for t in tensors]
        errors = [self._errors(comm, k, flat) for k, flat in enumerate(flats)]
        extra = {} if blend is None else {"blend": ([y.reshape(-1) for y in blend[0]], *blend[1:])}
        if then is not None:
            extra["then"] = then
        return [flat.view_as(t) for flat, t in zip(comm.compressed_all_reduce_many(flats, errors, label, **extra),
                                                   tensors)]

    def _errors(self, comm, k: int, flat: torch.Tensor):
        """Tensor ``k``'s ``ErrorFeedback`` (zeros when new or resized)."""
        if self.errors is None:
            self.errors = {}
        if k not in self.errors or self.errors[k].worker.numel() != padded_numel(flat.numel(), comm.world):
            self.errors[k] = error_feedback(flat.numel(), comm.world, flat.device)
        return self.errors[k]

    def _one(self, comm, k: int, flat: torch.Tensor, label: str) -> torch.Tensor:
        return comm.compressed_all_reduce(flat, self._errors(comm, k, flat), f"{label}, tensor {k}")

    def _comm(self):
        if self.comm is None:
            import torch.distributed as dist

            from zfunc.dist.comm import Comm
            on = dist.is_available() and dist.is_initialized()
            self.comm = Comm(group=dist.new_group(backend=dist.get_backend()) if on else None, alone=not on)
        return self.comm
