"""``zf.Mesh.planned(dp=, pp=, sp=, tp=, rank=)``: one rank's place in a mesh, without a process group.

What a dry run slices a model over (``zf.tensor_parallel`` on the meta device: shapes only) to say
what rank ``rank`` of a ``torchrun`` job of ``dp * pp * sp * tp`` processes would hold, from one
plain process. Its sizes and coordinates are ``zf.Mesh``'s layout (``zfunc.dist.mesh.coordinates``);
its comms issue nothing: a collective or a transfer on it raises ``CollectiveError`` naming the
operation, so nothing computed over it passes for a run. Cost: nothing (no group is created).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zfunc.dist.comm import CollectiveError, Comm
from zfunc.dist.p2p import P2P
from zfunc.dist.mesh import Mesh, coordinates


def _refuse(kind: str, label: str) -> CollectiveError:
    return CollectiveError(f"{kind} during {label or 'an unlabelled collective'}: this mesh is planned "
                           "(zf.Mesh.planned: a rank's place without a process group, for dry runs); it runs "
                           "no collective (expected a zf.Mesh of an initialised process group)")


@dataclass
class PlannedComm(Comm):
    """The comm of a planned mesh's group of ``size`` ranks: every collective raises ``CollectiveError``."""

    size: int = 1

    def _run(self, kind: str, nbytes: int, label: str, *args: Any, **kwargs: Any):
        raise _refuse(kind, label)

    def _on_gloo(self) -> bool:
        return False  # no backend: the collective itself is refused

    @property
    def world(self) -> int:
        return self.size


class PlannedP2P(P2P):
    """The point-to-point of a planned mesh: every send and receive raises ``CollectiveError``."""

    def _issue(self, kind: str, op: Any, t: Any, peer: int, label: str, tag: int):
        raise _refuse(kind, label)


def planned(dp: int = 1, pp: int = 1, sp: int = 1, tp: int = 1, rank: int = 0) -> Mesh:
    """Global rank ``rank``'s place in a mesh of ``dp x pp x sp x tp`` ranks (see the module docstring)."""
    sizes = {"pp": pp, "dp": dp, "sp": sp, "tp": tp}
    for name, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {n!r}")
    world = dp * pp * sp * tp
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ValueError(f"rank: expected an int in [0, {world}) (dp * pp * sp * tp), got {rank!r}")
    mesh = object.__new__(Mesh)
    mesh.dp, mesh.pp, mesh.sp, mesh.tp = dp, pp, sp, tp
    coords = coordinates(sizes, rank)
    mesh.pp_rank, mesh.rank, mesh.sp_rank, mesh.tp_rank = coords["pp"], coords["dp"], coords["sp"], coords["tp"]
    mesh.comm, mesh.reduce_comm = PlannedComm(size=dp), PlannedComm(size=dp)
    mesh.pp_comm, mesh.sp_comm, mesh.tp_comm = PlannedComm(size=pp), PlannedComm(size=sp), PlannedComm(size=tp)
    mesh.p2p, mesh.sp_p2p = PlannedP2P(peers=(rank,)), PlannedP2P(peers=(rank,))
    mesh.dp_sp = mesh if sp == 1 else planned(dp * sp, 1, 1, 1, mesh.rank * sp + mesh.sp_rank)
    return mesh
