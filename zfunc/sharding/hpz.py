"""ZeRO++'s hpZ (Wang et al., 2023, "hierarchical partitioning"): stage 3 keeps a secondary copy of
the params within groups of k ranks, so backward's re-gather stays inside the group.

``zf.shard(step, mesh, 3, hpz=k)`` cuts the dp ranks into groups of k consecutive ranks
(``zfunc.dist.hierarchy.blocks``: k = the ranks of a node keeps the re-gather on the node's fast links).
A unit's first gather in a microbatch (its forward) is the usual all-gather over all N ranks, from
the fp32 master pieces (in int8 with ``quantize_weights``). Each rank then keeps 1/k of the
gathered flat buffer (``world * segment`` values in the compute dtype): its *secondary* piece. Every
later gather of that unit in the microbatch (backward, a recomputed forward, a tied head read again)
all-gathers the k secondary pieces of its group instead.

**Law.** The re-gathered buffer holds the very bits the first gather produced, so the step equals the
step without hpZ bit for bit, and hence the plain step (tests/test_hpz.py: 4 ranks, k = 2).

**Cost.** Bytes: the backward gathers move ``2 Psi`` (bf16; ``4 Psi`` at fp32) as before but within
the group, counted as "hpz_all_gather" (``dist.Comm``, output bytes, as "all_gather" counts); the
N-rank "all_gather" carries the forward's only. Memory: the secondary pieces of every unit, held
from a unit's first gather to the end of the microbatch: ``(padded params) / k`` in the compute dtype
per rank (``ShardedStep.memory``'s ``secondary_params``), DeepSpeed's secondary partition.
"""
from __future__ import annotations

from typing import Any

import torch

from zfunc.ops.cpu import hostmem
from zfunc.sharding.prefetch import Gatherer

KIND = "hpz_all_gather"  # the byte counter's call type of the re-gathers inside a group


class SecondaryGatherer(Gatherer):
    """A ``Gatherer`` whose re-gathers of a unit read the secondary pieces of ``group`` (a ``Comm``
    over this rank's k ranks; module docstring)."""

    def __init__(self, *args: Any, group: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.group = group
        self.secondary: dict[int, torch.Tensor] = {}  # unit -> this rank's 1/k of its gathered buffer

    def _launch(self, u: int) -> None:
        own = self.secondary.get(u)
        if own is None:
            super()._launch(u)
            return
        out = hostmem.transient(own.numel() * self.group.world, own.dtype, own.device)
        self._issue(u, self.group, out, own, kind=KIND)

    def ensure(self, u: int) -> None:
        if self.gathered.get(u):
            return
        if u not in self.inflight:
            self._launch(u)
        out = self.inflight[u][1]
        super().ensure(u)
        if u not in self.secondary:  # the first gather: keep this rank's share of it
            self.secondary[u] = out.view(self.group.world, -1)[self.group_rank].clone()

    @property
    def group_rank(self) -> int:
        """This rank's place in its group: the dp rank modulo k."""
        return self.spec.rank % self.group.world


def secondary_bytes(units: list, world: int, k: int, dtype: torch.dtype) -> int:
    """The bytes of one rank's secondary pieces of ``units`` (``FlatGroup``s) over ``world`` ranks in
    groups of ``k``: ``world * segment / k`` values of ``dtype`` per unit."""
    return sum(unit.segment * world // k for unit in units) * torch.empty((), dtype=dtype).element_size()
