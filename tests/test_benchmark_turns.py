"""benchmarks/turns.py: trainers in processes of their own step one at a time, in each round's shuffled order."""
import os
import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.turns import take_turns  # noqa: E402

pytestmark = pytest.mark.multiprocess


def logging_trainer(name: str, rank: int, world: int, log: str):
    """A step that sleeps 20 ms and appends ``name rank round start end`` (CLOCK_MONOTONIC) to ``log``."""
    def step(r: int) -> None:
        t0 = time.monotonic()
        time.sleep(0.02)
        with open(log, "a") as f:
            f.write(f"{name} {rank} {r} {t0} {time.monotonic()}\n")
    return step, (name, rank, os.getpid())


def failing_trainer(name: str, rank: int, world: int):
    if name == "bad" and rank == 1:
        raise ValueError("no such engine")
    return (lambda r: None), None


def test_each_trainer_steps_alone_in_its_own_processes_in_each_rounds_shuffled_order(tmp_path):
    log = tmp_path / "steps.log"
    names = ["a", "b", "c"]
    times, extras = take_turns(logging_trainer, names, world=2, rounds=3, args=(str(log),), timeout_s=120)

    assert set(times) == set(names) and all(len(t) == 3 and min(t) >= 0.02 for t in times.values())
    pids = {n: {pid for _, _, pid in extras[n]} for n in names}
    assert [rank for _, rank, _ in extras["a"]] == [0, 1]
    assert all(len(p) == 2 for p in pids.values()) and not set.intersection(*pids.values())  # processes of its own
    steps = [line.split() for line in log.read_text().splitlines()]
    turns = {}  # (round, name) -> the turn's interval over both ranks
    for name, rank, r, t0, t1 in steps:
        lo, hi = turns.get((int(r), name), (float("inf"), 0.0))
        turns[(int(r), name)] = (min(lo, float(t0)), max(hi, float(t1)))
    assert len(steps) == 3 * 3 * 2 and len(turns) == 9
    ordered = sorted(turns, key=lambda k: turns[k][0])
    for r in range(3):
        assert [n for rr, n in ordered if rr == r] == random.Random(r).sample(names, 3)
    for earlier, later in zip(ordered, ordered[1:]):  # one turn ends before the next begins
        assert turns[earlier][1] <= turns[later][0]


def test_a_trainer_that_fails_stops_every_trainer_and_is_named():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="trainer 'bad' failed") as info:
        take_turns(failing_trainer, ["good", "bad"], world=2, rounds=50, timeout_s=120)
    assert "no such engine" in str(info.value.__cause__)
    assert time.monotonic() - t0 < 60


def test_take_turns_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"names: expected distinct trainer names, got \['a', 'a'\]"):
        take_turns(failing_trainer, ["a", "a"], world=1, rounds=1)
    with pytest.raises(ValueError, match="world: expected an int >= 1, got 0"):
        take_turns(failing_trainer, ["a"], world=0, rounds=1)
