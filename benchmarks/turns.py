"""Trainers in processes of their own, taking turns: each engine timed as a user runs it, alone in its process.

    times, extras = take_turns(build, ["zf-cpu", "ds-cpu", "torch-fb"], world=2, rounds=11, args=(cfg, batch))

Every trainer gets a ``zf.dist.spawn`` of its own (``world`` gloo ranks, its own process group);
rank r calls ``build(name, rank, world, *args) -> (step, extra)`` (module-level, so picklable),
runs whatever warm-up ``build`` does, and then steps only when this process, the coordinator, gives
its trainer the turn: one trainer at a time, in an order shuffled anew each round (the same
``random.Random(round)`` as the one-process benchmarks), while the others sleep on a semaphore.
So the rounds interleave the trainers as a one-process benchmark does (the load this shared machine
sees drifts over seconds, and paired ratios cancel it), but no engine runs in a process that another
engine has set up: its threads, its allocator's state, its OpenMP team and whatever it leaves behind
between calls are its own. Where that matters most is one process of several threads: the
README's results (the offload row) show torch's forward and backward alone slower in a process
where both engines' trainers were built than in one of its own. Costs: a process per rank per
trainer (each holds its own torch and model); the coordinator sleeps on semaphores between turns.

A turn: the coordinator releases the trainer's ``go`` semaphore once per rank; each rank takes it,
meets its peers at a barrier (``torch.distributed.barrier``), times ``step(round)``
(``time.perf_counter``) and releases ``done``; the coordinator takes ``done`` once per rank before
the next turn. A round's time for a trainer is its slowest rank's. If a trainer's spawn fails, the
coordinator stops every trainer (a ``stop`` flag, each ``go`` released) and raises that failure.
"""
from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import zfunc as zf


def _rank(rank: int, world: int, name: str, build: Callable, args: tuple, rounds: int, go, done, stop):
    """One rank of trainer ``name``: build it, then one timed step per turn (module docstring)."""
    try:
        step, extra = build(name, rank, world, *args)
    finally:
        done.release()  # ready (or failed: the coordinator finds out from the spawn)
    times = []
    for r in range(rounds):
        go.acquire()
        if stop.value:
            break
        dist.barrier()
        t0 = time.perf_counter()
        step(r)
        times.append(time.perf_counter() - t0)
        done.release()
    return times, extra


class _Group:
    """One trainer's spawn, run on a thread of this process, and its two semaphores."""

    def __init__(self, ctx, name: str, world: int, build: Callable, args: tuple, rounds: int, stop,
                 timeout_s: float):
        self.name, self.world = name, world
        self.go, self.done = ctx.Semaphore(0), ctx.Semaphore(0)
        self.result: list | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"turns-{name}", daemon=True,
                                       args=(build, args, rounds, stop, timeout_s))

    def _run(self, build, args, rounds, stop, timeout_s) -> None:
        try:
            self.result = zf.dist.spawn(_rank, self.world, self.world, self.name, build, args, rounds, self.go,
                                        self.done, stop, timeout_s=timeout_s)
        except BaseException as e:  # raised again by the coordinator
            self.error = e

    def wait_done(self, groups: list[_Group], deadline: float) -> None:
        """Take ``done`` once per rank; raise the first failure of any group, or on the deadline."""
        for _ in range(self.world):
            while not self.done.acquire(timeout=0.5):
                failed = next((g for g in groups if g.error is not None), None)
                if failed is not None:
                    raise RuntimeError(f"trainer {failed.name!r} failed") from failed.error
                if time.monotonic() > deadline:
                    raise TimeoutError(f"trainer {self.name!r}: no turn ended before the deadline")


def take_turns(build: Callable[..., tuple[Callable[[int], Any], Any]], names: list[str], world: int, rounds: int,
               args: tuple = (), timeout_s: float = 3600.0) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
    """Time trainer ``names`` in spawns of their own, taking turns (module docstring).

    Returns ``(times, extras)``: per name, each round's seconds (the slowest rank's), and each rank's
    ``extra`` from ``build`` (rank order). ``build`` must be a module-level function; ``args`` picklable.
    """
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"names: expected distinct trainer names, got {names!r}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world: expected an int >= 1, got {world!r}")
    ctx = multiprocessing.get_context("forkserver")  # its semaphores travel by name to any start method
    stop = ctx.Value("b", 0)
    groups = [_Group(ctx, n, world, build, args, rounds, stop, timeout_s) for n in names]
    deadline = time.monotonic() + timeout_s
    for g in groups:
        g.thread.start()
    try:
        for g in groups:  # every trainer built and warmed up before the first timed step
            g.wait_done(groups, deadline)
        for r in range(rounds):
            for g in random.Random(r).sample(groups, len(groups)):
                for _ in range(world):
                    g.go.release()
                g.wait_done(groups, deadline)
    except BaseException:
        stop.value = 1
        for g in groups:
            for _ in range(world):
                g.go.release()
        raise
    finally:
        for g in groups:
            g.thread.join(timeout=60)
    failed = next((g for g in groups if g.error is not None), None)
    if failed is not None:
        raise RuntimeError(f"trainer {failed.name!r} failed") from failed.error
    late = [g.name for g in groups if g.result is None]
    if late:
        raise TimeoutError(f"trainers {late}: their processes did not end within 60 s of the last turn")
    times = {g.name: [max(ts) for ts in zip(*(times for times, _ in g.result))] for g in groups}
    extras = {g.name: [extra for _, extra in g.result] for g in groups}
    return times, extras
