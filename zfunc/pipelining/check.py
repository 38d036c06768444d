"""The schedule checker: what a ``Schedule`` does, proved before anything runs (pure, no ranks).

``check(schedule)`` refuses a schedule that would not compute each microbatch's grads exactly
once, or would deadlock, and returns its ``Timeline``: every op's start and end with given op
costs, each rank's idle fraction (its bubble) and its peak of live microbatches.

**What is checked.** Every virtual stage runs on one rank; each ``(microbatch, stage)`` has one
``F`` and either one ``B`` or one ``I`` and one ``W``, on the stage's rank, the ``B`` or ``I``
after the ``F`` and the ``W`` after the ``I``. **Deadlock freedom** by simulation of what the
runner does: an op starts when its rank has finished the op before it and what it needs has
arrived (``F`` of stage ``k > 0``: the ``F`` of stage ``k - 1``; ``B``/``I`` of stage ``k``
below the last: the ``B``/``I`` of stage ``k + 1``); sends never block (the runner posts them
and waits for them at the end of the step), and every message has its own tag, so the order in
which a rank posts its receives does not matter. The ops of a rank run in a fixed order and
their dependencies are data, so the schedule either finishes under every timing or deadlocks
under every timing: one simulation decides it. A deadlock is a ``ValueError`` naming each stuck
rank's next op and what it waits for.

**Costs.** ``costs`` per kind, default ``F = I = W = 1`` and ``B = I + W = 2`` (a backward costs
about two forwards; zero-bubble splits it in two), communication free; a key ``(kind, stage)``
sets one virtual stage's, a key ``(kind, microbatch, stage)`` one op's (measured op times: the
bubble the schedule implies for them, which a run's measured bubble exceeds by its transfers'
latency; ``zfunc.pipelining.measured``). The bubble of a rank is
``1 - busy / makespan``: for 1F1B, ``(p - 1) / (m + p - 1)``. Cost of the check: O(ops x ranks)
in the worst case, a few milliseconds at p = 8, m = 32.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zfunc.pipelining.schedules import Op, Schedule

UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Timeline:
    """A checked schedule's simulated run: ``spans[r]`` each op of rank ``r`` with its start and
    end; ``makespan``; ``bubble[r]`` the fraction of the makespan rank ``r`` is idle;
    ``peak_live[r]`` the most microbatches (per virtual stage) whose activations it holds at once."""

    schedule: Schedule
    spans: tuple[tuple[tuple[Op, float, float], ...], ...]
    makespan: float
    bubble: tuple[float, ...]
    peak_live: tuple[int, ...]


def _refuse(what: str) -> ValueError:
    return ValueError(f"schedule: {what}")


def _check_ops(schedule: Schedule) -> None:
    """Each (microbatch, stage) backed once, on the stage's rank, in a valid order."""
    m, count = schedule.microbatches, len(schedule.ranks)
    for r, row in enumerate(schedule.ops):
        seen: set[Op] = set()
        for op in row:
            if not 0 <= op.stage < count or schedule.ranks[op.stage] != r:
                where = schedule.ranks[op.stage] if 0 <= op.stage < count else "no rank"
                raise _refuse(f"rank {r} runs {op}, but stage {op.stage} is on {where}")
            if op.microbatch >= m:
                raise _refuse(f"rank {r} runs {op}: microbatch {op.microbatch} of {m}")
            if op in seen:
                raise _refuse(f"rank {r} runs {op} twice")
            before = {"B": ("F",), "I": ("F",), "W": ("I",)}.get(op.kind, ())
            for kind in before:
                if Op(kind, op.microbatch, op.stage) not in seen:
                    raise _refuse(f"rank {r} runs {op} before {Op(kind, op.microbatch, op.stage)}")
            if op.kind in "BI" and Op("B" if op.kind == "I" else "I", op.microbatch, op.stage) in seen:
                raise _refuse(f"rank {r} runs both a whole backward and an input-grad op for microbatch "
                              f"{op.microbatch} of stage {op.stage}")
            seen.add(op)
        for k in schedule.stages_of(r):
            for i in range(m):
                backed = Op("B", i, k) in seen or (Op("I", i, k) in seen and Op("W", i, k) in seen)
                if Op("F", i, k) not in seen or not backed:
                    raise _refuse(f"rank {r} never runs the forward and backward (B, or I and W) of microbatch {i} "
                                  f"on stage {k}")


def _needs(op: Op, last: int) -> Op | None:
    """The op of another stage whose result ``op`` waits for (None: none)."""
    if op.kind == "F":
        return Op("F", op.microbatch, op.stage - 1) if op.stage > 0 else None
    if op.kind in "BI" and op.stage < last:
        return Op("B", op.microbatch, op.stage + 1)  # or its "I": _done looks up either
    return None


def check(schedule: Schedule, costs: Mapping[str | tuple[str, int] | tuple[str, int, int], float] | None = None
          ) -> Timeline:
    """Refuse ``schedule`` if it computes some grad other than once or deadlocks; else its
    ``Timeline`` under ``costs`` (per kind, default ``UNIT_COSTS``, per ``(kind, stage)`` or per op,
    ``(kind, microbatch, stage)``, the most specific key found). See the module docstring."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule: expected a zfunc.pipelining.Schedule, got {type(schedule).__name__}")
    costs = {**UNIT_COSTS, **(costs or {})}
    _check_ops(schedule)
    last = len(schedule.ranks) - 1
    p = schedule.stages
    finish: dict[tuple[str, int, int], float] = {}  # ("F" | "G", microbatch, stage): when its output is there

    def arrived(op: Op) -> float | None:
        need = _needs(op, last)
        if need is None:
            return 0.0
        return finish.get(("F" if need.kind == "F" else "G", need.microbatch, need.stage))

    pc, clock = [0] * p, [0.0] * p
    spans: list[list[tuple[Op, float, float]]] = [[] for _ in range(p)]
    remaining = sum(len(row) for row in schedule.ops)
    while remaining:
        progressed = False
        for r in range(p):
            row = schedule.ops[r]
            while pc[r] < len(row):
                op = row[pc[r]]
                ready = arrived(op)
                if ready is None:
                    break
                start = max(clock[r], ready)
                cost = costs.get((op.kind, op.microbatch, op.stage))
                clock[r] = end = start + (costs.get((op.kind, op.stage), costs[op.kind]) if cost is None else cost)
                spans[r].append((op, start, end))
                if op.kind in "FBI":
                    finish[("F" if op.kind == "F" else "G", op.microbatch, op.stage)] = end
                pc[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r} at {schedule.ops[r][pc[r]]} waits for {_needs(schedule.ops[r][pc[r]], last)}"
                     for r in range(p) if pc[r] < len(schedule.ops[r])]
            raise _refuse("deadlock: " + "; ".join(stuck))
    makespan = max(clock, default=0.0)
    busy = [sum(end - start for _, start, end in row) for row in spans]
    bubble = tuple(1.0 - b / makespan if makespan else 0.0 for b in busy)
    return Timeline(schedule, tuple(tuple(row) for row in spans), makespan, bubble,
                    tuple(peak_live(row) for row in schedule.ops))


def peak_live(ops: tuple[Op, ...]) -> int:
    """The most forwards of ``ops`` whose activations are held at once: an ``F`` holds them until
    its ``B`` or ``W``."""
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1 if op.kind in "BW" else 0
        peak = max(peak, live)
    return peak
