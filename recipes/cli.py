"""A recipe's command line: its flags parsed, and every one checked before anything is built.

Every key of a recipe's defaults is a flag (``n_layer`` -> ``--n-layer``); ``args.given`` names those
given on the command line (a --deepspeed config's values yield to them). ``check_args`` raises one
``FlagError`` naming each flag that cannot work, its value and what was expected: the values, the
model source (--flavor, --hf-config, --tokenizer), the layout (recipes/layout.py), --data, --device,
--out and --resume. ``training_flags`` are the flags that shape training, saved in every checkpoint:
--resume continues only a run saved with the same ones.
"""
from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from recipes import corpus, data_cap, hf, layout, lr_schedule
from recipes import data as data_mod
from recipes import precision as recipe_precision
from recipes.layout import FlagError, flag
from recipes.recipe import Recipe


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
        flags["data_cap"] = corpus.cap_of(args)
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
    launch = layout.Launch.of(args)
    errors = [f"{flag(k)}: expected {want}, got {getattr(args, k)!r}"
              for k, (ok, want) in recipe.rules.items() if not ok(getattr(args, k))]
    errors += recipe.check(args) + _world_size_errors(args)
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


def _world_size_errors(args: argparse.Namespace) -> list[str]:
    """--world-size plans a dry run in one process: refused without --dry-run, and under torchrun
    unless it is torchrun's WORLD_SIZE."""
    given = getattr(args, "world_size", 0)
    if not given:
        return []
    if not args.dry_run:
        return [f"--world-size: plans a --dry-run in one process; got --world-size {given} without --dry-run "
                "(torchrun's --nproc_per_node sets the processes of a run)"]
    started = os.environ.get("WORLD_SIZE")
    if started is not None and started != str(given):
        return [f"--world-size: {given}, but torchrun started {started} processes (expected {started}, or no "
                "--world-size)"]
    return []


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
    """--resume finds a checkpoint under ``ckpt_root``, saved with these ``training_flags`` (FlagError
    listing each that differs) at a step below --steps."""
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
