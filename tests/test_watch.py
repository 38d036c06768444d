"""recipes/watch.py's busy cores: CPU time over wall time, per log interval on the bar and in metrics.jsonl,
over the whole run on the final line; nothing of it on a GPU."""
import itertools
import os
import time

import pytest

from recipes import watch as watch_mod


def clocks(cpu_steps, wall_steps):
    """Fake (cpu, wall) clocks that advance by the given amounts at each pair of reads."""
    cpu, wall = itertools.accumulate(cpu_steps), itertools.accumulate(wall_steps)
    return (lambda: next(cpu)), (lambda: next(wall))


def test_busy_cores_are_cpu_time_over_wall_time_per_lap_and_in_total():
    # reads: start; lap 1; lap 2; total
    cpu, wall = clocks([0, 3.8, 1.0, 0], [0, 2.0, 2.0, 0])
    busy = watch_mod.BusyCores(cpu, wall)
    assert busy.lap() == pytest.approx(min(1.9, len(os.sched_getaffinity(0))))  # two threads, nearly always running
    assert busy.lap() == pytest.approx(0.5)  # the machine shared: a quarter of two cores
    assert busy.total() == pytest.approx(4.8 / 4.0)


def test_busy_cores_never_exceed_the_cores_this_process_may_run_on():
    """Two clock reads in a row: a preemption between them over a short lap must not read as more cores."""
    cpu, wall = clocks([0, 9.0], [0, 1.0])
    assert watch_mod.BusyCores(cpu, wall).lap() == len(os.sched_getaffinity(0))


def test_a_sleeping_process_keeps_no_core_busy():
    busy = watch_mod.BusyCores()
    time.sleep(0.2)
    assert 0 <= busy.lap() < 0.5


def record(tmp_path, threads):
    w = watch_mod.Watch(tmp_path, 0, None, flops_per_token=1.0, peak_flops=None, world=1, threads=threads)
    w.busy = watch_mod.BusyCores(*clocks([0, 0.6, 0, 0], [0, 2.0, 0, 0]))
    bar = w.progress(range(3), 0, 3)
    row = w.record(1, {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0}, 1000.0, [2**20])
    w.close()
    return row, bar, w


def test_on_a_cpu_the_bar_and_the_log_show_the_cores_kept_busy(tmp_path):
    row, bar, w = record(tmp_path, threads=2)
    assert row["cpu_cores"] == 0.3 and "cpu=0.3/2" in bar.postfix
    assert w.cores() == " on 0.30 of 2 cores"  # the whole run so far, for the final line


def test_on_a_gpu_no_cores_are_shown(tmp_path):
    row, bar, w = record(tmp_path, threads=None)
    assert "cpu_cores" not in row and "cpu=" not in bar.postfix and w.cores() == ""
