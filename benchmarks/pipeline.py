"""Pipeline parallelism on p gloo ranks of this CPU: zf.pipeline vs torch.distributed.pipelining.

    python benchmarks/pipeline.py [--stages 2] [--microbatches 2,4,8] [--n-layer 4] [--n-embd 192]
                                  [--block-size 128] [--batch 16] [--steps 3] [--rounds 3]

One spawn of ``--stages`` ranks; every rank builds, from the same initial GPT (recipes/gpt.py),
for each microbatch count m: zfunc's GPipe and 1F1B steps and torch's ``ScheduleGPipe`` and
``Schedule1F1B`` over ``PipelineStage``s holding the same blocks (the model split the same way:
embeddings + the first blocks on stage 0, the last blocks + final norm + head on the last stage).
They run interleaved, ``--steps`` steps each per round, for ``--rounds`` rounds, after a warm-up
step; a step is as slow as its slowest rank, and the median is reported.

Both sides train with AdamW (no clipping) and average the microbatch losses. Differences: torch
cannot tie ``wte``/``lm_head`` across stages, so its last stage trains an untied copy of the head,
while zfunc lends the tied weight from stage 0 and returns its grad (a little more traffic);
zfunc also all-reduces the loss and grad norm so every rank has the metrics.

Measured bubble, per stage: ``1 - compute / wall``, where ``compute`` is the time zfunc's stage
spent in forward and backward (``step.timings["compute_s"]``) and ``wall`` the whole step, which
starts after a barrier and ends with the loss all-reduce on every stage together (so it also
counts the optimizer update and the tied weight's exchange as idle). Theory for p equal stages:
``(p - 1) / (m + p - 1)``. On this shared 2-core machine, compare ratios, not absolute times.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
from recipes.gpt import GPT, Block, GPTConfig  # noqa: E402

LR = 1e-3
SCHEDULES = ("gpipe", "1f1b")


class FirstStage(nn.Module):
    """Embeddings and the first blocks of a GPT (torch's stage 0)."""

    def __init__(self, gpt: GPT, blocks: list[Block]):
        super().__init__()
        self.wte, self.wpe, self.drop, self.blocks = gpt.wte, gpt.wpe, gpt.drop, nn.ModuleList(blocks)

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = block(x)
        return x


class MiddleStage(nn.Module):
    def __init__(self, blocks: list[Block]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(MiddleStage):
    """The last blocks, final norm and an (untied) copy of the head."""

    def __init__(self, gpt: GPT, blocks: list[Block]):
        super().__init__(blocks)
        self.ln_f, self.lm_head = gpt.ln_f, nn.Linear(gpt.cfg.n_embd, gpt.cfg.vocab_size, bias=False)
        self.lm_head.weight = nn.Parameter(gpt.lm_head.weight.detach().clone())

    def forward(self, x):
        return self.lm_head(self.ln_f(super().forward(x)))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def torch_trainer(gpt: GPT, rank: int, p: int, m: int, schedule: str, batch: int):
    """``run(tokens) -> seconds`` for torch.distributed.pipelining on ``p`` ranks."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    per = len(gpt.blocks) // p
    blocks = list(gpt.blocks)[rank * per : (rank + 1) * per]
    module = FirstStage(gpt, blocks) if rank == 0 else LastStage(gpt, blocks) if rank == p - 1 else MiddleStage(blocks)
    stage = PipelineStage(module, rank, p, torch.device("cpu"))
    sched = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(stage, m, loss_fn=lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, fused=True)

    def run(tokens):
        x, y = tokens[:, :-1], tokens[:, 1:]
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def zfunc_trainer(gpt: GPT, mesh: zf.Mesh, m: int, schedule: str):
    apply, params = zf.functionalize(gpt)

    def loss_fn(p, tokens):
        return lm_loss(apply(p, tokens[:, :-1]), tokens[:, 1:])

    step = zf.pipeline(zf.train_step(loss_fn, zf.optim.adamw(LR)), stages=mesh.pp, microbatches=m,
                       schedule=schedule, model=gpt, units=zf.units.by_class(Block), mesh=mesh)
    holder = {"state": step.init(params), "bubbles": []}

    def run(tokens):
        t0 = time.perf_counter()
        holder["state"], metrics = step(holder["state"], tokens)
        metrics["loss"].item()  # the loss all-reduce ends the step on every stage together
        holder["bubbles"].append(1.0 - step.timings["compute_s"] / (time.perf_counter() - t0))

    return run, holder


def worker(rank: int, p: int, cfg: GPTConfig, ms: list[int], batch: int, steps: int, rounds: int):
    mesh = zf.Mesh(pp=p)
    torch.manual_seed(0)
    base = GPT(cfg)
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g) for _ in range(steps)]
    trainers, holders = {}, {}
    for m in ms:
        for s in SCHEDULES:
            trainers[("zfunc", s, m)], holders[(s, m)] = zfunc_trainer(copy.deepcopy(base), mesh, m, s)
            trainers[("torch", s, m)] = torch_trainer(copy.deepcopy(base), rank, p, m, s, batch)
    times = {k: [] for k in trainers}
    for run in trainers.values():  # warm-up: shapes, allocator
        run(data[0])
    for h in holders.values():
        h["bubbles"].clear()
    for _ in range(rounds):
        for k, run in trainers.items():
            for tokens in data:
                torch.distributed.barrier()  # every trainer starts its step together on all ranks
                t0 = time.perf_counter()
                run(tokens)
                times[k].append(time.perf_counter() - t0)
    return times, {k: statistics.median(h["bubbles"]) for k, h in holders.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", default="2,4,8")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=192)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (split into microbatches)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    p, ms = args.stages, [int(x) for x in args.microbatches.split(",")]
    cfg = GPTConfig(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=args.block_size)
    n_params = sum(x.numel() for x in GPT(cfg).parameters())
    print(f"GPT {n_params / 1e6:.2f}M params ({args.n_layer} blocks), {p} stages on {p} gloo ranks, batch "
          f"{args.batch}x{cfg.block_size}, torch {torch.__version__}; median of {args.rounds}x{args.steps} steps")
    results = zf.dist.spawn(worker, p, p, cfg, ms, args.batch, args.steps, args.rounds, timeout_s=3600)
    med = {k: statistics.median(max(r[0][k][i] for r in results) for i in range(len(results[0][0][k])))
           for k in results[0][0]}
    print("\n| m | schedule | bubble theory | bubble measured per stage | zfunc ms/step | torch ms/step | "
          "zfunc speed vs torch |")
    print("|---|---|---|---|---|---|---|")
    for m in ms:
        for s in SCHEDULES:
            theory = (p - 1) / (m + p - 1)
            measured = ", ".join(f"{r[1][(s, m)]:.2f}" for r in results)
            z, t = med[("zfunc", s, m)], med[("torch", s, m)]
            print(f"| {m} | {s} | {theory:.2f} | {measured} | {z * 1e3:.1f} | {t * 1e3:.1f} | {t / z:.2f}x |")


if __name__ == "__main__":
    main()
