"""Pipeline parallelism on p gloo ranks of this CPU: zf.pipeline vs torch.distributed.pipelining.

    python benchmarks/pipeline.py [--stages 2] [--microbatches 2,4,8] [--n-layer 4] [--n-embd 192]
                                  [--block-size 128] [--batch 16] [--steps 3] [--rounds 3] [--norm clip|none]
                                  [--schedules gpipe,1f1b,interleaved-1f1b,zero-bubble,zbv]

One spawn of ``--stages`` ranks; every rank builds, from the same initial GPT (recipes/gpt.py,
its ``lm_head`` untied from ``wte``: torch's stages cannot tie a weight across ranks, so both
sides train this one untied model), for each microbatch count m and schedule: zfunc's step and
torch's schedule of the same kind, whose ops per rank are zfunc's, in the same order (``TORCH``:
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` with 2 stages per rank,
``ScheduleInterleavedZeroBubble`` with one, ZB-H1, against zfunc's "zero-bubble", and
``ScheduleZBVZeroBubble``, whose V places stages ``r`` and ``2p - 1 - r`` on rank ``r``, against
zfunc's ZB-V, "zbv"). Both cut the model alike (``--n-layer`` a multiple of ``2 p``): virtual
stage 0 the embeddings + its blocks, the last its blocks + final norm + head, each other its
blocks; torch's ``PipelineStage``s hold those modules, zfunc's pipeline units are those modules
(``units=["wte", "wpe", "blocks.0", ..., "ln_f", "lm_head"]``, ``split`` to match), so every
param has one owner stage on both sides and nothing is lent; their losses agree (printed: the
largest difference of zfunc's loss and torch's over every step run). After a warm-up step each,
they run interleaved: per round and batch, zfunc's step and torch's of the same kind as a pair,
each after a barrier, the pair's order alternating from one batch to the next (whichever runs
first pays for what the step before it left in the caches and the allocator; a fixed order had
zfunc pay it on every pair); a step is as slow as its slowest rank. The ratio is the median of the pairs' ratios
(torch's time / zfunc's), the times the medians. CPU time, which load moves far less than the
wall clock: each step's process CPU time (every thread: the main one, gloo's, zfunc's comm
thread) summed over the ranks, the median of the pairs' ratios (torch's / zfunc's); and of it,
from ``getrusage``, the kernel's share (sys), the minor page faults and the voluntary context
switches per step, summed over the ranks, medians over the steps (counts load does not move).

The same work on both sides: the same model and stages, AdamW, the microbatch losses averaged,
and with ``--norm clip`` (the default) both clip the grads at the global norm ``CLIP`` as
torchtitan does across pp ranks (``clip_across_stages``: each rank's norm, one all-reduce of its
square over the pipeline, one scale of every grad; zfunc's step carries the square in the one
all-reduce it makes anyway, with the loss, so every rank has the metrics); ``--norm none``:
neither computes a grad norm (zfunc still all-reduces the loss: one scalar). What zfunc does
besides: that all-reduce (torch's loss stays on the last stage) and a 104-byte header per
boundary per step (``zfunc.pipelining.header``: the step, the batch's digest, the shape).

Bubble, per stage, the median over steps (``zf.pipelining.measured``, from every rank's
``step.timings`` of a step): measured, the rank's idle fraction of the pipeline's makespan (first
rank's start to last rank's end, ``1 - compute / makespan``; compute is each op's time from the
previous op's end, less its waits on peers: the runtime's work for an op is no idle time);
theory, the schedule's simulated bubble with unit op costs (``step.schedule.timeline(p)``;
``(p - 1) / (m + p - 1)`` for GPipe and 1F1B), and the same
simulation with each op taking that step's measured time: the bubble the schedule implies for
those ops, which the measured one exceeds only by the transfers' latency and a late start or end.
On this shared 2-core machine, compare ratios, not absolute times; the load average is printed.
"""
from __future__ import annotations

import argparse
import copy
import os
import resource
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
CLIP = 1.0  # max global grad norm with --norm clip
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
         "zero-bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
MULTI = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")  # take a list of stages
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 1, "zbv": 1}  # zfunc's (ZB-V's 2 implied)


def untied(gpt: GPT) -> GPT:
    """``gpt`` with ``lm_head`` its own param (a copy of ``wte``'s values): the model both sides train."""
    gpt.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())
    return gpt


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
    """The last blocks, final norm and head of an untied GPT."""

    def __init__(self, gpt: GPT, blocks: list[Block]):
        super().__init__(blocks)
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x):
        return self.lm_head(self.ln_f(super().forward(x)))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def torch_stage_module(gpt: GPT, k: int, count: int) -> nn.Module:
    """Virtual stage ``k`` of ``count``: its share of the blocks, with the embeddings on the first
    and the final norm and head on the last."""
    per = len(gpt.blocks) // count
    blocks = list(gpt.blocks)[k * per : (k + 1) * per]
    return FirstStage(gpt, blocks) if k == 0 else LastStage(gpt, blocks) if k == count - 1 else MiddleStage(blocks)


def clip_across_stages(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torchtitan's ``clip_grad_norm_`` under pp: this rank's grads' norm, its square summed over
    the pipeline's ranks (one all-reduce), every rank's grads scaled by one global factor."""
    grads = [q.grad for q in params if q.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True) ** 2
    torch.distributed.all_reduce(norm)
    norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def torch_trainer(gpt: GPT, rank: int, p: int, m: int, schedule: str, batch: int, norm: str):
    """``run(tokens)`` for torch.distributed.pipelining on ``p`` ranks: its schedule of the same
    kind (``TORCH``), its stages placed as that schedule places them (loop or V); ``norm`` "clip":
    clipped at the global grad norm ``CLIP`` as torchtitan does (``clip_across_stages``)."""
    from torch.distributed import pipelining as tp

    kind = TORCH[schedule]
    v = 2 if kind == "ScheduleZBVZeroBubble" else VIRTUAL[schedule]
    count = p * v
    mine = [rank, 2 * p - 1 - rank] if kind == "ScheduleZBVZeroBubble" else [rank + c * p for c in range(v)]
    modules = [torch_stage_module(gpt, k, count) for k in mine]
    stages = [tp.PipelineStage(mod, k, count, torch.device("cpu")) for mod, k in zip(modules, mine)]
    cls = getattr(tp, kind)
    sched = cls(stages if kind in MULTI else stages[0], m, loss_fn=lm_loss)
    params = [q for mod in modules for q in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, fused=True)

    def run(tokens):
        x, y = tokens[:, :-1], tokens[:, 1:]
        args = (x,) if 0 in mine else ()
        losses = []
        kwargs = dict(target=y, losses=losses) if count - 1 in mine else {}
        sched.step(*args, **kwargs)
        if norm == "clip":
            clip_across_stages(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().item() if losses else None  # the last stage's

    return run


def zfunc_units(gpt: GPT, count: int) -> tuple[list[str], list[int]]:
    """The pipeline units and ``split`` that cut ``gpt`` into ``count`` virtual stages as
    ``torch_stage_module`` does: the embeddings with the first blocks, the final norm and head
    with the last, so no param is outside a unit (none is lent)."""
    n, per = len(gpt.blocks), len(gpt.blocks) // count
    split = [per] * count
    split[0] += 2
    split[-1] += 2
    return ["wte", "wpe", *(f"blocks.{b}" for b in range(n)), "ln_f", "lm_head"], split


def zfunc_trainer(gpt: GPT, mesh: zf.Mesh, m: int, schedule: str, norm: str | None = None):
    """``run(tokens)`` for zf.pipeline over ``zfunc_units`` (an untied ``gpt``; a tied one, as
    benchmarks/plan_validate.py trains, over ``by_class(Block)``: its embeddings and head shared,
    lent to the last stage); ``norm`` "clip": clipped at the global grad norm ``CLIP`` (the step's
    one all-reduce carries the norm's square), "none": no grad norm computed, None: the norm
    computed for the metrics, no clip (the step's default)."""
    apply, params = zf.functionalize(gpt)

    def loss_fn(p, tokens):
        return lm_loss(apply(p, tokens[:, :-1]), tokens[:, 1:])

    opt = zf.optim.chain(zf.optim.clip_by_global_norm(CLIP), zf.optim.adamw(LR)) if norm == "clip" else \
        zf.optim.adamw(LR)
    inner = zf.train_step(loss_fn, opt, grad_norm=norm != "none")
    count = mesh.pp * (2 if schedule == "zbv" else VIRTUAL[schedule])
    tied = gpt.lm_head.weight is gpt.wte.weight  # one param cannot be in units of two stages
    units, split = (zf.units.by_class(Block), None) if tied else zfunc_units(gpt, count)
    step = zf.pipeline(inner, stages=mesh.pp, microbatches=m, schedule=schedule, model=gpt, units=units,
                       split=split, mesh=mesh, virtual_stages=VIRTUAL[schedule])
    holder = {"state": step.init(params), "timings": [], "theory": max(step.schedule.timeline(mesh.pp).bubble)}

    def run(tokens):
        holder["state"], metrics = step(holder["state"], tokens)
        holder["timings"].append(step.timings)
        return metrics["loss"].item()

    return run, holder


def worker(rank: int, p: int, cfg: GPTConfig, ms: list[int], batch: int, steps: int, rounds: int,
           schedules: list[str], norm: str):
    mesh = zf.Mesh(pp=p)
    torch.manual_seed(0)
    base = untied(GPT(cfg))
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g) for _ in range(steps)]
    trainers, holders = {}, {}
    for m in ms:
        for s in schedules:
            trainers[("zfunc", s, m)], holders[(s, m)] = zfunc_trainer(copy.deepcopy(base), mesh, m, s, norm)
            trainers[("torch", s, m)] = torch_trainer(copy.deepcopy(base), rank, p, m, s, batch, norm)
    times, cpu, losses = {k: [] for k in trainers}, {k: [] for k in trainers}, {k: [] for k in trainers}
    for k, run in trainers.items():  # warm-up: shapes, allocator
        losses[k].append(run(data[0]))
    for h in holders.values():
        h["timings"].clear()
    pairs = list(zip(list(trainers)[::2], list(trainers)[1::2]))  # (zfunc's, torch's) of each kind
    for r in range(rounds):
        for j, tokens in enumerate(data):
            flip = (r * len(data) + j) % 2  # the pair's order alternates (module docstring), alike on every rank
            for k in [key for pair in pairs for key in (pair[::-1] if flip else pair)]:
                run = trainers[k]
                torch.distributed.barrier()  # every trainer starts its step together on all ranks
                t0, c0 = time.perf_counter(), _usage()
                loss = run(tokens)
                times[k].append(time.perf_counter() - t0)
                losses[k].append(loss)
                cpu[k].append([b - a for a, b in zip(c0, _usage())])  # every thread of the rank: gloo's, comm's
    gap = max((abs(z - t) for s, m in holders for z, t in zip(losses["zfunc", s, m], losses["torch", s, m])
               if t is not None), default=None)  # on the last stage's rank
    return times, {k: (h["timings"], h["theory"]) for k, h in holders.items()}, cpu, gap


def _usage() -> tuple[float, float, int, int]:
    """This process's (every thread's) CPU time, its kernel share, minor page faults and voluntary
    context switches so far (``getrusage``): the first two load moves little, the counts not at all."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_stime, r.ru_minflt, r.ru_nvcsw


def bubbles(schedule: str, p: int, m: int, per_rank: list[list[dict]]) -> tuple[list[float], ...]:
    """Per rank, the median over steps of: the measured bubble over the pipeline's makespan, the
    bubble the schedule implies for that step's op times (``zf.pipelining.measured``), and the
    first's excess over the second, step by step."""
    plan = zf.pipelining.build(schedule, p, m, VIRTUAL[schedule])
    steps = [[rank[j] for rank in per_rank] for j in range(len(per_rank[0]))]
    measured = [zf.pipelining.measured.bubble(t) for t in steps]
    implied = [zf.pipelining.measured.implied(plan, t).bubble for t in steps]
    return ([statistics.median(b[r] for b in measured) for r in range(p)],
            [statistics.median(b[r] for b in implied) for r in range(p)],
            [statistics.median(a[r] - b[r] for a, b in zip(measured, implied)) for r in range(p)])


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
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"a subset of {SCHEDULES}")
    ap.add_argument("--norm", choices=("clip", "none"), default="clip",
                    help=f"clip: both clip at the global grad norm {CLIP} (torchtitan's way); none: no grad norm")
    args = ap.parse_args(argv)
    p, ms = args.stages, [int(x) for x in args.microbatches.split(",")]
    schedules = args.schedules.split(",")
    unknown = sorted(set(schedules) - set(SCHEDULES))
    if unknown:
        ap.error(f"--schedules: expected names among {SCHEDULES}, got {unknown}")
    cfg = GPTConfig(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=args.block_size)
    n_params = sum(x.numel() for x in GPT(cfg).parameters())
    print(f"GPT {n_params / 1e6:.2f}M params ({args.n_layer} blocks), {p} stages on {p} gloo ranks, batch "
          f"{args.batch}x{cfg.block_size}, torch {torch.__version__}; median of {args.rounds}x{args.steps} steps; "
          f"grad norm: {args.norm}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    results = zf.dist.spawn(worker, p, p, cfg, ms, args.batch, args.steps, args.rounds, schedules, args.norm,
                            timeout_s=3600)
    slowest = {k: [max(r[0][k][i] for r in results) for i in range(len(results[0][0][k]))] for k in results[0][0]}
    med = {k: statistics.median(v) for k, v in slowest.items()}
    paired = {(s, m): statistics.median(t / z for t, z in zip(slowest["torch", s, m], slowest["zfunc", s, m]))
              for m in ms for s in schedules}
    summed = {k: [[sum(r[2][k][i][c] for r in results) for c in range(4)] for i in range(len(results[0][2][k]))]
              for k in results[0][2]}
    cpu = {(s, m): statistics.median(t[0] / z[0] for t, z in zip(summed["torch", s, m], summed["zfunc", s, m]))
           for m in ms for s in schedules}
    usage = {k: [statistics.median(step[c] for step in v) for c in range(1, 4)] for k, v in summed.items()}
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; the same model on both sides: "
          f"zfunc's and torch's losses differ by at most {max(r[3] for r in results if r[3] is not None):.1e} "
          "over every step")
    print("\n| m | schedule (torch's) | bubble theory | theory at the step's op times, per stage | bubble measured "
          "per stage (its excess, paired) | zfunc ms/step | torch ms/step | zfunc speed vs torch (paired) | CPU time "
          "torch / zfunc (paired) | sys ms, minor faults, voluntary switches per step: zfunc / torch |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in ms:
        for s in schedules:
            theory = results[0][1][(s, m)][1]
            measured, implied, excess = bubbles(s, p, m, [r[1][(s, m)][0] for r in results])
            z, t = med[("zfunc", s, m)], med[("torch", s, m)]
            print(f"| {m} | {s} ({TORCH[s]}) | {theory:.2f} | {', '.join(f'{b:.2f}' for b in implied)} | "
                  f"{', '.join(f'{b:.2f} ({e:+.2f})' for b, e in zip(measured, excess))} | {z * 1e3:.1f} | "
                  f"{t * 1e3:.1f} | {paired[s, m]:.2f}x | {cpu[s, m]:.2f} | {_counts(usage['zfunc', s, m])} / "
                  f"{_counts(usage['torch', s, m])} |")


def _counts(u: list[float]) -> str:
    return f"{u[0] * 1e3:.1f}, {u[1]:.0f}, {u[2]:.0f}"


if __name__ == "__main__":
    main()
