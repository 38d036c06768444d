"""A run's measured bubble in the terms of the schedule's theory (``zfunc.pipelining.check``).

Input: one step's ``step.timings`` from every rank of a pipeline, in rank order (each rank's
``t0``, ``step_s``, ``compute_s`` and ``ops``: ``(kind, microbatch, start_s, end_s, stage,
busy_s)``, ``PipelineStep``'s docstring). Their ``t0`` are ``time.perf_counter()`` readings: they
share a clock when the ranks share a host (Linux's monotonic clock), which ``bubble`` needs.

- ``bubble(timings)``: each rank's idle fraction of the pipeline's makespan, from the first
  rank's start to the last rank's end: ``1 - compute_s / makespan``, what ``check``'s
  ``Timeline.bubble`` states for a schedule. (A rank's own ``timings["bubble"]`` divides by its
  own span instead, which leaves out the time it waits, done, for the others: the last stage of
  1F1B ends first, 1 - 12/13 of the span where the theory says 1 - 12/15 at p = 2, m = 4.)
- ``implied(plan, timings)``: ``check(plan, costs)`` with each op's measured ``busy_s``, the
  bubble the schedule implies for exactly those op times (each op's ``busy_s`` includes the
  runtime's work for it). The measured ``bubble`` exceeds it by what the schedule leaves out:
  the transfers' latency, a rank's late start, its time after its last op (the last sends).

Law: a run whose ops take their ``busy_s`` and start when ``check``'s simulation starts them
measures the simulation's bubble: ``bubble(t) == implied(plan, t).bubble``. Why per op and per
step, not a median op time per (kind, stage): the makespan is the longest chain of ops across
the ranks, and op times that vary (a shared CPU) lengthen it beyond the chain of median times;
the schedule is not to blame for that. Cost: O(ops) plus one ``check``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zfunc.pipelining.check import Timeline, check
from zfunc.pipelining.schedules import Schedule


def op_costs(timings: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int, int], float]:
    """Each op's measured busy time, ``(kind, microbatch, stage) -> busy_s``, over every rank's ``timings``."""
    return {(kind, i, stage): busy for t in timings for kind, i, _, _, stage, busy in t["ops"]}


def makespan(timings: Sequence[Mapping[str, Any]]) -> float:
    """From the first rank's start to the last rank's end (one clock: see the module docstring)."""
    return max(t["t0"] + t["step_s"] for t in timings) - min(t["t0"] for t in timings)


def bubble(timings: Sequence[Mapping[str, Any]]) -> tuple[float, ...]:
    """Each rank's idle fraction of the pipeline's makespan (``check``'s definition)."""
    span = makespan(timings)
    return tuple(1.0 - t["compute_s"] / span if span > 0 else 0.0 for t in timings)


def implied(plan: Schedule, timings: Sequence[Mapping[str, Any]]) -> Timeline:
    """``plan``'s simulated run with each op taking its measured ``busy_s``."""
    return check(plan, {**dict.fromkeys("FBIW", 0.0), **op_costs(timings)})
