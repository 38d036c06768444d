"""What a ZeRO step costs on top of the plain step, in CPU time, on 2 gloo ranks of this CPU: BERT weak scaling's model.

    python benchmarks/zero_cpu.py [--stages 0,1,2] [--dim 192] [--precision bf16] [--rounds 30]

One spawn, one thread per rank (as ``recipes.bert --scaling`` runs it). Trainers, interleaved
step by step in an order shuffled anew each round (the same on every rank): ``alone``, the plain
step on rank 0 while rank 1 waits (the 1-rank run of a weak-scaling table); ``both``, the plain
step on each rank at once, no collective (what sharing the machine costs); ``zf-N``, ``zf.shard``
stage N over both ranks (``recipes.bert``'s model, batch 8 x 32 per rank, AdamW with a clip, as the
recipe's default). Per trainer: the wall time of a step (the slowest rank), its paired efficiency
(median over rounds of ``alone``'s time over its own, the weak-scaling figure), and per rank the CPU
time of a step, the process's (gloo's threads and zfunc's comm thread included) and the main
thread's. CPU time is what a loaded machine does not distort: a step's wall time grows with the
load, the work it does does not. ``--dim 16`` shrinks every matrix to show the per-leaf costs,
which do not shrink with it.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
from recipes.bert import Bert, BertConfig  # noqa: E402


def _model(dim: int):
    cfg = BertConfig(vocab_size=260, dim=dim, n_layers=4, n_heads=4, ffn_dim=4 * dim, max_seq_len=32)
    torch.manual_seed(0)
    apply, params = zf.functionalize(Bert(cfg))

    def loss_fn(p, batch):
        tokens, labels = batch
        logits, _ = apply(p, tokens)  # the MLM head's logits; no NSP head
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return loss_fn, params


def worker(rank: int, world: int, stages: list[int], dim: int, precision: str, rounds: int):
    """Per trainer: this rank's (wall s, process CPU s, main-thread CPU s) of each timed step."""
    mesh = zf.Mesh(dp=world)
    loss_fn, params = _model(dim)
    tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(1e-3, weight_decay=0.01))
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randint(0, 256, (8, 32), generator=g), torch.randint(0, 256, (8, 32), generator=g))
            for _ in range(4)]
    plain = zf.train_step(loss_fn, tx, precision)
    steps = {"alone": plain, "both": plain, **{f"zf-{n}": zf.shard(zf.train_step(loss_fn, tx, precision), mesh, n)
                                               for n in stages}}
    states = {k: s.init(params) for k, s in steps.items()}

    def run(k, batch):
        if k != "alone" or rank == 0:
            states[k], m = steps[k](states[k], batch)
            m["loss"].item()
        if k in ("alone", "both"):
            dist.barrier()  # the others wait for rank 0 (alone), or for each other (both)

    names = list(steps)
    for _ in range(3):  # warm-up: kernels compiled, buckets ordered
        for k in names:
            run(k, data[0])
    times = {k: [] for k in names}
    for r in range(rounds):
        for k in random.Random(r).sample(names, len(names)):
            t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
            run(k, data[r % len(data)])
            times[k].append((time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - h0))
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="0,1,2", help="zf.shard stages to run, comma-separated (0-3)")
    p.add_argument("--dim", type=int, default=192, help="BERT's width (192: recipes.bert's default)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    try:
        stages = [int(s) for s in args.stages.split(",")]
        if not stages or any(s not in (0, 1, 2, 3) for s in stages):
            raise ValueError
    except ValueError:
        p.error(f"--stages: expected a comma-separated subset of 0,1,2,3, got {args.stages!r}")
    for flag, value in (("--dim", args.dim), ("--rounds", args.rounds)):
        if value < 1 or (flag == "--dim" and value % 4):
            p.error(f"{flag}: expected an int >= 1{' and a multiple of 4 (4 heads)' if flag == '--dim' else ''}, "
                    f"got {value}")
    results = zf.dist.spawn(worker, 2, 2, stages, args.dim, args.precision, args.rounds, timeout_s=3600)
    wall = {k: [max(t[0] for t in ts) for ts in zip(*(r[k] for r in results))] for k in results[0]}
    wall["alone"] = [t[0] for t in results[0]["alone"]]  # rank 0's step; rank 1 only waited
    print(f"BERT dim {args.dim}, {args.precision}, 2 gloo ranks, 1 thread each, batch 8x32 per rank, "
          f"{args.rounds} rounds")
    print("| trainer | wall ms/step | efficiency vs alone (paired) | CPU ms/step per rank | main thread ms/step |")
    print("|---|---|---|---|---|")
    for k in results[0]:
        eff = statistics.median(a / w for a, w in zip(wall["alone"], wall[k]))
        ranks = results[:1] if k == "alone" else results
        cpu = " / ".join(f"{statistics.median(t[1] for t in r[k]) * 1e3:.1f}" for r in ranks)
        main_cpu = " / ".join(f"{statistics.median(t[2] for t in r[k]) * 1e3:.1f}" for r in ranks)
        print(f"| {k} | {statistics.median(wall[k]) * 1e3:.1f} | {eff:.1%} | {cpu} | {main_cpu} |")


if __name__ == "__main__":
    main()
