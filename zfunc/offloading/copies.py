"""The compute-dtype copies of offloaded masters that an update wrote in its own pass (``ComputeCopies``)."""
from __future__ import annotations

import weakref
from typing import Any

import torch


class ComputeCopies:
    """Each RAM master's compute-dtype copy (bf16/fp16), written by the update in the kernel's own
    pass, so that the next forward gathers it instead of casting the master (a second pass over
    it, 6 B/param). A copy is used only for the very master tensor it was written from, unchanged
    since (same object, same version counter); it is dropped when that tensor dies. Keyed by
    tensor, not held by a step's run: one step object may drive several states. Cost: 2 B/param
    of host RAM (pinned with a GPU) for every offloaded master in RAM trained in bf16/fp16."""

    def __init__(self):
        self._by_id: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def of(self, master: Any) -> torch.Tensor | None:
        """The copy written from ``master`` (a tensor, or the ``OnDisk`` handle of its file) as it is now, or None."""
        entry = self._by_id.get(id(master))
        if entry is None or entry[0]() is not master or entry[1] != getattr(master, "_version", 0):
            return None
        return entry[2]

    def forget(self, masters: list) -> None:
        """Drop the copies of ``masters`` (files put back to an older version by a failed step)."""
        for m in masters:
            self._by_id.pop(id(m), None)

    def last(self, master: Any) -> torch.Tensor | None:
        """The last copy written from ``master``, whatever it became since (its storage, to write into)."""
        entry = self._by_id.get(id(master))
        return entry[2] if entry is not None and entry[0]() is master else None

    def held(self, masters: list) -> int:
        """Bytes of the copies kept for ``masters`` as they are now."""
        return sum(c.numel() * c.element_size() for c in map(self.of, masters) if c is not None)

    def buffer(self, master: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """Where ``master``'s next copy goes: its old copy's storage, or a new tensor."""
        entry = self._by_id.get(id(master))
        if entry is not None and entry[0]() is master and entry[2].dtype == dtype:
            return entry[2]
        return torch.empty(master.shape, dtype=dtype, pin_memory=pin)

    def written(self, master: torch.Tensor, copy: torch.Tensor) -> None:
        """``copy`` now equals ``master`` cast (the version counter read after the write)."""
        key, by_id, version = id(master), self._by_id, getattr(master, "_version", 0)
        entry = by_id.get(key)
        if entry is not None and entry[0]() is master:  # the same master again (each step): no new weakref
            by_id[key] = (entry[0], version, copy)
            return
        by_id[key] = (weakref.ref(master, lambda _: by_id.pop(key, None)), version, copy)
