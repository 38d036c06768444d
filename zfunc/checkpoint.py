"""Checkpoints: sharded, atomic save and load of any ``TrainState``, resharding, safetensors export.

Layout of ``save(state, "ckpt/000100")``::

    ckpt/000100/rank00000.safetensors ...   each rank's tensors (its pieces), written in parallel
    ckpt/000100/manifest.json               tree paths, shapes, dtypes, how each leaf is split, world
                                            size, stage, zfunc version, step, RNG, loss scale, the
                                            caller's ``extra`` (data position), a crc32 per file
    ckpt/latest                             "000100", replaced last

**Atomic.** Every rank writes into ``ckpt/.000100.tmp``; after a barrier rank 0 writes the
manifest, fsyncs, renames the directory into place and only then replaces ``latest`` (write to a
temporary file, fsync, rename). A crash at any point leaves the previous checkpoint and ``latest``
as they were. ``keep_last=k`` then removes all but the newest k checkpoints beside it.

**Resharding.** Every split zfunc makes is the same: dim 0 in ``torch.chunk`` style over the
ranks (``shard.ShardSpec``; a plain state is one rank holding everything), whatever the ZeRO stage.
So a checkpoint from N ranks at stage s loads into M ranks at stage t, or one process, by reading
for each leaf just the saved rows the new rank owns (safetensors slices, memory-mapped). Optimizer
leaves shaped like a param's piece are split like that param; other leaves (counts) are copied.

Why not ``torch.distributed.checkpoint``: it needs DTensors or a planner to describe the uneven
chunks, and its files are not plain safetensors; the layout above is a few dozen lines, its files
open with ``safetensors`` (zfunc streams them itself, checksumming on the way, and reads each
once), and it exports straight to a state dict.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist

import zfunc
from zfunc import tree
from zfunc.ops import hostmem
from zfunc.shard import LeafShard, ShardSpec
from zfunc.step import Step, TrainState
from zfunc.swap import fsync_dir

FORMAT = 1
MANIFEST = "manifest.json"
_BUFFERS = "buffers/"  # leaf paths of TrainState.buffers, the module buffers training updates


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match what it is loaded into."""


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


def _jsonable(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise CheckpointError(f"state: leaf {x!r} of type {type(x).__name__} cannot be saved (expected tensors, "
                          "numbers, strings or None)")


# ----------------------------------------------------------------------------- files


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write ``tensors`` (contiguous, CPU) as a safetensors file, fsynced; returns its crc32.

    Streams each tensor's memory straight to the file (no serialised copy) and checksums it on
    the way. Wider dtypes first, so every tensor's offset stays aligned for zero-copy reads.
    """
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for n in names:
        t = tensors[n]
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"state: leaf {n} has dtype {t.dtype}, which safetensors cannot hold")
        size = t.numel() * t.element_size()
        header[n] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    prefix = struct.pack("<Q", len(blob)) + blob
    checksum = _Crc32()
    with open(path, "wb") as f:
        for data in [memoryview(prefix)] + [_bytes_of(tensors[n]) for n in names]:
            for block in _blocks(data):
                f.write(block)
                checksum.update(block)  # on a helper thread, overlapping the next write
        f.flush()
        os.fsync(f.fileno())
    return checksum.value()


_BLOCK = 64 << 20


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _blocks(data: memoryview):
    for i in range(0, len(data), _BLOCK):
        yield data[i : i + _BLOCK]


class _Crc32:
    """A running crc32 computed on one helper thread (zlib releases the GIL), in update order."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1)
        self._crc = 0
        self._last = None

    def _step(self, block: memoryview) -> None:
        self._crc = zlib.crc32(block, self._crc)

    def update(self, block: memoryview) -> None:
        self._last = self._pool.submit(self._step, block)

    def value(self) -> int:
        self._pool.shutdown(wait=True)
        if self._last is not None:
            self._last.result()
        return self._crc


def _read_safetensors(path: Path, expected_crc: int | None) -> dict[str, torch.Tensor]:
    """Read a safetensors file in one pass; tensors are views into one buffer (no copies).

    With ``expected_crc`` the file's crc32 must match, else ``CheckpointError`` names the file.
    """
    size = path.stat().st_size
    # uninitialised: the file overwrites every byte. Loaded state is views into it, so it goes on
    # huge pages, as init places state (zfunc.ops.hostmem).
    raw = hostmem.empty(size, torch.uint8)
    checksum = _Crc32()
    with open(path, "rb", buffering=0) as f:
        for block in _blocks(_bytes_of(raw)):
            got = 0
            while got < len(block):
                n = f.readinto(block[got:])
                if not n:
                    raise CheckpointError(f"{path}: file ended after {got} of {len(block)} bytes of a block")
                got += n
            checksum.update(block)  # checksums block k while block k+1 is read
    if expected_crc is not None and checksum.value() != expected_crc:
        raise CheckpointError(f"{path}: checksum mismatch, the file is corrupt")
    try:
        (n_header,) = struct.unpack("<Q", bytes(raw[:8].numpy()))
        header = json.loads(bytes(raw[8 : 8 + n_header].numpy()))
    except (struct.error, ValueError) as e:
        raise CheckpointError(f"{path}: not a safetensors file ({e})") from e
    base = 8 + n_header
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, stop = meta["data_offsets"]
        dtype = _TORCH_DTYPES[meta["dtype"]]
        out[name] = raw[base + start : base + stop].view(dtype).reshape(meta["shape"])
    return out


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


# ----------------------------------------------------------------------------- save


def save(state: TrainState, directory: str | os.PathLike, *, keep_last: int | None = None,
         extra: dict | None = None) -> Path:
    """Write ``state`` to ``directory`` atomically; every rank of a sharded state calls it.

    Args:
      state: any ``TrainState``, plain or sharded (it is only read).
      directory: the checkpoint's own directory, e.g. ``ckpt/000100``; its parent gets ``latest``.
      keep_last: keep only the newest ``keep_last`` checkpoints in the parent (None keeps all).
      extra: JSON-able data saved in the manifest (e.g. the data loader's position); read it back
        with ``read_manifest(directory)["extra"]``.
    Returns the directory. Costs one streaming write of this rank's state bytes (checksummed on the
    way) and an fsync.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"state: expected a TrainState, got {type(state).__name__}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last: expected an int >= 1 or None, got {keep_last!r}")
    final = Path(directory)
    from zfunc.offload import in_ram

    state = in_ram(state)  # an offloaded state's swap files, read back
    world, rank, stage = _world_rank(state)
    tmp = final.with_name(f".{final.name}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(world)
    paths, leaves, _ = _paths_and_leaves(state)
    tensors = {p: x.detach().contiguous().cpu() for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)}
    crc = _write_safetensors(tmp / _rank_file(rank), tensors)
    digests = [crc]
    if world > 1:
        digests = [None] * world
        dist.all_gather_object(digests, crc)
    if rank == 0:
        splits = _splits(state)
        manifest = {
            "format": FORMAT, "zfunc": zfunc.__version__, "world": world, "stage": stage,
            "step": state.step, "rng": state.rng, "extra": extra or {},
            "files": {_rank_file(r): d for r, d in enumerate(digests)},
            "leaves": [
                {"path": p, "dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape),
                 "split_like": splits[p][0] if p in splits else None,
                 "full_shape": list(splits[p][1].shape) if p in splits else None,
                 "chunk": splits[p][1].chunk if p in splits else None}
                if isinstance(x, torch.Tensor) else {"path": p, "value": _jsonable(x)}
                for p, x in zip(paths, leaves)
            ],
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(final.parent)
        _write_text_atomic(final.parent / "latest", final.name)
        if keep_last:
            _prune(final.parent, keep_last)
    _barrier(world)
    return final


def _prune(root: Path, keep: int) -> None:
    checkpoints = sorted(p for p in root.iterdir() if p.is_dir() and (p / MANIFEST).exists())
    for old in checkpoints[:-keep]:
        shutil.rmtree(old)


def latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint ``root/latest`` names, or None when there is none yet."""
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / MANIFEST).exists() else None


def read_manifest(directory: str | os.PathLike) -> dict:
    """The checkpoint's manifest (a dict); raises ``CheckpointError`` if there is none."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise CheckpointError(f"directory: no checkpoint at {directory} ({MANIFEST} missing)")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT}")
    return manifest


# ----------------------------------------------------------------------------- load


class _Files:
    """The checkpoint's rank files, each read (and checksummed) once, on first use."""

    def __init__(self, directory: Path, manifest: dict, verify: bool):
        self.directory, self.manifest, self.verify = directory, manifest, verify
        self.read: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, rank: int) -> dict[str, torch.Tensor]:
        if rank not in self.read:
            name = _rank_file(rank)
            path = self.directory / name
            if not path.exists():
                raise CheckpointError(f"{path}: shard file missing (the checkpoint was written by "
                                      f"{self.manifest['world']} ranks)")
            self.read[rank] = _read_safetensors(path, self.manifest["files"][name] if self.verify else None)
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


def _template(manifest: dict, step_or_template: Any, device: str | torch.device) -> TrainState:
    if isinstance(step_or_template, TrainState):
        saved = _saved_buffers(manifest, _device_of(step_or_template, device))
        if step_or_template.buffers and saved:
            return step_or_template
        # buffers join a state at the first step that writes them: where the template or the
        # checkpoint has none yet, the checkpoint's (or their absence) are what is loaded
        return step_or_template.replace(buffers=saved)
    if not isinstance(step_or_template, Step):
        raise TypeError(f"step_or_template: expected a Step or a TrainState, got {type(step_or_template).__name__}")
    from zfunc.offload import OffloadedStep

    if isinstance(step_or_template, OffloadedStep):
        raise CheckpointError("step_or_template: loading straight into an offloaded step is not supported yet; load "
                              "into the step it wraps, then start the offloaded one from zf.checkpoint.full_params")
    params = {e["path"][len("params/"):]: torch.empty(e["full_shape"], dtype=getattr(torch, e["dtype"]), device="meta")
              for e in manifest["leaves"] if e["path"].startswith("params/")}
    template = step_or_template.init(params).replace(buffers=_saved_buffers(manifest, "meta"))
    return tree.map(lambda x: torch.empty(x.shape, dtype=x.dtype, device=device) if isinstance(x, torch.Tensor) else x,
                    template)


def load(directory: str | os.PathLike, step_or_template: Step | TrainState, *, device: str | torch.device = "cpu",
         verify: bool = True) -> TrainState:
    """Read a checkpoint into the layout of ``step_or_template`` (any world size and stage).

    Args:
      directory: a checkpoint directory (``latest(root)`` finds the newest).
      step_or_template: the step that will train the state (sharded or plain: the state is split
        as its ``init`` splits) or a ``TrainState`` whose structure, dtypes and split to follow.
        ``state.buffers`` (module buffers, whole on every rank) come from rank 0's file, as the
        checkpoint holds them, also when the template has none yet (a state from ``init``).
      device: where the tensors go when a step is given (a template's own devices are used).
      verify: check each file's crc32 as it is read.
    Raises ``CheckpointError`` naming what differs: a missing or corrupt file, another structure,
    shape or dtype. Nothing on disk is modified. Each file this rank needs is read once; where the
    layout is unchanged, the state's CPU tensors are views of the read buffer (no copies).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    template = _template(manifest, step_or_template, device)
    paths, leaves, treespec = _paths_and_leaves(template)
    saved = {e["path"]: e for e in manifest["leaves"]}
    if set(paths) != set(saved):
        missing, unexpected = sorted(set(paths) - set(saved)), sorted(set(saved) - set(paths))
        raise CheckpointError(f"{directory}: the state's structure differs from the checkpoint's: "
                              f"not in the checkpoint {missing[:5]}, only in the checkpoint {unexpected[:5]}")
    files = _Files(directory, manifest, verify)
    splits = _splits(template)
    world, rank, _ = _world_rank(template)
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
    """Every param whole (fp32 copies), on every rank, from any state: a collective when sharded."""
    if not isinstance(state, TrainState):
        raise TypeError(f"state: expected a TrainState, got {type(state).__name__}")
    if state.sharding is None:
        return tree.clone(state.params)
    from zfunc.dist import Mesh
    from zfunc.offload import in_ram
    from zfunc.shard import full_params as gather

    return gather(in_ram(state), mesh or Mesh(dp=state.sharding.world))


def export(directory: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the checkpoint's params, whole, as one safetensors file (a model state dict).

    ``model.load_state_dict(safetensors.torch.load_file(out), strict=False)`` restores a model,
    with the buffers training updated (BatchNorm statistics: ``state.buffers``); tied aliases and
    constant buffers are not repeated. Hugging Face's ``from_pretrained`` reads it as a
    ``model.safetensors``. Works in one process, whatever world size wrote the checkpoint.
    """
    directory, out = Path(directory), Path(out)
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
    _write_safetensors(tmp, tensors)
    os.replace(tmp, out)
    return out
