"""How a state's leaves map onto a checkpoint: the logical leaves every layout shares, and who
writes which (``zfunc.checkpoint.save_load`` says what saving and loading guarantee).

A checkpoint holds one *logical* state whatever layout wrote it: the leaves of the plain state,
named by their ``TrainState`` tree paths (``params/emb.weight``, ``opt_state/1/emb.weight``,
``opt_state/0``, ``buffers/bn.running_mean``, ``step``). A leaf split like a param (the param
itself, and optimizer leaves shaped like its piece) is stored as *pieces* of rows of the whole
leaf, in ``torch.chunk`` style along dim 0; any other leaf whole. For a state in any layout,
``slots`` says which logical leaf each of its leaves is and which rows of it this rank holds:

- plain: one rank, every leaf whole.
- ``zf.shard`` (``ShardSpec``): rank r holds rows ``[r * chunk, (r + 1) * chunk)`` of each split
  leaf; the other leaves (counts, module buffers) are on every rank.
- ``zf.offload`` (``OffloadSpec``): as shard, but the optimizer state is one state per param leaf,
  ``opt_state/i/...``: its logical path drops ``i`` (and names the param by its tree path), and the
  per-leaf copies of an unsplit leaf (Adam's count) are one logical leaf.
- ``zf.pipeline`` (``PipelineSpec``): stage s holds only the params it owns (the shared ones on stage
  0; no stand-ins) and their optimizer state, split over its dp ranks as a shard state, and its own
  units' buffers; counts and the other unsplit optimizer leaves are on every stage. Its process
  is global rank ``stage * dp + dp rank`` (``zf.Mesh``), which names its file.

**Written once.** ``assign`` sees every rank's leaves (an all-gather of their descriptions, a few
bytes per leaf): each piece of rows is written by the lowest rank holding it, an unsplit leaf or a
value by the lowest rank holding it (rank 0 for what every rank holds); empty pieces are not
written. Each manifest entry lists its pieces: file, rows and crc32.

**Read as needed.** A loader reads, for each leaf of its own layout, only the pieces holding the
rows it needs (``read_rows``; a piece is read whole, to check its crc32): a rank of the layout that
saved reads only its own pieces, a rank of another layout only the pieces overlapping its rows
(none of another stage's params). ``gather_params`` is ``full_params`` for states whose ranks hold
different params (pipelines).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist

from zfunc.core import tree
from zfunc.checkpoint.files import CheckpointError, RankFiles
from zfunc.sharding.layout import LeafShard, ShardSpec, _leaf_names
from zfunc.core.state import TrainState

PARAMS = "params/"
BUFFERS = "buffers/"  # TrainState.buffers: module buffers, never split


@dataclass(frozen=True)
class Slot:
    """One leaf of a state as the checkpoint sees it: its logical ``path``; for a leaf split like
    param ``split_like``, the whole leaf's ``full_shape`` and ``chunk`` and the ``rows`` of it this
    rank holds."""

    path: str
    split_like: str | None = None
    full_shape: tuple[int, ...] | None = None
    chunk: int | None = None
    rows: tuple[int, int] | None = None


def place(spec: Any) -> tuple[int, int]:
    """``(world, rank)`` of a state's process among those that save it (rank names its file)."""
    from zfunc.pipelining.step import PipelineSpec

    if spec is None:
        return 1, 0
    if isinstance(spec, ShardSpec):
        return spec.world, spec.rank
    if isinstance(spec, PipelineSpec):
        dp, rank = (spec.inner.world, spec.inner.rank) if spec.inner else (1, 0)
        return spec.stages * dp, spec.stage * dp + rank
    raise CheckpointError(f"state.placement: {spec!r} is not a layout checkpoints know (expected None, a ShardSpec "
                          "or a PipelineSpec)")


def describe(spec: Any) -> dict:
    """The layout, for the manifest: processes, pipeline stages, ZeRO stage (None: plain)."""
    from zfunc.pipelining.step import PipelineSpec

    world, _ = place(spec)
    inner = spec.inner if isinstance(spec, PipelineSpec) else spec
    return {"world": world, "pipeline": spec.stages if isinstance(spec, PipelineSpec) else None,
            "stage": inner.stage if isinstance(inner, ShardSpec) else None}


def param_keys(state: TrainState) -> list[str]:
    paths, _, _ = optree.tree_flatten_with_path(state.params, namespace=tree.NAMESPACE)
    return ["/".join(map(str, p)) for p in paths]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if len(x.shape) else (1,)


def _param_rows(state: TrainState) -> dict[str, tuple[LeafShard, tuple[int, ...], tuple[int, int]]]:
    """Param key -> (its whole ``LeafShard``, this rank's piece shape, the rows it holds)."""
    from zfunc.pipelining.step import PipelineSpec

    spec = state.placement
    dp = spec.inner if isinstance(spec, PipelineSpec) else spec
    out = {}
    for i, (key, p) in enumerate(zip(param_keys(state), tree.leaves(state.params))):
        if not hasattr(p, "shape"):  # a plain state's non-tensor leaf: saved as a value
            continue
        if dp is None:
            leaf = LeafShard(tuple(p.shape), p.shape[0] if len(p.shape) else 1)
            rows = (0, leaf.rows)
        else:
            leaf, rank = dp.leaves[i], dp.split[1]  # stage 0: every rank holds what rank 0 of one would
            start = min(rank * leaf.chunk, leaf.rows)
            rows = (start, start + leaf.local_rows(rank))
        out[key] = (leaf, _shape(p), rows)
    return out


def _logical(state: TrainState, paths: list[str]) -> list[str]:
    """The plain state's path of each leaf: an offloaded state's ``opt_state/i/REST`` (leaf i's
    own optimizer state, made for ``{name_i: piece}``) is ``opt_state/REST`` with the param named
    by its tree path."""
    from zfunc.offloading.step import OffloadSpec

    if not isinstance(state.placement, OffloadSpec):
        return paths
    keys, names = param_keys(state), _leaf_names(state.params)
    out = []
    for path in paths:
        if path.startswith("opt_state/"):
            _, i, *rest = path.split("/")
            name, rest = names[int(i)], "/".join(rest)
            if rest == name or rest.endswith("/" + name):
                rest = rest[: len(rest) - len(name)] + keys[int(i)]
            path = "/".join(["opt_state", rest]) if rest else "opt_state"
        out.append(path)
    return out


def slots(state: TrainState) -> tuple[list[Slot], list[Any], Any]:
    """``(slots, leaves, treespec)``: each of the state's flattened leaves and its ``Slot``."""
    paths, leaves, treespec = optree.tree_flatten_with_path(state, namespace=tree.NAMESPACE)
    rows = _param_rows(state)
    out = []
    for path, x in zip(_logical(state, ["/".join(map(str, p)) for p in paths]), leaves):
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
            leaf, _, held = rows[key]
            out.append(Slot(path, key, leaf.shape, leaf.chunk, held))
    return out, leaves, treespec


# ----------------------------------------------------------------------------- save: who writes what


def descriptions(state_slots: list[Slot], leaves: list[Any]) -> list[dict]:
    """What this rank holds, one dict per logical leaf (its first copy): what ``assign`` needs."""
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
        out.append({**d, "rows": list(slot.rows)} if slot.split_like else d)
    return out


def assign(everyone: list[list[dict]]) -> tuple[list[dict], list[set[str]]]:
    """The manifest's leaf entries (pieces without crc32s yet) and, per rank, the paths it writes;
    raises ``CheckpointError`` (on every rank alike) where ranks disagree about a leaf."""
    entries: dict[str, dict] = {}
    first: dict[str, int] = {}
    writes: list[set[str]] = [set() for _ in everyone]
    for rank, described in enumerate(everyone):
        for d in described:
            path, fixed = d["path"], {k: v for k, v in d.items() if k != "rows"}
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
                new = rows[1] > rows[0] and all(p["rows"][0] != rows[0] for p in entry["pieces"])
            if new:
                entry["pieces"].append({"file": rank, "rows": rows})
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
    module buffers) that other pipeline stages hold."""
    from zfunc.pipelining.step import PipelineSpec

    mine = {s.path for s in slots}
    held = set(param_keys(template))

    def elsewhere(path: str, entry: dict) -> bool:
        split_like = entry.get("split_like")
        return path.startswith(BUFFERS) or (split_like is not None and split_like not in held)

    pipelined = isinstance(template.placement, PipelineSpec)
    missing = sorted(mine - saved.keys())
    unexpected = sorted(p for p, e in saved.items() if p not in mine and not (pipelined and elsewhere(p, e)))
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
        size = (slot.rows[1] - slot.rows[0]) * int(torch.Size(slot.full_shape[1:]).numel())
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


def read_rows(files: RankFiles, entry: dict, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a split leaf's whole tensor, shaped ``(stop - start, *full[1:])``,
    read from the pieces holding them (each piece read whole, to check its crc32); a piece that is
    exactly those rows is returned as it was read, else the rows are copied out."""
    tail = entry["full_shape"][1:]
    parts, exact = [], False
    for piece in pieces(entry, files.manifest):
        a, b = piece["rows"]
        lo, hi = max(start, a), min(stop, b)
        if lo < hi:
            t = files.read(piece["file"], entry["path"], piece.get("crc")).reshape(-1, *tail)
            parts.append(t[lo - a : hi - a])
            exact = (a, b) == (start, stop)
    if exact:  # the one piece holding just these rows: its own buffer
        return parts[0]
    if not parts:
        return torch.empty((0, *tail), dtype=getattr(torch, entry["dtype"]))
    return torch.cat(parts)


def planned_reads(entry: dict, manifest: dict, rows: tuple[int, int] | None) -> list[tuple[int, str]]:
    """The ``(file, tensor)`` reads, in order, of ``read_rows(files, entry, *rows)``, or with
    ``rows`` None of ``read_whole`` of an unsplit leaf (for ``RankFiles.plan``)."""
    if rows is None:
        return [(pieces(entry, manifest)[0]["file"], entry["path"])]
    start, stop = rows
    return [(p["file"], entry["path"]) for p in pieces(entry, manifest)
            if max(start, p["rows"][0]) < min(stop, p["rows"][1])]


def read_whole(files: RankFiles, entry: dict, manifest: dict) -> torch.Tensor:
    """A leaf whole: all rows of a split one (in its whole shape), else the one saved tensor."""
    if entry.get("split_like") is None:
        piece = pieces(entry, manifest)[0]
        return files.read(piece["file"], entry["path"], piece.get("crc"))
    full = entry["full_shape"]
    return read_rows(files, entry, 0, full[0] if full else 1).reshape(full)


# ----------------------------------------------------------------------------- whole params


def gather_params(state: TrainState) -> dict[str, torch.Tensor]:
    """Every param whole (fp32) on every rank, from a state whose ranks hold pieces of different
    params (a pipelined one); every rank of the default process group calls it. Costs an
    all-gather of the ranks' pieces, each padded to the largest rank's (fp32), and one of their
    descriptions."""
    world, _ = place(state.placement)
    held = [(s.split_like, s.rows, s.full_shape) for s in slots(state)[0] if s.path.startswith(PARAMS)]
    pieces_ = [x.detach().float().reshape(-1) for x in tree.leaves(state.params)]
    device = pieces_[0].device if pieces_ else torch.device("cpu")
    flat = torch.cat(pieces_) if pieces_ else torch.zeros(0, device=device)
    if world > 1 and dist.get_world_size() != world:
        raise ValueError(f"state: it is one of {world} ranks, but the process group has {dist.get_world_size()}")
    everyone = all_gather((held, flat.numel()), world)
    size = max(n for _, n in everyone)
    padded = torch.cat([flat, flat.new_zeros(size - flat.numel())])
    gathered = [padded] if world == 1 else [torch.empty_like(padded) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, padded)
    out: dict[str, torch.Tensor] = {}
    for (described, _), buffer in zip(everyone, gathered):
        offset = 0
        for key, (a, b), shape in described:
            tail = tuple(shape[1:])
            n = (b - a) * int(torch.Size(tail).numel())
            if key not in out:
                out[key] = torch.empty(shape, dtype=torch.float32, device=device)
            out[key].reshape(-1, *tail)[a:b] = buffer[offset : offset + n].view(b - a, *tail)
            offset += n
    names = getattr(state.placement, "names", None) or sorted(out)
    return {k: out[k] for k in names}
