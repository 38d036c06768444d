"""The training loop every recipe runs (GPT, Llama, BERT): ``python -m recipes.NAME``, top to bottom.

``train`` reads like nanoGPT's loop. It checks every flag before anything is built (recipes/cli.py),
joins the process group and claims OUT (recipes/rundir.py: one run at a time, a previous run
continued with --resume or moved aside with --overwrite, never overwritten); reads the corpus
(recipes/corpus.py); builds the model on the meta device and the zfunc step the plan lays out
(recipes/engine.py); starts from a fresh or a resumed state (recipes/checkpoints.py); then steps,
and now and then logs (recipes/watch.py: the bar, OUT/metrics.jsonl, OUT/loss.png), evaluates
(recipes/evaluate.py) and saves a checkpoint; and ends with the final numbers (recipes/report.py), a
last checkpoint and a sample. ``--dry-run`` stops after the model, the plan's bytes per rank and the
verdict on this machine (recipes/report.py, recipes/verdict.py): nothing allocated, nothing created
in OUT.

The law every recipe keeps: step i's batch depends on (--seed, i) alone and is split over the
ranks by rows, so the same flags train the same on any layout and number of processes (a masked
task's loss is normalized by the global batch's count of masked tokens for that reason).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from recipes import checkpoints, engine, layout, lr_schedule, refusal, report, rundir
from recipes import corpus as corpus_mod
from recipes import evaluate as evaluation
from recipes import precision as recipe_precision
from recipes import watch as watch_mod
from recipes.cli import check_args, parse_args, training_flags, with_precision
from recipes.layout import FlagError
from recipes.recipe import Built, Recipe, n_params
from recipes.task import Task


@dataclass(frozen=True)
class Run:
    """Where and how this run trains: its flags (resolved), plan, processes, device, rank 0's voice,
    and when it started."""

    args: argparse.Namespace
    plan: Any
    launch: layout.Launch
    device: torch.device
    say: Callable[[str], None]
    t_start: float
    mesh: Any = None  # with --tp: the mesh the model is sliced over, which the step runs on


@dataclass
class Progress:
    """What the loop leaves: the val loss by eval step, the last train loss and eval (rank 0's), the
    whole params of the last eval, and tokens/s over the training time."""

    history: list = field(default_factory=list)
    train_loss: float = math.nan
    evals: dict = field(default_factory=lambda: {"val_loss": math.nan})
    whole: dict | None = None
    tokens_per_s: float = 0.0


def train(recipe: Recipe, args: argparse.Namespace) -> dict:
    """Train per ``args`` (from parse_args); returns the final numbers, sample and checkpoint path
    (on rank 0; the other ranks return what they know)."""
    args = lr_schedule.with_total(args)  # --resume: the checkpoint's schedule, read before the flags are checked
    check_args(recipe, args)  # before anything is built
    refusal.checked()  # rank 0 passed: another rank's refusal is its own
    t_start = time.time()
    launch = layout.Launch.of(args)  # a dry run in one process: rank 0 of the processes it plans
    plan, args = layout.resolve(with_precision(args), launch.world, recipe.units, notices=launch.rank == 0)
    say = _voice(launch)
    _say_precision(args, plan, launch, say)
    device = _join(launch, args)
    with rundir.claimed(args, launch):  # before anything is written in OUT, held to the end
        return _train(recipe, Run(args, plan, launch, device, say, t_start))


def _train(recipe: Recipe, run: Run) -> dict:
    """``train`` once its flags are checked, its process group joined and OUT claimed."""
    task = recipe.task
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    corpus, baseline, unit = _data(task, run)
    built, apply, params, run, whole = _model(recipe, run, corpus.vocab_size + recipe.extra_vocab, unit)
    args, plan, say = run.args, run.plan, run.say
    if args.dry_run:
        return report.dry_run(recipe.name, args, plan, built, params, run.device, run.launch, say)

    loss = engine.loss_fn(task, apply, built.module)
    step, mesh = engine.build_step(loss, built.module, args, plan, run.mesh)
    state, resumed = checkpoints.first_state(args, step, built, params, plan, run.device)
    schedule = lr_schedule.spec(args, plan)  # saved in every checkpoint: --resume continues it
    if resumed is not None:
        _say_resumed(args, schedule, resumed, state.step, say)
    judge_apply, judge_loss, judged = engine.on_whole_params(task, apply, loss, built.module, whole)
    evaluate = evaluation.evaluator(task, judge_apply, judge_loss, judged, corpus.val, corpus.vocab_size, args,
                                    run.device, plan.precision)
    save = checkpoints.saver(args, built.config, training_flags(recipe, args, plan), schedule)
    watch = watch_mod.Watch(Path(args.out), run.launch.rank, state.step if args.resume else None,
                            flops_per_token=built.flops_per_token, peak_flops=report.peak_flops(run.device),
                            world=run.launch.world,
                            threads=torch.get_num_threads() if run.device.type == "cpu" else None)

    state, progress = _loop(run, task, corpus, step, state, mesh, evaluate, save, watch)

    mfu = report.mfu(built.flops_per_token, progress.tokens_per_s, run.device, run.launch.world)
    if run.launch.rank == 0:  # the one that evaluated
        say(f"final {task.report(progress.evals, baseline, unit)} after {args.steps} steps; "
            f"{progress.tokens_per_s:,.0f} tokens/s{watch.cores()}; elapsed {time.time() - run.t_start:.0f} s")
    if run.device.type == "cuda":
        say(report.mfu_line(mfu, run.device))
    ckpt = save(state, args.steps, progress.evals)
    if ckpt is not None:
        say(f"saved {ckpt}")
    sample = b""
    if run.launch.rank == 0 and task.sample:
        sample = evaluation.sample(judge_apply, progress.whole, judged, args, run.device)
        say("sample:\n" + evaluation.sample_text(sample))
    _release_swap(run, step, state)
    return dict(**progress.evals, train_loss=progress.train_loss, **baseline, history=progress.history,
                steps=args.steps, n_params=n_params(judged), tokens_per_s=progress.tokens_per_s, mfu=mfu,
                elapsed_s=time.time() - run.t_start, checkpoint=str(ckpt) if ckpt is not None else None,
                sample=sample, rank=run.launch.rank)


def _data(task: Task, run: Run) -> tuple[Any, dict, str]:
    """The corpus, checked to hold a window of --block-size in both splits, the baselines the task must
    beat on it, and its unit ("byte", or "token" with --tokenizer); rank 0 says them."""
    args = run.args
    unit = "byte" if args.tokenizer is None else "token"
    corpus = corpus_mod.load_data(args)
    corpus_mod.check_windows(corpus, args.block_size, unit)  # now, not at the first batch or eval
    baseline = task.baseline(corpus.val, corpus.vocab_size)
    run.say(report.data_line(corpus, baseline, unit))
    return corpus, baseline, unit


def _model(recipe: Recipe, run: Run, vocab_size: int, unit: str) -> tuple[Built, Callable, dict, Run, Any]:
    """The recipe's model on the meta device (nothing allocated yet), prepared for the plan, its
    function and meta params, and with --tp its copy before the slicing (``engine.unsliced``: for eval
    and the sample); rank 0 says what it is and what each rank will hold. The run comes back with the
    plan of the model's own units (--hf-config: its repeated blocks) and with --tp the mesh."""
    args, plan, launch = run.args, run.plan, run.launch
    built = engine.build_model(recipe, args, vocab_size)
    vocab = report.vocab_note(args, built.module, built.config.get("vocab_size"), vocab_size, unit,
                              recipe.extra_vocab)  # before the head is tiled
    if built.units != recipe.units:
        plan, args = layout.resolve(args, launch.world, built.units, notices=False)
        run = Run(args, plan, launch, run.device, run.say, run.t_start)
    if plan.tp > 1:
        run = dataclasses.replace(run, mesh=engine.make_mesh(plan, planned=launch.planned))
    whole = engine.unsliced(built.module, plan)
    if args.compile:
        run.say(f"compile: {engine.compile_units(built.module, plan)} units compiled by torch.compile")
    apply, params = engine.functional(built.module, plan, run.mesh)
    shown = built if whole is None else dataclasses.replace(built, module=whole)  # the model: all its params
    for line in report.describe(args, plan, launch, shown, run.device, params) + ([vocab] if vocab else []):
        run.say(line)
    return built, apply, params, run, whole


def _loop(run: Run, task: Task, corpus, step, state, mesh, evaluate: Callable, save: Callable,
          watch: watch_mod.Watch) -> tuple[Any, Progress]:
    """From ``state.step`` to --steps: a batch, a step; every --log-every steps a log line, every
    --eval-every an eval (and always at the last step), every --ckpt-every a checkpoint (but the
    last, which the caller saves). Returns the last state and what the loop measured."""
    args, launch, device = run.args, run.launch, run.device
    first, progress = state.step, Progress()
    clock = watch_mod.TrainClock(first, args.batch_size * args.block_size)
    for i in watch.progress(range(first, args.steps), first, args.steps):
        # Step i's batch depends on (seed, i) alone, so a resumed run, in any layout, sees the same data.
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + i)
        batch = task.batch(corpus.train, args.batch_size, args.block_size, gen, corpus.vocab_size)
        state, metrics = step(state, _my_rows(batch, args, run.plan, mesh, device))
        n = i + 1
        do_eval = (args.eval_every and n % args.eval_every == 0) or n == args.steps
        if n % args.log_every == 0 or do_eval:  # .item() syncs the GPU: read metrics only now and then
            progress.train_loss = metrics["loss"].item()
            tokens_per_s = clock.lap(n)
            peak_mem = watch_mod.every_rank(watch_mod.peak_memory_bytes(device), launch.world)
            if do_eval:
                progress.whole = layout.whole_params(state, mesh)  # every rank takes part; rank 0 evaluates
                if launch.rank == 0:
                    progress.evals = evaluate(progress.whole)
                    progress.history.append((n, progress.evals["val_loss"]))
            evals = progress.evals
            more = {k: v for k, v in evals.items() if k != "val_loss"} if do_eval else None
            watch.record(n, metrics, tokens_per_s, peak_mem, evals["val_loss"] if do_eval else None, extra=more)
            if do_eval:
                shown = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in evals.items())
                watch.say(f"step {n}: train loss {progress.train_loss:.3f}, {shown} "
                          f"({time.time() - run.t_start:.0f} s)")
            clock.logged(n)
        if args.ckpt_every and n % args.ckpt_every == 0 and n != args.steps:
            save(state, n, progress.evals)
            clock.restart()
    watch.close()
    progress.tokens_per_s = clock.tokens_per_s(args.steps - first)
    return state, progress


def _my_rows(batch: tuple, args: argparse.Namespace, plan, mesh, device: torch.device) -> tuple:
    """This rank's share of the global batch, on ``device``: its dp slice (a pipeline's stages: the same)."""
    per_rank = args.batch_size // plan.dp
    return tuple(t[mesh.rank * per_rank:(mesh.rank + 1) * per_rank].to(device) for t in batch)


def _voice(launch: layout.Launch) -> Callable[..., None]:
    """``print`` on rank 0; the other ranks say nothing, and show no warnings (errors still reach them)."""
    if launch.rank == 0:
        return print
    warnings.simplefilter("ignore")
    return lambda *a, **k: None


def _say_precision(args: argparse.Namespace, plan, launch: layout.Launch, say: Callable) -> None:
    """The first line (the precision and why), and on stderr the warning for an emulated one."""
    device_type = launch.device(args.device).type
    say(recipe_precision.first_line(args, plan.precision, device_type))
    slow = recipe_precision.emulation_warning(args, plan.precision, device_type)
    if slow is not None and launch.rank == 0:
        print(slow, file=sys.stderr)


def _join(launch: layout.Launch, args: argparse.Namespace) -> torch.device:
    """Join the process group (torchrun) and return this rank's device."""
    launch.start()
    device = launch.device(args.device)
    if device.type == "cuda":  # before the first collective (NCCL's objects go through this GPU)
        torch.cuda.set_device(device)
    return device


def _say_resumed(args: argparse.Namespace, schedule: dict, resumed, step: int, say: Callable) -> None:
    """Where the run resumed, and what becomes of the lr schedule if --steps changed."""
    say(f"resumed from {resumed} at step {step}")
    notice = lr_schedule.on_resume(args, schedule, lr_schedule.saved_total(args.out), step)
    if notice:
        say(notice)


def _release_swap(run: Run, step, state) -> None:
    """A clean end removes the swap files (unless --keep-swap): nothing uses them now, the
    checkpoint holds the state."""
    import zfunc as zf

    if run.args.keep_swap:
        return
    freed = zf.offloading.release(step, state)
    if freed:
        mine = " on rank 0" if run.launch.world > 1 else ""
        run.say(f"removed the swap files under {run.args.nvme_path} ({freed / 1e6:.3g} MB{mine}; --keep-swap keeps "
                "them)")


def script(main_fn: Callable[[], Any]) -> None:
    """A recipe's ``__main__``: ``main_fn()``, then, in a rank torchrun started (``WORLD_SIZE`` set),
    ``os._exit(0)`` once stdout and stderr are flushed. Everything a run writes is on disk by then
    (checkpoints saved blocking, metrics appended and closed, the process group destroyed), and
    interpreter teardown is where gloo's C++ threads aborted ranks that had finished their work
    ("terminate called without an active exception", at times, also after
    ``destroy_process_group``). An exception leaves as usual; a refusal (a bad flag) with
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
