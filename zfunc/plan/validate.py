"""``--validate``: the step-time model against this machine's own benchmarks, after calibration.

The measuring is ``benchmarks/plan_validate.py``'s (it runs the repository's benchmarks' trainers
and recipes' GPT, from the repository's root); ``python -m zfunc.plan --validate`` runs that command.
This module turns its measurements into predicted beside measured step times (``shard_rows``,
``pipeline_rows``; ``offload_rows`` times zfunc's own offloaded step) and the table (``table``):
- ``benchmarks/shard.py``'s trainers (its ``build``: GPT 1.85M, 8 x 128 tokens per rank, fp32,
  clip + AdamW) on 2 gloo ranks: zfunc stages 1-3 and DDP for stage 0 (the same algorithm:
  bucketed fp32 all-reduce during backward), interleaved in an order shuffled each round (in a
  fixed one, each trainer's time depends on the one before it), each step started by a barrier as
  ``benchmarks/pipeline.py`` does (the shard benchmark's own back-to-back timing charges a step
  with the wait for the other rank's previous one, which load inflates);
- ``benchmarks/capacity.py``'s offloaded optimizer step alone (16 leaves, moments on NVMe, masters
  in RAM, clip: the update after backward), at 50M params (its 200M takes minutes to set up here),
  after two warm-up steps (the first writes allocate the swap files and their spares; capacity.py's
  best of its first three steps includes them);
- ``benchmarks/pipeline.py``'s zfunc GPipe and 1F1B trainers on 2 ranks (GPT 1.85M, batch 16 x
  128) at 2, 4 and 8 microbatches, each step started by a barrier (its ``worker``'s loop, without
  the torch trainers it compares with).
- a tensor-parallel run of the same GPT (``tp_rows``, bytes rather than time: ``bytes_table``) on 2
  ranks, 8 x 128 tokens: its ``step.memory(state)`` after a step (model states per rank and the tp
  group's bytes) against the plan's tp rows.

**Load** (``calibrate``'s module docstring). The ranks measure, in the same processes, their
single-thread rates (in CPU time: what a step's kernels cost with a core) right after their timed
steps, and their share of a core (``calibrate.cpu_share``) after every step (the smaller of the
two ranks' each time: a step waits for the slower); the prediction is the model's at those rates,
its CPU-bound parts divided by the share. The ratio is paired, the median over steps of each step's
time over the prediction at the share probed right after it; the predicted column is at the median
share. The offloaded update is timed in wall clock beside its CPU-Adam, first-touch, copy and disk
rates, each measured (median of 3) right after each timed step. Every figure is a median over steps.
Linux here schedules by session (autogroup: each session gets its part of the CPU, split among its
runnable threads), so a rank computing while the other waits gets more than when both compute: the pipeline ranks also
measure that share ("alone"), which its fill and drain run at (``loaded_pipeline``). On a quiet
machine both shares are 1 and the prediction is the calibrated one. Beside the wall clock the
table gives each step's CPU time (the slower rank's process) against the prediction at a whole
core, a comparison load barely moves (but a pipeline's bubble is idle, not CPU).
Target: predicted within +-25% of measured.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from zfunc.plan import calibrate
from zfunc.plan.core import plan
from zfunc.plan.cost import offload_update_parts
from zfunc.plan.model import ModelSpec, from_params
from zfunc.plan.strategy import from_flags

TOLERANCE = 0.25


@dataclass(frozen=True)
class Row:
    """One benchmark configuration: predicted and measured step seconds (medians), the predicted
    parts; for the spawned benchmarks also the ranks' share of a core, the prediction at a whole
    core, and the slower rank's CPU seconds per step (its process: main thread and gloo's)."""

    bench: str
    config: str
    predicted: float
    measured: float
    parts: dict
    share: float | None = None
    quiet: float | None = None
    cpu: float | None = None
    alone: float | None = None  # a pipeline's: the share of one rank while the others wait
    paired: float | None = None  # median over steps of measured / predicted at the share probed after it


TRAINERS = {"ddp": 0, "zf-1": 1, "zf-2": 2, "zf-3": 3}


def _rates(results, at=1) -> dict:
    """The ranks' own rates, the lower of each (a step is as slow as its slower rank)."""
    return {k: min(r[at][k] for r in results) for k in results[0][at]}


def _steps(results, key, at: int, slow=max) -> list[float]:
    """Per step, the slower rank's figure (``max`` of times; ``min`` of shares)."""
    return [slow(r[at][key][i] for r in results) for i in range(len(results[0][at][key]))]


def _paired(measured: list[float], predicted: list[float]) -> float:
    """Median over steps of measured / predicted, each step against the share probed right after it."""
    return statistics.median(m / p for m, p in zip(measured, predicted))


def shard_rows(cal: dict, results: list, model: ModelSpec, batch: int, seq: int) -> list[Row]:
    """The shard benchmark's rows: ``results`` are its ranks' (step times, rates, shares, CPU
    seconds) per trainer of ``TRAINERS``, for ``model`` at ``batch`` x ``seq`` tokens per rank."""
    world = len(results)
    whole = calibrate.cluster_from(cal, world, rates=_rates(results))
    rows = []
    for trainer, stage in TRAINERS.items():
        s = from_flags(zero=stage, micro_batch=batch, seq=seq, precision="fp32", clip=True)
        quiet = plan(model, whole, s)
        walls, shares = _steps(results, trainer, 0), _steps(results, trainer, 2, min)
        share = statistics.median(shares)
        loaded = {k: v / share for k, v in quiet.time.items()}  # every part is CPU work here
        label = "DDP (stage 0's algorithm)" if stage == 0 else f"zfunc stage {stage}"
        rows.append(Row("benchmarks/shard.py", f"{label}, {world} ranks, {batch}x{seq}/rank",
                        loaded["step"], statistics.median(walls), loaded, share, quiet.step_time,
                        statistics.median(_steps(results, trainer, 3)),
                        paired=_paired(walls, [quiet.step_time / x for x in shares])))
    return rows


def _median_wall(fn, repeats: int = 3) -> float:
    """Median wall seconds of ``fn()`` after a warm-up."""
    return calibrate._timed(fn, repeats, time.perf_counter, statistics.median)


def offload_rows(cal: dict, mparams: float = 50.0, path: str | None = None, steps: int = 5) -> list[Row]:
    import zfunc as zf

    n_leaves = 16
    leaf = int(mparams * 1e6) // n_leaves
    params = {f"w{i}": torch.randn(leaf) * 0.02 for i in range(n_leaves)}
    tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(1e-4, backend="numba"))
    root = tempfile.mkdtemp(prefix="zfunc-validate-", dir=path)
    step = zf.offload(zf.train_step(lambda p, b: sum(w[:4].sum() for w in p.values()) * b, tx), "nvme", path=root,
                      chunk_bytes=64 << 20)
    state = step.init(params)
    model = from_params(n_leaves * leaf)
    s = from_flags(zero=1, offload_optimizer="nvme", micro_batch=1, seq=1, precision="fp32", clip=True)
    measured, predicted = [], []
    for i in range(2 + steps):
        state, _ = step(state, torch.tensor(1.0))
        if i < 2:
            continue
        measured.append(step.update_s)  # the update alone (leaf by leaf, writes included)
        now = {name: dict(cal[name], all=rate(_median_wall)) for name, rate in
               (("cpu_adam_params_per_s", calibrate.cpu_adam_rate), ("first_touch_bw", calibrate.first_touch_bw),
                ("copy_bw", calibrate.copy_bw))}
        now = dict(cal, disk=calibrate.disk(path, nbytes=32 << 20, timer=_median_wall), **now)
        cluster = calibrate.cluster_from(now, 1)
        pl = plan(model, cluster, s)
        predicted.append((pl.time["update"], offload_update_parts(model, pl.plan, cluster)))
    step.engine.close()  # the swap files' lock, before they go
    shutil.rmtree(root, ignore_errors=True)
    p = statistics.median(t for t, _ in predicted)
    parts = {f"{k} (CPU-Adam and grad passes)" if k == "host" else k: statistics.median(d[k] for _, d in predicted)
             for k in predicted[0][1]}
    return [Row("benchmarks/capacity.py", f"offloaded optimizer step alone, {mparams:g}M params, moments on NVMe",
                p, statistics.median(measured), {"update": p, **parts})]


SCHEDULES = ("gpipe", "1f1b")


def pipeline_rows(cal: dict, results: list, model: ModelSpec, ms, batch: int, seq: int) -> list[Row]:
    """The pipeline benchmark's rows: ``results`` are its stages' (step times, rates, shares, CPU
    seconds, shares alone) per (schedule, microbatches), for ``model`` at ``batch`` x ``seq``."""
    p = len(results)
    quiet = calibrate.cluster_from(cal, p, rates=_rates(results))
    rows = []
    for m in ms:
        for schedule in SCHEDULES:
            s = from_flags(zero=0, pp=p, accum=m, micro_batch=batch // m, seq=seq, precision="fp32", clip=False,
                           schedule=schedule)
            whole, key = plan(model, quiet, s), (schedule, m)
            walls, shares, alone = _steps(results, key, 0), _steps(results, key, 2, min), _steps(results, key, 4, min)
            share, alone_share = statistics.median(shares), statistics.median(alone)
            parts = loaded_pipeline(whole.time, m, p, share, alone_share)
            each = [loaded_pipeline(whole.time, m, p, x, y)["step"] for x, y in zip(shares, alone)]
            rows.append(Row("benchmarks/pipeline.py", f"{schedule}, {p} stages, m={m}, {batch}x{seq}",
                            parts["step"], statistics.median(walls), parts, share, whole.step_time,
                            statistics.median(_steps(results, key, 3)), alone_share, _paired(walls, each)))
    return rows


def loaded_pipeline(whole: dict[str, float], m: int, p: int, share: float, alone: float) -> dict[str, float]:
    """A pipeline's step time parts at a whole core (``whole``), under load: Linux gives CPU time
    to each session (autogroup) and splits it among the session's runnable threads, so a stage
    computing while the others wait (the fill and drain: ``2 (p - 1)`` of the ``m + p - 1`` slots)
    runs at the share of one rank alone, and the ``m - p + 1`` steady slots, every stage busy, at
    the share of all at once."""
    slot = whole["compute"] / (m + p - 1)
    out = {k: v / share for k, v in whole.items() if k not in ("compute", "step")}
    out["compute (steady)"] = (m - p + 1) * slot / share
    out["compute (fill and drain)"] = 2 * (p - 1) * slot / alone
    out["step"] = sum(out.values())
    return out


def report(rows: list[Row], load_before: float, seconds: float) -> str:
    """The validation's printout: the load around it, ``table(rows)`` and each row's predicted parts."""
    lines = [f"\nload average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores), "
             f"{seconds:.0f} s\n", table(rows), "\npredicted parts (ms, under load): "]
    for row in rows:
        lines.append(f"  {row.config}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row.parts.items()))
    return "\n".join(lines)


COMMAND = ("benchmarks", "plan_validate.py")  # the measuring, in the repository


def main(calibration: str | None = None) -> int:
    """Run ``benchmarks/plan_validate.py`` from the repository's root (the working directory);
    2 where there is none."""
    script = os.path.join(*COMMAND)
    if not os.path.isfile(script):
        print(f"--validate: run from the repository's root: it runs {script}, which measures its benchmarks",
              file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, script] + (["--calibration", calibration] if calibration else []))


def table(rows: list[Row]) -> str:
    """The markdown table of ``rows`` and how many are within the tolerance (wall clock; the ratio
    paired step by step where the ranks probed their share after each step); beside it, the slower
    rank's CPU time per step against the prediction at a whole core, which load barely moves."""
    lines = ["| benchmark | configuration | share of a core | predicted ms | measured ms "
             "| measured / predicted (paired) | within 25% | predicted at a whole core ms | measured CPU ms "
             "| CPU / whole-core prediction |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    inside = 0
    for r in rows:
        ratio = r.measured / r.predicted if r.paired is None else r.paired
        ok = abs(ratio - 1) <= TOLERANCE
        inside += ok
        cpu = ("- | - | -" if r.cpu is None else
               f"{r.quiet * 1e3:.1f} | {r.cpu * 1e3:.1f} | {r.cpu / r.quiet:.2f}")
        share = "-" if r.share is None else f"{r.share:.2f}" + ("" if r.alone is None else f" ({r.alone:.2f} alone)")
        lines.append(f"| `{r.bench}` | {r.config} | {share} | {r.predicted * 1e3:.1f} | {r.measured * 1e3:.1f} "
                     f"| {ratio:.2f} | {'yes' if ok else 'no'} | {cpu} |")
    lines.append(f"\n{inside} of {len(rows)} within +-{TOLERANCE:.0%}")
    return "\n".join(lines)


@dataclass(frozen=True)
class BytesRow:
    """One predicted beside measured byte count: ``what`` (model states per rank, tp bytes per step)."""

    bench: str
    config: str
    what: str
    predicted: float
    measured: float


def tp_rows(cal: dict, results: list, model: ModelSpec, batch: int, seq: int) -> list[BytesRow]:
    """A tensor-parallel run's rows: ``results`` are its tp ranks' ``step.memory(state)`` after a step
    (``zf.tensor_parallel.step``: ``params`` and ``opt_state`` bytes, ``comm``: the tp group's bytes by
    call type), for ``model`` at ``batch`` x ``seq`` tokens; predicted by the plan of ``tp`` ranks, ZeRO 0,
    fp32 AdamW: its fp32 masters and optimizer state per rank (params / tp), and its all-reduce bytes
    (each block's four activations' all-reduces; the measured also holds the embedding's and head's and
    the gathered logits)."""
    tp = len(results)
    s = from_flags(tp=tp, zero=0, micro_batch=batch, seq=seq, precision="fp32", clip=True)
    predicted = plan(model, calibrate.cluster_from(cal, tp), s)
    gpu = predicted.memory["gpu"]
    states = max(r["params"] + r["opt_state"] for r in results)
    comm = max(sum(r["comm"].values()) for r in results)
    config = f"tp={tp}, ZeRO 0, fp32 AdamW, {batch}x{seq} tokens"
    return [BytesRow("zf.tensor_parallel.step", config, "model states per rank (fp32 params + AdamW state)",
                     gpu["masters"] + gpu["optimizer"], states),
            BytesRow("zf.tensor_parallel.step", config, "tp communication per step (all-reduce, gathers)",
                     predicted.comm["all_reduce"], comm)]


def bytes_table(rows: list[BytesRow]) -> str:
    """The markdown table of byte rows and how many are within the tolerance."""
    lines = ["| run | configuration | bytes | predicted MB | measured MB | measured / predicted | within 25% |",
             "|---|---|---|---|---|---|---|"]
    inside = 0
    for r in rows:
        ratio = r.measured / r.predicted
        ok = abs(ratio - 1) <= TOLERANCE
        inside += ok
        lines.append(f"| `{r.bench}` | {r.config} | {r.what} | {r.predicted / 1e6:.3f} | {r.measured / 1e6:.3f} "
                     f"| {ratio:.2f} | {'yes' if ok else 'no'} |")
    lines.append(f"\n{inside} of {len(rows)} within +-{TOLERANCE:.0%}")
    return "\n".join(lines)
