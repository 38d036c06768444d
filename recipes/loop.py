"""The training loop every recipe shares (GPT, Llama, BERT): its flags, their checks, the loop itself.

A recipe (recipes/gpt.py, llama.py, bert.py) is its model plus a ``Recipe``: the flags that shape
its model (``--n-layer``, ...), a ``build(args, vocab_size) -> Built`` that makes the model on the
meta device, and a ``Task`` (``CAUSAL``: next-token loss, val loss, a sample; bert's masked task:
MLM loss and masked-token accuracy). Everything else is here, once: every flag of the front door
(``TRAIN_DEFAULTS`` and recipes/layout.py's layout flags), their checks before anything is built,
``--flavor`` / ``--hf-config`` / ``--tokenizer``, the corpus (recipes/data.py), the zfunc step laid
out by the plan, eval, checkpoints and ``--resume``, the progress bar, OUT/metrics.jsonl and
OUT/loss.png (recipes/watch.py), and the final sample. OUT holds one run at a time, and a previous
run in it is continued (``--resume``) or moved aside (``--overwrite``), never overwritten
(recipes/rundir.py). ``--dry-run`` stops after printing the model, the plan's bytes per rank
(zfunc.plan's accounting of the meta-device leaves) and the verdict on this machine (recipes/verdict.py:
fits or not, what binds, a layout that fits): nothing allocated, nothing created in OUT.

Why one module over 400 lines: the flags, their checks and the loop are the GPT recipe's former
train() and flag code moved whole, one concept (what `python -m recipes.NAME` does); the models,
the data, the layout flags (recipes/layout.py), the run folder (recipes/rundir.py) and the weak-scaling
runs (recipes/scaling.py) live apart.

The law every recipe keeps: step i's batch depends on (--seed, i) alone and is split over the
ranks by rows, so the same flags train the same on any layout and number of processes (a masked
task's loss is normalized by the global batch's count of masked tokens for that reason).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import math
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes import data as data_mod
from recipes import data_cap, layout, lr_schedule, refusal, rundir, verdict
from recipes import corpus as corpus_mod
from recipes.cli import check_args, parse_args, training_flags, with_precision
from recipes import task as task_mod
from recipes.recipe import Built, Recipe, n_params
from recipes import precision as recipe_precision
from recipes import watch as watch_mod
from recipes.layout import FlagError, flag

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12}  # dense


# ----------------------------------------------------------------------------- the parts of a run
def make_optimizer(args: argparse.Namespace, plan):
    """AdamW(0.9, 0.95) on a warmup-cosine, decaying matrices only; a --deepspeed config's optimizer
    and scheduler when it names them (a config without a scheduler keeps its lr constant, as in
    DeepSpeed). Clipping at the plan's gradient_clipping (--grad-clip, or the config's; 0: none)."""
    import zfunc as zf

    if plan.optimizer is not None:
        return zf.config.optimizer(plan, lr_schedule.spec(args, plan)["total_steps"], mask=zf.optim.decay_mask)
    lr = lr_schedule.function(lr_schedule.spec(args, plan))  # laid over lr_schedule.total(args)
    adamw = zf.optim.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=args.weight_decay, mask=zf.optim.decay_mask)
    if plan.gradient_clipping > 0:
        return zf.optim.chain(zf.optim.clip_by_global_norm(plan.gradient_clipping), adamw)
    return adamw


def first_state(args: argparse.Namespace, step, built: Built, params: dict, plan, device: torch.device):
    """The state to train from: OUT/ckpt/latest loaded into this layout (--resume), or a fresh one
    from meta-device ``params`` by ``built.materialize`` (a step that can materialize leaf by leaf --
    offload, ZeRO-3 -- makes each rank's rows one leaf at a time, never the whole model)."""
    import zfunc as zf

    if args.resume:
        latest = zf.checkpoint.latest(Path(args.out) / "ckpt")
        if latest is None:
            raise FlagError(f"--resume: no checkpoint under {Path(args.out) / 'ckpt'}")  # removed since check_args
        try:  # zf.checkpoint.load checks the model's params against the checkpoint's
            return zf.checkpoint.load(latest, step, params=params, device=device), latest
        except zf.checkpoint.CheckpointError as e:
            raise FlagError(f"--resume: {e}") from e
    # the init is written for the model untiled; --tile-lm-head (zf.tile) has split its head since
    materialize = zf.materialize.tiled(built.materialize(args.seed), built.module)
    if "materialize" in inspect.signature(step.init).parameters:
        state = step.init(params, materialize=materialize)
    else:
        state = step.init({name: zf.materialize.leaf(materialize, name, like).to(device)
                           for name, like in params.items()})
    if plan.precision == "fp16":  # the plan's (a DeepSpeed config's) loss-scale rule
        state = state.replace(loss_scale=zf.precision.deepspeed_loss_scale(
            plan.initial_scale_power, plan.loss_scale_window, plan.hysteresis, plan.min_loss_scale,
            plan.consecutive_hysteresis))
    return state, None


def plan_bytes(params: dict, plan, model: nn.Module | None = None) -> dict[str, int]:
    """Bytes the busiest rank (rank 0) keeps by place -- "device", "cpu", "nvme" -- after a step, in
    zfunc.plan's accounting of these exact leaves (what step.memory(state) would report; stage 3's
    gathered units on top, bounded by zp.working_bound): with --pp, of the leaves pipeline stage 0
    keeps (``model`` tells which). Computed from shapes alone: nothing allocated."""
    from zfunc import plan as zp

    mine = params if model is None else layout.rank0_params(model, params, plan)
    leaves = [tuple(p.shape) for p in mine.values()]
    engine = _engine_bytes(leaves, plan)
    where = {"device": sum(engine.values()), "cpu": 0, "nvme": 0}
    if plan.offload_optimizer != "none":
        off = zp.offload_bytes(leaves, plan.dp, 0, optimizer=plan.offload_optimizer,
                               params=None if plan.offload_params == "none" else plan.offload_params)
        where["device"] -= engine["params"] + engine["optimizer"]  # they live where offload keeps them
        for place, n in off.items():
            where[place] += n
    return where


def _engine_bytes(leaves: list[tuple[int, ...]], plan) -> dict[str, int]:
    """zp.engine_bytes of rank 0's leaves at the stage the engine runs (layout.engine_stage)."""
    from zfunc import plan as zp

    accum = plan.microbatches if plan.pp > 1 else plan.accum  # a pipeline sums its microbatches' grads
    return zp.engine_bytes(leaves, plan.dp, 0, layout.engine_stage(plan), precision=plan.precision, accum=accum)


def zero_alone(params: dict, plan) -> str:
    """Why ZeRO 1 or 2 on one process holds more than ZeRO 0 ("" where it does not): it shards over
    one rank, so nothing is split, and its step still gathers a whole copy of the params (ZeRO 0
    computes on the fp32 masters themselves; below fp32 both make a compute copy) and keeps whole
    grads beside the fp32 grad slice the optimizer reads (ZeRO 0 sums them straight into it)."""
    if plan.dp > 1 or plan.pp > 1 or plan.zero_stage not in (1, 2):
        return ""
    zero0 = dataclasses.replace(plan, zero_stage=0)
    extra = plan_bytes(params, plan)["device"] - plan_bytes(params, zero0)["device"]
    leaves = [tuple(p.shape) for p in params.values()]
    mine, theirs = _engine_bytes(leaves, plan), _engine_bytes(leaves, zero0)
    held = [what for key, what in (("whole_params", "a whole copy of the params"),
                                   ("whole_grads", "whole grads beside the fp32 grad slice"))
            if mine.get(key, 0) > theirs.get(key, 0)]
    if extra <= 0 or not held:
        return ""
    return (f"; ZeRO {plan.zero_stage} on one process shards nothing and holds {extra / 1e9:.3g} GB more than "
            f"--zero 0: {' and '.join(held)} in each step")


def describe(args, plan, launch, built: Built, device, params: dict) -> list[str]:
    """What rank 0 says about the model, the layout and the plan's bytes per rank before training."""
    gb = lambda n: f"{n / 1e9:.3g} GB"  # noqa: E731
    where = plan_bytes(params, plan, built.module)
    ranks = f"rank 0 of {launch.world}" + (f", pipeline stage 0 of {plan.pp}" if plan.pp > 1 else "")
    return [f"model: {n_params(built.module) / 1e6:.2f}M params {built.config}; device {device}, "
            f"precision {plan.precision}; {args.steps} steps x {args.batch_size * args.block_size:,} tokens",
            f"layout: {launch.world} process{'es' * (launch.world > 1)}, dp={plan.dp} pp={plan.pp}, ZeRO "
            f"{plan.zero_stage}, offload optimizer {plan.offload_optimizer} params {plan.offload_params}, remat "
            f"{plan.remat}; per rank {args.batch_size // plan.dp} sequences in "
            f"{plan.microbatches if plan.pp > 1 else plan.accum} microbatches",
            f"plan (zfunc.plan, {ranks}, model states after a step): device {gb(where['device'])}, "
            f"cpu {gb(where['cpu'])}, nvme {gb(where['nvme'])}" + zero_alone(params, plan)]


def vocab_note(args: argparse.Namespace, model: nn.Module, model_vocab: Any, data_vocab: int, unit: str,
               special: int = 0) -> str:
    """One line when the model has more token ids than the data (a --flavor or --hf-config made for
    a tokenizer, trained on bytes): its embedding and head (their params, and bytes at 16 a param:
    fp32 weights and grads, Adam's two moments), the logits per token, and how to shrink them; ""
    otherwise. The model is kept as asked: its shape is the config's or the flavor's."""
    if not isinstance(model_vocab, int) or model_vocab <= data_vocab:
        return ""
    unique = {id(p): p for p in model.parameters()}.values()  # a tied head is the embedding
    rows = sum(p.numel() for p in unique if p.dim() and p.shape[0] == model_vocab)
    what = f"{unit}s" + (f" and {special} special tokens" if special else "")
    fix = (f'"vocab_size": {data_vocab} in the --hf-config shrinks them' if args.hf_config is not None else
           f"a --tokenizer with {model_vocab:,} tokens uses them; the model flags in place of --flavor {args.flavor} "
           "size them to the data")
    return (f"vocab: the model has {model_vocab:,} token ids, the data {data_vocab:,} ({what}): its embedding and "
            f"head ({rows / 1e6:.2f}M params, {16 * rows / 1e9:.3g} GB of weights, grads and Adam state) and "
            f"{model_vocab:,} logits per token serve {model_vocab - data_vocab:,} ids the data never holds; {fix}")


def peak_flops(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


@contextlib.contextmanager
def claimed_out(args: argparse.Namespace, launch: layout.Launch) -> Iterator[rundir.RunLock | None]:
    """OUT held for this run (recipes/rundir.py): rank 0 locks it, refuses it if another run holds it
    or a fresh start would overwrite a previous run, and moves that run aside for --overwrite; every
    rank then raises rank 0's refusal (a collective), so a torchrun job's ranks share one verdict and
    never lock against each other. A dry run writes nothing in OUT and claims nothing."""
    if args.dry_run:
        yield None
        return
    lock, refusal = None, None
    if launch.rank == 0:
        try:
            lock = rundir.claim(Path(args.out), resume=args.resume, overwrite=args.overwrite)
        except rundir.RunDirError as e:
            refusal = str(e)
        except OSError as e:
            refusal = f"--out: cannot lock {str(Path(args.out) / rundir.LOCK)!r} ({e})"
    refusal = watch_mod.every_rank(refusal, launch.world)[0]
    if refusal is not None:
        raise FlagError(refusal)
    try:
        if lock is not None and lock.moved is not None:
            print(f"--overwrite: moved the previous run ({', '.join(sorted(p.name for p in lock.moved.iterdir()))}) "
                  f"to {lock.moved}")
        yield lock
    finally:
        if lock is not None:
            lock.release()


# ----------------------------------------------------------------------------- the run
def train(recipe: Recipe, args: argparse.Namespace) -> dict:
    """Train per ``args`` (from parse_args); returns the final numbers, sample and checkpoint path
    (on rank 0; the other ranks return what they know)."""
    args = lr_schedule.with_total(args)  # --resume: the checkpoint's schedule, read before the flags are checked
    check_args(recipe, args)  # before anything is built
    refusal.checked()  # rank 0 passed: another rank's refusal is its own
    t_start = time.time()
    launch = layout.Launch.from_env()
    plan, args = layout.resolve(with_precision(args), launch.world, recipe.units, notices=launch.rank == 0)
    say = print if launch.rank == 0 else (lambda *a, **k: None)
    if launch.rank != 0:
        warnings.simplefilter("ignore")  # other ranks print nothing but errors
    device_type = launch.device(args.device).type
    say(recipe_precision.first_line(args, plan.precision, device_type))
    slow = recipe_precision.emulation_warning(args, plan.precision, device_type)
    if slow is not None and launch.rank == 0:
        print(slow, file=sys.stderr)
    launch.start()
    device = launch.device(args.device)
    if device.type == "cuda":  # before the first collective (NCCL's objects go through this GPU)
        torch.cuda.set_device(device)
    with claimed_out(args, launch):  # before anything is written in OUT, held to the end
        return _train(recipe, args, plan, launch, device, say, t_start)


def _train(recipe: Recipe, args: argparse.Namespace, plan, launch: layout.Launch, device: torch.device,
           say: Callable, t_start: float) -> dict:
    """``train`` once its flags are checked, its process group joined and OUT claimed."""
    import zfunc as zf  # the models and data are plain torch; only training needs zfunc

    flags, precision = training_flags(recipe, args, plan), plan.precision
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    task = recipe.task

    corpus = corpus_mod.load_data(args)
    unit = "byte" if args.tokenizer is None else "token"
    corpus_mod.check_windows(corpus, args.block_size, unit)  # now, not at the first batch or eval
    baseline = task.baseline(corpus.val, corpus.vocab_size)
    say(f"data: {data_cap.used(corpus)}; {len(corpus.train):,} train / "
        f"{len(corpus.val):,} val {unit}s; " + ", ".join(f"{k.replace('_', ' ')} of val {v:.3f}"
                                                        for k, v in baseline.items())
        + (" nats/byte" if unit == "byte" and "unigram_entropy" in baseline else ""))

    with torch.device("meta"):  # no memory yet: each leaf is made once, where the layout keeps it
        try:
            built = recipe.build(args, corpus.vocab_size + recipe.extra_vocab)
        except ValueError as e:
            raise FlagError(str(e)) from None
    if args.block_size > built.context:
        raise FlagError(f"--block-size: {args.block_size} exceeds the model's context of {built.context} "
                        "(expected at most that)")
    model = built.module
    vocab = vocab_note(args, model, built.config.get("vocab_size"), corpus.vocab_size + recipe.extra_vocab, unit,
                       recipe.extra_vocab)  # before the head is tiled
    if built.units != recipe.units:
        plan, args = layout.resolve(args, launch.world, built.units, notices=False)
    try:  # tile the head, remat the units: before functionalize
        zf.parallelize.prepare(model, plan)
    except ValueError as e:
        raise FlagError(layout._name_flags(str(e))) from None
    apply, params = zf.functionalize(model)
    for line in describe(args, plan, launch, built, device, params) + ([vocab] if vocab else []):
        say(line)
    if args.dry_run:  # rank 0 judges the plan against this machine
        found = verdict.of_run(recipe.name, args, plan, built, device, launch.world) if launch.rank == 0 else None
        for line in found.lines if found is not None else []:
            say(line)
        return dict(rank=launch.rank, n_params=n_params(model), plan_bytes=plan_bytes(params, plan, model),
                    config=built.config, fits=found.fits if found else None, needs=found.needs if found else None)

    def loss_fn(params, batch):
        return task.loss(apply(params, *batch[:task.inputs]), batch)

    step = zf.train_step(loss_fn, make_optimizer(args, plan), precision=precision, accum=plan.accum, seed=args.seed)
    mesh = zf.Mesh(dp=plan.dp, pp=plan.pp)
    step = zf.parallelize(step, model, plan, mesh)  # shard -> offload -> pipeline, as the plan says
    state, resumed = first_state(args, step, built, params, plan, device)
    schedule = lr_schedule.spec(args, plan)  # saved in every checkpoint: --resume continues it
    if resumed is not None:
        say(f"resumed from {resumed} at step {state.step}")
        notice = lr_schedule.on_resume(args, schedule, lr_schedule.saved_total(args.out), state.step)
        if notice:
            say(notice)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    @torch.no_grad()
    def evaluate(params) -> dict:
        model.eval()

        def forward(batch):
            batch = tuple(t.to(device) for t in batch)
            with torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None):
                return loss_fn(params, batch)

        def outputs(batch):
            with torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None):
                return apply(params, *(t.to(device) for t in batch[:task.inputs]))

        forward.outputs, forward.logits = outputs, lambda batch: task_mod.logits_of(outputs(batch))
        # the same batches every time
        out = task.evaluate(forward, corpus.val, args, torch.Generator().manual_seed(0), corpus.vocab_size)
        model.train()
        return out

    def save(n: int, metrics: dict):
        return zf.checkpoint.save(state, Path(args.out) / "ckpt" / f"{n:06d}", keep_last=args.keep_last,
                                  extra={"config": built.config, "flags": flags, lr_schedule.KEY: schedule,
                                         **metrics})

    def my_rows(batch):  # this rank's share of the global batch: its dp slice (a pipeline's stages: the same)
        per_rank = args.batch_size // plan.dp
        return tuple(t[mesh.rank * per_rank:(mesh.rank + 1) * per_rank].to(device) for t in batch)

    first, tokens_per_step = state.step, args.batch_size * args.block_size
    watch = watch_mod.Watch(Path(args.out), launch.rank, first if args.resume else None,
                            flops_per_token=built.flops_per_token, peak_flops=peak_flops(device), world=launch.world,
                            threads=torch.get_num_threads() if device.type == "cpu" else None)
    history, train_time, loss, evals, whole = [], 0.0, float("nan"), {"val_loss": float("nan")}, None
    last_logged, log_time = first, 0.0
    t0 = time.time()
    for i in watch.progress(range(first, args.steps), first, args.steps):
        # Step i's batch depends on (seed, i) alone, so a resumed run, in any layout, sees the same data.
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + i)
        batch = my_rows(task.batch(corpus.train, args.batch_size, args.block_size, gen, corpus.vocab_size))
        state, metrics = step(state, batch)
        n = i + 1
        do_eval = (args.eval_every and n % args.eval_every == 0) or n == args.steps
        if n % args.log_every == 0 or do_eval:  # .item() syncs the GPU: read metrics only now and then
            loss = metrics["loss"].item()
            elapsed = time.time() - t0
            train_time, log_time = train_time + elapsed, log_time + elapsed
            tokens_per_s = (n - last_logged) * tokens_per_step / max(log_time, 1e-9)
            peak_mem = watch_mod.every_rank(watch_mod.peak_memory_bytes(device), launch.world)
            if do_eval:
                whole = layout.whole_params(state, mesh)  # every rank takes part; rank 0 evaluates
                if launch.rank == 0:
                    evals = evaluate(whole)
                    history.append((n, evals["val_loss"]))
            more = {k: v for k, v in evals.items() if k != "val_loss"} if do_eval else None
            watch.record(n, metrics, tokens_per_s, peak_mem, evals["val_loss"] if do_eval else None, extra=more)
            if do_eval:
                shown = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in evals.items())
                watch.say(f"step {n}: train loss {loss:.3f}, {shown} ({time.time() - t_start:.0f} s)")
            last_logged, log_time, t0 = n, 0.0, time.time()
        if args.ckpt_every and n % args.ckpt_every == 0 and n != args.steps:
            save(n, evals)
            t0 = time.time()
    watch.close()

    tokens_per_s = (args.steps - first) * tokens_per_step / max(train_time, 1e-9)
    peak = peak_flops(device)
    mfu = built.flops_per_token * tokens_per_s / (peak * launch.world) if peak else None
    if launch.rank == 0:  # the one that evaluated
        say(f"final {task.report(evals, baseline, unit)} after {args.steps} steps; {tokens_per_s:,.0f} tokens/s"
            f"{watch.cores()}; elapsed {time.time() - t_start:.0f} s")
    if device.type == "cuda":
        say(f"MFU {mfu:.1%} of {peak / 1e12:.0f} TFLOP/s bf16 peak per GPU" if mfu is not None else
            f"MFU unknown: no peak FLOP/s on record for {torch.cuda.get_device_name(device)}")

    ckpt = save(args.steps, evals)
    if ckpt is not None:
        say(f"saved {ckpt}")

    sample = b""
    if launch.rank == 0 and task.sample:
        model.eval()
        codec = data_mod.codec(args.tokenizer)
        ids = task_mod.generate(lambda idx: apply(whole, idx), codec.encode("def "), args.sample_len, args.block_size,
                           args.temperature, args.top_k, torch.Generator().manual_seed(args.seed), device)
        sample = bytes(ids) if args.tokenizer is None else codec.decode(ids)
        text = (b"def " + sample).decode("utf-8", errors="replace") if isinstance(sample, bytes) else "def " + sample
        say("sample:\n" + text)
    if not args.keep_swap:  # a clean end: nothing uses the swap files now (the checkpoint holds the state)
        freed = zf.offload.release(step, state)
        if freed:
            mine = " on rank 0" if launch.world > 1 else ""
            say(f"removed the swap files under {args.nvme_path} ({freed / 1e6:.3g} MB{mine}; --keep-swap keeps them)")
    return dict(**evals, train_loss=loss, **baseline, history=history, steps=args.steps, n_params=n_params(model),
                tokens_per_s=tokens_per_s, mfu=mfu, elapsed_s=time.time() - t_start,
                checkpoint=str(ckpt) if ckpt is not None else None, sample=sample, rank=launch.rank)


def script(main_fn: Callable[[], Any]) -> None:
    """A recipe's ``__main__``: ``main_fn()``, then, in a rank torchrun started (``WORLD_SIZE`` set),
    ``os._exit(0)`` once stdout and stderr are flushed. Everything a run writes is on disk by then
    (checkpoints saved blocking, metrics appended and closed, the process group destroyed), and
    interpreter teardown is where gloo's C++ threads aborted ranks that had finished their work
    ("terminate called without an active exception": 3-4 of ~70 two-process test runs under load,
    also after ``destroy_process_group``). An exception leaves as usual; a refusal (a bad flag) with
    status 2, at once under torchrun (recipes/refusal.py).
    """
    refusal.exit_at_once()  # a refusal under torchrun: os._exit with its status once said
    main_fn()
    if "WORLD_SIZE" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def main(recipe: Recipe, argv=None) -> dict:
    """The command line; flags that cannot work exit with status 2 and their message, as argparse's do,
    said once by a torchrun job's ranks (recipes/refusal.py)."""
    args = refusal.parsed(lambda: parse_args(recipe, argv))
    started = torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        return train(recipe, args)
    except FlagError as e:
        refusal.refuse(f"python -m recipes.{recipe.name}: error: {e}")
    finally:  # a process group this run started (torchrun) is closed here, its threads joined, not at
        # interpreter teardown (where gloo's threads have aborted a rank that had finished its work)
        if not started and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
