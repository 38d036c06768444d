"""How a state's leaves map onto a checkpoint: the logical leaves every layout shares, and who
writes which (``zfunc.checkpoint.save_load`` says what saving and loading guarantee).

A checkpoint holds one *logical* state whatever layout wrote it: the leaves of the plain state,
named by their ``TrainState`` tree paths (``params/emb.weight``, ``opt_state/1/emb.weight``,
``opt_state/0``, ``buffers/bn.running_mean``, ``step``). A leaf split like a param (the param
itself, and optimizer leaves shaped like its piece) is stored as *pieces* of rows of the whole
leaf, in ``torch.chunk`` style along dim 0; any other leaf whole. For a state in any layout,
``slots`` says which logical leaf each of its leaves is and which rows of it this rank holds, as
the state's placement answers (``zfunc.core.placement``: each transformation registers its own,
beside its spec; nothing here knows a spec's type):

- plain: one rank, every leaf whole.
- ``zf.shard`` (``zfunc.sharding.layout.ShardPlacement``): rank r holds rows ``[r * chunk, (r + 1) * chunk)``
  of each split leaf; the other leaves (counts, module buffers) are on every rank.
- ``zf.offload`` (``zfunc.offloading.placement``): as shard, but the optimizer state is one state per
  param leaf, ``opt_state/i/...``: its logical path drops ``i`` (and names the param by its tree
  path), and the per-leaf copies of an unsplit leaf (Adam's count) are one logical leaf.
- ``zf.pipeline`` (``zfunc.pipelining.placement``): stage s holds only the params it owns and their
  optimizer state, split over its dp ranks as a shard state, and its own units' buffers; counts
  and the other unsplit optimizer leaves are on every stage; the checkpoint's other params are
  another stage's, not missing. Its process is global rank ``stage * dp + dp rank``.

**Written once.** ``assign`` sees every rank's leaves (an all-gather of their descriptions, a few
bytes per leaf): each piece of rows is written by the lowest rank holding it, an unsplit leaf or a
value by the lowest rank holding it (rank 0 for what every rank holds); empty pieces are not
written. Each manifest entry lists its pieces: file, rows and crc32.

**Read as needed.** A loader reads, for each leaf of its own layout, only the pieces holding the
rows it needs (``read_rows``; a piece is read whole, to check its crc32): a rank of the layout that
saved reads only its own pieces, a rank of another layout only the pieces overlapping its rows
(none of another stage's params).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist

from zfunc.core import placement, tree
from zfunc.core.slicing import Slicing
from zfunc.checkpoint.files import CheckpointError, RankFiles
from zfunc.core.state import TrainState

PARAMS = "params/"
BUFFERS = "buffers/"  # TrainState.buffers: module buffers, never split


@dataclass(frozen=True)
class Slot:
    """One leaf of a state as the checkpoint sees it: its logical ``path``; for a leaf split like
    param ``split_like``, the whole leaf's ``full_shape`` and ``chunk`` and the ``rows`` of it this
    rank holds; where the param is sliced first (tensor parallelism, ``Rows.slicing``), its
    ``slicing`` and the ``index`` of the slice whose rows ``chunk`` and ``rows`` count."""

    path: str
    split_like: str | None = None
    full_shape: tuple[int, ...] | None = None
    chunk: int | None = None
    rows: tuple[int, int] | None = None
    slicing: Slicing | None = None
    index: int = 0

    @property
    def cut_shape(self) -> tuple[int, ...]:
        """The shape of what this rank's rows are rows of: the slice, or the whole leaf."""
        return self.full_shape if self.slicing is None else self.slicing.piece_shape(self.full_shape)


def param_keys(state: TrainState) -> list[str]:
    paths, _, _ = optree.tree_flatten_with_path(state.params, namespace=tree.NAMESPACE)
    return ["/".join(map(str, p)) for p in paths]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if len(x.shape) else (1,)


def _param_rows(state: TrainState) -> dict[str, tuple[placement.Rows, tuple[int, ...]]]:
    """Param key -> (its ``Rows``: whole shape, chunk and the rows held here; this rank's piece shape)."""
    spec = state.placement
    rule = placement.of(spec)
    out = {}
    for i, (key, p) in enumerate(zip(param_keys(state), tree.leaves(state.params))):
        if not hasattr(p, "shape"):  # a plain state's non-tensor leaf: saved as a value
            continue
        out[key] = (rule.rows(spec, i, tuple(p.shape)), _shape(p))
    return out


def slots(state: TrainState) -> tuple[list[Slot], list[Any], Any]:
    """``(slots, leaves, treespec)``: each of the state's flattened leaves and its ``Slot``."""
    paths, leaves, treespec = optree.tree_flatten_with_path(state, namespace=tree.NAMESPACE)
    rows = _param_rows(state)
    logical = placement.of(state.placement).logical_paths(state, ["/".join(map(str, p)) for p in paths])
    out = []
    for path, x in zip(logical, leaves):
        key = None
        if path.startswith(PARAMS):
            key = path[len(PARAMS):] if path[len(PARAMS):] in rows else None
        elif hasattr(x, "shape"):  # an optimizer leaf whose path ends with a param's key, shaped like its piece
            parts = path.split("/")
            key = next((k for k in ("/".join(parts[c:]) for c in range(1, len(parts)))
                        if k in rows and _shape(x) == rows[k][1]), None)
        if key is None:
            out.append(Slot(path))
        else:
            held = rows[key][0]
            out.append(Slot(path, key, held.shape, held.chunk, held.held, held.slicing, held.index))
    return out, leaves, treespec


# ----------------------------------------------------------------------------- save: who writes what


def descriptions(state_slots: list[Slot], leaves: list[Any]) -> list[dict]:
    """What this rank holds, one dict per logical leaf (its first copy): what ``assign`` needs. A
    sliced leaf's says its ``slicing`` and the ``slice`` its rows are of."""
    out, seen = [], set()
    for slot, x in zip(state_slots, leaves):
        if slot.path in seen:
            continue
        seen.add(slot.path)
        if not isinstance(x, torch.Tensor):
            out.append({"path": slot.path, "value": x})
            continue
        d = {"path": slot.path, "dtype": str(x.dtype).removeprefix("torch."),
             "shape": list(slot.full_shape if slot.split_like else x.shape), "split_like": slot.split_like,
             "full_shape": list(slot.full_shape) if slot.split_like else None, "chunk": slot.chunk}
        if slot.slicing is not None:
            d["slicing"] = slot.slicing.as_json()
        if slot.split_like:
            d["rows"] = list(slot.rows)
            if slot.slicing is not None:
                d["slice"] = slot.index
        out.append(d)
    return out


_WHERE = ("rows", "slice")  # what differs between the ranks holding one leaf: which piece of it


def assign(everyone: list[list[dict]]) -> tuple[list[dict], list[set[str]]]:
    """The manifest's leaf entries (pieces without crc32s yet) and, per rank, the paths it writes;
    raises ``CheckpointError`` (on every rank alike) where ranks disagree about a leaf."""
    entries: dict[str, dict] = {}
    first: dict[str, int] = {}
    writes: list[set[str]] = [set() for _ in everyone]
    for rank, described in enumerate(everyone):
        for d in described:
            path, fixed = d["path"], {k: v for k, v in d.items() if k not in _WHERE}
            if path not in entries:
                entries[path], first[path] = ({**fixed, "pieces": []} if "dtype" in d else fixed), rank
            elif json.dumps(fixed) != json.dumps({k: v for k, v in entries[path].items() if k != "pieces"}):
                raise CheckpointError(f"state: ranks {first[path]} and {rank} hold different {path} "
                                      f"({entries[path]} and {fixed}); every rank must save the same training step")
            entry = entries[path]
            if "value" in d:
                continue
            rows = d.get("rows")
            if rows is None:
                new = not entry["pieces"]
            else:
                new = rows[1] > rows[0] and all((p.get("slice"), p["rows"][0]) != (d.get("slice"), rows[0])
                                                for p in entry["pieces"])
            if new:
                entry["pieces"].append({"file": rank, "rows": rows, **({"slice": d["slice"]} if "slice" in d else {})})
                writes[rank].add(path)
    return list(entries.values()), writes


def add_checksums(entries: list[dict], crcs: list[dict[str, int]]) -> None:
    """Each piece's crc32, from the ``write_safetensors`` result of the file holding it."""
    for entry in entries:
        for piece in entry.get("pieces", ()):
            piece["crc"] = crcs[piece["file"]][entry["path"]]


def all_gather(obj: Any, world: int, group: Any = None) -> list[Any]:
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


# ----------------------------------------------------------------------------- load: matching and reading


def check_structure(directory: Path, saved: dict[str, dict], slots: list[Slot], template: TrainState) -> None:
    """The checkpoint has every leaf of the state and, besides, only the leaves of params (and
    module buffers) that other processes hold, where the state holds part of the model (a
    pipeline stage: ``Placement.model``)."""
    mine = {s.path for s in slots}
    held = set(param_keys(template))

    def elsewhere(path: str, entry: dict) -> bool:
        split_like = entry.get("split_like")
        return path.startswith(BUFFERS) or (split_like is not None and split_like not in held)

    partial = placement.of(template.placement).model(template.placement) is not None  # the rest is elsewhere
    missing = sorted(mine - saved.keys())
    unexpected = sorted(p for p, e in saved.items() if p not in mine and not (partial and elsewhere(p, e)))
    if missing or unexpected:
        raise CheckpointError(f"{directory}: the state's structure differs from the checkpoint's: "
                              f"not in the checkpoint {missing[:5]}, only in the checkpoint {unexpected[:5]}")


def check_leaf(directory: Path, entry: dict, slot: Slot, like: Any) -> None:
    """The saved leaf can fill ``like``: a value for a value, else the same dtype, whole shape and size."""
    path = slot.path
    if not isinstance(like, torch.Tensor):
        if "dtype" in entry:
            raise CheckpointError(f"{directory}: leaf {path} is a tensor in the checkpoint, {like!r} in the state")
        return
    if entry.get("dtype") != str(like.dtype).removeprefix("torch."):
        raise CheckpointError(f"{directory}: leaf {path} is {entry.get('dtype')} in the checkpoint, "
                              f"{like.dtype} in the state")
    if entry["split_like"] is not None:
        if slot.split_like is None or tuple(entry["full_shape"]) != slot.full_shape:
            raise CheckpointError(f"{directory}: leaf {path} has whole shape {tuple(entry['full_shape'])} in the "
                                  f"checkpoint, {slot.full_shape if slot.split_like else 'unsplit'} in the state")
        size = (slot.rows[1] - slot.rows[0]) * int(torch.Size(slot.cut_shape[1:]).numel())
    else:
        size = int(torch.Size(entry["shape"]).numel())
    if size != like.numel():
        raise CheckpointError(f"{directory}: leaf {path} has {size} elements in the checkpoint, "
                              f"{like.numel()} in the state")


def pieces(entry: dict, manifest: dict) -> list[dict]:
    """The entry's pieces; a format-1 checkpoint's are implied: every rank's rows, or rank 0's file."""
    if "pieces" in entry:
        return entry["pieces"]
    if entry["split_like"] is None:
        return [{"file": 0, "rows": None}]
    chunk, full = entry["chunk"], entry["full_shape"]
    rows = full[0] if full else 1
    return [{"file": r, "rows": [r * chunk, min(rows, (r + 1) * chunk)]} for r in range(manifest["world"])
            if r * chunk < rows]


def saved_slicing(entry: dict) -> Slicing | None:
    """How the saved leaf was sliced before its rows were split (tensor parallelism), None: not."""
    return None if "slicing" not in entry else Slicing.from_json(entry["slicing"], tuple(entry["full_shape"]))


def read_rows(files: RankFiles, entry: dict, start: int, stop: int, index: int | None = None) -> torch.Tensor:
    """Rows ``[start, stop)`` of a split leaf's whole tensor (``index``: of its saved slice ``index``),
    shaped ``(stop - start, *tail)``, read from the pieces holding them (each piece read whole, to
    check its crc32); a piece that is exactly those rows is returned as it was read, else the rows
    are copied out."""
    cut = entry["full_shape"] if index is None else saved_slicing(entry).piece_shape(tuple(entry["full_shape"]))
    tail = list(cut[1:])
    parts, exact = [], False
    for piece in pieces(entry, files.manifest):
        a, b = piece["rows"]
        lo, hi = max(start, a), min(stop, b)
        if lo < hi and piece.get("slice") == index:
            t = files.read(piece["file"], entry["path"], piece.get("crc")).reshape(-1, *tail)
            parts.append(t[lo - a : hi - a])
            exact = (a, b) == (start, stop)
    if exact:  # the one piece holding just these rows: its own buffer
        return parts[0]
    if not parts:
        return torch.empty((0, *tail), dtype=getattr(torch, entry["dtype"]))
    return torch.cat(parts)


def read_slot(files: RankFiles, entry: dict, slot: Slot) -> torch.Tensor:
    """The rows ``slot`` holds of a split leaf: read from the pieces holding them where the saved
    leaf is cut as the slot's (both whole, or both the same slicing); else made from the whole leaf
    (every piece read: another tp size, or tp to none and back), cut as the slot's, copied out."""
    mine = slot.slicing
    if saved_slicing(entry) == mine:
        return read_rows(files, entry, *slot.rows, index=None if mine is None else slot.index)
    whole = read_whole(files, entry, files.manifest)
    cut = whole if mine is None else mine.piece(whole, slot.index)
    start, stop = slot.rows
    return cut.reshape(-1, *slot.cut_shape[1:])[start:stop].clone()


def planned_reads(entry: dict, manifest: dict, slot: Slot) -> list[tuple[int, str]]:
    """The ``(file, tensor)`` reads, in order, of ``read_slot(files, entry, slot)``, or, for an
    unsplit leaf, of ``read_whole`` (for ``RankFiles.plan``)."""
    if entry["split_like"] is None:
        return [(pieces(entry, manifest)[0]["file"], entry["path"])]
    if saved_slicing(entry) != slot.slicing:  # the whole leaf
        return [(p["file"], entry["path"]) for p in _in_order(pieces(entry, manifest))]
    start, stop = slot.rows
    index = None if slot.slicing is None else slot.index
    return [(p["file"], entry["path"]) for p in pieces(entry, manifest)
            if max(start, p["rows"][0]) < min(stop, p["rows"][1]) and p.get("slice") == index]


def _in_order(saved: list[dict]) -> list[dict]:
    """Pieces in the order ``read_whole`` reads them: by slice (a stable sort: each slice's in the manifest's order)."""
    return sorted(saved, key=lambda p: p.get("slice") or 0)


def read_whole(files: RankFiles, entry: dict, manifest: dict) -> torch.Tensor:
    """A leaf whole: all rows of a split one (in its whole shape; a sliced one's slices put
    together, their padding dropped), else the one saved tensor."""
    if entry.get("split_like") is None:
        piece = pieces(entry, manifest)[0]
        return files.read(piece["file"], entry["path"], piece.get("crc"))
    full = entry["full_shape"]
    slicing = saved_slicing(entry)
    if slicing is None:
        return read_rows(files, entry, 0, full[0] if full else 1).reshape(full)
    shape = slicing.piece_shape(tuple(full))
    return slicing.whole([read_rows(files, entry, 0, shape[0], t).reshape(shape) for t in range(slicing.tp)])
