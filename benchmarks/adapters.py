"""Each adapter's overhead per update against calling zfunc's step directly.

    python -m benchmarks.adapters [--n-layer 4 --n-embd 192 --batch 8 --accum 2 --rounds 21 --steps 3]
                                  [--only deepspeed,transformers,lightning]

The peer of each adapter: ``zf.train_step(loss_fn, opt, accum=k)`` on the same model (same init),
called as ``step(state, batch)`` on the adapter's microbatches joined, ``loss_fn`` running the model
and its loss; the same optimizer (AdamW, clip 1.0) in both. The adapters, each on its own copy:

- ``zfunc.deepspeed``: ``engine(x)``, the loss, ``engine.backward(loss)``, ``engine.step()`` per microbatch;
- ``zfunc.integrations.transformers.Trainer`` (a GPT-2 of the same shape, ``labels`` = the inputs):
  ``trainer.train()`` over a list of pre-made examples (no logging, saving or evaluation);
- ``zfunc.integrations.lightning.ZfuncStrategy`` (the recipe's GPT in a LightningModule):
  ``trainer.fit`` over pre-made microbatches (no logger, progress bar or checkpoints).

Each runs in this process with the direct step interleaved: after every ``--steps`` updates of the
adapter (its loop's own hook: a Trainer callback at each update), ``--steps`` direct updates are
timed, so each round is a pair of adjacent blocks; the first round is warm-up. The figure is the
median over rounds of the paired ratio adapter/direct (target <= 1.05), and the same for the
process's CPU time. An adapter's block includes its framework's own per-batch work (Lightning's and
the Trainer's loops, hooks and data loading), which is what a user of it pays. The adapters run the
step on a thread of their own: on a shared machine whose cores are oversubscribed, OpenMP teams of
different threads wait differently, so compare on a quiet machine (or ``--threads 1``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
import zfunc.deepspeed as deepspeed  # noqa: E402
from recipes.gpt import GPT, GPTConfig  # noqa: E402

ADAPTERS = ("deepspeed", "transformers", "lightning")


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
    p.add_argument("--rounds", type=int, default=21, help="timed rounds per adapter (after one warm-up round)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--only", default=",".join(ADAPTERS), help="the adapters to measure, comma-separated")
    return p.parse_args(argv)


def config(args) -> dict:
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.accum,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}}


class Rounds:
    """Blocks of ``steps`` adapter updates, each followed by ``steps`` direct updates; ``update()``
    is called by the adapter's loop after each of its updates."""

    def __init__(self, steps: int, rounds: int, direct: Callable[[], None]):
        self.steps, self.rounds, self.direct = steps, rounds, direct
        self.updates = 0
        self.pairs: list[tuple[tuple[float, float], tuple[float, float]]] = []  # ((wall, cpu) adapter, direct)
        self.total = (rounds + 1) * steps  # the adapter's updates, the warm-up round's included
        self.mark()

    def mark(self) -> None:
        self.t, self.c = time.perf_counter(), time.process_time()

    def _block(self, fn: Callable[[], None]) -> tuple[float, float]:
        self.mark()
        for _ in range(self.steps):
            fn()
        return (time.perf_counter() - self.t) / self.steps, (time.process_time() - self.c) / self.steps

    def update(self) -> None:
        self.updates += 1
        if self.updates % self.steps:
            return
        adapter = ((time.perf_counter() - self.t) / self.steps, (time.process_time() - self.c) / self.steps)
        direct = self._block(self.direct)
        if self.updates > self.steps:  # the first round warms both up
            self.pairs.append((adapter, direct))
        self.mark()

    def report(self, name: str) -> None:
        ratios = [a[0] / d[0] for a, d in self.pairs]
        cpu = [a[1] / d[1] for a, d in self.pairs]
        a_ms = statistics.median(a[0] for a, _ in self.pairs) * 1e3
        d_ms = statistics.median(d[0] for _, d in self.pairs) * 1e3
        q = statistics.quantiles(ratios, n=4)
        print(f"{name:<13} ms/update, medians: direct {d_ms:.2f}, adapter {a_ms:.2f}; adapter / direct, paired median "
              f"{statistics.median(ratios):.4f} (quartiles {q[0]:.4f}-{q[2]:.4f}; target <= 1.05); CPU time "
              f"{statistics.median(cpu):.4f}; {len(self.pairs)} rounds")


def direct_step(model: torch.nn.Module, loss_fn_of: Callable, plan: zf.config.Plan, whole) -> Callable[[], None]:
    """One update of ``zf.train_step`` on ``whole`` (the microbatches joined), state kept between calls."""
    apply, params = zf.functionalize(model)
    step = zf.train_step(loss_fn_of(apply), zf.config.optimizer(plan), plan.precision, plan.accum)
    held = {"state": step.init(params)}

    def run() -> None:
        held["state"], metrics = step(held["state"], whole)
        metrics["loss"].item()

    return run


def gpt(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                         vocab_size=256))


def gpt_batches(args):
    g = torch.Generator().manual_seed(1)
    micro = [(torch.randint(0, 256, (args.batch, args.block_size), generator=g),
              torch.randint(0, 256, (args.batch, args.block_size), generator=g)) for _ in range(args.accum)]
    return micro, tuple(torch.cat(parts) for parts in zip(*micro))


def gpt_loss(apply):
    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply(p, x).flatten(0, 1), y.flatten())

    return loss_fn


def bench_deepspeed(args) -> Rounds:
    micro, whole = gpt_batches(args)
    plan = zf.config.from_deepspeed(config(args))
    rounds = Rounds(args.steps, args.rounds, direct_step(gpt(args), gpt_loss, plan, whole))
    engine, *_ = deepspeed.initialize(model=gpt(args), config=config(args))
    rounds.mark()
    while rounds.updates < rounds.total:
        for x, y in micro:
            loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()
            loss.item()
        rounds.update()
    return rounds


def bench_lightning(args) -> Rounds:
    import lightning as L

    from zfunc.integrations.lightning import ZfuncStrategy

    class LitGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.gpt = gpt(args)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.gpt(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):  # the config's AdamW as a torch optimizer, mapped by the strategy
            return torch.optim.AdamW(self.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)

    class Hook(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % args.accum == 0:
                rounds.update()

    micro, whole = gpt_batches(args)
    plan = zf.config.from_deepspeed(config(args))
    rounds = Rounds(args.steps, args.rounds, direct_step(gpt(args), gpt_loss, plan, whole))
    lit_config = {k: v for k, v in config(args).items() if k != "optimizer"}
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ZfuncStrategy(lit_config), max_steps=rounds.total,
                        accumulate_grad_batches=args.accum, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Hook()], num_sanity_val_steps=0)
    data = torch.utils.data.DataLoader(micro * rounds.total, batch_size=None)  # pre-made microbatches, no collation
    rounds.mark()
    trainer.fit(LitGPT(), data)
    return rounds


def bench_transformers(args) -> Rounds:
    import transformers

    from zfunc.integrations.transformers import Trainer, TrainingArguments

    def model():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=args.block_size, n_embd=args.n_embd,
                                      n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)

    class Hook(transformers.TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            rounds.update()

    micro, _ = gpt_batches(args)
    whole = torch.cat([x for x, _ in micro])

    def hf_loss(apply):
        def loss_fn(p, ids):
            return apply(p, input_ids=ids, labels=ids).loss

        return loss_fn

    plan = zf.config.from_deepspeed(config(args))
    rounds = Rounds(args.steps, args.rounds, direct_step(model(), hf_loss, plan, whole))
    examples = [{"input_ids": ids, "labels": ids} for x, _ in micro for ids in x]
    targs = TrainingArguments(output_dir="/tmp/zfunc-bench-adapters", deepspeed=config(args),
                              per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accum,
                              max_steps=rounds.total, max_grad_norm=1.0, learning_rate=3e-4, report_to=[],
                              adam_beta2=0.95, weight_decay=0.1, use_cpu=True, save_strategy="no",
                              logging_strategy="no", disable_tqdm=True, dataloader_drop_last=True, seed=0)
    trainer = Trainer(model=model(), args=targs, train_dataset=examples * rounds.total, callbacks=[Hook()])
    rounds.mark()
    trainer.train()
    return rounds


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = [a.strip() for a in args.only.split(",") if a.strip()]
    unknown = sorted(set(chosen) - set(ADAPTERS))
    if unknown:
        raise SystemExit(f"--only: unknown adapters {unknown}; expected some of {', '.join(ADAPTERS)}")
    print(f"model: GPT {args.n_layer}x{args.n_embd}, {args.batch}x{args.block_size} tokens x {args.accum} "
          f"microbatches, {torch.get_num_threads()} threads, {args.rounds} rounds of {args.steps} updates")
    benches = {"deepspeed": bench_deepspeed, "transformers": bench_transformers, "lightning": bench_lightning}
    for name in chosen:
        benches[name](args).report(name)


if __name__ == "__main__":
    main()
