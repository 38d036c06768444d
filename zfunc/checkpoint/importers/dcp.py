"""Read a ``torch.distributed.checkpoint`` (DCP) directory, e.g. from an FSDP2 model, chunk by chunk.

What ``dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)`` writes, with
``model_sd, optim_sd = get_state_dict(model, optimizer)``: ``path/.metadata`` (every flattened key's
whole size and its saved chunks: offsets and sizes, from each rank's DTensor shard) and
``__R_0.distcp`` files holding the chunks. Keys are flattened with dots: ``model.<fqn>``,
``optim.state.<fqn>.exp_avg`` / ``.exp_avg_sq`` / ``.step``, ``optim.param_groups.<fqn>.lr``.

Reading rows ``[a, b)`` of a tensor builds DCP ``ReadItem``s for the saved chunks overlapping them
(any chunking: FSDP2's dim-0 shards, other tools' chunks along other dims) and hands them to DCP's
own ``FileSystemReader.read_data``, which reads those chunks' bytes and no others and copies the
overlap into the output through a minimal ``LoadPlanner`` (``resolve_tensor``).

**From someone else.** ``.metadata`` is a pickle: it is read by ``read_metadata`` through
``safe_unpickle.dcp_metadata()`` (DCP's metadata classes, dtypes, sizes), never by
``FileSystemReader.read_metadata``'s bare ``pickle.load``; any other global is a
``CheckpointError`` naming it, raised before anything can call it. The metadata is then checked
before use: every data file it names is a plain name in the checkpoint's own directory (not
``../x`` or ``/etc/x``), offsets and lengths are counts, every tensor's dtype, size and chunks
are what they say. Each chunk is a ``torch.save`` blob that ``read_data`` reads with
``torch.load(weights_only=True)``: torch's own allowlist of tensor globals, which
``torch.serialization.add_safe_globals`` calls elsewhere in the process would widen. A refused
chunk is a ``CheckpointError`` naming the tensor. So a checkpoint from someone else can give
wrong values but cannot run code or read files outside its directory.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from zfunc.checkpoint.files import CheckpointError
from zfunc.checkpoint.importers import safe_unpickle

MOMENTS = ("exp_avg", "exp_avg_sq")


def _said(e: Exception) -> str:
    """An error of ``read_data`` in a line: the global torch's ``weights_only`` unpickler refused,
    if that is what it was (its own message goes on to advise ``weights_only=False``)."""
    refused = re.search(r"GLOBAL ([\w.]+)", str(e))
    if refused:
        return f"refuses to load global {refused.group(1)!r}: a DCP chunk may hold only a tensor"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class _Into:
    """The ``LoadPlanner`` side ``read_data`` calls: each read item lands in a view of ``out``."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def resolve_tensor(self, req) -> torch.Tensor:
        view = self.out
        for dim, (offset, length) in enumerate(zip(req.dest_offsets, req.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, req, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, req, value) -> None:
        raise CheckpointError(f"{req.storage_index.fqn}: bytes where a tensor was expected")


def read_metadata(path: Path) -> Any:
    """The ``Metadata`` in ``path/.metadata``, read by ``safe_unpickle`` and checked (``check_metadata``)."""
    file = path / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = safe_unpickle.load(f, safe_unpickle.dcp_metadata())
    except safe_unpickle.Refused as e:
        raise CheckpointError(f"{file}: {e}") from None
    except Exception as e:  # noqa: BLE001  (a corrupt or foreign .metadata: any unpickling error)
        raise CheckpointError(f"{file}: not readable as DCP metadata ({type(e).__name__}: {e})") from None
    check_metadata(file, metadata)
    return metadata


def _counts(x: Any, n: int | None = None) -> bool:
    return isinstance(x, tuple) and all(type(v) is int and v >= 0 for v in x) and n in (None, len(x))


def check_metadata(file: Path, metadata: Any) -> None:
    """What ``DCPSource`` and ``read_data`` use of ``metadata`` is what it claims, and every data
    file it names lies in ``file``'s directory; else a ``CheckpointError`` naming the entry."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file}: not DCP metadata zfunc reads: {what}")

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise bad(f"a {type(metadata).__name__}, expected a Metadata holding a state_dict_metadata dict")
    if not isinstance(metadata.storage_data, dict):
        raise bad(f"storage_data is a {type(metadata.storage_data).__name__}, expected a dict")
    for key, m in metadata.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            continue
        if not (isinstance(key, str) and isinstance(m, TensorStorageMetadata) and _counts(m.size)
                and isinstance(m.properties, TensorProperties) and isinstance(m.properties.dtype, torch.dtype)
                and isinstance(m.chunks, list)
                and all(isinstance(c, ChunkStorageMetadata) and _counts(c.offsets, len(m.size))
                        and _counts(c.sizes, len(m.size)) for c in m.chunks)):
            raise bad(f"entry {key!r} is not a tensor's metadata (dtype, size, chunks of offsets and sizes)")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"storage_data maps a {type(index).__name__} to a {type(info).__name__}")
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or re.search(r"[/\\\0]", name):
            raise bad(f"the data of {index.fqn!r} is in {name!r}, not a file of the checkpoint's directory")
        if not _counts((info.offset, info.length)):
            raise bad(f"the data of {index.fqn!r} is at offset {info.offset!r}, length {info.length!r}")


class DCPSource:
    """A DCP checkpoint as a ``common.Source``."""

    def __init__(self, path: Path, model_key: str | None, optimizer_key: str | None) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.where = str(path)
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"{path}: not a torch.distributed.checkpoint directory (no .metadata file)")
        metadata = read_metadata(path)
        self.reader = FileSystemReader(str(path))
        self.reader.set_up_storage_reader(metadata, True)
        self.tensors = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        model_prefix = f"{model_key}." if model_key else ""
        optim_prefix = f"{optimizer_key}." if optimizer_key else None
        model = {k[len(model_prefix):]: k for k in self.tensors
                 if k.startswith(model_prefix) and not (optim_prefix and k.startswith(optim_prefix))}
        if not model:
            tops = sorted({k.split(".")[0] for k in metadata.state_dict_metadata})
            raise CheckpointError(f"{path}: no tensors under model_key={model_key!r} (the checkpoint's top-level keys: "
                                  f"{tops[:10]}); pass the key the model's state dict was saved under")
        state = f"{optim_prefix}state." if optim_prefix else None
        self.moments = {} if state is None else {
            name: {m: f"{state}{name}.{m}" for m in MOMENTS} for name in model
            if all(f"{state}{name}.{m}" in self.tensors for m in MOMENTS)}
        names = list(self.moments) or list(model)
        self.keys = {n: model[n] for n in names}
        self.params = {n: (tuple(self.tensors[k].size), self.tensors[k].properties.dtype) for n, k in self.keys.items()}
        self.buffer_keys = {n: k for n, k in model.items() if n not in self.keys}
        self.buffers = {n: (tuple(self.tensors[k].size), self.tensors[k].properties.dtype)
                        for n, k in self.buffer_keys.items()}
        self.optimizer_step = self._step(state, names) if self.moments else None
        self.step = self.optimizer_step or 0

    def _step(self, state: str, names: list[str]) -> int:
        key = f"{state}{names[0]}.step"
        if key not in self.tensors:
            raise CheckpointError(f"{self.where}: Adam moments without a step count ({key} missing)")
        return int(round(float(self._read(key, 0, 1).reshape(()))))

    def _read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the saved tensor ``key`` (a 0-d one: its value, shaped (1,))."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

        meta = self.tensors[key]
        size = list(meta.size) or [1]
        want_lo, want_hi = [start] + [0] * (len(size) - 1), [stop] + size[1:]
        out = torch.empty([stop - start] + size[1:], dtype=meta.properties.dtype)
        items, covered = [], 0
        for chunk in meta.chunks:
            c_lo = list(chunk.offsets) or [0]
            c_hi = [o + s for o, s in zip(c_lo, list(chunk.sizes) or [1])]
            lo = [max(a, b) for a, b in zip(want_lo, c_lo)]
            hi = [min(a, b) for a, b in zip(want_hi, c_hi)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            n = len(meta.size)
            items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size([l - w for l, w in zip(lo, want_lo)][:n]),
                                  storage_index=MetadataIndex(key, torch.Size(chunk.offsets)),
                                  storage_offsets=torch.Size([l - c for l, c in zip(lo, c_lo)][:n]),
                                  lengths=torch.Size([h - l for l, h in zip(lo, hi)][:n])))
            covered += math.prod(h - l for l, h in zip(lo, hi))
        if covered != out.numel():
            raise CheckpointError(f"{self.where}: {key} rows [{start}, {stop}): the saved chunks cover {covered} of "
                                  f"{out.numel()} elements")
        try:
            self.reader.read_data(LoadPlan(items), _Into(out if meta.size else out.reshape(()))).wait()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001  (a missing file, a short read, a chunk torch refuses to unpickle)
            raise CheckpointError(f"{self.where}: {key}: its saved chunks are not readable ({_said(e)})") from None
        return out

    def read(self, name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        key = self.keys[name] if kind == "param" else self.moments[name][kind]
        return self._read(key, start, stop).float()

    def read_buffer(self, name: str) -> torch.Tensor:
        size = self.buffers[name][0]
        return self._read(self.buffer_keys[name], 0, size[0] if size else 1).reshape(size)
