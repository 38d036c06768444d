"""The offloaded step against DeepSpeed's own ZeRO-Offload and ZeRO-Infinity, same model, same batches.

    python benchmarks/offload_peers.py [--world 1 2] [--kinds cpu,nvme] [--n-layer 4] [--n-embd 192]
                                       [--block-size 128] [--batch 8] [--rounds 11] [--dir /tmp/zfunc-offload-peers]
                                       [--processes own|shared]

For each ``--world`` (one spawn of that many gloo ranks) every rank builds, from the same initial
GPT (recipes/gpt.py: GPT-2's shape, tied embedding and head), fp32, AdamW (lr 1e-3, weight decay
0.01), the grad norm clipped at 1.0:

- ``cpu`` (ZeRO-Offload): ``zf.offload(step, "cpu")``, the step ``zf.shard(..., stage=2)`` over the
  ranks (a plain step alone), against DeepSpeed's engine at ZeRO stage 2 with
  ``offload_optimizer: cpu`` (its ``DeepSpeedCPUAdam``);
- ``nvme`` (ZeRO-Infinity): ``zf.offload(step, "nvme", params="nvme")``, stage 3 over the ranks
  (units: each ``Block``), against DeepSpeed at stage 3 with ``offload_optimizer`` and
  ``offload_param`` on ``nvme`` (its ``async_io`` op, JIT-built from ``libaio-dev``; where it cannot
  be built the row says so and only zfunc runs).

``DS_ACCELERATOR=cpu``. Each trainer runs in processes of its own (``--processes own``, the default:
``benchmarks/turns.py``, a spawn per trainer taking turns; ``shared``: every trainer in each rank's one
process). Each round runs one step of every trainer, in an order shuffled anew each round (the same
on every rank); a step is as slow as its slowest rank; the figure is the median over rounds of the
paired ratio DeepSpeed / zfunc (> 1: zfunc faster), after two warm-up steps.
The losses of the first steps (the mean over the ranks, as zfunc's metrics give it) are compared
(the same batches: they agree to the optimizers' rounding, printed as the largest difference).

The reference: a third trainer in the same rounds runs torch's forward and backward alone on the
same model and batch (``loss.backward()``, the grads then dropped; no collective, no update), the
work every engine here does whatever it offloads. Each engine's step over it (paired) says how much
of the step is that shared work: an engine near 1.0x has little left to gain but in the forward and
backward themselves (its grads' memory, its threads), whatever it offloads.
Memory: each trainer holds ~16 B/param in RAM or its swap files under ``--dir`` (removed at the end).
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before any deepspeed import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
from recipes.gpt import GPT, Block, GPTConfig  # noqa: E402
from benchmarks.shard import batches  # noqa: E402
from benchmarks.turns import take_turns  # noqa: E402

LR, WD = 1e-3, 0.01
KINDS = ("cpu", "nvme")


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def zfunc_trainer(kind: str, model: GPT, mesh: zf.Mesh, folder: Path):
    """``run(tokens) -> loss`` of zfunc's offloaded step (module docstring)."""
    apply, params = zf.functionalize(model)
    tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(LR, weight_decay=WD))
    step = zf.train_step(lambda p, tokens: lm_loss(apply(p, tokens[:, :-1]), tokens), tx)
    stage = 2 if kind == "cpu" else 3
    if mesh.dp > 1:
        step = zf.shard(step, mesh, stage, units=zf.units.by_class(Block) if stage == 3 else None)
    if kind == "cpu":
        step = zf.offload(step, "cpu")
    else:
        units = zf.units.by_class(Block) if mesh.dp == 1 else None
        step = zf.offload(step, "nvme", params="nvme", path=str(folder / "zfunc"), units=units)
    holder = {"state": step.init(params)}

    def run(tokens):
        holder["state"], metrics = step(holder["state"], tokens)
        return metrics["loss"].item()

    return run


def deepspeed_config(kind: str, batch: int, folder: Path) -> dict:
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    if kind == "nvme":
        nvme = {"device": "nvme", "nvme_path": str(folder / "deepspeed")}
        zero = {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme}
    return {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


def deepspeed_trainer(kind: str, model: GPT, batch: int, folder: Path):
    """``run(tokens) -> loss`` of DeepSpeed's engine with the same offload (module docstring)."""
    os.environ.setdefault("LOCAL_RANK", str(torch.distributed.get_rank()))
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=deepspeed_config(kind, batch, folder))

    def run(tokens):
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()  # the ranks' mean, as zfunc's metrics["loss"]
        torch.distributed.all_reduce(mean)
        return mean.item() / torch.distributed.get_world_size()

    return run


def forward_backward_trainer(model: GPT):
    """``run(tokens)``: torch's forward and backward alone (the reference, module docstring)."""
    def run(tokens):
        loss = lm_loss(model(tokens[:, :-1]), tokens)
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss.item()

    return run


def make_trainer(name: str, base: GPT, mesh: zf.Mesh, batch: int, folder: Path):
    """Trainer ``name`` ("zf-cpu", "ds-nvme", "torch-fb", ...) on a copy of ``base``: ``run(tokens) -> loss``."""
    side, kind = name.split("-")
    if side == "torch":
        return forward_backward_trainer(copy.deepcopy(base))
    if side == "zf":
        return zfunc_trainer(kind, copy.deepcopy(base), mesh, folder)
    return deepspeed_trainer(kind, copy.deepcopy(base), batch, folder)


def worker(rank: int, world: int, cfg: GPTConfig, batch: int, rounds: int, trainers: list[str], root: str):
    """``--processes shared``: every trainer in this rank's process, one step each per round."""
    mesh = zf.Mesh(dp=world)
    torch.manual_seed(0)
    base = GPT(cfg)
    built = {name: make_trainer(name, base, mesh, batch, Path(root)) for name in trainers}
    data = batches(cfg, batch, rank, 4)
    losses = {k: [run(data[0]), run(data[1])] for k, run in built.items()}  # warm-up, and the losses compared
    times = {k: [] for k in built}
    for r in range(rounds):
        for k in random.Random(r).sample(list(built), len(built)):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            built[k](data[r % len(data)])
            times[k].append(time.perf_counter() - t0)
    return times, losses


def build_alone(name: str, rank: int, world: int, cfg: GPTConfig, batch: int, root: str):
    """``--processes own`` (``turns.take_turns``): trainer ``name`` alone in this rank's process, warmed up by
    two steps whose losses it returns; then ``step(round)`` trains on the round's batch."""
    torch.manual_seed(0)
    run = make_trainer(name, GPT(cfg), zf.Mesh(dp=world), batch, Path(root))
    data = batches(cfg, batch, rank, 4)
    losses = [run(data[0]), run(data[1])]
    return (lambda r: run(data[r % len(data)])), losses


def timed(world: int, cfg: GPTConfig, batch: int, rounds: int, trainers: list[str], root: str, processes: str):
    """Per trainer: each round's step seconds (the slowest rank's), and the two warm-up losses (rank 0's)."""
    if processes == "own":
        times, extras = take_turns(build_alone, trainers, world, rounds, (cfg, batch, root))
        return times, {k: ranks[0] for k, ranks in extras.items()}
    results = zf.dist.spawn(worker, world, world, cfg, batch, rounds, trainers, root, timeout_s=3600)
    times = {k: [max(ts) for ts in zip(*(r[0][k] for r in results))] for k in trainers}
    return times, results[0][1]


def async_io_builds() -> bool:
    """Whether DeepSpeed's async_io op (ZeRO-Infinity's NVMe reads and writes) can be built here."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, nargs="+", default=[1, 2])
    p.add_argument("--kinds", default=",".join(KINDS), help=f"a comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--processes", choices=("own", "shared"), default="own",
                   help="own: each trainer in processes of its own, taking turns (benchmarks/turns.py); "
                        "shared: every trainer in each rank's one process")
    p.add_argument("--dir", default="/tmp/zfunc-offload-peers", help="swap files of both (removed at the end)")
    args = p.parse_args(argv)
    for flag, values in (("--world", args.world), ("--rounds", [args.rounds]), ("--batch", [args.batch])):
        if min(values) < 1:
            p.error(f"{flag}: expected ints >= 1, got {values if flag == '--world' else values[0]}")
    kinds = args.kinds.split(",")
    if set(kinds) - set(KINDS) or not kinds:
        p.error(f"--kinds: expected a comma-separated subset of {','.join(KINDS)}, got {args.kinds!r}")
    if importlib.util.find_spec("deepspeed") is None:
        p.error("DeepSpeed is not installed (DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)")
    cfg = GPTConfig(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=args.block_size)
    n_params = sum(x.numel() for x in GPT(cfg).parameters())
    nvme_peer = "nvme" in kinds and async_io_builds()
    print(f"GPT {n_params / 1e6:.2f}M params, batch {args.batch}x{cfg.block_size} per rank, fp32, "
          f"torch {torch.__version__}, --processes {args.processes}")
    print("\n| processes | offload | zfunc ms/step | DeepSpeed ms/step | zfunc speed vs DeepSpeed, paired "
          "| largest loss difference (2 steps) | forward+backward alone ms/step | zfunc / forward+backward, paired "
          "| DeepSpeed / forward+backward, paired |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world in args.world:
        trainers = [f"{side}-{kind}" for kind in kinds for side in ("zf", "ds")
                    if side == "zf" or kind == "cpu" or nvme_peer] + ["torch-fb"]
        root = Path(args.dir)
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        try:
            times, losses = timed(world, cfg, args.batch, args.rounds, trainers, str(root), args.processes)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        fb_t = times["torch-fb"]
        fb = f"{statistics.median(fb_t) * 1e3:.1f}"
        over = lambda ts: f"{statistics.median(t / f for t, f in zip(ts, fb_t)):.2f}x"  # noqa: E731
        for kind in kinds:
            zf_t = times[f"zf-{kind}"]
            if f"ds-{kind}" not in times:
                print(f"| {world} | {kind} | {statistics.median(zf_t) * 1e3:.1f} | not run (DeepSpeed's async_io "
                      f"cannot be built here: libaio-dev) | - | - | {fb} | {over(zf_t)} | - |")
                continue
            ds_t = times[f"ds-{kind}"]
            ratio = statistics.median(d / z for d, z in zip(ds_t, zf_t))
            diff = max(abs(a - b) for a, b in zip(losses[f"zf-{kind}"], losses[f"ds-{kind}"]))
            print(f"| {world} | {kind} | {statistics.median(zf_t) * 1e3:.1f} | {statistics.median(ds_t) * 1e3:.1f} "
                  f"| {ratio:.2f}x | {diff:.1e} | {fb} | {over(zf_t)} | {over(ds_t)} |")


if __name__ == "__main__":
    main()
