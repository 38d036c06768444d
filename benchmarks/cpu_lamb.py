"""CPU LAMB step time: zf.optim.lamb's Numba kernel (backend="numba", what "auto" picks on CPU) vs its
plain-torch path (backend="torch"), with adamw(backend="numba") as the one-pass reference.

    python benchmarks/cpu_lamb.py [--sizes 1e6 4e6] [--rounds 7] [--threads 2]

A model-shaped pytree of n fp32 params (four matrices + eight 1024-element vectors), fp32 grads.
Rounds interleave the three implementations (one step of each per round); each row reports the
median over rounds of the per-round ratio to the torch LAMB (paired: a round's three samples share the
machine's load), and the median step time. ``uptime``'s load is printed with the figures.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from zfunc import optim  # noqa: E402
from zfunc.ops.cpu import adam as cpu_adam  # noqa: E402


def tree_of(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    vec = {f"b{i}": torch.randn(1024, generator=gen) for i in range(8)}
    rows = (n - 8 * 1024) // 4 // 1024
    return {**vec, **{f"w{i}": torch.randn(rows, 1024, generator=gen) for i in range(4)}}


def steppers(n: int) -> dict[str, callable]:
    """name -> zero-arg callable doing one optimizer step on its own copy of the params."""
    out = {}
    for name, tx in (("lamb torch", optim.lamb(1e-3, weight_decay=0.01, backend="torch")),
                     ("lamb numba", optim.lamb(1e-3, weight_decay=0.01, backend="numba")),
                     ("adamw numba", optim.adamw(1e-3, weight_decay=0.01, backend="numba"))):
        params = tree_of(n)
        grads = {k: torch.randn_like(p) * 1e-2 for k, p in params.items()}
        box = [params, tx.init(params)]

        def step(tx=tx, box=box, grads=grads):
            box[0], box[1] = tx.apply(grads, box[1], box[0])
        out[name] = step
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 4e6])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch and kernel threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {cpu_adam.get_num_threads()}; load (uptime){os.popen('uptime').read().split('load average')[-1]}",
          end="")
    for size in args.sizes:
        n = int(size)
        impls = steppers(n)
        for f in impls.values():  # warm-up: compile (cached) and first-touch
            f()
        times = {k: [] for k in impls}
        for _ in range(args.rounds):
            for k, f in impls.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        base = times["lamb torch"]
        print(f"\n{n / 1e6:g}M fp32 params, {args.rounds} paired rounds")
        print(f"{'implementation':<14} {'median ms':>10} {'x torch lamb (paired median)':>30}")
        for k, ts in times.items():
            ratio = statistics.median(b / t for b, t in zip(base, ts))
            print(f"{k:<14} {statistics.median(ts) * 1e3:>10.1f} {ratio:>29.2f}x")


if __name__ == "__main__":
    main()
