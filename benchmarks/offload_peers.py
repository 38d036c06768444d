"""The offloaded step against DeepSpeed's own ZeRO-Offload and ZeRO-Infinity, same model, same batches.

    python benchmarks/offload_peers.py [--world 1 2] [--kinds cpu,nvme,nvme-opt] [--n-layer 4] [--n-embd 192]
                                       [--block-size 128] [--batch 8] [--rounds 11] [--dir /tmp/zfunc-offload-peers]
                                       [--processes own|shared]

For each ``--world`` (one spawn of that many gloo ranks) every rank builds, from the same initial
GPT (recipes/gpt.py: GPT-2's shape, tied embedding and head), fp32, AdamW (lr 1e-3, weight decay
0.01), the grad norm clipped at 1.0:

- ``cpu`` (ZeRO-Offload): ``zf.offload(step, "cpu")``, the step ``zf.shard(..., stage=2)`` over the
  ranks (a plain step alone), against DeepSpeed's engine at ZeRO stage 2 with
  ``offload_optimizer: cpu`` (its ``DeepSpeedCPUAdam``);
- ``nvme`` (ZeRO-Infinity, optimizer and params on NVMe): ``zf.offload(step, "nvme", params="nvme")``,
  stage 3 over the ranks (units: each ``Block``), against DeepSpeed at stage 3 with
  ``offload_optimizer`` and ``offload_param`` on ``nvme`` (its ``async_io`` op, JIT-built from
  ``libaio-dev``; where it cannot be built the row says so and only zfunc runs);
- ``nvme-opt`` (the optimizer on NVMe, params in RAM): ``zf.offload(step, "nvme", params="cpu")``
  against DeepSpeed with ``offload_param: cpu``.

**What DeepSpeed puts on NVMe.** Its param swapper takes a param's partition only from 1 MiB up
(``MIN_AIO_BYTES``) and, by default, keeps up to ``max_in_cpu`` = 1e9 elements in RAM anyway: on the
default 1.85M model no param of DeepSpeed's leaves RAM, so there its ``nvme`` row does the work of
``nvme-opt`` while zfunc reads every param from its files. The last column says which share each
engine keeps on NVMe; ``--n-embd 512`` (12.8M params) gives DeepSpeed 90-98% of them there, the
like-for-like ZeRO-Infinity row. To run that at all, DeepSpeed gets ``max_in_cpu: 0``, a swap buffer
per param (its default 5 is fewer than one unit's params: the forward fails for want of one), no
param prefetch where it swaps params (its prefetch of NVMe params asserts, ``param N already
assigned swap buffer id M``) and ``keep_given_dtype`` (its ``zero.Init`` picks bf16 on a CPU
whatever dtype it is given, and fp32 params in bf16 swap buffers fail the first forward).

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
SWAPPABLE_BYTES = 1 << 20  # DeepSpeed keeps a param partition smaller than this in RAM (its MIN_AIO_BYTES)
KINDS = ("cpu", "nvme", "nvme-opt")


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
        where_params = "nvme" if kind == "nvme" else "cpu"
        step = zf.offload(step, "nvme", params=where_params, path=str(folder / f"zfunc-{kind}"), units=units)
    holder = {"state": step.init(params)}

    def run(tokens):
        holder["state"], metrics = step(holder["state"], tokens)
        return metrics["loss"].item()

    return run


def deepspeed_config(kind: str, batch: int, folder: Path, model: torch.nn.Module, world: int) -> dict:
    """DeepSpeed's config for ``kind`` (module docstring)."""
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    if kind != "cpu":
        nvme = {"device": "nvme", "nvme_path": str(folder / f"deepspeed-{kind}")}
        zero = {"stage": 3, "offload_optimizer": nvme, "offload_param": {"device": "cpu"}}
    if kind == "nvme":
        sizes = [p.numel() for p in model.parameters()]
        zero["offload_param"] = {**nvme, "max_in_cpu": 0, "buffer_count": len(sizes), "buffer_size": max(sizes)}
        if -(-max(sizes) // world) * next(model.parameters()).element_size() >= SWAPPABLE_BYTES:
            zero["stage3_prefetch_bucket_size"] = 0  # its prefetch of NVMe params asserts (module docstring)
    return {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


def keep_given_dtype() -> None:
    """Make ``deepspeed.zero.Init`` keep the dtype it is given on a CPU accelerator.

    Its ``_set_dtype`` reads ``dtype or torch.float16 if fp16 else torch.bfloat16 if
    is_bf16_supported else torch.float32``: by precedence a given dtype counts only where fp16 is
    supported, and ``is_bf16_supported`` is tested uncalled (a bound method: true), so on a CPU it
    picks bf16 whatever it is given. The param swapper then keeps fp32 params in bf16 buffers and
    the first forward of ZeRO-Infinity with params on NVMe fails (``float != c10::BFloat16``). This
    gives it the precedence its ``dtype or`` intends (the engine passes the model's dtype); with
    ``dtype=None`` it behaves as before."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._set_dtype
    if getattr(original, "zfunc_keeps_dtype", False):
        return

    def set_dtype(self, ds_config, dtype):
        if dtype is not None:  # its else branch's ``dtype or``, whatever the config
            self.dtype = dtype
        else:
            original(self, ds_config, dtype)

    set_dtype.zfunc_keeps_dtype = True
    Init._set_dtype = set_dtype


def nvme_share(model: torch.nn.Module) -> float:
    """The share of ``model``'s param elements DeepSpeed keeps on NVMe (its partitions' ``final_location``)."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    parts = [p.ds_tensor for p in model.parameters()]
    on = sum(t.ds_numel for t in parts if getattr(t, "final_location", None) == OffloadDeviceEnum.nvme)
    return on / sum(t.ds_numel for t in parts)


def deepspeed_trainer(kind: str, model: GPT, batch: int, folder: Path):
    """``run(tokens) -> loss`` of DeepSpeed's engine with the same offload (module docstring)."""
    os.environ.setdefault("LOCAL_RANK", str(torch.distributed.get_rank()))
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    if kind == "nvme":
        keep_given_dtype()
    config = deepspeed_config(kind, batch, folder, model, torch.distributed.get_world_size())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def run(tokens):
        loss = lm_loss(engine(tokens[:, :-1]), tokens)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()  # the ranks' mean, as zfunc's metrics["loss"]
        torch.distributed.all_reduce(mean)
        return mean.item() / torch.distributed.get_world_size()

    run.params_on_nvme = nvme_share(model) if kind == "nvme" else 0.0
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
    side, kind = name.split("-", 1)
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
    losses = {k: ([run(data[0]), run(data[1])], on_nvme(run)) for k, run in built.items()}  # warm-up, compared
    times = {k: [] for k in built}
    for r in range(rounds):
        for k in random.Random(r).sample(list(built), len(built)):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            built[k](data[r % len(data)])
            times[k].append(time.perf_counter() - t0)
    return times, losses


def on_nvme(run) -> float | None:
    """The share of a DeepSpeed trainer's param elements on NVMe (None for the others)."""
    return getattr(run, "params_on_nvme", None)


def build_alone(name: str, rank: int, world: int, cfg: GPTConfig, batch: int, root: str):
    """``--processes own`` (``turns.take_turns``): trainer ``name`` alone in this rank's process, warmed up by
    two steps whose losses it returns (with ``on_nvme``); then ``step(round)`` trains on the round's batch."""
    torch.manual_seed(0)
    run = make_trainer(name, GPT(cfg), zf.Mesh(dp=world), batch, Path(root))
    data = batches(cfg, batch, rank, 4)
    losses = [run(data[0]), run(data[1])]
    return (lambda r: run(data[r % len(data)])), (losses, on_nvme(run))


def timed(world: int, cfg: GPTConfig, batch: int, rounds: int, trainers: list[str], root: str, processes: str):
    """Per trainer: each round's step seconds (the slowest rank's), and the two warm-up losses with the
    share of params on NVMe (rank 0's; ``on_nvme``)."""
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
    nvme_peer = kinds != ["cpu"] and async_io_builds()
    print(f"GPT {n_params / 1e6:.2f}M params, batch {args.batch}x{cfg.block_size} per rank, fp32, "
          f"torch {torch.__version__}, --processes {args.processes}")
    print("\n| processes | offload | zfunc ms/step | DeepSpeed ms/step | zfunc speed vs DeepSpeed, paired "
          "| largest loss difference (2 steps) | forward+backward alone ms/step | zfunc / forward+backward, paired "
          "| DeepSpeed / forward+backward, paired | params on NVMe, zfunc / DeepSpeed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
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
            zf_nvme = f"{100 if kind == 'nvme' else 0}%"
            if f"ds-{kind}" not in times:
                print(f"| {world} | {kind} | {statistics.median(zf_t) * 1e3:.1f} | not run (DeepSpeed's async_io "
                      f"cannot be built here: libaio-dev) | - | - | {fb} | {over(zf_t)} | - | {zf_nvme} / - |")
                continue
            ds_t = times[f"ds-{kind}"]
            ratio = statistics.median(d / z for d, z in zip(ds_t, zf_t))
            (zf_losses, _), (ds_losses, ds_nvme) = losses[f"zf-{kind}"], losses[f"ds-{kind}"]
            diff = max(abs(a - b) for a, b in zip(zf_losses, ds_losses))
            print(f"| {world} | {kind} | {statistics.median(zf_t) * 1e3:.1f} | {statistics.median(ds_t) * 1e3:.1f} "
                  f"| {ratio:.2f}x | {diff:.1e} | {fb} | {over(zf_t)} | {over(ds_t)} | {zf_nvme} / {ds_nvme:.0%} |")


if __name__ == "__main__":
    main()
