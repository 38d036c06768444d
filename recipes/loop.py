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

Why one module over 400 lines: the flags, their checks and the loop are one concept (what
`python -m recipes.NAME` does); the models,
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
from recipes import precision as recipe_precision
from recipes import watch as watch_mod
from recipes.layout import FlagError, flag

# Every recipe's training flags (a recipe may change a default); its model flags come first.
TRAIN_DEFAULTS = dict(
    steps=600, batch_size=32, accum=1,
    lr=3e-3, end_lr=3e-4, warmup=40, weight_decay=0.1, grad_clip=1.0,
    precision=None, device=None, data=None, out="out/run", seed=1337,
    eval_every=100, eval_batches=20, ckpt_every=200, keep_last=2, resume=False, overwrite=False, log_every=10,
    data_cap=None, extend_schedule=False,
)
MODEL_SOURCE_DEFAULTS = dict(flavor=None, hf_config=None, tokenizer=None, dry_run=False)
TRAIN_HELP = dict(
    batch_size="global batch: sequences per optimizer step, over all processes; split over the data-parallel "
               "ranks, then into --accum (with --pp: --microbatches) microbatches, so the same flags train the "
               "same on any number of processes and layout",
    accum="gradient accumulation: microbatches each rank's share of the batch is cut into",
    lr="peak learning rate (after linear warmup)",
    end_lr="learning rate at the end of the cosine decay", warmup="linear warmup steps (at most half of --steps)",
    grad_clip="max global grad norm",
    precision="default: bf16 on CUDA and on a CPU with native bf16 matrix units (AMX, AVX512-BF16, Arm BF16), "
              "else fp32; the recipe's first line says which and why",
    device="default: cuda if available, else cpu",
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
    **layout.LAYOUT_HELP,
)
MAY_CHANGE_ON_RESUME = ("steps", "device", "out", "resume", "overwrite", "eval_every", "eval_batches", "ckpt_every",
                        "keep_last", "log_every", "sample_len", "temperature", "top_k", "dry_run",
                        "extend_schedule",  # the schedule a resumed run follows, not what it trains on
                        *layout.MAY_CHANGE_ON_RESUME)
AT_LEAST_1, AT_LEAST_0 = (lambda v: v >= 1, "an int >= 1"), (lambda v: v >= 0, "an int >= 0")
FINITE_AT_LEAST_0 = (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
TRAIN_RULES = dict(  # flag: (test, what is expected)
    block_size=AT_LEAST_1, steps=AT_LEAST_1, batch_size=AT_LEAST_1, accum=AT_LEAST_1, eval_batches=AT_LEAST_1,
    keep_last=AT_LEAST_1, log_every=AT_LEAST_1, warmup=AT_LEAST_0, eval_every=AT_LEAST_0, ckpt_every=AT_LEAST_0,
    seed=(lambda v: 0 <= v < 2**32, "an int in [0, 2**32)"),
    lr=FINITE_AT_LEAST_0, end_lr=FINITE_AT_LEAST_0, weight_decay=FINITE_AT_LEAST_0,
    grad_clip=(lambda v: v > 0, "a number > 0"),
    data_cap=(lambda v: data_cap.is_cap(v), "a byte count such as 16M or 1G (K, M, G, T: powers of 1024) or none"),
)
SAMPLE_DEFAULTS = dict(sample_len=300, temperature=0.8, top_k=40)
SAMPLE_HELP = dict(sample_len="tokens (bytes) to generate at the end", top_k="sample from the k likeliest tokens")
SAMPLE_RULES = dict(sample_len=AT_LEAST_0, top_k=AT_LEAST_1,
                    temperature=(lambda v: math.isfinite(v) and v > 0, "a finite number > 0"))
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12}  # dense


# ----------------------------------------------------------------------------- what a recipe brings
@dataclass
class Built:
    """A model built on the meta device, with what the loop needs to know of it."""

    module: nn.Module
    config: dict  # saved in every checkpoint as extra["config"]
    context: int  # the longest window it takes (--block-size must not exceed it)
    materialize: Callable[[int], Callable]  # seed -> zf.materialize materializer of every param
    units: str | None = None  # the plan's units (ZeRO-3 gathers, remat, pipeline stages)
    flops_per_token: float = 0.0


@dataclass(frozen=True)
class Task:
    """What is trained on the windows: the batch made of them, its loss, the eval and the closing words.

    ``batch(data, batch_size, block_size, generator, vocab_size)``: the global batch (a tuple of tensors
    split by rows; ``vocab_size``: the data's); its first ``inputs`` tensors are the model's arguments.
    ``loss(out, batch)``: the loss of the model's output ``out``. ``evaluate(forward, val, args,
    generator, vocab_size)``: {"val_loss": ..., and more}; ``forward(batch)`` is the loss,
    ``forward.logits(batch)`` the logits, ``forward.outputs(batch)`` the model's whole output.
    ``baseline(val, vocab_size)``: {name: value} of the guesses to beat.
    """

    name: str
    batch: Callable
    loss: Callable
    evaluate: Callable
    baseline: Callable
    report: Callable[[dict, dict, str], str]  # (eval metrics, baseline, unit) -> the final numbers in words
    sample: bool = True
    hf_task: str = "causal-lm"
    inputs: int = 1  # leading batch tensors the model takes (BERT with NSP: the ids and the token types)


def logits_of(out):
    """A model's logits: our models return them (BERT: with the NSP logits beside them)."""
    return out[0] if isinstance(out, tuple) else out


def token_counts(data, vocab_size: int, piece: int = 1 << 24) -> torch.Tensor:
    """How often each id occurs in ``data`` (a tensor, or an array / np.memmap), float64, at least
    ``vocab_size`` long; counted ``piece`` ids at a time, so it needs 8 bytes per id of a piece, not
    of the whole split (a memmap's pages are read once)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for i in range(0, len(data), piece):
        part = data[i:i + piece]
        values = part.long() if isinstance(part, torch.Tensor) else torch.from_numpy(np.asarray(part, dtype=np.int64))
        c = torch.bincount(values, minlength=vocab_size).double()
        counts = F.pad(counts, (0, len(c) - len(counts))) if len(c) > len(counts) else counts  # ids past vocab_size
        counts[:len(c)] += c
    return counts


def unigram_entropy(data, vocab_size: int = 256) -> dict:
    """Entropy of the token histogram in nats/token: the loss of a model that ignores context."""
    p = token_counts(data, vocab_size)
    p = p[p > 0] / p.sum()
    return {"unigram_entropy": float(-(p * p.log()).sum())}


def _causal_loss(out, batch):
    return F.cross_entropy(logits_of(out).flatten(0, 1).float(), batch[1].flatten())


def _causal_eval(forward, val, args, gen, vocab_size) -> dict:
    total = 0.0
    for _ in range(args.eval_batches):
        batch = data_mod.get_batch(val, args.batch_size, args.block_size, gen)
        total += forward(batch).item()
    return {"val_loss": total / args.eval_batches}


def _causal_report(metrics: dict, baseline: dict, unit: str) -> str:
    return f"val loss {metrics['val_loss']:.3f} nats/{unit} (unigram baseline {baseline['unigram_entropy']:.3f})"


CAUSAL = Task("causal-lm", lambda data, B, T, gen, vocab_size: data_mod.get_batch(data, B, T, gen), _causal_loss,
              _causal_eval, unigram_entropy, _causal_report)


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
    task: Task = CAUSAL
    units: str | None = None  # before the model is built (the plan's checks)
    check: Callable[[argparse.Namespace], list[str]] = lambda args: []
    extra_vocab: int = 0  # ids the task adds after the data's (BERT: PAD, CLS, SEP, MASK)
    may_change_on_resume: tuple = MAY_CHANGE_ON_RESUME
    flavors: Callable[[str], Any] | None = None  # name -> config kwargs (raises ValueError for a bad name)


# ----------------------------------------------------------------------------- flags
def parser(recipe: Recipe, with_defaults: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m recipes.{recipe.name}", description=recipe.description,
                                argument_default=None if with_defaults else argparse.SUPPRESS)
    for name, default in recipe.defaults.items():
        kw = {} if with_defaults else {"default": argparse.SUPPRESS}
        if isinstance(default, bool):
            p.add_argument(flag(name), action="store_true", help=recipe.help.get(name), **kw)
            continue
        choices = ["fp32", "bf16", "fp16"] if name == "precision" else layout.CHOICES.get(name)
        p.add_argument(flag(name), type=str if default is None else type(default), choices=choices,
                       **({"default": default} if with_defaults else kw),
                       help=_with_default(recipe.help.get(name), default))
    return p


def _with_default(text: str | None, default: Any) -> str:
    """A flag's help with "(default: X)" added, unless the help states its default itself or there
    is none to state (None: the help says what its absence means)."""
    text = text or ""
    if default is None or re.search(r"\bdefault\b", text):
        return text
    return f"{text} (default: %(default)s)".lstrip()


def parse_args(recipe: Recipe, argv=None) -> argparse.Namespace:
    """Every key of the recipe's defaults is a flag: n_layer -> --n-layer (values checked by check_args);
    ``args.given`` names the flags given on the command line (a --deepspeed config's values yield to them)."""
    args = parser(recipe).parse_args(argv)
    args.given = frozenset(vars(parser(recipe, with_defaults=False).parse_args(argv)))
    return args


def device_of(args: argparse.Namespace) -> torch.device:
    return layout.Launch.from_env().device(args.device)


def with_precision(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with --precision resolved (when not given: recipes/precision.py's default for the device)."""
    precision = args.precision or recipe_precision.default(device_of(args).type)[0]
    return argparse.Namespace(**{**vars(args), "precision": precision})


def _resolved(path: str | None) -> str | None:
    if path is None or path.lstrip().startswith("{"):
        return path
    return str(Path(path).resolve())


def training_flags(recipe: Recipe, args: argparse.Namespace, plan=None) -> dict:
    """The flags that shape the training, as saved in every checkpoint (precision, paths and a
    --deepspeed config's optimizer resolved)."""
    flags = {k: getattr(args, k) for k in recipe.defaults if k not in recipe.may_change_on_resume}
    flags["precision"] = with_precision(args).precision
    for name in ("data", "tokenizer", "hf_config"):
        if name in flags:
            flags[name] = _resolved(flags[name])
    if "data_cap" in flags:  # in bytes: 16M and the default corpus' default read the same
        flags["data_cap"] = cap_of(args)
    flags["deepspeed_optimizer"] = layout.deepspeed_optimizer(plan) if plan is not None else None
    return flags


def _source_errors(recipe: Recipe, args: argparse.Namespace) -> list[str]:
    """--flavor, --hf-config, --tokenizer: each readable, and not two model sources at once."""
    errors = []
    flavor, hf_config, tokenizer = (getattr(args, k, None) for k in ("flavor", "hf_config", "tokenizer"))
    if flavor is not None and hf_config is not None:
        errors.append(f"--flavor {flavor!r} and --hf-config: expected one model source, got both")
    if flavor is not None and recipe.flavors is not None:
        try:
            recipe.flavors(flavor)
        except ValueError as e:
            errors.append(str(e))
    if hf_config is not None:
        from recipes import hf

        try:
            hf.read_config(hf_config)
        except (ValueError, FileNotFoundError) as e:
            errors.append(str(e))
    if tokenizer is not None:
        try:
            data_mod.load_tokenizer(tokenizer)
        except (ValueError, FileNotFoundError, ImportError) as e:
            errors.append(str(e))
    return errors


def check_args(recipe: Recipe, args: argparse.Namespace) -> None:
    """Check every flag before anything is built: each value (the recipe's rules), the model source
    flags, the layout flags and the global batch's split over the processes (recipes/layout.py, a
    --deepspeed config included), --data, --device, --resume or --overwrite, that --out is writable
    (creating OUT/ckpt; with --dry-run, creating nothing: its nearest existing folder is writable), and
    that --resume finds a checkpoint saved with these training_flags at a step below --steps.
    Raises FlagError naming each flag, its value and what was expected."""
    launch = layout.Launch.from_env()
    errors = [f"{flag(k)}: expected {want}, got {getattr(args, k)!r}"
              for k, (ok, want) in recipe.rules.items() if not ok(getattr(args, k))]
    errors += recipe.check(args)
    errors += layout.check_layout_args(args, launch.world)
    if args.data is not None and not Path(args.data).exists():
        errors.append(f"--data: path {args.data!r} does not exist")
    errors += _source_errors(recipe, args)
    if args.resume and args.overwrite:
        errors.append("--overwrite: expected either --resume or --overwrite, got both (--resume continues the run "
                      "in --out, --overwrite moves it aside and starts afresh)")
    try:
        device = device_of(args)
        if device.type == "cuda" and not torch.cuda.is_available():
            errors.append(f"--device: {args.device!r} asked for, but CUDA is not available")
    except RuntimeError as e:
        errors.append(f"--device: expected a torch device such as cpu or cuda:0, got {args.device!r} ({e})")
    if errors:
        raise FlagError("\n".join(errors))
    plan, args = layout.resolve(with_precision(args), launch.world, recipe.units, notices=False)
    ckpt_root = Path(args.out) / "ckpt"
    if args.dry_run:
        _check_writable(ckpt_root)
        return
    try:  # now, not at the first save after all the training
        ckpt_root.mkdir(parents=True, exist_ok=True)
        # a new file of its own (ranks on two machines sharing OUT may have the same pid), removed on close
        with tempfile.NamedTemporaryFile(dir=ckpt_root, prefix=".write-test-"):
            pass
    except OSError as e:
        raise FlagError(f"--out: cannot write checkpoints under {str(ckpt_root)!r} ({e})") from e
    if args.resume:
        check_resume(recipe, args, ckpt_root, plan)


def _check_writable(path: Path) -> None:
    """--out for a dry run: the nearest folder of ``path`` that exists is one this process may write
    in (nothing is created)."""
    there = path
    while not os.path.lexists(there) and there != there.parent:
        there = there.parent
    if not there.is_dir() or not os.access(there, os.W_OK | os.X_OK):
        raise FlagError(f"--out: cannot write checkpoints under {str(path)!r} ({str(there)!r} is not a writable "
                        "folder)")


def check_resume(recipe: Recipe, args: argparse.Namespace, ckpt_root: Path, plan=None) -> None:
    import zfunc as zf

    latest = zf.checkpoint.latest(ckpt_root)
    if latest is None:
        raise FlagError(f"--resume: no checkpoint under {ckpt_root}")
    manifest = zf.checkpoint.read_manifest(latest)
    extra = manifest.get("extra", {})
    saved = extra.get("flags") or extra.get("config", {})  # "config" alone: a checkpoint from before flags were saved
    given = training_flags(recipe, args, plan)
    name = lambda k: flag(k) if k in recipe.defaults else "the optimizer and scheduler of --deepspeed"  # noqa: E731
    saved, given = lr_schedule.comparable(data_cap.saved_flags(saved), args), lr_schedule.comparable(given, args)
    differ = [f"  {name(k)}: {saved[k]!r} in the checkpoint, {given[k]!r} given"
              for k in sorted(saved) if k in given and saved[k] != given[k]]
    if differ:
        raise FlagError(f"--resume: {latest} was saved by a run with other flags; pass its flags (or another "
                        "--out to start afresh):\n" + "\n".join(differ))
    if args.steps <= manifest["step"]:
        raise FlagError(f"--steps: {args.steps} is not beyond step {manifest['step']} of the checkpoint {latest} "
                        f"resumed: nothing to train (pass --steps above {manifest['step']})")


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
    materialize = built.materialize(args.seed)
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


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


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


@torch.no_grad()
def generate_ids(model_fn, prompt: list[int], length: int, block_size: int, temperature=0.8, top_k=40,
                 generator=None, device="cpu") -> list[int]:
    """Sample ``length`` ids after ``prompt``; model_fn(idx) -> logits (recipes/gpt.py's generate, on ids)."""
    idx = torch.tensor(prompt or [10], dtype=torch.long, device=device)[None]
    for _ in range(length):
        logits = logits_of(model_fn(idx[:, -block_size:]))[:, -1, :].float() / max(temperature, 1e-6)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(F.softmax(logits, dim=-1).cpu(), 1, generator=generator).to(device)
        idx = torch.cat([idx, nxt], dim=1)
    return idx[0, -length:].tolist() if length else []


def cap_of(args: argparse.Namespace) -> int | None:
    """--data-cap in bytes (None: none), its default resolved for this --data and --tokenizer."""
    return data_cap.resolve_cap(data_cap.parse_cap(getattr(args, "data_cap", None)), args.data, args.tokenizer)


def load_data(args: argparse.Namespace) -> data_mod.Corpus:
    """Bytes (no --tokenizer), else the tokens cached under OUT/tokens; a dry run that finds no cache
    there tokenizes into a temporary folder, removed before it returns (the memory maps stay valid)."""
    cache, cap = Path(args.out) / "tokens", data_cap.parse_cap(getattr(args, "data_cap", None))
    if args.dry_run and args.tokenizer is not None and not data_mod.is_cached(args.data, args.tokenizer, cache,
                                                                              cap_of(args)):
        with tempfile.TemporaryDirectory(prefix="zfunc-dry-run-tokens-") as tmp:
            return data_mod.load(args.data, args.tokenizer, cache_dir=tmp, max_bytes=cap)
    return data_mod.load(args.data, args.tokenizer, cache_dir=cache, max_bytes=cap)


def check_windows(corpus: data_mod.Corpus, block_size: int, unit: str) -> None:
    """Both splits of ``corpus`` hold a window of ``block_size`` and its next token, found before any
    batch or eval; FlagError naming --block-size, the split, --data, its size and the minimum."""
    for split, data in (("train", corpus.train), ("val", corpus.val)):
        if len(data) <= block_size + 1:
            total = len(corpus.train) + len(corpus.val)
            raise FlagError(f"--block-size: {block_size} needs more than {block_size + 1} {unit}s, the {split} "
                            f"split of --data {corpus.source!r} has {len(data)}; the corpus holds {total} {unit}s, "
                            f"too few to split into train and val windows: expected at least "
                            f"{data_mod.min_corpus(block_size)} {unit}s for --block-size {block_size} (val is "
                            f"{data_mod.VAL_PERCENT}%), or a smaller --block-size")


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

    corpus = load_data(args)
    unit = "byte" if args.tokenizer is None else "token"
    check_windows(corpus, args.block_size, unit)  # now, not at the first batch or eval
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
        zf.config.prepare(model, plan)
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

        forward.outputs, forward.logits = outputs, lambda batch: logits_of(outputs(batch))
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
        ids = generate_ids(lambda idx: apply(whole, idx), codec.encode("def "), args.sample_len, args.block_size,
                           args.temperature, args.top_k, torch.Generator().manual_seed(args.seed), device)
        sample = bytes(ids) if args.tokenizer is None else codec.decode(ids)
        text = (b"def " + sample).decode("utf-8", errors="replace") if isinstance(sample, bytes) else "def " + sample
        say("sample:\n" + text)
    if not args.keep_swap:  # a clean end: nothing uses the swap files now (the checkpoint holds the state)
        freed = zf.offloading.release(step, state)
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
