"""What a user watches while a recipe trains: rank 0's progress bar, OUT/metrics.jsonl, OUT/loss.png.

The bar shows loss, tokens/s, MFU (on a GPU with a known peak), each rank's peak memory and, on a CPU,
the cores rank 0 kept busy against the threads it computes on (``cpu=1.9/2``: its CPU time over wall
time since the last log; on a shared machine fewer, and tokens/s falls faster than they do).
``metrics.jsonl`` gets one JSON object per logged step (``step``, ``loss``, ``lr``, ``grad_norm``,
``tokens_per_s``, ``peak_mem_mb`` per rank, ``mfu`` when known, ``cpu_cores`` on a CPU; an eval step
adds ``val_loss``); ``loss.png`` plots train and val loss against step, redrawn at each eval
(``recipes.plot``: numpy and zlib, nothing to install). A resumed run keeps the lines up to its
checkpoint's step and appends; lines a crash tore (cut mid-write, or not UTF-8) are set aside in
``metrics.jsonl.torn-<UTC time>``, named in a warning. Ranks other than 0 print nothing.
"""
from __future__ import annotations

import json
import math
import os
import resource
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from recipes import plot as plot_mod


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: allocated CUDA memory on a GPU, else resident set size (RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def every_rank(value: Any, world: int) -> list[Any]:
    """``value`` of each rank, on every rank (a collective when ``world > 1``)."""
    if world == 1:
        return [value]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def split_log(raw: bytes, resumed_at: int) -> tuple[list[bytes], list[bytes]]:
    """(lines to keep, lines to set aside) of a metrics log's bytes, each ending in a newline: a
    record of a step up to ``resumed_at`` is kept, a later one dropped (the resumed run logs it
    again); a line that is not UTF-8 JSON of a record with a numeric step is set aside."""
    kept, torn = [], []
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            step = json.loads(line.decode("utf-8"))["step"]
            if not isinstance(step, (int, float)):
                raise TypeError(step)
        except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
            torn.append(line + b"\n")
            continue
        if step <= resumed_at:
            kept.append(line + b"\n")
    return kept, torn


def _unused(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ... : the first name not taken."""
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _mem(mb: list[float]) -> str:
    if len(mb) <= 4:
        return "/".join(f"{m:,.0f}" for m in mb) + "M"
    top = max(range(len(mb)), key=mb.__getitem__)
    return f"max {mb[top]:,.0f}M (rank {top})"


class BusyCores:
    """How many cores this process keeps busy: the CPU time of all its threads over wall time, since it
    was made (``total``) and since the last ``lap``. Cost: two clock reads each."""

    def __init__(self, cpu_clock: Callable[[], float] = time.process_time,
                 wall_clock: Callable[[], float] = time.perf_counter):
        self.cpu_clock, self.wall_clock = cpu_clock, wall_clock
        self.start = self.last = (cpu_clock(), wall_clock())

    def _now(self) -> tuple[float, float]:
        return self.cpu_clock(), self.wall_clock()

    @staticmethod
    def _between(mark: tuple[float, float], now: tuple[float, float]) -> float:
        """CPU time over wall time, at most the cores this process may run on: the two clocks are
        read one after the other, so over a short lap a preemption between them can push the ratio
        past what the machine can do."""
        cpu, wall = now[0] - mark[0], now[1] - mark[1]
        return min(cpu / wall, float(len(os.sched_getaffinity(0)))) if wall > 0 else 0.0

    def lap(self) -> float:
        now = self._now()
        busy, self.last = self._between(self.last, now), now
        return busy

    def total(self) -> float:
        return self._between(self.start, self._now())


class TrainClock:
    """Wall time spent training, apart from what the loop does between steps: ``lap(n)`` at a log line
    adds the time since the clock last started and returns the tokens/s since the last log line;
    ``logged(n)`` starts it again once the line (and any eval) is done, ``restart()`` once a
    checkpoint is saved. Cost: a clock read each."""

    def __init__(self, first_step: int, tokens_per_step: int):
        self.tokens_per_step, self.last_logged = tokens_per_step, first_step
        self.train_time, self.since_log, self.t0 = 0.0, 0.0, time.time()

    def lap(self, n: int) -> float:
        elapsed = time.time() - self.t0
        self.train_time, self.since_log = self.train_time + elapsed, self.since_log + elapsed
        return (n - self.last_logged) * self.tokens_per_step / max(self.since_log, 1e-9)

    def logged(self, n: int) -> None:
        self.last_logged, self.since_log, self.t0 = n, 0.0, time.time()

    def restart(self) -> None:
        self.t0 = time.time()

    def tokens_per_s(self, steps: int) -> float:
        """Tokens/s over ``steps`` steps, in the training time laps counted."""
        return steps * self.tokens_per_step / max(self.train_time, 1e-9)


class Watch:
    """The bar, the metrics log and the plot of one run, on every rank (rank 0 writes). ``threads``: the
    CPU threads the run computes on (torch.get_num_threads()), None on a GPU (no cores shown)."""

    def __init__(self, out: Path, rank: int, resumed_at: int | None, *, flops_per_token: float,
                 peak_flops: float | None, world: int, threads: int | None = None):
        self.writes = rank == 0
        self.metrics, self.png = Path(out) / "metrics.jsonl", Path(out) / "loss.png"
        self.flops_per_token, self.peak_flops, self.world = flops_per_token, peak_flops, world
        self.threads, self.busy = threads, BusyCores()
        self.bar = None
        if self.writes:
            self._start_log(resumed_at)

    def _start_log(self, resumed_at: int | None) -> None:
        """A fresh run starts the log; a resumed one keeps what happened up to its checkpoint, and sets
        lines it cannot read (cut by a crash mid-write, or not UTF-8) aside in a file it names."""
        kept: list[bytes] = []
        if resumed_at is not None and self.metrics.exists():
            kept, torn = split_log(self.metrics.read_bytes(), resumed_at)
            if torn:
                stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
                aside = _unused(self.metrics.with_name(f"{self.metrics.name}.torn-{stamp}"))
                aside.write_bytes(b"".join(torn))
                warnings.warn(f"{self.metrics}: {len(torn)} unreadable line{'s' * (len(torn) > 1)} (a write cut by a "
                              f"crash) set aside in {aside}; the log keeps its {len(kept)} whole lines up to "
                              f"step {resumed_at}", stacklevel=2)
        tmp = self.metrics.with_name(f".{self.metrics.name}.tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, self.metrics)

    def say(self, message: str) -> None:
        if self.writes:
            (self.bar.write if self.bar is not None else print)(message)

    def progress(self, steps: Iterable[int], first: int, total: int) -> Iterable[int]:
        from tqdm import tqdm

        self.bar = tqdm(steps, desc="train", dynamic_ncols=True, initial=first, total=total, disable=not self.writes)
        return self.bar

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def record(self, step: int, metrics: dict, tokens_per_s: float, peak_mem: list[int],
               val_loss: float | None = None, extra: dict | None = None) -> dict:
        """Log one step (every rank calls it; rank 0 writes); returns the record. ``extra``: more
        eval numbers for the record (BERT's val_accuracy)."""
        row = {"step": step, "loss": float(metrics["loss"]), "lr": metrics["lr"],
               "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tokens_per_s,
               "peak_mem_mb": [round(b / 2**20, 1) for b in peak_mem]}
        if self.peak_flops:
            row["mfu"] = self.flops_per_token * tokens_per_s / (self.peak_flops * self.world)
        if "loss_scale" in metrics:
            row["loss_scale"], row["skipped"] = metrics["loss_scale"], bool(metrics["skipped"])
        if self.threads:
            row["cpu_cores"] = round(self.busy.lap(), 2)
        if val_loss is not None:
            row["val_loss"] = val_loss
        row.update(extra or {})
        if not self.writes:
            return row
        with open(self.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.bar is not None:
            shown = dict(loss=f"{row['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}", mem=_mem(row["peak_mem_mb"]))
            if "mfu" in row:
                shown["mfu"] = f"{row['mfu']:.1%}"
            if "cpu_cores" in row:
                shown["cpu"] = f"{row['cpu_cores']:.1f}/{self.threads}"
            self.bar.set_postfix(shown)
        if val_loss is not None:
            self.plot()
        return row

    def cores(self) -> str:
        """`` on 1.93 of 2 cores``: the cores kept busy over the whole run (its evals included) against
        the threads it computes on, for the final line; empty on a GPU."""
        return f" on {self.busy.total():.2f} of {self.threads} cores" if self.threads else ""

    def plot(self) -> None:
        """Redraw OUT/loss.png from the whole log (a resumed run's earlier steps included)."""
        rows = [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]
        train = [(r["step"], r["loss"]) for r in rows if math.isfinite(r.get("loss", math.nan))]
        val = [(r["step"], r["val_loss"]) for r in rows if math.isfinite(r.get("val_loss", math.nan))]
        lines = [plot_mod.Series(train, "train loss", plot_mod.BLUE),
                 plot_mod.Series(val, "val loss", plot_mod.ORANGE, width=2.0, marker=3.5)]
        rgb = plot_mod.chart(lines, xlabel="step", ylabel="loss")
        tmp = self.png.with_name(f".{self.png.name}.tmp")
        tmp.write_bytes(plot_mod.png(rgb))
        os.replace(tmp, self.png)
