"""``WorkingMemory``: the peak bytes a region's operators allocate, what the tiling tests check (the CPU has
no allocator statistics)."""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class WorkingMemory(TorchDispatchMode):
    """Accounted working bytes of a region: ``with WorkingMemory() as mem: ...; mem.peak_bytes``.

    Counts the storages that operators create inside the region (forward and backward: the
    autograd engine runs the ops under the same mode) while they are alive; tensors that existed
    before (params, inputs) and views or in-place results of them are not counted. The peak is
    sampled after each operator, so a kernel's internal scratch is not seen. CPU has no allocator
    statistics; this is the stand-in tests check. Cost: a Python call per operator -- for
    measuring, not for training.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current_bytes = self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._note(t.untyped_storage(), inputs)
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        self.current_bytes = sum(n for _, n in self._live.values())
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out

    def _note(self, storage, inputs: set[int]) -> None:
        ref = StorageWeakRef(storage)
        known = self._live.get(ref.cdata)
        if known is not None and not known[0].expired():
            self._live[ref.cdata] = (known[0], storage.nbytes())  # resized in place
        elif ref.cdata not in inputs:  # new memory, not an input returned (in place) or viewed
            self._live[ref.cdata] = (ref, storage.nbytes())
