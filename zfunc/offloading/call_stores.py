"""Where one call of an offloaded step (an ``init`` or a step) puts leaves, and how a failed call is undone.

``_Stores`` holds the optimizer's and the params' ``Store`` (a file engine where that part lives on
NVMe, else RAM), the writes the call has in flight (at most ``2 * chunk_bytes``: each new write waits
for the oldest beyond that) and the files whose new versions the call issued. A call returns only
once all of its writes are done; after a failure ``undo`` waits for the rest and puts every file the
call rewrote back to its previous version (``SwapEngine.restore``), so the state passed in is whole
again where none of it was updated in place in RAM, and says which for the error.
"""
from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from zfunc.core.state import TrainState
from zfunc.offloading.store import Store


class _Writes:
    """The writes one call has in flight (at most ``budget`` bytes: each new write waits for the
    oldest beyond that) and the files whose new versions it issued. Its own object, not part of
    ``_Stores``: a ``Store`` holds its ``track``, and a bound method of the ``_Stores`` that holds the
    store would make a reference cycle, which keeps the call's buffers alive until Python's cyclic
    GC runs (a 12.8M GPT's two-rank NVMe step grew by ~100 MB of RSS a step)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.queue: deque = deque()
        self.in_flight = 0  # bytes of ``queue``
        self.rewritten: list[str] = []  # the files whose new versions this call issued

    def track(self, write: Future | None, nbytes: int, name: str | None = None) -> None:
        """Count ``write`` in flight (``name``: a file the call rewrites, put back if it fails)."""
        if write is None:
            return
        if name is not None:
            self.rewritten.append(name)
        self.queue.append((write, nbytes))
        self.in_flight += nbytes
        self.wait(self.budget)

    def wait(self, budget: int | None) -> None:
        """Wait for the oldest writes until at most ``budget`` bytes are in flight (all: None);
        the first that failed raises (the rest stay counted, for ``drain``)."""
        queue = self.queue
        while queue and (budget is None or self.in_flight > budget):
            write, nbytes = queue.popleft()
            self.in_flight -= nbytes
            write.result()

    def drain(self) -> None:
        """Wait for every write in flight, their errors dropped: only a call that has failed
        already has writes left at its end (a step waits for all of its own before it returns)."""
        while self.queue:
            with contextlib.suppress(Exception):
                self.wait(None)


class _Stores:
    """Where one call (an ``init`` or a step) puts leaves: the optimizer's and the params' stores,
    the writes in flight (``_Writes``, at most ``2 * chunk_bytes``) and the files the call rewrote.
    ``step`` is the ``OffloadedStep`` (read: its chunk size, engine and where it keeps each store),
    not imported: zfunc.offloading.offloaded imports this module."""

    def __init__(self, step: Any, device: torch.device):
        pin = device.type == "cuda"
        self.chunk_bytes, self.engine = step.chunk_bytes, step.engine
        self.writes = _Writes(2 * step.chunk_bytes)
        self._in_place = (step.where_optimizer, step.where_masters) != ("nvme", "nvme")  # leaves in RAM
        self._opt_store = Store(step.engine if step.where_optimizer == "nvme" else None, pin, self.writes.track)
        self._param_store = Store(step.engine if step.where_masters == "nvme" else None, pin, self.writes.track)

    def undo(self, state: TrainState) -> str:
        """After a failed call: every write waited for and every file the call rewrote put back
        to its version before it (``SwapEngine.restore``); ``state`` (the one the call took) usable
        again where that leaves it whole: nothing of it lives in RAM, where an update works in
        place. Says which, for the error."""
        self.writes.drain()
        if not state.consumed:
            return "the state passed in is unchanged"
        lost = "the state passed in is consumed"
        try:
            kept = [self.engine.restore(name) for name in self.writes.rewritten] if self.writes.rewritten else []
            if not all(k.result() for k in kept):
                return (f"{lost}: the previous versions of its files were not kept (no spare files: hard links "
                        "unsupported on the swap disk?); restart from a checkpoint")
        except OSError as e:
            return f"{lost}: putting its files back failed ({e}); restart from a checkpoint"
        if self._in_place:
            return (f"{lost}: its leaves in RAM were updated in place before the failure (the files written are back "
                    "to their versions before the step, but only optimizer='nvme' with the masters there too (params "
                    "None or 'nvme') keeps a failed step's input whole); restart from a checkpoint")
        state._consumed = False
        return ("the state passed in is unchanged: the step's files are back to their versions before it (save it, "
                "or make room and call the step again)")


