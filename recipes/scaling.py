"""The weak-scaling table of a recipe: `python -m recipes.bert --scaling 1,2`.

Weak scaling: the per-rank batch is fixed and the global batch grows with the ranks; perfect scaling
keeps each rank's sequences/s. Each world size is a fresh ``torchrun`` of the recipe's own command
line, so the table measures exactly what a user runs (its layout flags included).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import zfunc as zf
from recipes import cli
from recipes.recipe import Recipe

def weak_scaling(recipe: Recipe, worlds: str, argv: list[str], steps: int = 30, per_rank: int = 8) -> list[dict]:
    """The weak-scaling table: for each world size N in ``worlds`` ("1,2"), ``torchrun --standalone
    --nproc_per_node N -m recipes.NAME`` with the flags ``argv`` (the recipe's default layout) and a
    global batch of ``per_rank`` x N (``--batch-size`` in ``argv``: the per-rank batch), one CPU thread
    per rank (``OMP_NUM_THREADS=1``: a rank is one core, as one accelerator), ``--steps`` (default
    ``steps``), no eval or checkpoint before the last step. Throughput: the median over OUT/metrics.jsonl's
    intervals of ``--log-every`` steps, the first (warm-up) left out; sequences/s = tokens/s / block size.
    Efficiency: per-rank sequences/s at N over that at the smallest N. Prints the table; returns its rows."""
    try:
        sizes = [int(w) for w in worlds.split(",")]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        raise SystemExit(f"python -m recipes.{recipe.name}: error: --scaling: expected world sizes such as 1,2, "
                         f"got {worlds!r}") from None
    args = cli.parse_args(recipe, argv)
    per_rank = args.batch_size if "batch_size" in args.given else per_rank
    steps = args.steps if "steps" in args.given else steps
    log_every = args.log_every if "log_every" in args.given else 5
    root = Path(__file__).resolve().parents[1]
    # GLOO_SOCKET_IFNAME: the ranks' gloo sockets on loopback, as zf.dist.spawn's (one machine here)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": zf.dist.loopback_interface(),
           "PYTHONPATH": os.pathsep.join(
        [str(root)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            out = Path(tmp) / f"world{n}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                   "-m", f"recipes.{recipe.name}", *argv, "--batch-size", str(per_rank * n), "--steps", str(steps),
                   "--log-every", str(log_every), "--eval-every", "0", "--ckpt-every", "0", "--eval-batches", "1",
                   "--out", str(out)]
            done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"--scaling: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
            logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            rates = [r["tokens_per_s"] for r in logged[1:]] or [logged[-1]["tokens_per_s"]]
            seqs = statistics.median(rates) / args.block_size
            rows.append(dict(ranks=n, global_batch=per_rank * n, sequences_per_s=seqs, per_rank=seqs / n))
    base = rows[0]["per_rank"]
    for row in rows:
        row["efficiency"] = row["per_rank"] / base
    print(f"weak scaling, python -m recipes.{recipe.name} {' '.join(argv)}: {per_rank} sequences x "
          f"{args.block_size} per rank per step, {steps} steps, 1 thread per rank")
    print("| ranks | global batch | sequences/s | per rank | scaling efficiency |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['ranks']} | {row['global_batch']} | {row['sequences_per_s']:.2f} | {row['per_rank']:.2f} | "
              f"{row['efficiency']:.1%} |")
    return rows
