"""What a recipe is: its flags on the ones every recipe shares, the model it builds, and its task.

A recipe (recipes/gpt.py, llama.py, bert.py) is its model plus a ``Recipe``: the flags that shape its
model (``--n-layer``, ...) added to the training flags here (``TRAIN_DEFAULTS``, their help and rules,
and recipes/layout.py's layout flags), a ``build(args, vocab_size) -> Built`` that makes the model on
the meta device, and a ``Task`` (recipes/task.py: ``CAUSAL``, or bert's masked task). Everything else
a run does is the loop's (recipes/loop.py), the same for every recipe.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

from recipes import data_cap, layout
from recipes import task as task_mod

# Every recipe's training flags (a recipe may change a default); its model flags come first.
TRAIN_DEFAULTS = dict(
    steps=600, batch_size=32, accum=1,
    lr=3e-3, end_lr=3e-4, warmup=40, weight_decay=0.1, grad_clip=1.0,
    precision=None, device=None, data=None, out="out/run", seed=1337,
    eval_every=100, eval_batches=20, ckpt_every=200, keep_last=2, resume=False, overwrite=False, log_every=10,
    data_cap=None, extend_schedule=False, optimizer="adamw", freeze_step=100, compile=False,
)
MODEL_SOURCE_DEFAULTS = dict(flavor=None, hf_config=None, tokenizer=None, dry_run=False, world_size=0)
TRAIN_HELP = dict(
    batch_size="global batch: sequences per optimizer step, over all processes; split over the data-parallel "
               "ranks, then into --accum (with --pp: --microbatches) microbatches, so the same flags train the "
               "same on any number of processes and layout",
    accum="gradient accumulation: microbatches each rank's share of the batch is cut into",
    lr="peak learning rate (after linear warmup)",
    end_lr="learning rate at the end of the cosine decay", warmup="linear warmup steps (at most half of --steps)",
    grad_clip="max global grad norm",
    optimizer="adamw; or a 1-bit one (zf.optim.onebit_adam, zero_one_adam, onebit_lamb: stage 0 over several "
              "ranks, the momentum all-reduced 1-bit compressed after --freeze-step full-precision steps), on the same "
              "betas, schedule, decay and clipping",
    freeze_step="with a 1-bit --optimizer: full-precision warm-up steps (zero_one_adam: its var_freeze_step)",
    precision="default: bf16 on CUDA and on a CPU with native bf16 matrix units (AMX, AVX512-BF16, Arm BF16), "
              "else fp32; the recipe's first line says which and why",
    device="default: cuda if available, else cpu",
    compile="torch.compile each unit (the recipe's blocks) in place: one graph serves every identical block, "
            "LayerNorm, activations and residual adds fused (on a GPU); the first step pays the compile; with "
            "--zero 0-2 and --offload-optimizer (not with --pp, --tp, --sp, --remat, --zero 3, --offload-params, "
            "--tile-*)",
    out="output dir (checkpoints in OUT/ckpt); one run at a time (OUT/run.lock), and a previous run in it is "
        "continued (--resume) or moved aside (--overwrite), never overwritten",
    eval_every="evaluate every N steps; 0: never (the last step always evaluates)",
    ckpt_every="save a checkpoint every N steps; 0: never (the last step always saves)",
    keep_last="checkpoints to keep (>= 1)",
    resume="continue from OUT/ckpt/latest: the flags that shape training must be those it was saved with; "
           "--steps (above the checkpoint's step; the lr schedule stays the checkpoint's, its last lr held past "
           "its end, unless --extend-schedule), --device, "
           "--out, the eval, log, checkpoint and sample flags and the layout (--zero, --offload-*, --remat, --pp, "
           "--microbatches, --accum, --deepspeed, the number of processes) may change",
    overwrite="start afresh in an --out that holds a previous run (its metrics.jsonl, loss.png and ckpt), "
              "first moving that run aside into OUT/previous-<time>/ (nothing is deleted); without it (or "
              "--resume) such an --out is refused",
    extend_schedule="with --resume and another --steps: lay the lr schedule over the new --steps, as a fresh run "
                    "of that many steps would (warmup and decay), not continue the checkpoint's (a warning says "
                    "what changes)",
    log_every="log a line to OUT/metrics.jsonl (and the bar) every N steps (eval steps always)",
    data="text file or folder (default: the Python stdlib's .py files)",
    data_cap="read at most this many bytes of --data: 16M, 1G (powers of 1024), a byte count, or none; not given: "
             "all of --data, and of the default corpus (the stdlib, as bytes) its first 16M; the data line says "
             "what the cap left out",
    flavor="a named published size (the model flags given beside it override its values)",
    hf_config="a transformers config (config.json, a folder holding one, or a JSON string): that model, "
              "randomly initialized, in place of the recipe's own (needs transformers)",
    tokenizer="a local tokenizer.json (or a folder holding one): train on its tokens, cached as a memory-mapped "
              "file under OUT/tokens; default: bytes",
    dry_run="print the model, the plan (bytes per rank) and whether it fits this machine's RAM, disk under "
            "--nvme-path and GPU (what binds; else a layout that fits), then stop before anything is allocated",
    world_size="with --dry-run in one process: plan rank 0 of this many processes, as torchrun's would run "
               "(0: the fewest the layout flags need, --pp * --sp * --tp)",
    **layout.LAYOUT_HELP,
)
MAY_CHANGE_ON_RESUME = ("steps", "device", "out", "resume", "overwrite", "eval_every", "eval_batches", "ckpt_every",
                        "keep_last", "log_every", "sample_len", "temperature", "top_k", "dry_run", "world_size",
                        "extend_schedule",  # the schedule a resumed run follows, not what it trains on
                        "compile",  # how the same function runs
                        *layout.MAY_CHANGE_ON_RESUME)
AT_LEAST_1, AT_LEAST_0 = (lambda v: v >= 1, "an int >= 1"), (lambda v: v >= 0, "an int >= 0")
FINITE_AT_LEAST_0 = (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
TRAIN_RULES = dict(  # flag: (test, what is expected)
    block_size=AT_LEAST_1, steps=AT_LEAST_1, batch_size=AT_LEAST_1, accum=AT_LEAST_1, eval_batches=AT_LEAST_1,
    keep_last=AT_LEAST_1, log_every=AT_LEAST_1, warmup=AT_LEAST_0, eval_every=AT_LEAST_0, ckpt_every=AT_LEAST_0,
    freeze_step=AT_LEAST_0, world_size=AT_LEAST_0,
    seed=(lambda v: 0 <= v < 2**32, "an int in [0, 2**32)"),
    lr=FINITE_AT_LEAST_0, end_lr=FINITE_AT_LEAST_0, weight_decay=FINITE_AT_LEAST_0,
    grad_clip=(lambda v: v > 0, "a number > 0"),
    data_cap=(lambda v: data_cap.is_cap(v), "a byte count such as 16M or 1G (K, M, G, T: powers of 1024) or none"),
)
SAMPLE_DEFAULTS = dict(sample_len=300, temperature=0.8, top_k=40)
SAMPLE_HELP = dict(sample_len="tokens (bytes) to generate at the end", top_k="sample from the k likeliest tokens")
SAMPLE_RULES = dict(sample_len=AT_LEAST_0, top_k=AT_LEAST_1,
                    temperature=(lambda v: math.isfinite(v) and v > 0, "a finite number > 0"))


@dataclass
class Built:
    """A model built on the meta device, with what the loop needs to know of it."""

    module: nn.Module
    config: dict  # saved in every checkpoint as extra["config"]
    context: int  # the longest window it takes (--block-size must not exceed it)
    materialize: Callable[[int], Callable]  # seed -> zf.materialize materializer of every param, the model untiled
    units: str | None = None  # the plan's units (ZeRO-3 gathers, remat, pipeline stages)
    flops_per_token: float = 0.0


@dataclass
class Recipe:
    """A recipe's part of the command line: its name (``python -m recipes.NAME``), its flags, how it
    builds its model, and its task. ``check`` adds the model flags' own cross-checks (errors as lines)."""

    name: str
    description: str
    defaults: dict
    help: dict
    rules: dict
    build: Callable[[argparse.Namespace, int], Built]
    task: task_mod.Task = task_mod.CAUSAL
    units: str | None = None  # before the model is built (the plan's checks)
    check: Callable[[argparse.Namespace], list[str]] = lambda args: []
    extra_vocab: int = 0  # ids the task adds after the data's (BERT: PAD, CLS, SEP, MASK)
    may_change_on_resume: tuple = MAY_CHANGE_ON_RESUME
    flavors: Callable[[str], Any] | None = None  # name -> config kwargs (raises ValueError for a bad name)


def model_kwargs(args: argparse.Namespace, flavor_kwargs: dict, flag_to_field: dict[str, str],
                 context: str, vocab_size: int | None = None, special: int = 0) -> dict:
    """Config keyword arguments: the flavor's (if --flavor), the model flags' otherwise; a model flag
    given on the command line beside --flavor overrides the flavor's value. The model's ``context``
    field is --block-size without a flavor, the flavor's own with one (--block-size is then the
    window trained on, at most that). ``vocab_size`` (the data's ids, ``special`` of them the
    model's own tokens; None: left out) unless the flavor names one, which must hold them
    (ValueError otherwise)."""
    given = getattr(args, "given", frozenset())
    out = dict(flavor_kwargs)
    for name, field_name in flag_to_field.items():
        if not flavor_kwargs or name in given:
            out[field_name] = getattr(args, name)
    if not flavor_kwargs:
        out[context] = args.block_size
    if vocab_size is not None and out.setdefault("vocab_size", vocab_size) < vocab_size:
        with_special = f" with the {special} special tokens" if special else ""
        raise ValueError(f"--flavor {args.flavor}: its vocabulary of {out['vocab_size']} is smaller than the "
                         f"data's {vocab_size}{with_special} (expected --tokenizer with at most "
                         f"{out['vocab_size'] - special} tokens)")
    return out


def n_params(module: nn.Module) -> int:
    """The params of ``module``, a tied one counted once."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
