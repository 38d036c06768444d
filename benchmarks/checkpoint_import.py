"""Memory of loading a DeepSpeed ZeRO-3 checkpoint: zfunc's per-rank import vs ``zero_to_fp32``.

    DS_ACCELERATOR=cpu python benchmarks/checkpoint_import.py [--layers 24 --width 1024 --dir /tmp/x]

Writes (once, with deepspeed on 2 gloo ranks: 1 AdamW step, ``save_checkpoint``) a ZeRO-3 checkpoint
of an MLP of ``layers`` Linear(width, width) layers (24 x 1024^2 = 25M fp32 params: 100 MB of params,
300 MB of params + Adam moments), then measures, each in fresh processes, the peak RSS growth (over
the process's RSS just before the call; ``ru_maxrss``) and the time of:

- ``zero_to_fp32``: ``get_fp32_state_dict_from_zero_checkpoint`` (params only, whole, one process);
- zfunc, one plain process: ``zf.checkpoint.load_deepspeed`` into a plain AdamW step (the whole
  params and moments: 12 bytes/param is the state itself);
- zfunc, ZeRO-3 on 2 ranks: each rank's load (its half of params and moments).

deepspeed is needed here (not by zfunc's import). Figures are per process.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def net(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_worker(rank: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = net(args.layers, args.width)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(2, args.width)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(kind: str, rank: int, args, queue) -> None:
    """Peak RSS growth (MB) and seconds of one load, in this fresh process."""
    import zfunc as zf

    model = net(args.layers, args.width).to("meta")
    apply, params = zf.functionalize(model)
    step = zf.train_step(lambda p, x: apply(p, x).sum(), zf.optim.adamw(1e-3))
    if kind == "zfunc-zero3":
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
        step = zf.shard(step, zf.Mesh(dp=2), 3)
    if kind == "zero_to_fp32":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    base, t0 = rss_mb(), time.perf_counter()
    if kind == "zero_to_fp32":
        state = get_fp32_state_dict_from_zero_checkpoint(args.dir)
        held = sum(v.numel() for v in state.values()) * 4
    else:
        state = zf.checkpoint.load_deepspeed(args.dir, step, params=params)
        held = sum(x.numel() * x.element_size() for x in zf.tree.leaves((state.params, state.opt_state))
                   if isinstance(x, torch.Tensor))
    seconds = time.perf_counter() - t0
    queue.put((kind, rank, peak_mb() - base, held / 2**20, seconds))


def run(kind: str, ranks: int, args) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args.port = free_port()
    procs = [ctx.Process(target=measure, args=(kind, r, args, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    out = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    return sorted(out, key=lambda r: r[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--dir", default="/tmp/zfunc_ds_import_bench")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not Path(args.dir, "latest").is_file():
        ctx, port = mp.get_context("spawn"), free_port()
        procs = [ctx.Process(target=write_worker, args=(r, port, args)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            assert p.exitcode == 0
    n = args.layers * args.width**2
    print(f"{n / 1e6:.1f}M fp32 params: params {n * 4 / 2**20:.0f} MB, params + Adam moments {n * 12 / 2**20:.0f} MB")
    for round_ in range(args.rounds):
        for kind, ranks in (("zero_to_fp32", 1), ("zfunc-plain", 1), ("zfunc-zero3", 2)):
            for k, rank, grew, held, seconds in run(kind, ranks, args):
                print(f"round {round_} {k:13s} rank {rank}: peak RSS growth {grew:7.0f} MB, holds {held:6.0f} MB, "
                      f"{seconds:5.2f} s")


if __name__ == "__main__":
    main()
