"""Blocks of consecutive ranks inside a ``Comm``'s group: the groups of a two-level collective (the
ranks of one node, then the same position on every node) and of ZeRO++'s hpZ (a secondary copy of
the params held within groups of k ranks).

``blocks(comm, size, purpose)`` cuts ``comm``'s ranks (in its rank order) into blocks of ``size``
consecutive ranks and returns ``Blocks(inner, outer)``: ``inner`` a ``Comm`` over this rank's block,
``outer`` a ``Comm`` over the ranks at this rank's position in every block. Rank ``r`` of ``comm`` is
rank ``r % size`` of ``inner`` and ``r // size`` of ``outer``. Both count their bytes into ``comm``'s
own counter (``Comm.bytes``), under the call types their callers name, so a mesh's ``comm_bytes``
shows them and ``clear_comm_bytes`` clears them.

Cost: process groups are made once per ``(purpose, groups, size)`` and kept for the process's life;
making them is collective over the whole world (``torch.distributed.new_group``), so every rank
calls ``blocks`` with the same arguments in the same order (``zf.shard`` does, when it is built).
Each ``purpose`` gets groups of its own: collectives of one purpose are issued from one comm
thread, and two threads must not share a process group (their calls could interleave differently
on different ranks).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch.distributed as dist

from zfunc.dist.comm import Comm

_made: dict[tuple, tuple[Any, Any]] = {}  # (purpose, all groups, size) -> (inner, outer) process groups of this rank


class Blocks(NamedTuple):
    """``inner``: this rank's block of ``size`` consecutive ranks; ``outer``: one rank of every block,
    those at this rank's position in its block."""

    inner: Comm
    outer: Comm


def blocks(comm: Comm, size: int, purpose: str) -> Blocks:
    """``comm``'s ranks cut into blocks of ``size`` consecutive ranks (module docstring). ``size``
    must divide ``comm.world``; a comm of one process gives two comms of one process."""
    world = comm.world
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or world % size:
        raise ValueError(f"size: expected an int >= 1 dividing the {world} ranks, got {size!r}")
    if comm.alone or world == 1:
        return Blocks(Comm(alone=True, bytes=comm.bytes), Comm(alone=True, bytes=comm.bytes))
    groups = _every_group(comm.group)
    key = (purpose, groups, size)
    if key not in _made:
        _made[key] = _make(groups, size)
    inner, outer = _made[key]
    return Blocks(_over(inner, comm), _over(outer, comm))


def per_node(comm: Comm, ranks_per_node: int | None) -> int:
    """How many of ``comm``'s ranks share each node, nodes being blocks of ``ranks_per_node`` global
    ranks (None: one node): ``comm.world`` for one node. ``ValueError`` unless ``comm``'s ranks, in its
    rank order, fall in blocks of one size, one node each (``blocks`` needs them so)."""
    world = comm.world
    if ranks_per_node is None or comm.alone or world == 1:
        return world
    ranks = dist.get_process_group_ranks(comm.group) if comm.group is not None else list(range(world))
    node = [r // ranks_per_node for r in ranks]
    size = node.count(node[0])
    runs = [node[i : i + size] for i in range(0, world, size)]
    if world % size or any(len(set(run)) != 1 for run in runs) or len({run[0] for run in runs}) != len(runs):
        raise ValueError(f"ranks_per_node: the ranks {ranks} fall on nodes {node} at {ranks_per_node} ranks per "
                         "node; expected blocks of consecutive ranks, one block per node, all of one size")
    return size


def _over(group: Any, comm: Comm) -> Comm:
    """A comm over ``group`` counting into ``comm``'s bytes (a group of this process alone: copies)."""
    if group is None:
        return Comm(alone=True, bytes=comm.bytes)
    return Comm(group=group, bytes=comm.bytes)


def _every_group(group: Any) -> tuple[tuple[int, ...], ...]:
    """The global ranks of every group of the partition ``group`` belongs to (the mesh's dp groups:
    one per pipeline stage and tp slice), each in group-rank order: one all-gather of each rank's
    group over the world; the default group alone needs none."""
    mine = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    if len(mine) == dist.get_world_size():
        return (mine,)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return tuple(sorted(set(everyone)))


def _make(groups: tuple[tuple[int, ...], ...], size: int) -> tuple[Any, Any]:
    """Every block and every cross-block group of every group, made by every rank in one order;
    this rank's two (None where this rank's would hold it alone)."""
    inner = _make_cut(groups, lambda ranks: [ranks[i : i + size] for i in range(0, len(ranks), size)])
    outer = _make_cut(groups, lambda ranks: [ranks[j::size] for j in range(size)])
    return inner, outer


def _make_cut(groups: tuple[tuple[int, ...], ...], cut) -> Any:
    """The process groups ``cut(ranks)`` makes of every group, in order; the one holding this rank."""
    me, backend, mine = dist.get_rank(), dist.get_backend(), None
    for ranks in groups:
        for members in cut(ranks):
            made = dist.new_group(list(members), backend=backend) if len(members) > 1 else None
            if me in members:
                mine = made
    return mine
