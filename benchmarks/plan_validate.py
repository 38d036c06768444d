"""The estimator's step times against this machine's benchmarks: ``python -m zfunc.plan --validate``.

    python benchmarks/plan_validate.py [--calibration PATH] [--mparams 50]

Measures, after calibration (``zfunc.plan.calibrate``; measured first when PATH has none):
``benchmarks/shard.py``'s trainers on 2 gloo ranks, zfunc's offloaded optimizer step alone and
``benchmarks/pipeline.py``'s zfunc trainers on 2 ranks, each step started by a barrier and followed
by a probe of the rank's share of a core; and a tp=2 run's bytes (model states per rank, tp bytes per
step) against the plan's tp rows; ``zfunc.plan.validate`` turns the measurements into
predicted beside measured step times (its docstring: the configurations, the load, the tolerance).
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
from benchmarks.pipeline import zfunc_trainer  # noqa: E402
from benchmarks.shard import batches, build  # noqa: E402
from recipes.gpt import GPT, GPTConfig  # noqa: E402
from zfunc.plan import calibrate, validate  # noqa: E402
from zfunc.plan.model import from_module  # noqa: E402

CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=192, block_size=128)


def gpt_spec(cfg: GPTConfig):
    with torch.device("meta"):
        return from_module(GPT(cfg), name="GPT (recipes/gpt.py)")


def shard_worker(rank: int, world: int, cfg, batch: int, rounds: int):
    """Per trainer, this rank's step times (s), each step started by a barrier and followed by a
    probe of this rank's share of a core; then its rates (CPU time)."""
    mesh = zf.Mesh(dp=world)
    torch.manual_seed(0)
    base = GPT(cfg)
    trainers = {k: build(k, base, mesh)[0] for k in validate.TRAINERS}
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


def pipeline_worker(rank: int, p: int, cfg, ms: list[int], batch: int, steps: int, rounds: int):
    """``benchmarks/pipeline.py``'s ``worker`` loop over its zfunc trainers, each step followed by a
    probe of this rank's share of a core; then its rates (CPU time)."""
    mesh = zf.Mesh(pp=p)
    torch.manual_seed(0)
    base = GPT(cfg)
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g) for _ in range(steps)]
    trainers = {(s, m): zfunc_trainer(copy.deepcopy(base), mesh, m, s)[0] for m in ms for s in validate.SCHEDULES}
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


def tp_worker(rank: int, cfg, batch: int) -> dict:
    """A tp=2 run of the GPT (``zf.tensor_parallel``, plan=None; fp32 AdamW after a clip), two steps on one
    batch of ``batch`` windows; this rank's ``step.memory(state)`` after the second."""
    mesh = zf.Mesh(tp=2)
    torch.manual_seed(0)
    model = zf.tensor_parallel(GPT(cfg), mesh)
    apply, params = zf.functionalize(model)

    def loss(p, tokens):
        return F.cross_entropy(apply(p, tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(1e-4))
    step = zf.tensor_parallel.step(zf.train_step(loss, tx), model)
    state = step.init(params)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=torch.Generator().manual_seed(7))
    for _ in range(2):
        state, _ = step(state, tokens)
    return step.memory(state)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", help="this machine's constants (python -m zfunc.plan --calibrate)")
    p.add_argument("--mparams", type=float, default=50.0, help="params of the offloaded step, in millions")
    args = p.parse_args(argv)
    try:
        cal = calibrate.load(args.calibration)
    except (OSError, ValueError) as e:
        print(f"{e}\nmeasuring this machine first", flush=True)
        cal = calibrate.measure()
        print(f"wrote {calibrate.save(cal, args.calibration)}")
    print(calibrate.describe(cal))
    before, start = os.getloadavg()[0], time.perf_counter()
    model, seq, ms = gpt_spec(CONFIG), CONFIG.block_size, (2, 4, 8)
    shard = zf.dist.spawn(shard_worker, 2, 2, CONFIG, 8, 20, timeout_s=3600)
    rows = validate.shard_rows(cal, shard, model, batch=8, seq=seq) + validate.offload_rows(cal, args.mparams)
    pipe = zf.dist.spawn(pipeline_worker, 2, 2, CONFIG, list(ms), 16, 3, 3, timeout_s=3600)
    rows += validate.pipeline_rows(cal, pipe, model, ms, batch=16, seq=seq)
    print(validate.report(rows, before, time.perf_counter() - start))
    tp = zf.dist.spawn(tp_worker, 2, CONFIG, 8, timeout_s=600)
    print("\ntensor parallelism, bytes (zfunc.plan.validate.tp_rows):\n"
          + validate.bytes_table(validate.tp_rows(cal, tp, model, batch=8, seq=seq)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
