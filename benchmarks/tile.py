"""Memory-centric tiling on this CPU: a wide Linear and an LM head + cross-entropy at vocab 128k.

    python benchmarks/tile.py [--tiles 8] [--rounds 5] [--threads 1] [--tokens 1024] [--vocab 131072]

Time: in one process, untiled and tiled runs of forward + backward interleaved for ``--rounds``
rounds after a warm-up; ratios of medians to the untiled op, in wall time and in process CPU
time. The machine is shared: compare ratios, not times. With ``--threads 1`` (the default) CPU
time is the work done whatever the wait for a core; with more threads OpenMP's spinning at
barriers is counted too, and wall time suffers most from the neighbours.
Memory, per config in a fresh subprocess with glibc's mmap threshold fixed at 64 KiB (so freed
buffers go back to the OS and RSS follows live memory), after a warm-up run and a reset of the
peak (``/proc/self/clear_refs``):
- LM head: peak RSS growth during one forward + backward, and the bytes
  ``zf.tiling.WorkingMemory`` accounts (storages the op allocates, forward and backward).
- Linear: what tiling shrinks is the layer's parameter working set under stage 3: the step's
  accounted peak of whole params gathered and of whole grads held (``step.memory``), on a mesh of
  one process with ``prefetch=0`` (each extra prefetch depth adds one tile), plus peak RSS growth
  of that step. The Linear's activations are not tiled (the output is the output).
Targets: time overhead <= 1.1x, memory ~1/k.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf

CONFIGS = ("linear", "linear-tiled", "head", "head-tiled", "head-tile(fn)")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak_rss() -> int:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS, which it returns."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


# ------------------------------------------------------------------------------- the ops


def linear_case(args, tiled: bool):
    """``(run, inputs)``: forward + backward of a wide Linear (``--d-in`` -> ``--d-out``)."""
    torch.manual_seed(0)
    layer = nn.Linear(args.d_in, args.d_out, bias=False)
    if tiled:
        layer = zf.tile(layer, tiles=args.tiles)
    x = torch.randn(args.linear_tokens, args.d_in, requires_grad=True)

    def run():
        layer(x).square().mean().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    return run, (layer, x)


def head_case(args, kind: str):
    """``(run, inputs)``: forward + backward of ``cross_entropy(hidden @ weight.T, targets)``."""
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.d_model, requires_grad=True)
    weight = (torch.randn(args.vocab, args.d_model) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,))

    def ce_sum(h, t):
        return F.cross_entropy(h @ weight.T, t, reduction="sum")

    if kind == "head":
        loss = lambda: F.cross_entropy(hidden @ weight.T, targets)
    elif kind == "head-tiled":
        loss = lambda: zf.tiling.lm_head_loss(hidden, weight, targets, tiles=args.tiles)
    else:  # the generic function form: checkpointed tiles, recomputed in backward
        tiled = zf.tile(ce_sum, tiles=args.tiles, argnums=(0, 1), reduce="sum")
        loss = lambda: tiled(hidden, targets) / targets.numel()

    def run():
        loss().backward()
        hidden.grad = weight.grad = None

    return run, (hidden, weight, targets)


def make(args, config: str):
    return linear_case(args, config.endswith("tiled")) if config.startswith("linear") else head_case(args, config)


# ------------------------------------------------------------------------------- time


def time_interleaved(args, configs) -> dict[str, dict[str, list[float]]]:
    """Per config, ``wall`` and ``cpu`` seconds of each round."""
    runs = {c: make(args, c)[0] for c in configs}
    for run in runs.values():  # warm-up: first-touch page faults, MKL's buffers
        run()
    times = {c: {"wall": [], "cpu": []} for c in configs}
    for _ in range(args.rounds):
        for c, run in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            times[c]["wall"].append(time.perf_counter() - t0)
            times[c]["cpu"].append(time.process_time() - c0)
    return times


# ------------------------------------------------------------------------------- memory (subprocess)


def measure_memory(args, config: str) -> dict[str, float]:
    """Runs in its own process: peak RSS growth and accounted bytes of one config."""
    if config.startswith("linear"):
        return linear_stage3_memory(args, config.endswith("tiled"))
    run, _ = make(args, config)
    run()
    base = reset_peak_rss()
    run()
    out = {"rss_growth": peak_rss_bytes() - base}
    with zf.tiling.WorkingMemory() as mem:
        run()
    out["accounted"] = mem.peak_bytes
    return out


def linear_stage3_memory(args, tiled: bool) -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.d_in, args.d_out, bias=False))
    if tiled:
        model[0] = zf.tile(model[0], tiles=args.tiles)
    apply, params = zf.functionalize(model)
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.sgd(1e-3))
    step = zf.shard(step, zf.Mesh(), 3, units=zf.units.by_class(nn.Linear), prefetch=0)
    state = step.init(params)
    del params, model
    x = torch.randn(args.linear_tokens, args.d_in)
    state, _ = step(state, x)
    base = reset_peak_rss()
    state, _ = step(state, x)
    m = step.memory(state)
    return {"rss_growth": peak_rss_bytes() - base, "accounted": m["whole_params"] + m["whole_grads"]}


def memory_in_subprocess(config: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--measure", config, *sys.argv[1:]]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- report


def mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def report(args, times, memory) -> None:
    k = args.tiles
    print(f"tiles k={k}; Linear {args.linear_tokens}x{args.d_in} -> {args.d_out}; LM head {args.tokens} tokens, "
          f"d={args.d_model}, vocab={args.vocab}; {args.rounds} interleaved rounds, torch threads "
          f"{torch.get_num_threads()}")
    print("| config | median wall s | time / untiled: wall, cpu (medians) | accounted MiB | / untiled "
          "| peak RSS growth MiB | / untiled |")
    print("|---|---|---|---|---|---|---|")
    for c in CONFIGS:
        base = "linear" if c.startswith("linear") else "head"
        wall, cpu = (statistics.median(times[c][m]) / statistics.median(times[base][m]) for m in ("wall", "cpu"))
        acc = memory[c]["accounted"] / memory[base]["accounted"]
        rss = memory[c]["rss_growth"] / max(memory[base]["rss_growth"], 1)
        print(f"| {c} | {statistics.median(times[c]['wall']):.3f} | {wall:.2f}x, {cpu:.2f}x | "
              f"{mib(memory[c]['accounted'])} | {acc:.3f} | {mib(memory[c]['rss_growth'])} | {rss:.3f} |")
    print(f"targets: time / untiled <= 1.1x; memory ~1/k = {1 / k:.3f}. Linear: accounted = whole params + "
          "grads under stage 3 (prefetch 0); its RSS also holds what the step allocates whatever the tiling "
          "(fp32 grad shard, optimizer temporaries: whole on a mesh of one). LM head: accounted = working bytes. "
          "head-tile(fn) is the generic function form, "
          "which recomputes each tile's logits in backward: shown for its cost, not a target.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see the docstring)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--linear-tokens", type=int, default=128)
    p.add_argument("--d-in", type=int, default=2048)
    p.add_argument("--d-out", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--measure", choices=CONFIGS, help=argparse.SUPPRESS)  # internal: one memory subprocess
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.measure:
        print(json.dumps(measure_memory(args, args.measure)))
        return
    memory = {c: memory_in_subprocess(c) for c in CONFIGS}
    times = time_interleaved(args, CONFIGS)
    report(args, times, memory)


if __name__ == "__main__":
    main()
