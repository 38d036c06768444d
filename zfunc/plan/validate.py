"""``--validate``: the step-time model against this machine's own benchmarks, after calibration.

Runs small configurations of the repository's benchmarks (from its root: they import ``benchmarks/``
and ``recipes/``) and prints predicted beside measured step times, with the load average.
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
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from zfunc.plan import calibrate
from zfunc.plan.core import plan
from zfunc.plan.cost import offload_update_parts
from zfunc.plan.model import from_module, from_params
from zfunc.plan.strategy import Strategy

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


def _gpt(cfg):
    from recipes.gpt import GPT

    with torch.device("meta"):
        return from_module(GPT(cfg), name="GPT (recipes/gpt.py)")


def _config():
    from recipes.gpt import GPTConfig

    return GPTConfig(n_layer=4, n_head=4, n_embd=192, block_size=128)


TRAINERS = {"ddp": 0, "zf-1": 1, "zf-2": 2, "zf-3": 3}


def _shard_worker(rank: int, world: int, cfg, batch: int, rounds: int):
    """Per trainer, this rank's step times (s), each step started by a barrier and followed by a
    probe of this rank's share of a core; then its rates (CPU time)."""
    import zfunc as zf
    from benchmarks.shard import batches, build
    from recipes.gpt import GPT

    mesh = zf.Mesh(dp=world)
    torch.manual_seed(0)
    base = GPT(cfg)
    trainers = {k: build(k, base, mesh)[0] for k in TRAINERS}
    data = batches(cfg, batch, rank, 3)
    for run in trainers.values():  # warm-up: JIT, allocator, bucket order, unit order
        run(data[0]).item()
        run(data[1]).item()
    times, cpu, shares = ({k: [] for k in trainers} for _ in range(3))
    names = list(trainers)
    for r in range(rounds):  # a fresh order each round, the same on every rank (as benchmarks/shard.py)
        for k in random.Random(r).sample(names, len(names)):
            run = trainers[k]
            torch.distributed.barrier()
            t, c = time.perf_counter(), time.process_time()
            run(data[r % len(data)]).item()
            times[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
            shares[k].append(calibrate.cpu_share(then=torch.distributed.barrier))
    torch.distributed.barrier()
    return times, calibrate.rates_now(), shares, cpu


def _rates(results, at=1) -> dict:
    """The ranks' own rates, the lower of each (a step is as slow as its slower rank)."""
    return {k: min(r[at][k] for r in results) for k in results[0][at]}


def _steps(results, key, at: int, slow=max) -> list[float]:
    """Per step, the slower rank's figure (``max`` of times; ``min`` of shares)."""
    return [slow(r[at][key][i] for r in results) for i in range(len(results[0][at][key]))]


def _paired(measured: list[float], predicted: list[float]) -> float:
    """Median over steps of measured / predicted, each step against the share probed right after it."""
    return statistics.median(m / p for m, p in zip(measured, predicted))


def shard_rows(cal: dict, rounds: int = 20, batch: int = 8, world: int = 2) -> list[Row]:
    import zfunc as zf

    cfg = _config()
    results = zf.dist.spawn(_shard_worker, world, world, cfg, batch, rounds, timeout_s=3600)
    model, whole = _gpt(cfg), calibrate.cluster_from(cal, world, rates=_rates(results))
    rows = []
    for trainer, stage in TRAINERS.items():
        s = Strategy(zero=stage, micro_batch=batch, seq=cfg.block_size, precision="fp32", clip=True)
        quiet = plan(model, whole, s)
        walls, shares = _steps(results, trainer, 0), _steps(results, trainer, 2, min)
        share = statistics.median(shares)
        loaded = {k: v / share for k, v in quiet.time.items()}  # every part is CPU work here
        label = "DDP (stage 0's algorithm)" if stage == 0 else f"zfunc stage {stage}"
        rows.append(Row("benchmarks/shard.py", f"{label}, {world} ranks, {batch}x{cfg.block_size}/rank",
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
    s = Strategy(zero=1, offload_optimizer="nvme", micro_batch=1, seq=1, precision="fp32", clip=True)
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
        predicted.append((pl.time["update"], offload_update_parts(model, pl.strategy, cluster)))
    step.engine.close()  # the swap files' lock, before they go
    shutil.rmtree(root, ignore_errors=True)
    p = statistics.median(t for t, _ in predicted)
    parts = {f"{k} (CPU-Adam and grad passes)" if k == "host" else k: statistics.median(d[k] for _, d in predicted)
             for k in predicted[0][1]}
    return [Row("benchmarks/capacity.py", f"offloaded optimizer step alone, {mparams:g}M params, moments on NVMe",
                p, statistics.median(measured), {"update": p, **parts})]


SCHEDULES = ("gpipe", "1f1b")


def _pipeline_worker(rank: int, p: int, cfg, ms: list[int], batch: int, steps: int, rounds: int):
    """``benchmarks/pipeline.py``'s ``worker`` loop over its zfunc trainers, each step followed by a
    probe of this rank's share of a core; then its rates (CPU time)."""
    import copy

    import zfunc as zf
    from benchmarks.pipeline import zfunc_trainer
    from recipes.gpt import GPT

    mesh = zf.Mesh(pp=p)
    torch.manual_seed(0)
    base = GPT(cfg)
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g) for _ in range(steps)]
    trainers = {(s, m): zfunc_trainer(copy.deepcopy(base), mesh, m, s)[0] for m in ms for s in SCHEDULES}
    for run in trainers.values():  # warm-up: shapes, allocator
        run(data[0])
    times, cpu, shares, alone = ({k: [] for k in trainers} for _ in range(4))
    for _ in range(rounds):
        for k, run in trainers.items():
            for tokens in data:
                torch.distributed.barrier()  # every trainer starts its step together on all ranks
                t0, c = time.perf_counter(), time.process_time()
                run(tokens)
                times[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c)
                shares[k].append(calibrate.cpu_share(then=torch.distributed.barrier))
                for r in range(p):  # and each rank alone, the other waiting, as in the fill and drain
                    if r == rank:
                        alone[k].append(calibrate.cpu_share(then=torch.distributed.barrier))
                    else:
                        torch.distributed.barrier()
    torch.distributed.barrier()
    return times, calibrate.rates_now(), shares, cpu, alone


def pipeline_rows(cal: dict, ms=(2, 4, 8), batch: int = 16, steps: int = 3, rounds: int = 3) -> list[Row]:
    import zfunc as zf

    cfg, p = _config(), 2
    results = zf.dist.spawn(_pipeline_worker, p, p, cfg, list(ms), batch, steps, rounds, timeout_s=3600)
    model, quiet = _gpt(cfg), calibrate.cluster_from(cal, p, rates=_rates(results))
    rows = []
    for m in ms:
        for schedule in SCHEDULES:
            s = Strategy(zero=0, pp=p, accum=m, micro_batch=batch // m, seq=cfg.block_size, precision="fp32",
                         clip=False, schedule=schedule)
            whole, key = plan(model, quiet, s), (schedule, m)
            walls, shares, alone = _steps(results, key, 0), _steps(results, key, 2, min), _steps(results, key, 4, min)
            share, alone_share = statistics.median(shares), statistics.median(alone)
            parts = loaded_pipeline(whole.time, m, p, share, alone_share)
            each = [loaded_pipeline(whole.time, m, p, x, y)["step"] for x, y in zip(shares, alone)]
            rows.append(Row("benchmarks/pipeline.py", f"{schedule}, 2 stages, m={m}, {batch}x{cfg.block_size}",
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


def main(calibration: str | None = None, mparams: float = 50.0) -> int:
    import importlib.util

    if importlib.util.find_spec("benchmarks") is None or importlib.util.find_spec("recipes") is None:
        print("--validate: run from the repository root (it imports benchmarks/ and recipes/)", file=sys.stderr)
        return 2
    try:
        cal = calibrate.load(calibration)
    except (OSError, ValueError) as e:
        print(f"{e}\nmeasuring this machine first", flush=True)
        cal = calibrate.measure()
        print(f"wrote {calibrate.save(cal, calibration)}")
    print(calibrate.describe(cal))
    before, start = os.getloadavg()[0], time.perf_counter()
    rows = shard_rows(cal) + offload_rows(cal, mparams) + pipeline_rows(cal)
    print(f"\nload average {before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores), "
          f"{time.perf_counter() - start:.0f} s\n")
    print(table(rows))
    print("\npredicted parts (ms, under load): ")
    for row in rows:
        print(f"  {row.config}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row.parts.items()))
    return 0


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
