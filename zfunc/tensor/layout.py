"""How a tensor-parallel model's params are sliced: ``Slicing`` per param, ``Layout`` per model.

A sliced param is the whole one cut along one dim (``zfunc.core.slicing.Slicing``: padded, in fused
parts, one equal piece per tp rank; ``piece`` and ``whole`` are inverse).

The padded rows are zeros and stay zeros: no token looks them up, the gathered logits drop their
columns, so their grads are zero, and AdamW leaves a zero param with zero grads at zero.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zfunc.core.slicing import Slicing

__all__ = ["Layout", "Slicing", "layout_of", "record"]


@dataclass
class Layout:
    """A tensor-parallel model's slicing: param name -> ``Slicing`` (params not named are
    replicated), the ``tp`` size and this process's ``rank``, and what was patched (module name ->
    {attribute: (whole value, this rank's value)}), for the record and for errors."""

    tp: int
    rank: int
    slicings: dict[str, Slicing] = field(default_factory=dict)
    patched: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    styles: dict[str, str] = field(default_factory=dict)  # module name -> its style
    sequence_parallel: bool = False
    comm: Any = None  # the tp group's Comm (``zf.Mesh.tp_comm``)
    embeddings: frozenset = frozenset()  # the modules in ``styles`` that are embeddings (vocab lookups)
    tiled: frozenset = frozenset()  # layers zf.tile split (their tiles are in ``styles``: one vocab layer each)

    def whole(self, name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Param ``name`` whole from every rank's piece (replicated: rank 0's)."""
        s = self.slicings.get(name)
        return pieces[0] if s is None else s.whole(pieces)

    def piece(self, name: str, whole: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank ``rank``'s (default: this rank's) piece of param ``name`` given whole."""
        s = self.slicings.get(name)
        return whole if s is None else s.piece(whole, self.rank if rank is None else rank)

    def whole_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """Param ``name``'s whole shape (padding dropped) from this rank's piece's ``local`` shape."""
        s = self.slicings.get(name)
        if s is None:
            return tuple(local)
        shape = list(local)
        shape[s.dim] = s.size
        return tuple(shape)

    def materializer(self, fn: Any) -> Any:
        """``fn`` (a ``zf.materialize`` materializer of the whole model's leaves) made to give this rank's
        pieces: each sliced leaf is made whole (one whole leaf at a time), then cut; rows asked of a
        piece are cut from it."""
        from zfunc.model.materialize import leaf

        def piece(name: str, like: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
            if name not in self.slicings:
                return leaf(fn, name, like, rows)
            whole = leaf(fn, name, torch.empty(self.whole_shape(name, tuple(like.shape)), dtype=like.dtype,
                                               device="meta"))
            mine = self.piece(name, whole)
            return mine if rows is None else mine[rows]

        return piece

    def gather(self, params: dict[str, torch.Tensor], comm: Any) -> dict[str, torch.Tensor]:
        """Every param of ``params`` (this rank's pieces, by name) whole: one all-gather over the tp
        ``comm`` per sliced param (a collective: every rank of the group calls it)."""
        out = {}
        for name, p in params.items():
            s = self.slicings.get(name)
            if s is None or self.tp == 1:
                out[name] = p if s is None else s.whole([p])
                continue
            p = p.detach().contiguous()
            buf = torch.empty((self.tp, *p.shape), dtype=p.dtype, device=p.device)
            comm.all_gather(buf, p, label=f"tensor parallel: param '{name}' made whole")
            out[name] = s.whole(list(buf.unbind(0)))
        return out


_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, Layout] = weakref.WeakKeyDictionary()


def record(model: nn.Module, layout: Layout) -> None:
    _LAYOUTS[model] = layout


def layout_of(model: nn.Module) -> Layout | None:
    """The ``Layout`` ``zf.tensor_parallel`` gave ``model``; None for a model it did not slice."""
    return _LAYOUTS.get(model)
