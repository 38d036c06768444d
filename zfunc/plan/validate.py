"""``--validate``: the step-time model against this machine's own benchmarks, after calibration.

Runs small configurations of the repository's benchmarks (from its root: they import ``benchmarks/``
and ``recipes/``) and prints predicted beside measured step times, with the load average. On a
shared machine the constants drift within seconds, so each benchmark's ranks measure the per-rank
rates (``calibrate.rates_now``: matmul, copy, attention, GELU; the offload row: CPU-Adam and the
swap engine's disk bandwidth) right after their timed steps, in the same processes, and the
prediction uses those; the collectives come from the calibration file.
- ``benchmarks/shard.py``'s trainers (its ``build``: GPT 1.85M, 8 x 128 tokens per rank, fp32,
  clip + AdamW) on 2 gloo ranks: zfunc stages 1-3 and DDP for stage 0 (the same algorithm:
  bucketed fp32 all-reduce during backward), interleaved, each step started by a barrier as
  ``benchmarks/pipeline.py`` does (the shard benchmark's own back-to-back timing charges a step
  with the wait for the other rank's previous one, which load inflates);
- ``benchmarks/capacity.py``'s offloaded optimizer step alone (16 leaves, moments on NVMe, masters
  in RAM, clip: the update after backward), at 50M params (its 200M takes minutes to set up here);
- ``benchmarks/pipeline.py``'s zfunc GPipe and 1F1B on 2 ranks (GPT 1.85M, batch 16 x 128) at 2, 4
  and 8 microbatches (its ``worker``).
Target: predicted within +-25% of measured.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from zfunc.plan import calibrate
from zfunc.plan.core import plan
from zfunc.plan.model import from_module, from_params
from zfunc.plan.strategy import Strategy

TOLERANCE = 0.25


def _gpt(cfg):
    from recipes.gpt import GPT

    with torch.device("meta"):
        return from_module(GPT(cfg), name="GPT (recipes/gpt.py)")


def _config():
    from recipes.gpt import GPTConfig

    return GPTConfig(n_layer=4, n_head=4, n_embd=192, block_size=128)


TRAINERS = {"ddp": 0, "zf-1": 1, "zf-2": 2, "zf-3": 3}


def _shard_worker(rank: int, world: int, cfg, batch: int, rounds: int):
    """Per trainer, this rank's step times (s), each step started by a barrier; then its rates."""
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
    times = {k: [] for k in trainers}
    for r in range(rounds):
        for k, run in trainers.items():
            torch.distributed.barrier()
            t = time.perf_counter()
            run(data[r % len(data)]).item()
            times[k].append(time.perf_counter() - t)
    torch.distributed.barrier()
    return times, calibrate.rates_now()


def _slowest(results, key, at=0) -> float:
    """Median over steps of the slower rank's time."""
    return statistics.median(max(r[at][key][i] for r in results) for i in range(len(results[0][at][key])))


def _rates(results, at=1) -> dict:
    """The ranks' own rates, the lower of each (a step is as slow as its slower rank)."""
    return {k: min(r[at][k] for r in results) for k in results[0][at]}


def shard_rows(cal: dict, rounds: int = 10, batch: int = 8, world: int = 2) -> list[tuple]:
    import zfunc as zf

    cfg = _config()
    results = zf.dist.spawn(_shard_worker, world, world, cfg, batch, rounds, timeout_s=3600)
    model, cluster = _gpt(cfg), calibrate.cluster_from(cal, world, rates=_rates(results))
    rows = []
    for trainer, stage in TRAINERS.items():
        s = Strategy(zero=stage, micro_batch=batch, seq=cfg.block_size, precision="fp32", clip=True)
        p = plan(model, cluster, s)
        label = "DDP (stage 0's algorithm)" if stage == 0 else f"zfunc stage {stage}"
        rows.append(("benchmarks/shard.py", f"{label}, {world} ranks, {batch}x{cfg.block_size}/rank", p.step_time,
                     _slowest(results, trainer), p.time))
    return rows


def offload_rows(cal: dict, mparams: float = 50.0, path: str | None = None) -> list[tuple]:
    import zfunc as zf

    n_leaves = 16
    leaf = int(mparams * 1e6) // n_leaves
    params = {f"w{i}": torch.randn(leaf) * 0.02 for i in range(n_leaves)}
    tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(1e-4, backend="numba"))
    root = tempfile.mkdtemp(prefix="zfunc-validate-", dir=path)
    step = zf.offload(zf.train_step(lambda p, b: sum(w[:4].sum() for w in p.values()) * b, tx), "nvme", path=root,
                      chunk_bytes=64 << 20)
    state = step.init(params)
    timed = []
    for _ in range(3):
        state, _ = step(state, torch.tensor(1.0))
        timed.append(step.update_s)  # the update alone (leaf by leaf, writes included)
    measured = min(timed)
    step.engine.close()  # the swap files' lock, before they go
    shutil.rmtree(root, ignore_errors=True)
    now = dict(cal, disk=calibrate.disk(path),  # the disk and CPU-Adam as they are now
               cpu_adam_params_per_s=dict(cal["cpu_adam_params_per_s"], all=calibrate.cpu_adam_rate()))
    model = from_params(n_leaves * leaf)
    s = Strategy(zero=1, offload_optimizer="nvme", micro_batch=1, seq=1, precision="fp32", clip=True)
    p = plan(model, calibrate.cluster_from(now, 1), s)
    return [("benchmarks/capacity.py", f"offloaded optimizer step alone, {mparams:g}M params, moments on NVMe",
             p.time["update"], measured, {"update": p.time["update"]})]


def _pipeline_worker(rank: int, p: int, cfg, ms: list[int], batch: int, steps: int, rounds: int):
    from benchmarks.pipeline import worker

    out = worker(rank, p, cfg, ms, batch, steps, rounds)
    torch.distributed.barrier()
    return out[0], calibrate.rates_now()


def pipeline_rows(cal: dict, ms=(2, 4, 8), batch: int = 16, steps: int = 3, rounds: int = 3) -> list[tuple]:
    import zfunc as zf

    cfg, p = _config(), 2
    results = zf.dist.spawn(_pipeline_worker, p, p, cfg, list(ms), batch, steps, rounds, timeout_s=3600)
    model, cluster = _gpt(cfg), calibrate.cluster_from(cal, p, rates=_rates(results))
    rows = []
    for m in ms:
        for schedule in ("gpipe", "1f1b"):
            s = Strategy(zero=0, pp=p, accum=m, micro_batch=batch // m, seq=cfg.block_size, precision="fp32",
                         clip=False, schedule=schedule)
            pl = plan(model, cluster, s)
            rows.append(("benchmarks/pipeline.py", f"{schedule}, 2 stages, m={m}, {batch}x{cfg.block_size}",
                         pl.step_time, _slowest(results, ("zfunc", schedule, m)), pl.time))
    return rows


def main(calibration: str | None = None, mparams: float = 50.0) -> int:
    import importlib.util

    if importlib.util.find_spec("benchmarks") is None or importlib.util.find_spec("recipes") is None:
        print("--validate: run from the repository root (it imports benchmarks/ and recipes/)", file=sys.stderr)
        return 2
    try:
        cal = calibrate.load(calibration)
    except OSError:
        print("no calibration yet: measuring this machine first", flush=True)
        cal = calibrate.measure()
        print(f"wrote {calibrate.save(cal, calibration)}")
    print(calibrate.describe(cal))
    before = os.getloadavg()[0]
    rows = shard_rows(cal) + offload_rows(cal, mparams) + pipeline_rows(cal)
    print(f"\nload average {before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)\n")
    print("| benchmark | configuration | predicted ms | measured ms | measured / predicted | within 25% |")
    print("|---|---|---|---|---|---|")
    inside = 0
    for bench, config, predicted, measured, _ in rows:
        ratio = measured / predicted
        ok = abs(ratio - 1) <= TOLERANCE
        inside += ok
        print(f"| `{bench}` | {config} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} | {ratio:.2f} | "
              f"{'yes' if ok else 'no'} |")
    print(f"\n{inside} of {len(rows)} within +-{TOLERANCE:.0%}")
    print("\npredicted parts (ms): ")
    for bench, config, _, _, parts in rows:
        print(f"  {config}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()))
    return 0
