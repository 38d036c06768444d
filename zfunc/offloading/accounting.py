"""The bytes of an offloaded step by place and kind: what ``OffloadedStep.memory`` reports, and the
formulas ``zfunc.plan`` predicts with.

For a rank holding ``P_r`` elements of its param pieces (``zf.shard``'s split; ``P`` whole), ``e``
the compute dtype's bytes, ``k`` the optimizer's bytes per param (8 for Adam), ``M`` the masters'
place (``params`` if given, else the optimizer's: the fp32 masters live with the optimizer state):

- ``masters``, at ``M``: ``4 P_r`` (between steps);
- ``optimizer``, at the optimizer's place: ``k P_r`` (between steps);
- ``compute_params``, on the device with ``params=None``: ``e P_r`` (between steps; on a CPU device
  at fp32 the RAM master is itself the compute param: the same bytes as ``masters``); in host RAM
  with ``params="cpu"`` below fp32: ``e P_r`` (the copy the update writes);
- ``whole_params``, on the device during the step: ``e P`` (stages 1/2), the live units (stage 3);
- ``held_grads``, at the optimizer's place during the step, when the update waits for backward (a
  clip, fp16, ``grad_norm=True``, accumulation): ``e P_r`` alone, ``4 P_r`` over ranks or with
  accumulation (fp32 sums); with the optimizer on NVMe, in host RAM instead when they fit in the
  step's ``chunk_bytes`` (``ram_bytes``);
- ``grad_buckets``, on the device during backward: at most ``GRAD_BUCKETS`` groups (buckets;
  stage 3: units), the one backward is filling and the one on its way to the host.

With overlap (no clip, no fp16, accumulation 1) nothing is held: each unit is updated as its grads
arrive. On a CPU device "device" and "host" are the same RAM: the host buffers are the grads.
Swap files of the state take twice their logical bytes on disk (the engine keeps a spare of each);
the held grads' scratch files take their bytes once.
"""
from __future__ import annotations

PLACES = ("device", "cpu", "nvme")
GRAD_BUCKETS = 2  # the group backward is filling and the one being reduced / copied to the host


def elem(precision: str) -> int:
    """Bytes of the compute dtype."""
    return 4 if precision == "fp32" else 2


def resting(mine: float, *, precision: str, optimizer: str, params: str | None,
            optimizer_bytes: int = 8) -> dict[str, dict[str, float]]:
    """Bytes kept between steps, by place and kind (module docstring's table)."""
    e, masters = elem(precision), params or optimizer
    out: dict[str, dict[str, float]] = {p: {} for p in PLACES}
    out[masters]["masters"] = 4 * mine
    out[optimizer]["optimizer"] = optimizer_bytes * mine
    if params is None:
        out["device"]["compute_params"] = e * mine
    elif params == "cpu" and e < 4:
        out["cpu"]["compute_params"] = e * mine
    return out


def held_grads(mine: float, *, precision: str, optimizer: str, world: int, accum: int, held: bool,
               ram_bytes: float = 0) -> dict[str, float]:
    """Bytes of grads held for the norm during a step, by place: the optimizer's (RAM or its swap
    files), but host RAM where the optimizer is on NVMe and they fit in ``ram_bytes`` (the step's
    ``chunk_bytes``: ``spills``); none when ``held`` is False (updated on arrival)."""
    if not held:
        return {}
    nbytes = (elem(precision) if world == 1 and accum == 1 else 4) * mine
    return {"nvme" if spills(nbytes, optimizer, ram_bytes) else "cpu" if optimizer == "nvme" else optimizer: nbytes}


def spills(nbytes: float, optimizer: str, ram_bytes: float) -> bool:
    """Whether ``nbytes`` of held grads go to swap files (``SpilledGrads``): with the optimizer on
    NVMe, when more than ``ram_bytes``. Within it, RAM holds them (``HeldSlices``): no disk write
    and read-back per step, and no more RAM than the ``2 * chunk_bytes`` of grad writes a spill
    keeps in flight."""
    return optimizer == "nvme" and nbytes > ram_bytes


def totals(by_kind: dict[str, dict[str, float]]) -> dict[str, float]:
    """Bytes per place."""
    return {place: sum(kinds.values()) for place, kinds in by_kind.items()}
