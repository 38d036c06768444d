"""Each adapter's overhead per step against calling zfunc's step directly.

    python -m benchmarks.adapters [--n-layer 4 --n-embd 192 --batch 8 --accum 2 --rounds 21 --steps 3]

The peer: ``zf.train_step(loss_fn, opt, accum=k)`` on the recipe's GPT, called as ``step(state,
batch)`` with ``loss_fn`` running the model and the cross-entropy. The adapter: the same model,
optimizer (AdamW, clip 1.0) and batches through ``zfunc.deepspeed`` (``engine(x)``, the loss,
``engine.backward(loss)``, ``engine.step()`` per microbatch; a config with the same settings).
Both run in one process, interleaved: each round times ``--steps`` updates of each, in an order
that alternates by round; the figure is the median over rounds of the paired ratio adapter/direct
(target <= 1.05), and the same for the process's CPU time. The adapter runs the step on a
thread of its own: on a shared machine whose cores are oversubscribed, OpenMP teams of different
threads wait differently, so compare on a quiet machine (or ``--threads 1``). The Hugging Face and
Lightning adapters are not built yet, so they are not measured.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
import zfunc.deepspeed as deepspeed  # noqa: E402
from recipes.gpt import GPT, GPTConfig  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="updates per timed block")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    return p.parse_args(argv)


def build(args):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                         vocab_size=256))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.accum,
              "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}}
    plan = zf.config.from_deepspeed(config)

    model = build(args)
    apply, params = zf.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply(p, x).flatten(0, 1), y.flatten())

    step = zf.train_step(loss_fn, zf.config.optimizer(plan), plan.precision, plan.accum)
    direct = {"step": step, "state": step.init(params)}

    other = build(args)
    engine, *_ = deepspeed.initialize(model=other, config=config)

    g = torch.Generator().manual_seed(1)
    micro = [(torch.randint(0, 256, (args.batch, args.block_size), generator=g),
              torch.randint(0, 256, (args.batch, args.block_size), generator=g)) for _ in range(args.accum)]
    whole = tuple(torch.cat(parts) for parts in zip(*micro))

    def run_direct() -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            direct["state"], metrics = direct["step"](direct["state"], whole)
            metrics["loss"].item()
        return (time.perf_counter() - t) / args.steps, (time.process_time() - c) / args.steps

    def run_engine() -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            for x, y in micro:
                loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
                engine.backward(loss)
                engine.step()
                loss.item()
        return (time.perf_counter() - t) / args.steps, (time.process_time() - c) / args.steps

    run_direct(), run_engine()  # warm-up: Numba, allocator
    ratios, cpu_ratios, times = [], [], {"direct": [], "deepspeed": []}
    for r in range(args.rounds):
        order = (("direct", run_direct), ("deepspeed", run_engine))
        got = dict((name, fn()) for name, fn in (order if r % 2 == 0 else order[::-1]))
        for name, (t, _) in got.items():
            times[name].append(t)
        ratios.append(got["deepspeed"][0] / got["direct"][0])
        cpu_ratios.append(got["deepspeed"][1] / got["direct"][1])
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"model: GPT {args.n_layer}x{args.n_embd}, {args.batch}x{args.block_size} tokens x {args.accum} "
          f"microbatches, {torch.get_num_threads()} threads, {args.rounds} rounds of {args.steps} updates")
    print(f"ms/update, medians: direct {med['direct']:.2f}, zfunc.deepspeed {med['deepspeed']:.2f}")
    q = statistics.quantiles(ratios, n=4)
    print(f"zfunc.deepspeed / direct, paired median: {statistics.median(ratios):.4f} (quartiles {q[0]:.4f}-"
          f"{q[2]:.4f}; target <= 1.05)")
    print(f"CPU time (all threads) per update, zfunc.deepspeed / direct, paired median: "
          f"{statistics.median(cpu_ratios):.4f}")


if __name__ == "__main__":
    main()
