"""Collectives between ranks of one host: zfunc's shared-memory channel vs gloo (zfunc's and torch's own).

    python benchmarks/collectives.py [--world 2] [--mb 0.004,1.9,7.4] [--rounds 30] [--reps 5]

One spawn of ``--world`` ranks, one thread each. For each size (MB of the all-gather's output and
of the reduce-scatter's input, bf16 into fp32 as ZeRO's grads go; the all-reduce of that many fp32
bytes) three transports run interleaved, round by round, ``--reps`` calls each after a barrier:
``shm``, ``zfunc.Comm`` on the group's shared-memory channel (``zfunc.dist.shm``); ``zf-gloo``, the
same ``Comm`` with the channel off (its gloo forms: one broadcast per rank, an all-to-all plus a
local sum); ``torch``, torch.distributed's own gloo calls (``all_gather_into_tensor``,
``reduce_scatter_tensor`` on the widened tensor, ``all_reduce``). Printed per call: the median wall
time (the slowest rank's), the process CPU time per rank (every thread: gloo's own included), and
the paired speedup of ``shm`` over each gloo form (median over rounds of their time over its). The
floor is one ``copy_`` of the bytes a rank must receive (the fastest of 50, one thread).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
from zfunc.dist import shm  # noqa: E402

TRANSPORTS = ("shm", "zf-gloo", "torch")


def _calls(comm, world: int, rank: int, nbytes: float) -> dict[str, dict]:
    """Per op, per transport: a callable doing one call (fresh inputs are not needed: same bytes)."""
    n = max(world, int(nbytes / 2) // world * world)  # bf16 elements of the gathered / reduced tensor
    gathered, local = torch.empty(n, dtype=torch.bfloat16), torch.randn(n // world).bfloat16()
    full, out = torch.randn(n).bfloat16(), torch.empty(n // world)
    wide = full.float()
    vec = torch.randn(max(1, int(nbytes / 4)))
    return {
        "all_gather bf16": {
            "shm": lambda: comm.all_gather(gathered, local),
            "zf-gloo": lambda: comm.all_gather(gathered, local),
            "torch": lambda: dist.all_gather_into_tensor(gathered, local, group=comm.group),
        },
        "reduce_scatter bf16->fp32": {
            "shm": lambda: comm.reduce_scatter(out, full),
            "zf-gloo": lambda: comm.reduce_scatter(out, full),
            "torch": lambda: dist.reduce_scatter_tensor(out, wide, group=comm.group),
        },
        "all_reduce fp32": {
            "shm": lambda: comm.all_reduce(vec),
            "zf-gloo": lambda: comm.all_reduce(vec),
            "torch": lambda: dist.all_reduce(vec, group=comm.group),
        },
    }


def _worker(rank: int, world: int, sizes: list[float], rounds: int, reps: int) -> dict:
    torch.set_num_threads(1)
    mesh = zf.Mesh(dp=world)
    comm = mesh.comm
    results = {}
    for mb in sizes:
        for op, by in _calls(comm, world, rank, mb * 1e6).items():
            times = {t: [] for t in TRANSPORTS}
            cpu = {t: [] for t in TRANSPORTS}
            for t in TRANSPORTS:  # warm-up: the channel opens, buffers are touched
                shm.ENABLED = t == "shm"
                by[t]()
            for _ in range(rounds):
                for t in TRANSPORTS:
                    shm.ENABLED = t == "shm"
                    dist.barrier()
                    c0, t0 = time.process_time(), time.perf_counter()
                    for _ in range(reps):
                        by[t]()
                    wall = torch.tensor([(time.perf_counter() - t0) / reps])
                    cpu[t].append((time.process_time() - c0) / reps)
                    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                    times[t].append(wall.item())
            results[(mb, op)] = (times, cpu)
    shm.ENABLED = True
    return results


def _floor(nbytes: float, rounds: int = 50) -> float:
    src, dst = torch.ones(max(1, int(nbytes)), dtype=torch.uint8), torch.zeros(max(1, int(nbytes)), dtype=torch.uint8)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mb", default="0.004,1.9,7.4", help="sizes in MB, comma-separated")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        sizes = [float(s) for s in args.mb.split(",") if s.strip()]
        if not sizes or not all(0 < s < float("inf") for s in sizes):
            raise ValueError
    except ValueError:
        parser.error(f"--mb: expected comma-separated sizes in MB, each > 0, got {args.mb!r}")
    for flag, value, least in (("--world", args.world, 2), ("--rounds", args.rounds, 1), ("--reps", args.reps, 1)):
        if value < least:
            parser.error(f"{flag}: expected an int >= {least}, got {value}")
    torch.set_num_threads(1)
    ranks = zf.dist.spawn(_worker, args.world, args.world, sizes, args.rounds, args.reps, timeout_s=1800)
    print(f"{args.world} ranks of this host, 1 thread each, {args.rounds} rounds x {args.reps} calls; "
          f"load {open('/proc/loadavg').read().split()[0]}")
    print("| MB | op | shm ms | zf-gloo ms | torch ms | CPU ms/rank shm / zf-gloo / torch | shm vs zf-gloo | "
          "shm vs torch | floor (one copy) ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (mb, op), (times, _) in ranks[0].items():
        med = {t: statistics.median(times[t]) * 1e3 for t in TRANSPORTS}
        cpu = {t: statistics.median(c for r in ranks for c in r[(mb, op)][1][t]) * 1e3 for t in TRANSPORTS}
        paired = {t: statistics.median(a / b for a, b in zip(times[t], times["shm"])) for t in ("zf-gloo", "torch")}
        received = mb * 1e6 * (args.world - 1) / args.world * (2 if op.startswith("all_gather") else 1)
        print(f"| {mb:g} | {op} | {med['shm']:.3f} | {med['zf-gloo']:.3f} | {med['torch']:.3f} | "
              f"{cpu['shm']:.3f} / {cpu['zf-gloo']:.3f} / {cpu['torch']:.3f} | {paired['zf-gloo']:.2f}x | "
              f"{paired['torch']:.2f}x | {_floor(received) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
