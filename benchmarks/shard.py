"""ZeRO on 2 gloo ranks of this CPU: DDP, FSDP2, DeepSpeed's ZeRO and zfunc stages 0/1/2/3 on the same GPT.

    python benchmarks/shard.py [--world 2] [--n-layer 4] [--n-embd 192] [--batch 8] [--rounds 60]
                               [--trainers ddp,zf-0] [--deepspeed] [--processes own|shared]

Phase 1 (throughput): every trainer (or ``--trainers``) built from the same initial GPT, each in a spawn
of its own (``--processes own``, the default: ``benchmarks/turns.py``; ``shared``: one spawn whose ranks
build them all), run interleaved: each round runs one step of every trainer, in an order shuffled anew each
round (the same on every rank), for ``--rounds`` rounds. What runs before a trainer shifts its
timings, and an order that merely rotates keeps each trainer behind the same one: stage 1, always
behind FSDP2, came out 0.01-0.03x below the identical stage 2 step in three runs of three;
shuffled, the sign of their difference changes from run to run (-0.013 to +0.017 over seven). A
step is as slow as its slowest rank. Ratios are *paired*: the median over rounds of
the peer's step time over the trainer's in the same round, so that the load this shared machine
sees, which drifts over seconds, cancels (blocks of consecutive steps per trainer let it decide the
ranking: the identical stage 1 and 2 steps came out 0.87x and 0.98x of DDP in one run). Stages
0/1/2 are compared with DDP (stage 0 is DDP's algorithm: whole grads all-reduced in buckets
during backward), stage 3 with FSDP2, which shards the same units (each ``Block``, then
the root). ``--deepspeed`` adds DeepSpeed's own engine at stages 1/2/3 (``ds-1``..``ds-3``,
``DS_ACCELERATOR=cpu``, ``deepspeed.initialize`` on the same gloo group, torch's AdamW as its client
optimizer, ``gradient_clipping`` 1.0, fp32), each compared with zfunc's stage of the same number.
Phase 2 (memory): a fresh spawn per trainer, so each peak RSS is its own: peak RSS minus the RSS
after building the model, per rank, beside the bytes the trainer accounts for; before that the
trainer takes two steps of a tiny GPT, so that what it loads once per process is left out of the
growth and printed on its own (``memory_worker``).
Prints a markdown table and one README row.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
from benchmarks.turns import take_turns  # noqa: E402
from recipes.gpt import GPT, Block, GPTConfig  # noqa: E402

# zf-3* is stage 3 with verify=False: no per-collective agreement check between the ranks (which
# reports diverging control flow instead of letting gloo abort), to show what that check costs.
TRAINERS = ("ddp", "fsdp2", "zf-0", "zf-1", "zf-2", "zf-3", "zf-3*")
DEEPSPEED = ("ds-1", "ds-2", "ds-3")
LR = 1e-3


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def batches(cfg: GPTConfig, batch: int, rank: int, n: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g) for _ in range(n)]


def torch_trainer(kind: str, model: torch.nn.Module):
    """DDP or FSDP2 with fused (DDP) / foreach (FSDP2's DTensors) AdamW: ``step(tokens) -> loss``."""
    from torch.nn.parallel import DistributedDataParallel

    if kind == "ddp":
        module = DistributedDataParallel(model)
        opt = torch.optim.AdamW(module.parameters(), lr=LR, fused=True)
    else:
        from torch.distributed.fsdp import fully_shard

        for m in model.modules():
            if isinstance(m, Block):
                fully_shard(m)
        module = fully_shard(model)
        opt = torch.optim.AdamW(module.parameters(), lr=LR)

    def step(tokens):
        logits = module(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def accounted():
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        params = sum(local(p).numel() * 4 for p in module.parameters())
        state = sum(local(v).numel() * v.element_size() for s in opt.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.dim())
        return params + state

    return step, accounted


def deepspeed_trainer(stage: int, model: torch.nn.Module, batch: int):
    """DeepSpeed's engine at ZeRO ``stage`` (fp32, clip 1.0, torch AdamW): ``step(tokens) -> loss``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(torch.distributed.get_rank()))
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=config)

    def step(tokens):
        loss = F.cross_entropy(engine(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        return loss.detach()

    def accounted():
        return float("nan")  # DeepSpeed keeps no per-rank byte count of its own to compare

    return step, accounted


def zfunc_trainer(stage: int, model: torch.nn.Module, mesh: zf.Mesh, verify: bool = True):
    apply, params = zf.functionalize(model)

    def loss_fn(p, tokens):
        return F.cross_entropy(apply(p, tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(LR))
    step = zf.shard(zf.train_step(loss_fn, tx), mesh, stage, units=zf.units.by_class(Block) if stage == 3 else None,
                    verify=verify)
    holder = {"state": step.init(params)}

    def run(tokens):
        holder["state"], m = step(holder["state"], tokens)
        return m["loss"]

    def accounted():
        mem = step.memory(holder["state"])
        return mem["params"] + mem["optimizer"]

    return run, accounted


def build(kind: str, model, mesh, batch: int):
    model = copy.deepcopy(model)
    if kind.startswith("ds-"):
        return deepspeed_trainer(int(kind[3]), model, batch)
    if kind.startswith("zf-"):
        return zfunc_trainer(int(kind[3]), model, mesh, verify=not kind.endswith("*"))
    return torch_trainer(kind, model)


def throughput_worker(rank: int, world: int, cfg: GPTConfig, batch: int, rounds: int, kinds: tuple[str, ...]):
    """Per trainer, this rank's step times (s), one per round."""
    mesh = zf.Mesh(dp=world)
    torch.manual_seed(0)
    base = GPT(cfg)
    trainers = {k: build(k, base, mesh, batch)[0] for k in kinds}
    data = batches(cfg, batch, rank, 5)
    times = {k: [] for k in kinds}
    for _ in range(2):  # warm-up (JIT, allocator, DDP's buckets, stage-3 unit order)
        for run in trainers.values():
            run(data[0]).item()
    names = list(trainers)
    for r in range(rounds):  # a fresh order each round, the same on every rank
        for k in random.Random(r).sample(names, len(names)):
            t0 = time.perf_counter()
            trainers[k](data[r % len(data)]).item()
            times[k].append(time.perf_counter() - t0)
    return times


def build_alone(kind: str, rank: int, world: int, cfg: GPTConfig, batch: int):
    """``--processes own`` (``turns.take_turns``): trainer ``kind`` alone in this rank's process, warmed up as
    ``throughput_worker`` warms up each; ``step(round)`` trains on the round's batch."""
    torch.manual_seed(0)
    run = build(kind, GPT(cfg), zf.Mesh(dp=world), batch)[0]
    data = batches(cfg, batch, rank, 5)
    for _ in range(2):
        run(data[0]).item()
    return (lambda r: run(data[r % len(data)]).item()), None


def paired_ratio(peer: list[float], ours: list[float]) -> float:
    """Median over rounds of peer time / our time in the same round (> 1: we are faster)."""
    return statistics.median(p / o for p, o in zip(peer, ours))


TINY = GPTConfig(n_layer=1, n_head=4, n_embd=16, block_size=16)  # loads a trainer's code, holds next to nothing


def memory_worker(rank: int, world: int, kind: str, cfg: GPTConfig, batch: int, steps: int):
    """``(peak RSS growth, accounted state, one-off load)`` of trainer ``kind`` on this rank, in bytes.
    First the same trainer takes two steps on ``TINY``: whatever it loads once per process (zfunc's
    Numba runtime and CPU-Adam kernels: ~160 MB a rank on 2 ranks; DDP's first use: ~110 MB) is then
    in the RSS the growth starts from, and its size is the one-off load."""
    mesh = zf.Mesh(dp=world)
    start = rss_bytes()
    run, _ = build(kind, GPT(TINY), mesh, 2)
    for tokens in batches(TINY, 2, rank, 2):
        run(tokens).item()
    del run
    torch.manual_seed(0)
    base = GPT(cfg)
    data = batches(cfg, batch, rank, steps)
    before = rss_bytes()
    run, accounted = build(kind, base, mesh, batch)
    del base
    for tokens in data:
        run(tokens).item()
    return peak_rss_bytes() - before, accounted(), before - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--rounds", type=int, default=60, help="steps of each trainer, interleaved")
    p.add_argument("--trainers", default=",".join(TRAINERS),
                   help=f"a comma-separated subset of {','.join(TRAINERS + DEEPSPEED)}")
    p.add_argument("--deepspeed", action="store_true", help=f"add {','.join(DEEPSPEED)} (needs deepspeed installed)")
    p.add_argument("--processes", choices=("own", "shared"), default="own",
                   help="own: each trainer in processes of its own, taking turns (benchmarks/turns.py); "
                        "shared: every trainer in each rank's one process")
    args = p.parse_args(argv)
    for flag, value in (("--world", args.world), ("--rounds", args.rounds), ("--batch", args.batch)):
        if value < 1:
            p.error(f"{flag}: expected an int >= 1, got {value}")
    kinds = tuple(args.trainers.split(",")) + (DEEPSPEED if args.deepspeed else ())
    if set(kinds) - set(TRAINERS + DEEPSPEED) or "ddp" not in kinds:
        p.error(f"--trainers: expected 'ddp' and others of {','.join(TRAINERS + DEEPSPEED)}, got {args.trainers!r}")
    if any(k.startswith("ds-") for k in kinds) and importlib.util.find_spec("deepspeed") is None:
        p.error("--deepspeed: DeepSpeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)")
    cfg = GPTConfig(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=args.block_size)
    n_params = sum(x.numel() for x in GPT(cfg).parameters())
    print(f"GPT {n_params / 1e6:.2f}M params, {args.world} gloo ranks, batch {args.batch}x{cfg.block_size} per rank, "
          f"torch {torch.__version__}, --processes {args.processes}")
    if args.processes == "own":
        times = take_turns(build_alone, list(kinds), args.world, args.rounds, (cfg, args.batch))[0]
    else:
        results = zf.dist.spawn(throughput_worker, args.world, args.world, cfg, args.batch, args.rounds, kinds,
                                timeout_s=3600)
        times = {k: [max(ts) for ts in zip(*(r[k] for r in results))] for k in kinds}  # the slowest rank
    med = {k: statistics.median(v) for k, v in times.items()}
    peers = [peer for peer in ("ddp", "fsdp2") if peer in kinds]
    vs = {k: {peer: paired_ratio(times[peer], times[k]) for peer in peers} for k in kinds}
    for k in kinds:  # zfunc's stage N against DeepSpeed's stage N
        if k.startswith("zf-") and f"ds-{k[3]}" in kinds:
            vs[k]["deepspeed"] = paired_ratio(times[f"ds-{k[3]}"], times[k])
    memory = {k: zf.dist.spawn(memory_worker, args.world, args.world, k, cfg, args.batch, 2, timeout_s=600)
              for k in kinds}
    print("\n| trainer | median ms/step | vs DDP, paired (of medians) | vs FSDP2, paired (of medians) "
          "| vs DeepSpeed's same stage, paired (of medians) | peak RSS growth/rank (MB) | accounted state/rank (MB) "
          "| loaded once per process (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    for k in kinds:
        rss = max(m[0] for m in memory[k]) / 2**20
        acc = max(m[1] for m in memory[k]) / 2**20
        once = max(m[2] for m in memory[k]) / 2**20
        ratios = [f"{vs[k][peer]:.3f}x ({med[peer] / med[k]:.2f}x)" if peer in vs[k] else "-"
                  for peer in ("ddp", "fsdp2")]
        ratios.append(f"{vs[k]['deepspeed']:.3f}x ({med[f'ds-{k[3]}'] / med[k]:.2f}x)" if "deepspeed" in vs[k] else "-")
        accounted = "-" if acc != acc else f"{acc:.2f}"  # nan: DeepSpeed's
        print(f"| {k} | {med[k] * 1e3:.1f} | {' | '.join(ratios)} | {rss:.1f} | {accounted} | {once:.1f} |")
    if set(kinds) == set(TRAINERS):
        print(f"\nREADME row: | ZeRO on {args.world} gloo ranks, GPT {n_params / 1e6:.1f}M "
              f"| `python benchmarks/shard.py` "
              f"| throughput vs DDP (paired, {args.rounds} rounds): stage 0 {vs['zf-0']['ddp']:.2f}x, stage 1 "
              f"{vs['zf-1']['ddp']:.2f}x, stage 2 {vs['zf-2']['ddp']:.2f}x; "
              f"stage 3 vs FSDP2 {vs['zf-3']['fsdp2']:.2f}x ({vs['zf-3*']['fsdp2']:.2f}x without verify) |")
    if set(DEEPSPEED) <= set(kinds):
        print(f"README row: | ZeRO vs DeepSpeed's own on {args.world} gloo ranks, GPT {n_params / 1e6:.1f}M "
              f"| `python benchmarks/shard.py --deepspeed` | throughput vs DeepSpeed (paired, {args.rounds} rounds): "
              + ", ".join(f"stage {n} {vs[f'zf-{n}']['deepspeed']:.2f}x" for n in (1, 2, 3) if f"zf-{n}" in kinds)
              + " |")


if __name__ == "__main__":
    main()
