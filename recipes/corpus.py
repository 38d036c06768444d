"""The corpus a run trains on, as its flags ask: --data as bytes or, with --tokenizer, as tokens cached
under OUT/tokens, read up to --data-cap (recipes/data.py, recipes/data_cap.py), and checked to hold a
training window of --block-size in both splits before anything is built on it.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from recipes import data as data_mod
from recipes import data_cap
from recipes.layout import FlagError


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
