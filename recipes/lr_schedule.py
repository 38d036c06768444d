"""A recipe run's learning-rate schedule, saved in its checkpoints, and how ``--resume`` continues it.

A run lays its schedule over a number of steps, its total: ``--steps`` on a fresh run. The schedule
(``spec``: its kind, total, warmup, peak and final lr, or a --deepspeed config's scheduler and its
parameters) is saved in every checkpoint as ``extra["schedule"]``. The law of ``--resume``: the lr
at each step is the one the run that saved the checkpoint, never interrupted, would have had there,
whatever the new ``--steps``: the schedule keeps its total, training stops at the new ``--steps``,
and past the schedule's end the lr stays at its final value (the cosine's ``--end-lr``; a DeepSpeed
WarmupDecayLR's ``warmup_min_lr``, WarmupCosineLR's ``lr * cos_min_ratio``; WarmupLR never decays).
``--extend-schedule`` lays it over the new ``--steps`` instead, as a fresh run of that many steps
would (warmup and decay included), with a one-line warning naming the lr that changes. A checkpoint
saved before schedules were recorded is laid over ``--steps``, with a warning.

A --deepspeed config that gives its scheduler's ``total_num_steps`` keeps it (DeepSpeed's rule);
one that leaves it "auto" takes the total above (recipes/layout.py reads ``args.schedule_steps``).
Cost: one manifest read on --resume; the schedule itself is a function of the step count.
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Callable

KEY = "schedule"  # the checkpoint extra's entry


class ScheduleWarning(UserWarning):
    """A resumed run whose lr does not continue the checkpoint's schedule."""


def saved_total(out: str | Path) -> int | None:
    """The total steps of the schedule saved in OUT/ckpt/latest; None without a checkpoint, or when it
    records none or cannot be read (check_resume names what is wrong with it)."""
    import zfunc as zf

    try:
        latest = zf.checkpoint.latest(Path(out) / "ckpt")
        manifest = zf.checkpoint.read_manifest(latest) if latest is not None else {}
    except (OSError, zf.checkpoint.CheckpointError):
        return None
    extra = manifest.get("extra")
    spec = extra.get(KEY) if isinstance(extra, dict) else None
    n = spec.get("total_steps") if isinstance(spec, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def with_total(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with ``schedule_steps``, the total the schedule is laid over: the checkpoint's on
    --resume (unless --extend-schedule, or it records none), else --steps."""
    n = None
    if getattr(args, "resume", False) and not getattr(args, "extend_schedule", False):
        n = saved_total(args.out)
    return argparse.Namespace(**{**vars(args), "schedule_steps": n or args.steps})


def total(args: argparse.Namespace) -> int:
    """The steps the schedule is laid over (``with_total``'s; --steps when it was not called)."""
    return getattr(args, "schedule_steps", None) or args.steps


def spec(args: argparse.Namespace, plan) -> dict:
    """The schedule this run trains on, as saved in its checkpoints (JSON): ``kind``, ``total_steps``
    and what fixes the lr at each step (a --deepspeed config's scheduler: its parameters)."""
    n = total(args)
    if plan.scheduler is not None:  # its total is the config's, or ours for "auto"
        params = dict(plan.scheduler_params)
        lr = plan.optimizer_params.get("lr") if plan.optimizer is not None else None
        return dict(kind=plan.scheduler, total_steps=params.get("total_num_steps") or n, params=params, lr=lr)
    if plan.optimizer is not None:  # a config with an optimizer and no scheduler: a constant lr, as DeepSpeed
        return dict(kind="constant", total_steps=n, lr=plan.optimizer_params["lr"])
    return dict(kind="warmup_cosine", total_steps=n, peak_lr=args.lr, end_lr=args.end_lr,
                warmup_steps=min(args.warmup, n // 2))


def laid_over(spec: dict, n: int, args: argparse.Namespace) -> dict:
    """``spec`` laid over ``n`` steps, as a fresh run of ``n`` steps with these flags lays it (a
    --deepspeed config's explicit total aside: the caller knows whether it is one)."""
    if spec["kind"] == "warmup_cosine":
        return {**spec, "total_steps": n, "warmup_steps": min(args.warmup, n // 2)}
    if "total_num_steps" in spec.get("params", {}):
        return {**spec, "total_steps": n, "params": {**spec["params"], "total_num_steps": n}}
    return {**spec, "total_steps": n}


def function(spec: dict) -> Callable[[int], float]:
    """``count -> lr`` of a ``spec`` (count: updates already applied), as the optimizer follows it."""
    import zfunc as zf

    kind = spec["kind"]
    if kind == "warmup_cosine":
        return zf.optim.warmup_cosine(spec["peak_lr"], spec["warmup_steps"], spec["total_steps"],
                                      end_value=spec["end_lr"])
    if kind == "constant":
        return zf.optim.constant_schedule(spec["lr"])
    if kind == "WarmupLR":
        return zf.config.warmup_lr(**spec["params"])
    if kind == "WarmupDecayLR":
        return zf.config.warmup_decay_lr(**spec["params"])
    return zf.config.warmup_cosine_lr(spec["lr"], **spec["params"])


def comparable(flags: dict, args: argparse.Namespace) -> dict:
    """Training ``flags`` as --resume compares them: with --extend-schedule, a --deepspeed
    scheduler's total (its "auto" follows --steps then) is left out."""
    ds = flags.get("deepspeed_optimizer")
    if not getattr(args, "extend_schedule", False) or not isinstance(ds, dict):
        return flags
    params = {k: v for k, v in (ds.get("scheduler_params") or {}).items() if k != "total_num_steps"}
    return {**flags, "deepspeed_optimizer": {**ds, "scheduler_params": params}}


def on_resume(args: argparse.Namespace, now: dict, before: int | None, step: int) -> str | None:
    """What rank 0 says of the schedule ``now`` (``spec``'s) of a run resumed at ``step`` from a
    checkpoint whose schedule was laid over ``before`` steps (None: it records none). A line when
    it continues to another --steps; a ScheduleWarning when --extend-schedule re-lays it, or the
    checkpoint records none; None: nothing to say."""
    lr = lambda s, count: f"{function(s)(count):.3g}"  # noqa: E731
    n = now["total_steps"]
    if before is None:
        _warn(f"--resume: the checkpoint records no lr schedule (saved before schedules were): it is laid over "
              f"--steps {args.steps}, as a fresh run's; the lr of step {step + 1} is {lr(now, step)}")
        return None
    if n != before:  # --extend-schedule
        _warn(f"--extend-schedule: the lr schedule is re-laid over {n} steps (the checkpoint's: {before}): the lr "
              f"of step {step + 1} is {lr(now, step)}, {lr(laid_over(now, before, args), step)} on the checkpoint's")
        return None
    if getattr(args, "extend_schedule", False) and args.steps != n:
        _warn(f"--extend-schedule: the lr schedule keeps its {n} steps, the total_num_steps its --deepspeed config "
              "gives")
    if args.steps == n:
        return None
    if args.steps > n:
        return (f"schedule: the checkpoint's {now['kind']} over {n} steps continues; past its end (steps "
                f"{n + 1}-{args.steps}) the lr stays at its final value, {lr(now, args.steps - 1)} "
                f"(--extend-schedule lays it over --steps {args.steps})")
    return (f"schedule: the checkpoint's {now['kind']} over {n} steps continues; training stops at step "
            f"{args.steps} (lr {lr(now, args.steps - 1)}; --extend-schedule lays it over --steps {args.steps})")


def _warn(message: str) -> None:
    # one line: no source line under it (line 0 has none); ranks other than 0 ignore warnings
    warnings.warn_explicit(message, ScheduleWarning, __file__, 0)
