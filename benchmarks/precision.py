"""Tokens/s of each recipe's training step in fp32, bf16 and fp16 on this machine.

    python -m benchmarks.precision [--recipes gpt llama bert --rounds 7 --steps 1]

Each recipe is built as ``python -m recipes.NAME`` builds it (its default flags and layout, its
corpus, ``--precision`` the only change) once per precision, from the same init, in one process.
The precisions then run interleaved: each round times ``--steps`` steps of each, in an order that
rotates from round to round, on the same batches (step i's batch depends on the seed and i alone).
This machine is shared, so a precision's tokens/s is the median over its rounds, and each ratio
to fp32 the median of the per-round ratios (paired: both sides of a ratio ran seconds apart).
Prints the native units found (``zfunc.ops.cpu.units.native_units``), a table and the ratios.
``--no-onednn`` with ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` in the environment runs
the steps as a CPU with AVX2 alone does (bf16 and fp16 matmuls in ATen's kernels), on any x86 CPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zfunc.ops.cpu import units as cpu_units  # noqa: E402
from recipes import bert, checkpoints, cli, engine, gpt, layout, llama  # noqa: E402
from recipes.corpus import load_data  # noqa: E402
from recipes.recipe import Recipe  # noqa: E402

RECIPES = {"gpt": gpt.RECIPE, "llama": llama.RECIPE, "bert": bert.RECIPE}
PRECISIONS = ("fp32", "bf16", "fp16")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (each runs every precision)")
    p.add_argument("--steps", type=int, default=1, help="steps of each precision per round")
    p.add_argument("--warmup-rounds", type=int, default=1, help="untimed rounds first")
    p.add_argument("--no-onednn", action="store_true",
                   help="torch.backends.mkldnn.enabled = False: bf16/fp16 matmuls take ATen's own kernels, as on a "
                        "CPU without AVX512 (with ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 in the "
                        "environment: a CPU with AVX2 alone)")
    return p.parse_args(argv)


def build_step(recipe: Recipe, precision: str, corpus, out: str):
    """``(step, state, batch_of)`` for ``recipe`` at its defaults in ``precision``, one process."""
    args = cli.parse_args(recipe, ["--precision", precision, "--out", out])
    plan, args = layout.resolve(args, 1, recipe.units, notices=False)
    built = engine.build_model(recipe, args, corpus.vocab_size + recipe.extra_vocab)
    if built.units != recipe.units:
        plan, args = layout.resolve(args, 1, built.units, notices=False)
    apply, params = engine.functional(built.module, plan)
    task = recipe.task
    step, _ = engine.build_step(engine.loss_fn(task, apply, built.module), built.module, args, plan)
    state, _ = checkpoints.first_state(args, step, built, params, plan, torch.device("cpu"))

    def batch_of(i: int):
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + i)
        return task.batch(corpus.train, args.batch_size, args.block_size, gen, corpus.vocab_size)

    return step, state, batch_of, args.batch_size * args.block_size


def measure(name: str, opts: argparse.Namespace, corpus) -> dict[str, list[float]]:
    """Tokens/s of each precision per timed round, interleaved."""
    with tempfile.TemporaryDirectory() as out:
        runs = {p: list(build_step(RECIPES[name], p, corpus, out)) for p in opts.precisions}
    rates: dict[str, list[float]] = {p: [] for p in opts.precisions}
    i = 0
    for r in range(opts.warmup_rounds + opts.rounds):
        order = opts.precisions[r % len(opts.precisions):] + opts.precisions[:r % len(opts.precisions)]
        for p in order:
            step, state, batch_of, tokens = runs[p]
            t0 = time.perf_counter()
            for k in range(opts.steps):
                state, metrics = step(state, batch_of(i + k))
                float(metrics["loss"])
            elapsed = time.perf_counter() - t0
            runs[p][1] = state
            if r >= opts.warmup_rounds:
                rates[p].append(opts.steps * tokens / elapsed)
        i += opts.steps
    return rates


def main(argv=None) -> None:
    opts = parse_args(argv)
    opts.precisions = list(opts.precisions)
    if opts.no_onednn:
        torch.backends.mkldnn.enabled = False
    units = {p: ", ".join(cpu_units.native_units(p)) or "none" for p in ("bf16", "fp16")}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, "
          f"oneDNN {'off' if opts.no_onednn else 'on'}; native units: bf16 {units['bf16']}, fp16 {units['fp16']}")
    corpus = load_data(cli.parse_args(RECIPES["gpt"], []))
    print("| recipe | " + " | ".join(f"{p} tokens/s" for p in opts.precisions) + " | "
          + " | ".join(f"fp32 / {p}" for p in opts.precisions if p != "fp32") + " |")
    for name in opts.recipes:
        rates = measure(name, opts, corpus)
        medians = {p: statistics.median(v) for p, v in rates.items()}
        ratios = {p: statistics.median(f / x for f, x in zip(rates["fp32"], rates[p]))
                  for p in opts.precisions if p != "fp32" and "fp32" in rates}
        print(f"| {name} | " + " | ".join(f"{medians[p]:,.0f} ({min(rates[p]):,.0f}-{max(rates[p]):,.0f})"
                                          for p in opts.precisions)
              + " | " + " | ".join(f"{v:.2f}x" for v in ratios.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
