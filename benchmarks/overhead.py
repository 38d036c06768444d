"""zfunc's train_step vs a hand-written PyTorch loop on the recipes/gpt.py model.

    python -m benchmarks.overhead [--n-layer 4 --n-embd 192 --steps 5 --rounds 10 --precision fp32]

Both sides start from the same weights and see the same batches with the same hyperparameters
(AdamW b=(0.9, 0.95), weight decay 0.1 on matrices only, clip 1.0, warmup-cosine lr). They run
interleaved in one process, in alternating blocks of `--steps` steps (this machine is shared, and
separate runs of the same kernel vary by tens of percent), and each side's time per step is the
best, and the median, over its blocks: on a loaded machine the best is the honest number. The
plain loop is what a careful user writes by hand: torch.optim.AdamW(fused=True), loss.backward(),
clip_grad_norm_, zero_grad(set_to_none=True).
Prints ms/step for each, the ratio zfunc/plain (goal <= 1.05) and a markdown row for the README.
The model size defaults to the recipe's. bf16/fp16 are each side's idiom, not identical numerics:
the plain loop autocasts its forward, zfunc casts a compute copy of the params.
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
from recipes.data import get_batch, load_bytes as load_corpus  # noqa: E402
from recipes.gpt import DEFAULTS, GPT, GPTConfig  # noqa: E402

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "lr"):
        p.add_argument("--" + name.replace("_", "-"), type=type(DEFAULTS[name]), default=DEFAULTS[name],
                       help="as recipes.gpt")
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=10, help="timed blocks per side, alternating")
    p.add_argument("--warmup-blocks", type=int, default=1, help="untimed blocks per side first")
    p.add_argument("--precision", choices=list(AUTOCAST), default="fp32", help="compute precision")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--seed", type=int, default=0, help="init and batches")
    return p.parse_args(argv)


def lr_at(step, peak, warmup, total, end):
    """The same schedule as zf.optim.warmup_cosine, for the plain loop."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min((step - warmup) / max(1, total - warmup), 1.0)
    return end + 0.5 * (peak - end) * (1 + math.cos(math.pi * t))


def make_plain(model, args, warmup, total_steps, device):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    dtype = AUTOCAST[args.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    count = [0]

    def step(batch):
        x, y = batch
        for group in opt.param_groups:
            group["lr"] = lr_at(count[0], args.lr, warmup, total_steps, args.lr / 10)
        with torch.autocast(device.type, dtype, enabled=dtype is not None):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        count[0] += 1
        return loss

    return step


def make_zfunc(model, args, warmup, total_steps):
    apply, params = zf.functionalize(model)

    def loss_fn(params, batch):
        x, y = batch
        return F.cross_entropy(apply(params, x).flatten(0, 1).float(), y.flatten())

    opt = zf.optim.chain(
        zf.optim.clip_by_global_norm(1.0),
        zf.optim.adamw(zf.optim.warmup_cosine(args.lr, warmup, total_steps, end_value=args.lr / 10),
                       b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=zf.optim.decay_mask))
    train_step = zf.train_step(loss_fn, opt, precision=args.precision)
    box = {"state": train_step.init(params)}

    def step(batch):
        box["state"], metrics = train_step(box["state"], batch)
        return metrics["loss"]

    return step


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(args.seed)
    corpus = load_corpus()
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    model = GPT(cfg).to(device)
    n_params = model.num_params(non_embedding=False)
    blocks = args.warmup_blocks + args.rounds
    gen = torch.Generator().manual_seed(args.seed)
    batches = [[get_batch(corpus.train, args.batch_size, cfg.block_size, gen, device)
                for _ in range(args.steps)] for _ in range(blocks)]
    total, warmup = blocks * args.steps, min(10, blocks * args.steps // 4)
    sides = {"plain": make_plain(copy.deepcopy(model), args, warmup, total, device),
             "zfunc": make_zfunc(copy.deepcopy(model), args, warmup, total)}
    times = {name: [] for name in sides}
    losses = {name: None for name in sides}
    for b in range(blocks):
        order = list(sides) if b % 2 == 0 else list(reversed(sides))  # neither side always first
        for name in order:
            sync()
            t0 = time.perf_counter()
            for batch in batches[b]:
                loss = sides[name](batch)
            sync()
            if b >= args.warmup_blocks:
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
            losses[name] = loss.item()

    med = {n: statistics.median(t) for n, t in times.items()}
    best = {n: min(t) for n, t in times.items()}
    label = (f"GPT {n_params / 1e6:.1f}M (L{cfg.n_layer} d{cfg.n_embd} T{cfg.block_size} "
             f"B{args.batch_size}), {args.precision}, {device.type}")
    print(label)
    for n in sides:
        print(f"  {n:5s}: median {med[n]:7.2f} ms/step, best {best[n]:7.2f} ms/step "
              f"(blocks: {', '.join(f'{t:.1f}' for t in times[n])}); last loss {losses[n]:.4f}")
    ratio, ratio_best = med["zfunc"] / med["plain"], best["zfunc"] / best["plain"]
    print(f"  zfunc/plain: {ratio_best:.3f}x best, {ratio:.3f}x median (goal <= 1.05)")
    print(f"| model | precision | device | plain ms/step | zfunc ms/step | zfunc/plain |  "
          f"(best of {args.rounds} blocks of {args.steps} steps)")
    print(f"| {label.split(',')[0]} | {args.precision} | {device.type} | {best['plain']:.1f} | "
          f"{best['zfunc']:.1f} | {ratio_best:.3f}x |")
    return dict(median=med, best=best, ratio=ratio, ratio_best=ratio_best, losses=losses)


if __name__ == "__main__":
    main()
