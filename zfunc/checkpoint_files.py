"""The files of a checkpoint: each rank's tensors as safetensors, checksummed, and the manifest.
(Split from ``checkpoint.py``, which says what a saved state means, so that each stays readable.)

Each rank's tensors are one safetensors file, ``rank{r:05d}.safetensors``, streamed from the
tensors' memory and checksummed (crc32) on the way; ``manifest.json`` describes them. These two
kinds of file are all a checkpoint directory holds.
"""
from __future__ import annotations

import json
import os
import re
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from zfunc.ops import hostmem

FORMAT = 1
MANIFEST = "manifest.json"
LATEST = "latest"
RANK_FILE = re.compile(r"rank\d{5}\.safetensors")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match what it is loaded into; or a save would
    overwrite something that is not a zfunc checkpoint."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


# ----------------------------------------------------------------------------- manifest


def read_manifest(directory: str | os.PathLike) -> dict:
    """The checkpoint's manifest (a dict); raises ``CheckpointError`` naming the file if it is
    missing, not JSON, or of another format."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"directory: no checkpoint at {directory} ({MANIFEST} missing)")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: not a zfunc manifest, it does not parse as JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path}: format {got!r}, expected {FORMAT}")
    return manifest


def write_manifest(directory: Path, manifest: dict) -> None:
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------- safetensors


ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
_TORCH_DTYPES = {v: k for k, v in ST_DTYPES.items()}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write ``tensors`` (contiguous, CPU) as a safetensors file, fsynced; returns its crc32.

    Streams each tensor's memory straight to the file (no serialised copy) and checksums it on
    the way. Wider dtypes first, so every tensor's offset stays aligned for zero-copy reads.
    """
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for n in names:
        t = tensors[n]
        if t.dtype not in ST_DTYPES:
            raise CheckpointError(f"state: leaf {n} has dtype {t.dtype}, which safetensors cannot hold")
        size = t.numel() * t.element_size()
        header[n] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
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


def read_safetensors(path: Path, expected_crc: int | None) -> dict[str, torch.Tensor]:
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
