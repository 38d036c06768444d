"""Checkpoints: sharded, atomic save and load of any ``TrainState``, resharding, safetensors export.

Layout of ``save(state, "ckpt/000100")``::

    ckpt/000100/rank00000.safetensors ...   the tensors each rank owns (its pieces), written in parallel
    ckpt/000100/manifest.json               the plain state's tree paths, dtypes, whole shapes, each
                                            leaf's pieces (file, rows, crc32), the layout (world, ZeRO
                                            stage, pipeline stages), zfunc version, step, run, RNG, loss
                                            scale, the caller's ``extra`` (data position)
    ckpt/latest                             "000100", replaced last

What is guaranteed (the files: ``zfunc.checkpoint.files``; ownership, locks, replacing, pruning:
``zfunc.checkpoint.folder``):

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
- **Every rank or none.** A sharded or pipelined ``save`` and ``full_params`` (``zfunc.core.placement``)
  first check that every rank made the call (``zf.dist.all_arrive``, at most
  ``zfunc.dist.comm.ARRIVAL_TIMEOUT_S``); otherwise each rank that came raises ``CollectiveError``
  naming the call and the missing ranks instead of hanging in a collective.
- **In the background.** ``save(..., blocking=False)`` snapshots the state and returns a
  ``SaveHandle`` while a thread writes it; the guarantees above hold as for a blocking save
  (``zfunc.checkpoint.background``: the snapshot, the donation rule that protects it, the handle).
- **Loads check the model and the bytes.** ``load`` builds the state for the model it is given
  (``params=``, else the params ``step.init`` last received, else the manifest's) and raises
  ``CheckpointError`` listing params missing from the checkpoint, params only in the checkpoint
  and shape/dtype differences, then any other difference of structure or dtype; the crc32 of
  each file header and tensor is checked as it is read (``verify=True``). Loads never write the
  checkpoint.
- **No code in the files.** A checkpoint is JSON and safetensors: a load unpickles nothing, so
  loading one from someone else runs none of its code (DeepSpeed's and DCP's checkpoints hold
  pickles: ``zfunc.checkpoint.importers`` reads them through an allowlist).

**Resharding.** A checkpoint is the same logical thing whatever wrote it: the plain state's
leaves, whole params and optimizer state (``zfunc.checkpoint.layout``, asking each state's placement:
``zfunc.core.placement``). Every split zfunc makes is
the same: dim 0 in ``torch.chunk`` style over a stage's dp ranks (``shard.ShardSpec``), whatever the
ZeRO stage; a pipeline stage (``PipelineSpec``) holds only its own params and their optimizer
state; an offloaded state has one optimizer state per param leaf, saved as the plain one;
a stage-0 state, whole on every rank (``ShardSpec.split == (1, 0)``), is saved once, by rank 0. Each
leaf is written once, by the rank that owns it, as pieces of rows. So a checkpoint from any layout
(plain, N ranks at stage s, offloaded, a pipeline of p stages x d dp ranks) loads into any other,
by reading for each leaf just the saved pieces holding the rows the new rank owns. Optimizer
leaves shaped like a param's piece are split like that param; other leaves (counts) are copied.
A tensor-parallel state (``zf.tensor_parallel.step``, alone or under ``zf.shard``) cuts a param into
tp slices along one dim first (``zfunc.core.slicing.Slicing``, padded, in fused parts): its pieces
are rows of a slice, the manifest records the slicing beside the whole shape and each piece's
``slice`` (format 3), and a loader cut the same way reads just its pieces, any other (another tp
size, none) puts the whole leaf together (padding dropped) and cuts its own piece from it: every
piece of that leaf read, one leaf at a time.

Why not ``torch.distributed.checkpoint``: it needs DTensors or a planner to describe the uneven
chunks, and its files are not plain safetensors; the layout above is a few dozen lines, its files
open with ``safetensors`` (zfunc streams them itself, checksumming each tensor on the way, and
reads back only the tensors it needs), and it exports straight to a state dict.
"""
from __future__ import annotations

import functools
import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from zfunc.checkpoint import background as ca, files as cf, layout as cl, restore
from zfunc.core import placement, tree
from zfunc.checkpoint.background import SaveHandle
from zfunc.checkpoint.files import LATEST, CheckpointError
from zfunc.checkpoint.manifest import read_manifest
from zfunc.checkpoint.importers import foreign_format, load_foreign
from zfunc.checkpoint.folder import (checkpoint_path, claim, default_run, locked, prune, put_in_place, scratch,
                                     write_text_atomic)
from zfunc.checkpoint.layout import BUFFERS, PARAMS, Slot
from zfunc.core.state import TrainState
from zfunc.core.step import Step
from zfunc.dist.comm import all_arrive
from zfunc.offloading.swap.directory import fsync_dir
from zfunc.version import __version__


__all__ = ["save", "load", "export"]


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
         extra: dict | None = None, run: str | None = None, blocking: bool = True) -> Path | SaveHandle:
    """Write ``state`` to ``directory`` atomically; every rank of a sharded or pipelined state calls it.

    Args:
      state: any ``TrainState``: plain, sharded, offloaded or pipelined (it is only read).
      directory: the checkpoint's own directory, e.g. ``ckpt/000100``: new, empty, or a zfunc
        checkpoint to replace (anything else is refused); its parent gets ``latest``.
      keep_last: keep only the ``keep_last`` checkpoints of this run in the parent with the
        highest step (None keeps all); see the module docstring.
      extra: JSON-able data saved in the manifest (e.g. the data loader's position); read it back
        with ``read_manifest(directory)["extra"]``.
      run: the run this checkpoint belongs to, for ``keep_last``; default the directory's name
        without its trailing digits.
      blocking: False returns a ``SaveHandle`` at once and writes in the background while
        training goes on (``zfunc.checkpoint.background``: the snapshot, and what the caller must not
        do until the next step consumes the state); every rank passes the same value.
    Returns the directory (``blocking=False``: a handle whose ``wait()`` returns it). Waits first
    for this process's previous background save. Raises ``CheckpointError`` before writing
    anything when a path it would write is not zfunc's. Costs one write of the state bytes this
    rank owns (parallel ``O_DIRECT`` blocks, checksummed on another thread:
    ``zfunc.checkpoint.disk_io``) and an fsync; with several ranks also a store round trip checking
    every rank called it and two all-gathers of a few bytes per leaf (who writes what, the
    checksums). In the background: a copy of those bytes in host memory while the save runs
    (``zfunc.checkpoint.background.KEEP_BYTES`` keeps some for the next one), and a write paced to
    ``zfunc.checkpoint.background.SAVE_DUTY`` of the disk's time until someone waits for it.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"state: expected a TrainState, got {type(state).__name__}")
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking: expected a bool, got {type(blocking).__name__}")
    ca.wait_for_previous()
    final, run, extra = _check_save_args(directory, keep_last, extra, run)
    rule = placement.of(state.placement)
    world, rank = rule.processes(state.placement)
    state = rule.in_memory(state)  # e.g. an offloaded state's swap files, read back
    slots, leaves, _ = cl.slots(state)
    _check_leaves([s.path for s in slots], leaves)
    if world > 1:
        if dist.get_world_size() != world:
            raise ValueError(f"state: it is one of {world} ranks, the process group has {dist.get_world_size()}")
        all_arrive("zf.checkpoint.save" + ("" if blocking else "(blocking=False)"), "state")
    entries, writes = cl.assign(cl.all_gather(cl.descriptions(slots, leaves), world))
    group = ca.background_group(world) if world > 1 and not blocking else None
    manifest = _manifest(state, entries, run, extra)
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
        tensors: dict[str, torch.Tensor] = {}
        for slot, x in zip(slots, leaves):
            if slot.path in writes[rank] and slot.path not in tensors:  # an offloaded state's first copy
                tensors[slot.path] = x
        pace = None if blocking else ca.pace()
        finish = functools.partial(_write_and_publish, tmp, final, manifest, world, rank, group, keep_last, pace)
        if blocking:
            finish({p: x.detach().contiguous().cpu() for p, x in tensors.items()})
        else:
            snapshot = ca.Snapshot(tensors, eager=lambda path: path.startswith(BUFFERS))
            return ca.start(final, snapshot, finish, held.pop_all().close, pace)
    return final


def _write_and_publish(tmp: Path, final: Path, manifest: dict, world: int, rank: int, group: Any,
                       keep_last: int | None, pace: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Write this rank's file (at ``pace``: ``zfunc.checkpoint.disk_io.Pace`` or None); gather the checksums;
    rank 0 writes the manifest and puts the checkpoint in place; every rank learns the outcome
    (the last collective: a barrier)."""
    try:
        crcs = cf.write_safetensors(tmp / cf.rank_file(rank), tensors, pace)
    except Exception as e:
        if world == 1:
            raise
        crcs, mine = f"rank {rank} could not write its file ({type(e).__name__}: {e})", e
    else:
        mine = None
    everyone = cl.all_gather(crcs, world, group)
    failed = next((c for c in everyone if isinstance(c, str)), None)
    if failed is None and rank == 0:
        try:
            cl.add_checksums(manifest["leaves"], everyone)
            manifest["files"] = {cf.rank_file(r): c[cf.HEADER] for r, c in enumerate(everyone)}
            cf.write_manifest(tmp, manifest)
            fsync_dir(tmp)
            _publish(tmp, final, manifest["run"], keep_last)
        except Exception as e:
            if world == 1:
                raise
            failed, mine = f"rank 0 could not put it in place ({type(e).__name__}: {e})", e
    if world > 1:
        shared = [failed]
        dist.broadcast_object_list(shared, src=0, group=group)  # rank 0's verdict; also the barrier
        failed = shared[0]
    if failed:
        raise CheckpointError(f"zf.checkpoint.save of {final}: {failed}") from mine


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


def _manifest(state: TrainState, entries: list[dict], run: str, extra: dict) -> dict:
    """The manifest but for its checksums (``files`` and the pieces' ``crc``: after the write)."""
    layout = placement.of(state.placement).describe(state.placement)  # world, pipeline stages, ZeRO stage
    fmt = cf.FORMAT_SLICED if any("slicing" in e for e in entries) else cf.FORMAT
    return {"format": fmt, "zfunc": __version__, **layout, "step": state.step,
            "run": run, "rng": state.rng, "extra": extra, "files": {}, "leaves": entries}


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


# ----------------------------------------------------------------------------- load


def _reader(files: cf.RankFiles, entry: dict, slot: Slot, like: Any) -> Callable[[], Any]:
    """A function reading the leaf (a CPU tensor shaped like ``like``, or the saved value)."""
    def read() -> Any:
        if not isinstance(like, torch.Tensor):
            return entry.get("value")
        if entry["split_like"] is None:
            return cl.read_whole(files, entry, files.manifest).reshape(like.shape)
        return cl.read_slot(files, entry, slot).reshape(like.shape)

    return read


def load(directory: str | os.PathLike, step_or_template: Step | TrainState, *, params: Any = None,
         device: str | torch.device = "cpu", verify: bool = True) -> TrainState:
    """Read a checkpoint into the layout of ``step_or_template`` (any world size, stage, pipeline).

    Args:
      directory: a checkpoint directory (``latest(root)`` finds the newest).
      step_or_template: the step that will train the state (plain, sharded, pipelined or
        offloaded: the state is laid out as its ``init`` lays it out; an offloaded step's lands
        where it keeps it, in RAM or written leaf by leaf into its swap files) or a ``TrainState``
        whose structure, dtypes and split to follow. ``state.buffers`` (module buffers, whole)
        are loaded as the checkpoint holds them, also when the template has none yet (a state
        from ``init``); a pipeline stage gets those of its own units.
      params: with a step, the model's params (what ``zf.functionalize`` returns, on any device,
        meta included); default: what the step's ``init`` last received, else the checkpoint's.
      device: where the tensors go when a step is given (an offloaded step computes there; a
        template's own devices are used).
      verify: check the crc32 of each file header and tensor read.
    Raises ``CheckpointError`` naming what differs: params the model has and the checkpoint lacks
    or the reverse, whole shapes or dtypes, another optimizer structure, a missing or corrupt file.
    The checkpoint is never modified. Reads only the saved pieces holding rows this rank needs,
    one at a time, the next two read ahead (``RankFiles.plan``); where the layout is unchanged,
    the state's CPU tensors are the buffers they were read into (no copies), 4 KiB pages that
    khugepaged merges into huge pages later (``zfunc.checkpoint.landing``). Builds the step's state
    on the meta device first (``restore.shapes_only``: no torch Python meta kernel, nothing imported). Into an offloaded
    step, at most one leaf (param piece and its optimizer state) is in RAM at once, besides the
    step's writes in flight (nothing is read ahead there).
    """
    directory = checkpoint_path(directory)
    if foreign_format(directory):  # a DeepSpeed or torch DCP checkpoint: zfunc.checkpoint.importers
        return load_foreign(directory, step_or_template, params=params, device=device)
    manifest = read_manifest(directory)
    template, source, model = restore.template(manifest, step_or_template, params)
    slots, leaves, treespec = cl.slots(template)
    restore.check_model(directory, manifest, template, slots, leaves, source)
    saved = {e["path"]: e for e in manifest["leaves"]}
    cl.check_structure(directory, saved, slots, template)
    for slot, like in zip(slots, leaves):
        cl.check_leaf(directory, saved[slot.path], slot, like)
    with cf.RankFiles(directory, manifest, verify) as files:
        lazy = tree.unflatten(treespec, [_reader(files, saved[s.path], s, x) for s, x in zip(slots, leaves)])
        restored = restore.restored(step_or_template, template, lazy, model, device)
        if restored is not None:
            return restored
        files.plan([r for s, x in zip(slots, leaves) if isinstance(x, torch.Tensor)  # read ahead, in this order
                    for r in cl.planned_reads(saved[s.path], manifest, s)])
        return tree.map(lambda read, like: restore.to_device(read(), like, device), lazy, template)


# ----------------------------------------------------------------------------- whole params


def export(directory: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the checkpoint's params, whole, as one safetensors file (a model state dict).

    ``model.load_state_dict(safetensors.torch.load_file(out), strict=False)`` restores a model,
    with the buffers training updated (BatchNorm statistics: ``state.buffers``); tied aliases and
    constant buffers are not repeated. Hugging Face's ``from_pretrained`` reads it as a
    ``model.safetensors``. Works in one process, whatever layout wrote the checkpoint.
    """
    directory, out = checkpoint_path(directory), checkpoint_path(out, "out")
    manifest = read_manifest(directory)
    tensors = {}
    with cf.RankFiles(directory, manifest, verify=True) as files:
        for entry in manifest["leaves"]:
            for prefix in (PARAMS, BUFFERS):  # buffers: trained BatchNorm statistics
                if entry["path"].startswith(prefix) and "dtype" in entry:
                    tensors[entry["path"][len(prefix):]] = cl.read_whole(files, entry, manifest).contiguous()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    cf.write_safetensors(tmp, tensors)
    os.replace(tmp, out)
    return out


