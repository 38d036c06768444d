"""The mesh over ``torch.distributed``: the ranks laid out on its axes and each axis's groups and comms.

``Mesh(dp=N)`` wraps the default process group; ``Mesh(dp=N, pp=P)`` adds a pipeline axis and ``Mesh(dp=N, sp=S)`` a
sequence-parallel one (see ``Mesh`` for the layout and its groups). The default process group (gloo for CPU tensors,
NCCL for CUDA) is set up by ``torchrun``'s environment variables or ``spawn`` (``zfunc.dist.launch``). Each axis's
collectives go through a byte-counting ``Comm`` and its transfers through a ``P2P`` (``zfunc.dist.comm``).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch.distributed as dist

from zfunc.core import env
from zfunc.dist.comm import Comm
from zfunc.dist.p2p import P2P

AXES = ("pp", "dp", "sp", "tp")


def global_rank(sizes: dict[str, int], coords: dict[str, int]) -> int:
    """The global rank at ``coords`` (axis -> index, missing: 0) of a mesh of ``sizes`` (axis -> size,
    missing: 1): ``((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank``."""
    rank = 0
    for axis in AXES:
        rank = rank * sizes.get(axis, 1) + coords.get(axis, 0)
    return rank


def coordinates(sizes: dict[str, int], rank: int) -> dict[str, int]:
    """The index along every axis of global rank ``rank`` (the inverse of ``global_rank``)."""
    coords = {}
    for axis in reversed(AXES):
        rank, coords[axis] = divmod(rank, sizes.get(axis, 1))
    return coords


def axis_groups(sizes: dict[str, int], axis: str) -> list[list[int]]:
    """The groups of global ranks that differ only along ``axis``, each in ``axis`` order, the groups
    in global-rank order of their first member (every rank builds the same list)."""
    world = 1
    for n in sizes.values():
        world *= n
    groups = {}
    for rank in range(world):
        coords = coordinates(sizes, rank)
        key = tuple(coords[a] for a in AXES if a != axis)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


class Mesh:
    """A mesh of ``pp * dp * sp * tp`` ranks: ``dp`` data-parallel replicas of a ``pp``-stage pipeline,
    each sequence cut over ``sp`` ranks (``zf.sequence_parallel``), each layer's weights sliced over
    ``tp`` tensor-parallel ranks (``zf.tensor_parallel``).

    ``Mesh(dp=None, pp=1, sp=1, tp=1)`` takes ``dp = world size / (pp * sp * tp)``. The process group
    must be initialised first (``init_from_env()`` under ``torchrun``, or ``spawn``); a single process
    without one gets a trivial mesh of 1.

    Layout (Megatron's order, DeepSpeed-Ulysses' sp inside dp), axes outermost first ``AXES = (pp, dp,
    sp, tp)``: ``global rank = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank``. The axis that
    moves the most per step sits on the nearest ranks: tensor parallelism all-reduces activations in
    every block's forward and backward, sequence parallelism exchanges them at every attention call
    (all-to-all or ring), dp reduces every grad once per step, and the pipeline moves one activation
    per microbatch point to point, so it is the axis that may cross the slowest links.

    ``rank``, ``comm`` and ``reduce_comm`` are over this rank's data-parallel group (the ``dp`` ranks
    holding the same pipeline stage, the same part of each sequence and the same tp slice: dp groups
    exclude sp and tp peers), so ``zf.shard`` works over the dp axis unchanged; ``pp_rank``,
    ``pp_comm`` (collectives: loss and norm sums) and ``p2p`` (activations and grads) are over its
    pipeline group; ``sp_rank``, ``sp_comm`` (Ulysses' all-to-all) and ``sp_p2p`` (ring attention's
    blocks) over its sequence group; ``tp_rank`` and ``tp_comm`` over its tensor-parallel group
    (``tp`` consecutive global ranks). With ``pp = sp = tp = 1`` the mesh is the default process group
    and creates no other groups but ``reduce_comm``'s. ``comm_bytes`` counts the dp, pp and sp comms;
    ``tp_comm.bytes`` counts tp's.

    **Grads of params replicated over sp.** The ``sp`` ranks of a sequence group hold the same params
    and each computes grads from its part of the tokens, as ``dp`` ranks do from their part of the
    batch; so the ranks that reduce grads (and may shard model states) are the ``dp x sp`` ranks of
    one pipeline stage and tp slice: ``dp_sp``, a ``Mesh`` over them (``dp = dp * sp``, rank ``dp_rank
    * sp + sp_rank``; its pp and tp axes and their comms this mesh's), which ``zf.shard`` takes in place of
    a mesh with ``sp > 1`` (DeepSpeed-Ulysses' choice: ZeRO over dp x sp). One reduce-scatter over ``dp *
    sp`` ranks moves what a dp reduce-scatter would, and model states divide by ``dp * sp`` instead of
    ``dp``. Law: with each rank's loss the ``zfunc.sequence`` loss (its tokens' share, scaled by ``sp``),
    the mean over the ``dp x sp`` ranks is the plain step's loss and their mean grad its grad.

    ``ranks_per_node`` (default: torchrun's ``LOCAL_WORLD_SIZE``; None: one node) says which global ranks
    share a node: ranks ``[j * ranks_per_node, (j + 1) * ranks_per_node)`` are node j. ZeRO++'s quantized
    grad reduce-scatter then goes in two levels, inside the node and across (``zfunc.dist.quantized``).
    """

    ranks_per_node: int | None = None  # global ranks per node (``__init__``); None: one node

    def __init__(self, dp: int | None = None, pp: int = 1, sp: int = 1, tp: int = 1,
                 ranks_per_node: int | None = None):
        initialised = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialised else 1
        for name, n in (("pp", pp), ("sp", sp), ("tp", tp)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {n!r}")
        inner = [(n, v) for n, v in (("pp", pp), ("sp", sp), ("tp", tp)) if v > 1]
        if dp is None:
            if world % (pp * sp * tp):
                raise ValueError(f"{', '.join(n for n, _ in inner) or 'pp'}: the world size {world} is not a "
                                 f"multiple of {_product(inner) if len(inner) > 1 else '{}={}'.format(*inner[0])}")
            dp = world // (pp * sp * tp)
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
            raise ValueError(f"dp: expected an int >= 1, got {dp!r}")
        if dp * pp * sp * tp != world:
            axes = [("dp", dp)] + inner
            ranks = f"{dp} ranks" if not inner else f"{_product(axes)} ranks"
            raise ValueError(
                f"{', '.join(n for n, _ in axes)}: the mesh has {ranks} but the process group has world size {world}"
                + ("" if initialised else
                   " (torch.distributed is not initialised: start with torchrun or zf.dist.spawn)")
            )
        self.dp, self.pp, self.sp, self.tp = dp, pp, sp, tp
        self.ranks_per_node = _ranks_per_node(ranks_per_node, world)
        self.dp_sp = self
        if pp == sp == tp == 1:
            self._data_parallel_only(initialised)
        else:
            self._groups(dist.get_rank())

    @classmethod
    def alone(cls) -> Mesh:
        """A mesh of this process alone, whatever the process group: its collectives are copies
        (a plain step's offload runs on one)."""
        mesh = object.__new__(cls)
        mesh.dp, mesh.pp, mesh.sp, mesh.tp = 1, 1, 1, 1
        mesh.dp_sp = mesh
        mesh._data_parallel_only(initialised=False)
        return mesh

    def _data_parallel_only(self, initialised: bool) -> None:
        me = dist.get_rank() if initialised else 0
        self.rank, self.pp_rank, self.sp_rank, self.tp_rank = me, 0, 0, 0
        self.comm = Comm(alone=not initialised)
        # Grad reduce-scatters get a process group (and comm thread) of their own: they run in a
        # fixed order there, independent of the order of param gathers on ``comm``.
        self.reduce_comm = Comm(group=dist.new_group(backend=dist.get_backend()) if initialised else None,
                                alone=not initialised)
        self.pp_comm, self.p2p = Comm(alone=True), P2P(peers=(me,))
        self.sp_comm, self.sp_p2p = Comm(alone=True), P2P(peers=(me,))
        self.tp_comm = Comm(alone=True)

    def _groups(self, rank: int) -> None:
        sizes = {"pp": self.pp, "dp": self.dp, "sp": self.sp, "tp": self.tp}
        coords = coordinates(sizes, rank)
        self.pp_rank, self.rank, self.sp_rank, self.tp_rank = coords["pp"], coords["dp"], coords["sp"], coords["tp"]
        dp_groups, pp_groups = axis_groups(sizes, "dp"), axis_groups(sizes, "pp")
        # Every rank creates every group, in this order (torch.distributed requires it).
        self.comm = Comm(group=_my_group(dp_groups, rank))
        self.reduce_comm = Comm(group=_my_group(dp_groups, rank))
        self.pp_comm = Comm(group=_my_group(pp_groups, rank)) if self.pp > 1 else Comm(alone=True)
        self.p2p = P2P(_my_group(pp_groups, rank), tuple(_mine(pp_groups, rank))) if self.pp > 1 else P2P(peers=(rank,))
        self.tp_comm = Comm(group=_my_group(axis_groups(sizes, "tp"), rank)) if self.tp > 1 else Comm(alone=True)
        if self.sp == 1:
            self.sp_comm, self.sp_p2p = Comm(alone=True), P2P(peers=(rank,))
            return
        sp_groups = axis_groups(sizes, "sp")
        self.sp_comm = Comm(group=_my_group(sp_groups, rank))
        self.sp_p2p = P2P(_my_group(sp_groups, rank), tuple(_mine(sp_groups, rank)))
        self.dp_sp = self._over_dp_sp(sizes, rank)

    def _over_dp_sp(self, sizes: dict[str, int], rank: int) -> Mesh:
        """This mesh with its dp and sp axes merged into one data-parallel axis of ``dp * sp`` ranks (one
        pipeline stage's, one tp slice's); the pp and tp axes and their comms are this mesh's (shared: a
        pipeline over a step sharded on it sends and receives on them)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for r in range(self.pp * self.dp * self.sp * self.tp):
            c = coordinates(sizes, r)
            groups.setdefault((c["pp"], c["tp"]), []).append(r)
        flat = object.__new__(Mesh)
        flat.dp, flat.pp, flat.sp, flat.tp, flat.dp_sp = self.dp * self.sp, self.pp, 1, self.tp, flat
        flat.ranks_per_node = self.ranks_per_node
        flat.rank, flat.pp_rank, flat.sp_rank, flat.tp_rank = self.rank * self.sp + self.sp_rank, self.pp_rank, 0, \
            self.tp_rank
        flat.comm = Comm(group=_my_group(list(groups.values()), rank))
        flat.reduce_comm = Comm(group=_my_group(list(groups.values()), rank))
        flat.pp_comm, flat.p2p, flat.tp_comm = self.pp_comm, self.p2p, self.tp_comm
        flat.sp_comm, flat.sp_p2p = Comm(alone=True), P2P(peers=(rank,))
        return flat

    @property
    def size(self) -> int:
        """Number of data-parallel ranks."""
        return self.dp

    def _comms(self) -> list[Any]:
        return [self.comm, self.reduce_comm, self.pp_comm, self.p2p, self.sp_comm, self.sp_p2p] + (
            [] if self.dp_sp is self else [self.dp_sp.comm, self.dp_sp.reduce_comm])

    def comm_bytes(self) -> dict[str, int]:
        """Bytes per call type counted by the mesh's dp, pp and sp comms since they were cleared."""
        return dict(sum((c.bytes for c in self._comms()), Counter()))

    def clear_comm_bytes(self) -> None:
        for c in self._comms():
            c.bytes.clear()

    def __repr__(self) -> str:
        inner = [(n, getattr(self, n)) for n in ("pp", "sp", "tp") if getattr(self, n) > 1]
        axes = "".join(f", {n}={v}" for n, v in inner)
        ranks = "".join(f", {n}_rank={getattr(self, n + '_rank')}" for n, _ in inner)
        return f"Mesh(dp={self.dp}{axes}, rank={self.rank}{ranks})"


def _ranks_per_node(given: int | None, world: int) -> int | None:
    """The global ranks per node: ``given``, else torchrun's ``LOCAL_WORLD_SIZE``, else None (one node),
    checked to divide the world."""
    n = given if given is not None else env.number("LOCAL_WORLD_SIZE", None, int, lambda v: v >= 1, "an int >= 1")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1 or world % n):
        raise ValueError(f"ranks_per_node: expected an int >= 1 dividing the world size {world}, got {n!r}")
    return n


def _product(axes: list[tuple[str, int]]) -> str:
    """``"dp * tp = 3 * 2 = 6"``: the axes' names, sizes and product."""
    total = 1
    for _, v in axes:
        total *= v
    return " * ".join(n for n, _ in axes) + " = " + " * ".join(str(v) for _, v in axes) + f" = {total}"


def _mine(groups: list[list[int]], rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


def _my_group(groups: list[list[int]], rank: int) -> Any:
    """Create one process group per list of ranks (all ranks take part); return ``rank``'s."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks, backend=dist.get_backend())
        if rank in ranks:
            mine = group
    return mine
