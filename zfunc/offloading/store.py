"""Where offloaded tensors live between steps: RAM or swap files, read ahead and written back.

``Store.put`` places a tensor (a handle back: the tensor itself, or an ``OnDisk`` naming its swap
file), ``fetch`` starts reading it, ``store_back`` makes a new value its content. ``ReadAhead``
keeps reads running ahead of their use along an expected order, within a byte budget.

Pending reads are plain objects holding plain references, never future callbacks: closures
registered between futures form reference cycles that keep read buffers alive until Python's
cyclic GC happens to run (hundreds of MB of peak RSS on a model of tens of millions of params).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OnDisk:
    """A tensor kept in a swap file: the file's name in the engine, and the tensor's shape/dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Read:
    """``result()`` waits for the swap read ``io`` and returns its buffer ``out``."""

    def __init__(self, io: Future, out: torch.Tensor):
        self.io, self.out = io, out

    def result(self) -> torch.Tensor:
        self.io.result()
        return self.out


class All:
    """``result()``: the results of ``parts``, in order."""

    def __init__(self, parts: list):
        self.parts = parts

    def result(self) -> list:
        return [p.result() for p in self.parts]


def done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class Store:
    """Tensors kept in RAM (``engine=None``) or in swap files, read and written by future."""

    def __init__(self, engine=None, pin: bool = False, track: Callable[[Future | None, int], None] | None = None):
        self.engine, self.pin, self.track = engine, pin, track

    def put(self, name: str, t: torch.Tensor) -> torch.Tensor | OnDisk:
        """Keep ``t`` (a CPU tensor the store takes over); returns its handle. A file's write is
        handed to ``track(future, nbytes)``, which bounds the writes in flight."""
        if self.engine is None:
            return t.pin_memory() if self.pin else t
        self.track(self.engine.write(name, t.contiguous()), t.numel() * t.element_size())
        return OnDisk(name, tuple(t.shape), t.dtype)

    def fetch(self, x: torch.Tensor | OnDisk) -> Future | Read:
        """A future of the tensor behind ``x`` (for a file, a fresh aligned buffer read from it)."""
        if not isinstance(x, OnDisk):
            return done(x)
        from zfunc.offloading.swap.file_format import aligned_empty

        out = aligned_empty(x.nbytes, pin=self.pin)[: x.nbytes].view(x.dtype).view(x.shape)
        return Read(self.engine.read(x.name, out), out)

    def store_back(self, x: torch.Tensor | OnDisk, t: torch.Tensor) -> tuple[torch.Tensor | OnDisk, Future | None]:
        """Make ``t`` the new value of ``x``: a file is rewritten (the future), RAM keeps ``t``."""
        if not isinstance(x, OnDisk):
            return t, None
        return x, self.engine.write(x.name, t.contiguous())


class ReadAhead:
    """Futures of store reads, launched ahead along an expected order within a byte budget.

    ``get(i)`` returns the tensor for key ``i`` (waiting for its read, or reading it now if it was
    not expected), then tops up: reads along ``order`` after the last one launched start until
    ``budget`` bytes are in flight. Keys are read once per ``get``; the order can repeat keys.
    """

    def __init__(self, fetch: Callable[[int], Future], nbytes: Callable[[int], int], order: list[int], budget: int):
        self.fetch, self.nbytes, self.order, self.budget = fetch, nbytes, order, budget
        self.ahead: dict[int, deque[Future]] = {}
        self.inflight = 0
        self.next = 0  # position in ``order`` of the next read to launch
        self.seen: list[int] = []  # the order of this pass's requests (the next pass's ``order``)

    def get(self, i: int) -> torch.Tensor:
        self.seen.append(i)
        queued = self.ahead.get(i)
        if queued:
            future = queued.popleft()
            self.inflight -= self.nbytes(i)
        else:
            future = self.fetch(i)
            if self.next < len(self.order) and self.order[self.next] == i:
                self.next += 1  # on schedule: do not read it again ahead
        self._top_up()
        return future.result()

    def _top_up(self) -> None:
        while self.next < len(self.order) and self.inflight < self.budget:
            i = self.order[self.next]
            self.next += 1
            self.ahead.setdefault(i, deque()).append(self.fetch(i))
            self.inflight += self.nbytes(i)
