"""Which tokens of each sequence a rank of a sequence-parallel group computes.

Every rank of an ``sp`` group is given the same whole batch (``(B, T)`` token ids, as every rank of a
pipeline is); the sequence-parallel model takes its rank's tokens, ``T / sp`` of each sequence, at its
entry (``SequenceLayout.take``), and the loss takes the same tokens of the labels. Two layouts:

- ``"contiguous"`` (Ulysses): rank ``r`` holds tokens ``[r T/sp, (r+1) T/sp)``; Ulysses' all-to-all
  concatenates the ranks' tokens in rank order, which is then the sequence's own order.
- ``"balanced"`` (ring): the sequence is cut in ``2 sp`` chunks and rank ``r`` holds chunks ``r`` and
  ``2 sp - 1 - r`` (a causal mask's work is then the same on every rank: early chunks attend to few
  keys, late ones to many, and each rank has one of each).

Law: the ranks' ``index`` together cover ``range(T)`` once. Cost: an index of ``T / sp`` positions;
``take`` copies ``T / sp`` tokens of each sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "balanced")


@dataclass(frozen=True)
class SequenceLayout:
    """Rank ``rank`` of ``sp`` holds the tokens ``index(T)`` of every sequence of length ``T``."""

    sp: int = 1
    rank: int = 0
    kind: str = "contiguous"

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise ValueError(f"kind: expected one of {LAYOUTS}, got {self.kind!r}")
        if not 0 <= self.rank < self.sp:
            raise ValueError(f"rank: expected 0 <= rank < sp={self.sp}, got {self.rank}")

    @property
    def parts(self) -> int:
        """The number of equal chunks a sequence is cut into: ``sp`` (contiguous) or ``2 sp`` (balanced)."""
        return self.sp if self.kind == "contiguous" or self.sp == 1 else 2 * self.sp

    def chunks(self) -> tuple[int, ...]:
        """The chunks (of ``parts``) this rank holds, in the order it holds them."""
        if self.parts == self.sp:
            return (self.rank,)
        return (self.rank, 2 * self.sp - 1 - self.rank)

    def check(self, length: int, what: str = "the sequence") -> None:
        if length % self.parts:
            raise ValueError(f"{what}: length {length} does not split into {self.parts} equal chunks over sp={self.sp} "
                             f"({self.kind} layout); use a length that is a multiple of {self.parts}")

    def index(self, length: int, device: torch.device | str | None = None) -> torch.Tensor:
        """This rank's token positions (``int64``, ascending within each chunk) in a ``length``-token sequence."""
        self.check(length)
        size = length // self.parts
        return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in self.chunks()])

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``x`` along ``dim`` (the sequence dim)."""
        if self.sp == 1:
            return x
        length = x.shape[dim]
        self.check(length)
        size = length // self.parts
        return torch.cat([x.narrow(dim, c * size, size) for c in self.chunks()], dim=dim)
