"""The params an offloaded step's units gather: compute copies where the device keeps them, else
masters read ahead from RAM or their swap files (``StoredPieces``, the run's params source).

A leaf's piece is its compute-dtype copy where the last update wrote one (``ComputeCopies``), else
its master, read from the store ahead of use in the order the last step read them (``ReadAhead``);
a master in RAM is itself the piece. The reads of this pass (forward, or backward's) go through a
store of their own, apart from the update's reads of the same files.
"""
from __future__ import annotations

from typing import Any

import torch

from zfunc.core import tree
from zfunc.core.roles import Role, RunContext
from zfunc.offloading.copies import ComputeCopies
from zfunc.offloading.run import LeafUpdate
from zfunc.offloading.store import ReadAhead, Store


class _Pieces:
    """The param pieces, as ``shard``'s gatherers index them: a leaf's compute copy where the
    last update wrote one (``copies[i]``), else its master, read from the store on access."""

    def __init__(self, masters: list, reader: ReadAhead, copies: list):
        self.masters, self.reader, self.copies = masters, reader, copies

    def __len__(self) -> int:
        return len(self.masters)

    def __getitem__(self, i: int) -> torch.Tensor:
        copy = self.copies[i]
        return self.reader.get(i) if copy is None else copy


class StoredPieces(Role):
    """Params source of an offloaded step: a leaf's compute copy where the last update wrote one
    (``ComputeCopies``: with ``params=None``, the compute-dtype params the device keeps), else its
    master, read from the store ahead of use (a RAM master is itself the piece), in the order the
    last step read them (``fetch_order``, ``ReadAhead``); it learns this call's order."""

    def __init__(self, context: RunContext, update: LeafUpdate, compute_copies: ComputeCopies,
                 where_params: str | None, fetch_order: list[int]):
        self.context, self.compute_copies, self.where_params = context, compute_copies, where_params
        # a store of its own: a packed file's read serves its members' fetches of this pass (forward, or
        # backward's), apart from the update's reads of the same file (which it writes back into)
        store = Store(update._param_store.engine, update._param_store.pin)
        self._reader = ReadAhead(lambda i: store.fetch(update._masters[i]), update._leaf_bytes,
                                 fetch_order, update.chunk_bytes)
        if where_params is not None:  # the units' params come from the stores: their first reads start with the call
            self._reader.start()

    def finish(self) -> dict[str, Any]:
        return {"fetch_order": self._reader.seen}  # the next step reads ahead in this order

    def device(self, pieces) -> torch.device:
        return self.context.spec.device

    def pieces(self, params) -> tuple[Any, Any]:
        masters, treespec = tree.flatten(params)
        copies = [self.compute_copies.of(m) for m in masters]
        if self.where_params is None and all(c is not None or isinstance(m, torch.Tensor)
                                             for m, c in zip(masters, copies)):
            return [m if c is None else c for m, c in zip(masters, copies)], treespec
        return _Pieces(masters, self._reader, copies), treespec


