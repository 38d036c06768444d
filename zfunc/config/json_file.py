"""JSON from a file someone else wrote (a DeepSpeed or transformers config), read within bounds.

``read(path)`` and ``parse(text)`` return what ``json.loads`` would, or raise ``ValueError`` with a
message that names the problem and the bound, never a ``RecursionError`` traceback or a silently
odd value. The bounds, each far above any real config:
- at most ``MAX_BYTES`` bytes in a file;
- containers nested at most ``MAX_DEPTH`` deep (the top object is depth 1; DeepSpeed's and
  transformers' configs reach about 5);
- no duplicate keys in an object (``json.loads`` keeps the last silently, so a reviewer reading
  the first would be misled; DeepSpeed refuses them too);
- no ``NaN``, ``Infinity`` or ``-Infinity``, which are not JSON (Python's reader accepts them).
Cost: one parse, plus one walk over the parsed values (no recursion) for the depth.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MAX_DEPTH = 32
MAX_BYTES = 16 << 20
_TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep (the limit for a config); expected a config's few levels"


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"duplicate keys {dup}")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity); give a finite number")


def depth(value: Any) -> int:
    """How deep ``value``'s dicts and lists nest (a scalar is 0, ``{}`` is 1), by an explicit stack."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:  # no need to walk the rest
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def check_depth(value: Any) -> None:
    """Raise ``ValueError`` when ``value`` nests more than ``MAX_DEPTH`` deep."""
    if depth(value) > MAX_DEPTH:
        raise ValueError(_TOO_DEEP)


def parse(text: str) -> Any:
    """``json.loads(text)`` within the module's bounds; ``ValueError`` names what broke them."""
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:  # deeper than Python's parser goes, so far deeper than MAX_DEPTH
        raise ValueError(_TOO_DEEP) from None
    check_depth(value)
    return value


def read(path: str | os.PathLike) -> Any:
    """``parse`` of the file at ``path`` (UTF-8). ``FileNotFoundError`` when there is no such file,
    ``ValueError`` for a file too large, not UTF-8, or out of bounds."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {str(path)!r}")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ValueError(f"{size:,} bytes, more than the {MAX_BYTES:,} a config may have")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    return parse(text)
