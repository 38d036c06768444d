"""The cap on what a recipe reads of its corpus (``--data-cap``): the flag's value, its default for a
corpus, and what a cap left out, in words for the recipe's data line.

The default: all of the corpus, but MAX_CORPUS_BYTES of the default corpus read as bytes (the
stdlib's .py files, ~30 MB: the main job's corpus, whose README figures are of its first 16 MiB).
A cap stops the reading: the files after it are only listed (a stat each), so the line can say how
many files and bytes it left out.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

# The default corpus' cap as bytes: the stdlib holds ~30 MB of .py; the main job (and the README's
# figures) trains on its first 16 MiB. Any other corpus, and the stdlib as tokens, is read whole.
MAX_CORPUS_BYTES = 16 * 2**20
DEFAULT_CAP = "default"  # a --data-cap not given: resolve_cap's default for the corpus
_SIZE = re.compile(r"([0-9]+)(?:([KMGT])(?:iB)?)?", re.IGNORECASE)


def parse_cap(text: str | None) -> int | None | str:
    """``--data-cap``'s value: bytes (an int >= 1, or with K, M, G, T: powers of 1024, "iB" optional),
    None for "none" / "all" (no cap), DEFAULT_CAP when not given. ValueError naming the flag."""
    if text is None:
        return DEFAULT_CAP
    if text.strip().lower() in ("none", "all"):
        return None
    m = _SIZE.fullmatch(text.strip())
    n = int(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper()) if m else 0
    if n < 1:
        raise ValueError(f"--data-cap: expected a byte count such as 16M or 1G (K, M, G, T: powers of 1024) "
                         f"or none (all of --data), got {text!r}")
    return n


def is_cap(text: str | None) -> bool:
    """Whether ``parse_cap`` takes ``text``."""
    try:
        parse_cap(text)
    except ValueError:
        return False
    return True


def format_cap(n: int) -> str:
    """``n`` bytes as --data-cap would take it: "16M" for 16 MiB, else the count."""
    for i in (4, 3, 2, 1):
        if n % 1024 ** i == 0:
            return f"{n // 1024 ** i}{' KMGT'[i]}"
    return str(n)


def resolve_cap(cap: int | None | str, path: str | os.PathLike | None, tokenizer: str | os.PathLike | None
                ) -> int | None:
    """The cap in bytes (None: none) of a ``parse_cap`` value: DEFAULT_CAP is MAX_CORPUS_BYTES for the
    default corpus read as bytes (the main job's corpus), no cap for a --data or for tokens."""
    if cap == DEFAULT_CAP:
        return MAX_CORPUS_BYTES if path is None and tokenizer is None else None
    return cap


@dataclass
class Leftover:
    """What a cap left out of a corpus: ``files`` after it (not opened: their sizes are listed, so
    a binary file among them counts too) and ``bytes`` (the rest of the file it cut, and theirs)."""

    files: int = 0
    bytes: int = 0


def used(corpus) -> str:
    """What was read of ``corpus`` (a recipes.data.Corpus), in words for the recipe's data line: its
    source, files and bytes, and, when the cap cut it, how much of the corpus that left out."""
    text = f"{corpus.source}: "
    if not corpus.left_bytes:
        size = "" if corpus.n_bytes is None else f", {corpus.n_bytes:,} bytes"
        return text + f"{corpus.n_files:,} file{'s' * (corpus.n_files != 1)}{size}"
    whose = "the default corpus' " if corpus.cap_is_default else ""
    return (text + f"{corpus.n_files:,} of {corpus.n_files + corpus.left_files:,} files, {corpus.n_bytes:,} of "
            f"{corpus.n_bytes + corpus.left_bytes:,} bytes read: {whose}--data-cap {format_cap(corpus.cap)} left "
            f"out {corpus.left_bytes:,} bytes ({corpus.left_files:,} files not read; --data-cap none reads all)")


def saved_flags(flags: dict) -> dict:
    """A checkpoint's training ``flags`` with the cap its run read under: one saved before
    --data-cap was a flag read its --data up to MAX_CORPUS_BYTES as bytes, all of it as tokens (so
    --resume on another cap is refused, not trained on other data); others as saved."""
    if "data" not in flags or "data_cap" in flags:
        return flags
    return {**flags, "data_cap": MAX_CORPUS_BYTES if flags.get("tokenizer") is None else None}
