"""A leaf cut along one dim into equal slices, one per rank: ``Slicing`` (tensor parallelism's cut).

The whole dim (``size`` rows) is first padded with zeros to ``padded`` (a vocab that tp does not
divide: GPT-2's 50257 over 2 ranks is padded to 50258), then cut into ``parts`` equal fused parts (a
fused q/k/v projection: 3), and rank ``r`` of ``tp`` keeps the ``r``-th of ``tp`` equal pieces of
every part, the parts' pieces concatenated. So ``piece`` and ``whole`` are inverse:
``whole([piece(w, r) for r in range(tp)]) == w``, bit for bit (concatenations and a narrow only).

It lives in the core because both sides of a checkpoint read it: ``zfunc.tensor`` cuts params with
it, and ``zf.checkpoint`` records it in the manifest (``as_json`` / ``from_json``) to rebuild a saved
leaf whole, or cut it again for another layout, without knowing tensor parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Slicing:
    """Param sliced along ``dim`` over ``tp`` ranks: ``size`` whole rows padded to ``padded``, in
    ``parts`` fused parts."""

    dim: int
    tp: int
    size: int
    padded: int
    parts: int = 1

    def piece(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of the whole param (a new tensor)."""
        if self.padded > self.size:
            pad = list(whole.shape)
            pad[self.dim] = self.padded - self.size
            whole = torch.cat([whole, whole.new_zeros(pad)], self.dim)
        chunks = whole.chunk(self.parts, self.dim)
        return torch.cat([c.chunk(self.tp, self.dim)[rank] for c in chunks], self.dim).contiguous()

    def whole(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole param (padding dropped) from every rank's piece, in rank order."""
        per_rank = [p.chunk(self.parts, self.dim) for p in pieces]
        parts = [torch.cat([mine[k] for mine in per_rank], self.dim) for k in range(self.parts)]
        return torch.cat(parts, self.dim).narrow(self.dim, 0, self.size)

    def piece_shape(self, whole: tuple[int, ...]) -> tuple[int, ...]:
        """A rank's piece's shape, from the whole param's (``padded / tp`` along ``dim``)."""
        shape = list(whole)
        shape[self.dim] = self.padded // self.tp
        return tuple(shape)

    def as_json(self) -> dict[str, int]:
        """What a checkpoint's manifest records (``size`` is the whole shape's, recorded beside it)."""
        return {"dim": self.dim, "tp": self.tp, "padded": self.padded, "parts": self.parts}

    @classmethod
    def from_json(cls, saved: dict[str, Any], whole: tuple[int, ...]) -> Slicing:
        """The slicing ``as_json`` recorded, of a param of ``whole`` shape."""
        return cls(saved["dim"], saved["tp"], whole[saved["dim"]], saved["padded"], saved["parts"])
