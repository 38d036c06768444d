"""A checkpoint's manifest, read as data from someone else: every field checked before it is used.

``read_manifest`` parses ``manifest.json`` and checks each field zfunc reads -- its type, its
range, the values allowed, and that the files it names are the checkpoint's own rank files -- so
a broken or hostile manifest is refused with a ``CheckpointError`` naming the file, the field,
the value and what was expected, before any tensor file is opened. The laws it enforces:

- top level: ``format`` in ``FORMATS``; ``world`` an int in ``[1, MAX_WORLD]``; ``step`` an int
  >= 0; ``files`` maps exactly ``rank00000.safetensors`` .. the world's last rank file to crc32s;
  ``leaves`` a list; ``pipeline`` (None or an int dividing ``world``), ``stage`` (None, 0-3),
  ``run``, ``zfunc`` (strs), ``rng`` (an int) and ``extra`` (a dict) where present.
- a leaf: a unique ``path`` (a str); either a ``value`` (None, bool, int, float, str) or a tensor:
  ``dtype`` one of ``DTYPES``, ``shape`` a list of at most 64 ints in ``[0, MAX_DIM]`` of at most
  ``MAX_TENSOR_BYTES``, ``split_like`` (None, or a str with ``full_shape`` like ``shape`` and
  ``chunk`` an int >= 0); a params leaf is split.
- a leaf's ``pieces`` (format 2; implied by ``chunk`` and ``world`` in format 1): each names a
  ``file`` (a rank in ``[0, world)``) and a ``crc`` (a crc32); an unsplit leaf has one piece,
  ``rows`` None; a split leaf's ``rows`` ``[a, b]`` partition ``[0, full_shape[0])``.
- format 3: a split leaf may be sliced first (tensor parallelism): ``slicing`` ``{dim, tp, padded,
  parts}`` (``dim`` < its rank, ``padded`` >= the dim's size and a multiple of ``tp * parts``); each
  piece names its ``slice`` in ``[0, tp)``, and each slice's ``rows`` partition the slice's rows
  (``padded / tp`` along dim 0, else ``full_shape[0]``).

Other keys are ignored: zfunc never reads them.

A manifest names no paths: rank files are named by rank (``rank_file``), so none lies outside
the checkpoint's directory; ``inside`` refuses a file there that is a link to somewhere else.
Cost: one pass over the manifest, no file but the manifest read.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zfunc.checkpoint.files import FORMATS, MANIFEST, ST_DTYPES, CheckpointError, inside, rank_file
from zfunc.checkpoint.layout import PARAMS

MAX_WORLD = 100_000  # rank file names have five digits
MAX_DIM = 1 << 50
MAX_TENSOR_BYTES = 1 << 50  # more than any host holds: a larger claim is a broken manifest
DTYPES = {str(d).removeprefix("torch."): d.itemsize for d in ST_DTYPES}
_CRC = "a crc32 (an int in [0, 2**32))"


def read_manifest(directory: str | os.PathLike) -> dict:
    """The checkpoint's manifest, every field checked (see the module docstring); raises
    ``CheckpointError`` naming the file when it is missing, a link out of ``directory``, not
    JSON, or any field is not what zfunc writes there."""
    path = Path(directory) / MANIFEST
    if not os.path.lexists(path):
        raise CheckpointError(f"directory: no checkpoint at {directory} ({MANIFEST} missing)")
    inside(Path(directory), path)
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: not a zfunc manifest, it does not parse as JSON ({e})") from e
    except RecursionError:
        raise CheckpointError(f"{path}: not a zfunc manifest, its JSON nests too deeply to parse") from None
    check_manifest(path, manifest)
    return manifest


def check_manifest(path: Path, manifest: Any) -> None:
    """Raise ``CheckpointError`` at the first field of ``manifest`` (read from ``path``) that is
    not what zfunc writes there."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: not a zfunc manifest: the JSON is {_kind(manifest)}, expected an object")
    field = _Fields(path, manifest)
    fmt = field("format", lambda v: _int(v) and v in FORMATS, f"one of {FORMATS}")
    world = field("world", lambda v: _int(v) and 1 <= v <= MAX_WORLD, f"an int in [1, {MAX_WORLD}]")
    field("step", lambda v: _int(v) and v >= 0, "an int >= 0")
    field.optional("pipeline", lambda v: v is None or (_int(v) and v >= 1 and world % v == 0),
                   f"None or an int >= 1 dividing world={world}")
    field.optional("stage", lambda v: v is None or (_int(v) and 0 <= v <= 3), "None or a ZeRO stage 0-3")
    for name in ("zfunc", "run"):
        field.optional(name, lambda v: isinstance(v, str), "a str")
    field.optional("rng", _int, "an int")
    field.optional("extra", lambda v: isinstance(v, dict), "an object")
    names = [rank_file(r) for r in range(world)]
    files = field("files", lambda v: isinstance(v, dict) and sorted(v) == names,
                  f"an object naming the rank files {names[0]} .. {names[-1]} (world={world}), each once")
    for name in names:
        field.at(f"files[{name!r}]", files[name], _is_crc, _CRC)
    leaves = field("leaves", lambda v: isinstance(v, list), "a list of leaf entries")
    seen: set[str] = set()
    for i, entry in enumerate(leaves):
        _check_leaf(field, f"leaves[{i}]", entry, fmt, world, seen)


def _check_leaf(field: _Fields, at: str, entry: Any, fmt: int, world: int, seen: set[str]) -> None:
    field.at(at, entry, lambda v: isinstance(v, dict), "an object")
    leaf = field.within(at, entry)
    path = leaf("path", lambda v: isinstance(v, str) and v and v not in seen, "a str naming a leaf not named before")
    seen.add(path)
    leaf = field.within(f"{at} ({path})", entry)
    if ("value" in entry) == ("dtype" in entry):
        leaf.fail_field("value/dtype", {k: entry[k] for k in ("value", "dtype") if k in entry},
                        "either a value or a dtype (a tensor), not both or neither")
    if "value" in entry:
        leaf("value", lambda v: v is None or isinstance(v, (bool, int, float, str)), "None, a bool, a number or a str")
        return
    itemsize = DTYPES.get(leaf("dtype", lambda v: isinstance(v, str) and v in DTYPES, f"one of {sorted(DTYPES)}"))
    leaf("shape", lambda v: _shape(v, itemsize), _SHAPE)
    split_like = leaf("split_like", lambda v: v is None or isinstance(v, str), "None or the str naming a param")
    tp = None  # a tensor-parallel leaf's slices (format 3)
    if split_like is None:
        if path.startswith(PARAMS):
            leaf.fail_field("split_like", None, "a str: a params leaf is split like itself")
        rows = None
    else:
        full = leaf("full_shape", lambda v: _shape(v, itemsize), _SHAPE)
        rows = full[0] if full else 1
        if "slicing" in entry:
            slicing = leaf("slicing", lambda v: fmt >= 3 and _slicing(v, full),
                           f"(format 3) an object of ints dim < {len(full)}, tp >= 1, parts >= 1 and padded >= the "
                           "dim's size, a multiple of tp * parts")
            rows = slicing["padded"] // slicing["tp"] if slicing["dim"] == 0 else rows
            tp = slicing["tp"]
        if fmt == 1:  # the pieces are implied: every rank's chunk of rows
            leaf("chunk", lambda v: _int(v) and v >= 0 and (rows == 0 or v >= 1 and v * world >= rows),
                 f"an int whose {world} ranks' chunks cover the {rows} rows")
        else:
            leaf("chunk", lambda v: _int(v) and v >= 0, "an int >= 0")
    if fmt > 1 or "pieces" in entry:
        pieces = leaf("pieces", lambda v: isinstance(v, list), "a list of pieces")
        _check_pieces(field, f"{at} ({path}).pieces", pieces, world, rows, tp)


def _check_pieces(field: _Fields, at: str, pieces: list, world: int, rows: int | None, tp: int | None = None) -> None:
    """Each piece names a rank's file and a crc32; split rows partition ``[0, rows)`` (with ``tp``
    slices: each piece names its ``slice``, and each slice's rows partition ``[0, rows)``)."""
    if rows is None and len(pieces) != 1:
        field.fail(at, pieces, "one piece: an unsplit leaf is written once")
    spans: dict[int | None, list] = {}
    for j, piece in enumerate(pieces):
        field.at(f"{at}[{j}]", piece, lambda v: isinstance(v, dict), "an object")
        one = field.within(f"{at}[{j}]", piece)
        one("file", lambda v: _int(v) and 0 <= v < world, f"a rank in [0, {world})")
        one("crc", _is_crc, _CRC)
        if rows is None:
            one("rows", lambda v: v is None, "None (an unsplit leaf)")
            continue
        index = None if tp is None else one("slice", lambda v: _int(v) and 0 <= v < tp, f"a slice in [0, {tp})")
        spans.setdefault(index, []).append(one(
            "rows", lambda v: isinstance(v, list) and len(v) == 2 and all(map(_int, v)) and 0 <= v[0] < v[1] <= rows,
            f"[a, b] with 0 <= a < b <= {rows} (the leaf's rows)"))
    if rows is None:
        return
    if tp is not None and sorted(spans) != list(range(tp)) and rows > 0:
        field.fail(at, pieces, f"pieces of every slice 0 .. {tp - 1}")
    for index, spanned in spans.items():
        ends = [0] + [b for _, b in sorted(spanned)]
        if [a for a, _ in sorted(spanned)] != ends[:-1] or ends[-1] != rows:
            which = "" if index is None else f" of slice {index}"
            field.fail(at, pieces, f"pieces whose rows{which} partition [0, {rows}): no gap, no overlap")
    if not spans and rows > 0:
        field.fail(at, pieces, f"pieces whose rows partition [0, {rows}): no gap, no overlap")


_SHAPE = f"a list of at most 64 ints in [0, {MAX_DIM}] of at most {MAX_TENSOR_BYTES} bytes"


def _shape(v: Any, itemsize: int) -> bool:
    if not (isinstance(v, list) and len(v) <= 64 and all(_int(d) and 0 <= d <= MAX_DIM for d in v)):
        return False
    return math.prod(v) * itemsize <= MAX_TENSOR_BYTES


def _slicing(v: Any, full: list) -> bool:
    """A leaf's tensor-parallel ``slicing`` (``Slicing.as_json``) that cuts ``full`` into equal slices."""
    if not (isinstance(v, dict) and all(_int(v.get(k)) for k in ("dim", "tp", "padded", "parts"))):
        return False
    dim, tp, padded, parts = v["dim"], v["tp"], v["padded"], v["parts"]
    return (0 <= dim < len(full) and tp >= 1 and parts >= 1 and full[dim] <= padded <= MAX_DIM
            and padded % (tp * parts) == 0)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_crc(v: Any) -> bool:
    return _int(v) and 0 <= v < 1 << 32


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a str", bool: "a bool", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{_kind(value)} {text[:60]}...({len(text)} characters)"


class _Fields:
    """Checks the fields of one JSON object of the manifest at ``path``; ``prefix`` names it."""

    def __init__(self, path: Path, obj: dict, prefix: str = ""):
        self.path, self.obj, self.prefix = path, obj, prefix

    def __call__(self, name: str, ok: Callable[[Any], bool], expected: str) -> Any:
        """The field ``name``, which must be present and pass ``ok``."""
        if name not in self.obj:
            raise CheckpointError(f"{self.path}: {self.prefix}{name} is missing, expected {expected}")
        return self.at(self.prefix + name, self.obj[name], ok, expected)

    def optional(self, name: str, ok: Callable[[Any], bool], expected: str) -> Any:
        """The field ``name`` if present (it must pass ``ok``), else None."""
        return self(name, ok, expected) if name in self.obj else None

    def at(self, where: str, value: Any, ok: Callable[[Any], bool], expected: str) -> Any:
        """``value``, found at ``where`` (the whole name), which must pass ``ok``."""
        if not ok(value):
            self.fail(where, value, expected)
        return value

    def fail(self, where: str, value: Any, expected: str) -> None:
        raise CheckpointError(f"{self.path}: {where} is {_show(value)}, expected {expected}")

    def fail_field(self, name: str, value: Any, expected: str) -> None:
        self.fail(self.prefix + name, value, expected)

    def within(self, where: str, obj: dict) -> _Fields:
        return _Fields(self.path, obj, f"{where}.")
