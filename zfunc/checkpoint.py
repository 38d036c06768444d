"""Checkpoints: sharded, atomic save and load of any ``TrainState``, resharding, safetensors export.

Layout of ``save(state, "ckpt/000100")``::

    ckpt/000100/rank00000.safetensors ...   each rank's tensors (its pieces), written in parallel
    ckpt/000100/manifest.json               tree paths, shapes, dtypes, how each leaf is split, world
                                            size, stage, zfunc version, step, run, RNG, loss scale,
                                            the caller's ``extra`` (data position), a crc32 per file
    ckpt/latest                             "000100", replaced last

What is guaranteed (the files: ``zfunc.checkpoint_files``; ownership, locks, replacing, pruning:
``zfunc.checkpoint_folder``):

- **Only its own files.** ``save`` writes ``ckpt/000100``, ``ckpt/latest`` and scratch names
  beside them (``.000100.tmp``, ``.000100.lock``, ``.latest.lock``, ``.latest.tmp``), nothing
  else. When one of them exists and is not what zfunc writes there -- a directory that is not a
  zfunc checkpoint (no readable manifest, or files a checkpoint does not write, such as a folder
  of checkpoints), a plain file, a ``latest`` that is not a one-line pointer -- ``save`` raises
  ``CheckpointError`` naming it before it writes anything. Bad arguments (``extra`` that is not
  JSON, a leaf safetensors cannot hold) are refused before anything is written too.
- **Atomic.** Every rank writes into ``.000100.tmp``; after a barrier rank 0 writes the manifest,
  fsyncs, and puts the directory in place, swapping it with an existing checkpoint of that name
  in one rename (``renameat2`` ``RENAME_EXCHANGE``; where the file system lacks it, two renames,
  between which the name is absent), and only then replaces ``latest`` (written beside it,
  fsynced, renamed). A crash at any point leaves each checkpoint name holding a whole checkpoint,
  the previous one or the new one (on the fallback, between its two renames, the previous one
  is in ``.000100.old``), and ``latest`` naming a whole checkpoint; the next save to that name
  removes the scratch the crash left.
- **One writer at a time.** Saves to one directory, from threads or processes, run one after the
  other (an ``flock`` beside it, taken by rank 0), so the checkpoint is whole and is one of them;
  saves into one folder put their checkpoint in place and update ``latest`` one at a time.
- **Pruning.** ``keep_last=k`` keeps, among the checkpoints *of the same run* in the folder, the
  ``k`` with the highest recorded step; it never deletes the checkpoint just written, the one
  ``latest`` names, another run's checkpoints, or a directory holding files a checkpoint does not
  write. A checkpoint's run is ``save``'s ``run=``, by default its name without trailing digits
  ("000100" -> "", "gpt-000100" -> "gpt-", "step8" -> "step"): runs sharing a folder need names
  that differ before their step digits, or ``run=``.
- **Every rank or none.** A sharded ``save`` and ``full_params`` first check that every rank made
  the call (``zf.dist.all_arrive``, at most ``zf.dist.ARRIVAL_TIMEOUT_S``); otherwise each rank
  that came raises ``CollectiveError`` naming the call and the missing ranks instead of hanging
  in a collective.
- **Loads check the model and the bytes.** ``load`` builds the state for the model it is given
  (``params=``, else the params ``step.init`` last received, else the manifest's) and raises
  ``CheckpointError`` listing params missing from the checkpoint, params only in the checkpoint
  and shape/dtype differences, then any other difference of structure or dtype; each file's crc32
  is checked as it is read (``verify=True``). Loads never write.

**Resharding.** Every split zfunc makes is the same: dim 0 in ``torch.chunk`` style over the
ranks (``shard.ShardSpec``; a plain state is one rank holding everything), whatever the ZeRO stage.
So a checkpoint from N ranks at stage s loads into M ranks at stage t, or one process, by reading
for each leaf just the saved rows the new rank owns. A stage-0 state, whole on every rank, is
laid out as one rank alone (``ShardSpec.split``): rank 0 saves it, once, as a plain state is saved
(the manifest says world 1, stage 0), and each rank loading into stage 0 reads every row. Optimizer leaves shaped like a param's piece
are split like that param; other leaves (counts) are copied.

Why not ``torch.distributed.checkpoint``: it needs DTensors or a planner to describe the uneven
chunks, and its files are not plain safetensors; the layout above is a few dozen lines, its files
open with ``safetensors`` (zfunc streams them itself, checksumming on the way, and reads each
once), and it exports straight to a state dict.
"""
from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist

import zfunc
from zfunc import checkpoint_files as cf, tree
from zfunc.checkpoint_files import LATEST, CheckpointError, read_manifest
from zfunc.checkpoint_folder import (checkpoint_path, claim, default_run, latest, locked, prune, put_in_place, scratch,
                                     write_text_atomic)
from zfunc.dist import all_arrive
from zfunc.shard import LeafShard, ShardSpec
from zfunc.step import Step, TrainState
from zfunc.swap import fsync_dir

_BUFFERS = "buffers/"  # leaf paths of TrainState.buffers, the module buffers training updates

__all__ = ["CheckpointError", "save", "load", "latest", "read_manifest", "full_params", "export"]


# ----------------------------------------------------------------------------- describing a state


def _paths_and_leaves(state: TrainState) -> tuple[list[str], list[Any], Any]:
    paths, leaves, treespec = optree.tree_flatten_with_path(state, namespace=tree.NAMESPACE)
    return ["/".join(map(str, p)) for p in paths], leaves, treespec


def _param_keys(state: TrainState) -> list[str]:
    paths, _, _ = optree.tree_flatten_with_path(state.params, namespace=tree.NAMESPACE)
    return ["/".join(map(str, p)) for p in paths]


def _splits(state: TrainState) -> dict[str, tuple[str, LeafShard]]:
    """Path of every leaf split like a param -> (param key, its full-shape LeafShard)."""
    spec = state.sharding
    params = tree.leaves(state.params)
    keys = _param_keys(state)
    full = {k: (spec.leaves[i] if spec else LeafShard(tuple(p.shape), p.shape[0] if p.dim() else 1))
            for i, (k, p) in enumerate(zip(keys, params))}
    local = {k: tuple(p.shape) if p.dim() else (1,) for k, p in zip(keys, params)}
    out = {}
    for path, leaf in zip(*_paths_and_leaves(state)[:2]):
        if not isinstance(leaf, torch.Tensor):
            continue
        if path.startswith("params/"):
            key = path[len("params/"):]
            out[path] = (key, full[key])
            continue
        # an optimizer leaf whose path ends with a param's key and is shaped like its piece
        parts = path.split("/")
        for cut in range(1, len(parts)):
            key = "/".join(parts[cut:])
            if key in local and (tuple(leaf.shape) if leaf.dim() else (1,)) == local[key]:
                out[path] = (key, full[key])
                break
    return out


def _world_rank(state: TrainState) -> tuple[int, int, int | None]:
    spec = state.sharding
    if spec is not None and not isinstance(spec, ShardSpec):  # zf.pipeline's PipelineSpec
        raise CheckpointError(f"state: checkpoints of pipelined states ({spec}) are not supported yet; "
                              "save and load plain or zf.shard states")
    return (spec.world, spec.rank, spec.stage) if isinstance(spec, ShardSpec) else (1, 0, None)


def _layout(state: TrainState) -> tuple[int, int]:
    """``(ranks, rank)`` of the layout the state's leaves are split in: a stage-0 state, whole on
    every rank, is laid out as one rank alone (``ShardSpec.split``), like a plain state."""
    _world_rank(state)  # refuses the layouts checkpoints do not handle
    spec = state.sharding
    return spec.split if isinstance(spec, ShardSpec) else (1, 0)


# ----------------------------------------------------------------------------- save


def _check_leaves(paths: list[str], leaves: list[Any]) -> None:
    """Refuse, before anything is written, a leaf the files cannot hold."""
    for path, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor):
            if x.dtype not in cf.ST_DTYPES:
                raise CheckpointError(f"state: leaf {path} has dtype {x.dtype}, which safetensors cannot hold")
            if x.device.type == "meta":
                raise CheckpointError(f"state: leaf {path} is on the meta device, it has no values to save")
        elif not (x is None or isinstance(x, (bool, int, float, str))):
            raise CheckpointError(f"state: leaf {path} = {x!r} of type {type(x).__name__} cannot be saved "
                                  "(expected tensors, numbers, strings or None)")


def _check_extra(extra: Any) -> dict:
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise TypeError(f"extra: expected a dict of JSON values, got {type(extra).__name__}")
    for key, value in extra.items():
        if not isinstance(key, str):
            raise TypeError(f"extra: keys must be strings, got {key!r} ({type(key).__name__})")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"extra[{key!r}]: a {type(value).__name__} cannot be saved as JSON ({e}); expected "
                            "numbers, strings, bools, None and lists or dicts of them (a tensor: .item() or .tolist())"
                            ) from None
    return extra


def save(state: TrainState, directory: str | os.PathLike, *, keep_last: int | None = None,
         extra: dict | None = None, run: str | None = None) -> Path:
    """Write ``state`` to ``directory`` atomically; every rank of a sharded state calls it.

    Args:
      state: any ``TrainState``, plain or sharded (it is only read).
      directory: the checkpoint's own directory, e.g. ``ckpt/000100``: new, empty, or a zfunc
        checkpoint to replace (anything else is refused); its parent gets ``latest``.
      keep_last: keep only the ``keep_last`` checkpoints of this run in the parent with the
        highest step (None keeps all); see the module docstring.
      extra: JSON-able data saved in the manifest (e.g. the data loader's position); read it back
        with ``read_manifest(directory)["extra"]``.
      run: the run this checkpoint belongs to, for ``keep_last``; default the directory's name
        without its trailing digits.
    Returns the directory. Raises ``CheckpointError`` before writing anything when a path it would
    write is not zfunc's. Costs one streaming write of this rank's state bytes (checksummed on the
    way) and an fsync; a sharded save also a store round trip checking every rank called it.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"state: expected a TrainState, got {type(state).__name__}")
    final, run, extra = _check_save_args(directory, keep_last, extra, run)
    world, rank, stage = _world_rank(state)
    writers = _layout(state)[0]  # ranks holding a part: a stage-0 state is written once, by rank 0
    from zfunc.offload import in_ram

    state = in_ram(state)  # an offloaded state's swap files, read back
    paths, leaves, _ = _paths_and_leaves(state)
    _check_leaves(paths, leaves)
    if world > 1:
        all_arrive("zf.checkpoint.save", "state")
    tmp = scratch(final, "tmp")
    with ExitStack() as held:  # rank 0 holds the lock on ``final`` until the save is in place
        problem = claim(final, held) if rank == 0 else None
        if world > 1:
            shared = [problem]
            dist.broadcast_object_list(shared, src=0)
            problem = shared[0]
        if problem:
            raise CheckpointError(problem)
        if rank == 0:
            tmp.mkdir()
        _barrier(world)
        crc = None
        if rank < writers:
            tensors = {p: x.detach().contiguous().cpu() for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)}
            crc = cf.write_safetensors(tmp / cf.rank_file(rank), tensors)
        digests = [crc]
        if world > 1:
            digests = [None] * world
            dist.all_gather_object(digests, crc)
        if rank == 0:
            cf.write_manifest(tmp, _manifest(state, paths, leaves, writers, stage, run, extra, digests[:writers]))
            fsync_dir(tmp)
            _publish(tmp, final, run, keep_last)
    _barrier(world)
    return final


def _check_save_args(directory: Any, keep_last: Any, extra: Any, run: Any) -> tuple[Path, str, dict]:
    """``(final, run, extra)`` checked; refused before anything is written."""
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last: expected an int >= 1 or None, got {keep_last!r}")
    final = checkpoint_path(directory)
    if final.name in ("", ".", "..", LATEST) or final.name.startswith("."):
        raise ValueError(f"directory: expected a path whose last part names the checkpoint (not hidden, not "
                         f"{LATEST!r}), got {str(directory)!r}")
    if run is not None and not isinstance(run, str):
        raise TypeError(f"run: expected a str or None, got {type(run).__name__}")
    return final, default_run(final.name) if run is None else run, _check_extra(extra)


def _publish(tmp: Path, final: Path, run: str, keep_last: int | None) -> None:
    """Rank 0: the written ``tmp`` becomes ``final``, then ``latest`` names it, then old ones of
    the run are pruned; one save in the folder at a time."""
    with locked(final.parent / ".latest.lock"):
        put_in_place(tmp, final)
        write_text_atomic(final.parent / LATEST, final.name)
        if keep_last:
            prune(final.parent, run, keep_last, keep={final.name})


def _manifest(state: TrainState, paths: list[str], leaves: list[Any], world: int, stage: int | None, run: str,
              extra: dict, digests: list[int]) -> dict:
    splits = _splits(state)
    return {
        "format": cf.FORMAT, "zfunc": zfunc.__version__, "world": world, "stage": stage,
        "step": state.step, "run": run, "rng": state.rng, "extra": extra,
        "files": {cf.rank_file(r): d for r, d in enumerate(digests)},
        "leaves": [
            {"path": p, "dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape),
             "split_like": splits[p][0] if p in splits else None,
             "full_shape": list(splits[p][1].shape) if p in splits else None,
             "chunk": splits[p][1].chunk if p in splits else None}
            if isinstance(x, torch.Tensor) else {"path": p, "value": x}
            for p, x in zip(paths, leaves)
        ],
    }


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


# ----------------------------------------------------------------------------- load


class _Files:
    """The checkpoint's rank files, each read (and checksummed) once, on first use."""

    def __init__(self, directory: Path, manifest: dict, verify: bool):
        self.directory, self.manifest, self.verify = directory, manifest, verify
        self.read: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, rank: int) -> dict[str, torch.Tensor]:
        if rank not in self.read:
            name = cf.rank_file(rank)
            path = self.directory / name
            if not path.exists():
                raise CheckpointError(f"{path}: shard file missing (the checkpoint was written by "
                                      f"{self.manifest['world']} ranks)")
            self.read[rank] = cf.read_safetensors(path, self.manifest["files"][name] if self.verify else None)
        return self.read[rank]


def _read_rows(files: _Files, entry: dict, world: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a split leaf's whole tensor, from the ranks that saved them."""
    chunk, full = entry["chunk"], entry["full_shape"]
    rows = full[0] if full else 1
    parts = []
    for r in range(world):
        lo, hi = max(start, r * chunk), min(stop, (r + 1) * chunk, rows)
        if lo < hi:
            saved = files(r)[entry["path"]]
            parts.append(saved.reshape(-1, *full[1:])[lo - r * chunk : hi - r * chunk])
    if not parts:
        return torch.empty((0, *full[1:]), dtype=getattr(torch, entry["dtype"]))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _saved_buffers(manifest: dict, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like the checkpoint's module buffers (``state.buffers``: never split)."""
    return {e["path"][len(_BUFFERS):]: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]), device=device)
            for e in manifest["leaves"] if e["path"].startswith(_BUFFERS)}


def _device_of(template: TrainState, default: str | torch.device) -> str | torch.device:
    tensors = [x for x in tree.leaves(template.params) if isinstance(x, torch.Tensor)]
    return tensors[0].device if tensors else default


def _meta(x: Any) -> Any:
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x


def _template(manifest: dict, step_or_template: Any, params: Any, device: str | torch.device) -> tuple[TrainState, str]:
    """The state to fill and where its model came from."""
    if isinstance(step_or_template, TrainState):
        if params is not None:
            raise ValueError("params: give it with a Step; a TrainState template's own params say the model")
        saved = _saved_buffers(manifest, _device_of(step_or_template, device))
        if step_or_template.buffers and saved:
            return step_or_template, "the template state"
        # buffers join a state at the first step that writes them: where the template or the
        # checkpoint has none yet, the checkpoint's (or their absence) are what is loaded
        return step_or_template.replace(buffers=saved), "the template state"
    if not isinstance(step_or_template, Step):
        raise TypeError(f"step_or_template: expected a Step or a TrainState, got {type(step_or_template).__name__}")
    from zfunc.offload import OffloadedStep

    if isinstance(step_or_template, OffloadedStep):
        raise CheckpointError("step_or_template: loading straight into an offloaded step is not supported yet; load "
                              "into the step it wraps, then start the offloaded one from zf.checkpoint.full_params")
    if params is not None:
        model, source = params, "params="
    elif getattr(step_or_template, "initialized_with", None) is not None:
        model, source = step_or_template.initialized_with, "the params step.init last received"
    else:  # nothing says what the model is: the checkpoint's own params
        model = {e["path"][len("params/"):]: torch.empty(e["full_shape"], dtype=getattr(torch, e["dtype"]),
                                                         device="meta")
                 for e in manifest["leaves"] if e["path"].startswith("params/")}
        source = "the checkpoint"
    template = step_or_template.init(tree.map(_meta, model)).replace(buffers=_saved_buffers(manifest, "meta"))
    return tree.map(lambda x: torch.empty(x.shape, dtype=x.dtype, device=device) if isinstance(x, torch.Tensor) else x,
                    template), source


def _check_model(directory: Path, manifest: dict, template: TrainState, source: str) -> None:
    """Every param of the model is in the checkpoint with its whole shape and dtype, and no other."""
    def describe(shape, dtype) -> str:
        return f"{tuple(shape)} {dtype}"

    saved = {e["path"][len("params/"):]: describe(e["full_shape"], e["dtype"])
             for e in manifest["leaves"] if e["path"].startswith("params/") and "dtype" in e}
    model = {path[len("params/"):]: describe(leaf.shape, str(x.dtype).removeprefix("torch."))
             for path, (_, leaf), x in _param_splits(template)}
    missing, unexpected = sorted(model.keys() - saved.keys()), sorted(saved.keys() - model.keys())
    differ = [f"{n}: {saved[n]} in the checkpoint, {model[n]} in the model" for n in sorted(model.keys() & saved.keys())
              if saved[n] != model[n]]
    if missing or unexpected or differ:
        parts = [f"{len(missing)} params of the model not in the checkpoint {missing[:5]}" if missing else "",
                 f"{len(unexpected)} params in the checkpoint not in the model {unexpected[:5]}" if unexpected else "",
                 f"{len(differ)} differ: {'; '.join(differ[:5])}" if differ else ""]
        raise CheckpointError(f"{directory}: the checkpoint does not hold this model (from {source}): "
                              + "; ".join(p for p in parts if p))


def _param_splits(state: TrainState) -> list[tuple[str, tuple[str, LeafShard], torch.Tensor]]:
    paths, leaves, _ = _paths_and_leaves(state)
    splits = _splits(state)
    return [(p, splits[p], x) for p, x in zip(paths, leaves) if p.startswith("params/") and p in splits]


def load(directory: str | os.PathLike, step_or_template: Step | TrainState, *, params: Any = None,
         device: str | torch.device = "cpu", verify: bool = True) -> TrainState:
    """Read a checkpoint into the layout of ``step_or_template`` (any world size and stage).

    Args:
      directory: a checkpoint directory (``latest(root)`` finds the newest).
      step_or_template: the step that will train the state (sharded or plain: the state is split
        as its ``init`` splits) or a ``TrainState`` whose structure, dtypes and split to follow.
        ``state.buffers`` (module buffers, whole on every rank) come from rank 0's file, as the
        checkpoint holds them, also when the template has none yet (a state from ``init``).
      params: with a step, the model's params (what ``zf.functionalize`` returns, on any device,
        meta included); default: what the step's ``init`` last received, else the checkpoint's.
      device: where the tensors go when a step is given (a template's own devices are used).
      verify: check each file's crc32 as it is read.
    Raises ``CheckpointError`` naming what differs: params the model has and the checkpoint lacks
    or the reverse, whole shapes or dtypes, another optimizer structure, a missing or corrupt file.
    Nothing on disk is modified. Each file this rank needs is read once; where the layout is
    unchanged, the state's CPU tensors are views of the read buffer (no copies).
    """
    directory = checkpoint_path(directory)
    manifest = read_manifest(directory)
    template, source = _template(manifest, step_or_template, params, device)
    _check_model(directory, manifest, template, source)
    paths, leaves, treespec = _paths_and_leaves(template)
    saved = {e["path"]: e for e in manifest["leaves"]}
    if set(paths) != set(saved):
        missing, unexpected = sorted(set(paths) - set(saved)), sorted(set(saved) - set(paths))
        raise CheckpointError(f"{directory}: the state's structure differs from the checkpoint's: "
                              f"not in the checkpoint {missing[:5]}, only in the checkpoint {unexpected[:5]}")
    files = _Files(directory, manifest, verify)
    splits = _splits(template)
    world, rank = _layout(template)
    values = []
    for path, like in zip(paths, leaves):
        entry = saved[path]
        if not isinstance(like, torch.Tensor):
            values.append(entry.get("value"))
            continue
        if entry.get("dtype") != str(like.dtype).removeprefix("torch."):
            raise CheckpointError(f"{directory}: leaf {path} is {entry.get('dtype')} in the checkpoint, "
                                  f"{like.dtype} in the state")
        if entry["split_like"] is None:
            value = files(0)[path]
        else:
            if path not in splits or tuple(entry["full_shape"]) != splits[path][1].shape:
                raise CheckpointError(f"{directory}: leaf {path} has whole shape {tuple(entry['full_shape'])} in "
                                      f"the checkpoint, {splits[path][1].shape if path in splits else 'unsplit'} in the state")
            leaf = splits[path][1]
            start = min(rank * leaf.chunk, leaf.rows) if world > 1 else 0
            stop = start + (leaf.local_rows(rank) if world > 1 else leaf.rows)
            value = _read_rows(files, entry, manifest["world"], start, stop)
        if value.numel() != like.numel():
            raise CheckpointError(f"{directory}: leaf {path} has {value.numel()} elements in the checkpoint, "
                                  f"{like.numel()} in the state")
        values.append(value.reshape(like.shape).to(like.device))
    return tree.unflatten(treespec, values)


# ----------------------------------------------------------------------------- whole params


def full_params(state: TrainState, mesh=None) -> dict:
    """Every param whole (fp32 copies), on every rank, from any state: a collective when sharded,
    which every rank of the state must call (checked first, see ``zf.dist.all_arrive``)."""
    if not isinstance(state, TrainState):
        raise TypeError(f"state: expected a TrainState, got {type(state).__name__}")
    if state.sharding is None:
        return tree.clone(state.params)
    from zfunc.dist import Mesh
    from zfunc.offload import in_ram
    from zfunc.shard import full_params as gather

    if _layout(state)[0] == 1:  # every param whole on this rank (stage 0): a copy, no collective
        return gather(in_ram(state), mesh)
    if state.sharding.world > 1:
        all_arrive("zf.checkpoint.full_params", "state", mesh.comm.group if mesh is not None else None)
    return gather(in_ram(state), mesh or Mesh(dp=state.sharding.world))


def export(directory: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the checkpoint's params, whole, as one safetensors file (a model state dict).

    ``model.load_state_dict(safetensors.torch.load_file(out), strict=False)`` restores a model,
    with the buffers training updated (BatchNorm statistics: ``state.buffers``); tied aliases and
    constant buffers are not repeated. Hugging Face's ``from_pretrained`` reads it as a
    ``model.safetensors``. Works in one process, whatever world size wrote the checkpoint.
    """
    directory, out = checkpoint_path(directory), checkpoint_path(out, "out")
    manifest = read_manifest(directory)
    files = _Files(directory, manifest, verify=True)
    tensors = {}
    for entry in manifest["leaves"]:
        if entry["path"].startswith("params/"):
            rows = entry["full_shape"][0] if entry["full_shape"] else 1
            whole = _read_rows(files, entry, manifest["world"], 0, rows)
            tensors[entry["path"][len("params/"):]] = whole.reshape(entry["full_shape"]).contiguous()
        elif entry["path"].startswith(_BUFFERS):  # trained BatchNorm statistics: whole on every rank
            tensors[entry["path"][len(_BUFFERS):]] = files(0)[entry["path"]].contiguous()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    cf.write_safetensors(tmp, tensors)
    os.replace(tmp, out)
    return out
