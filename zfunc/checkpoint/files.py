"""The files of a checkpoint: each rank's tensors as safetensors, checksummed, and the manifest
(``zfunc.checkpoint.save_load`` says what a saved state means).

Each rank's tensors are one safetensors file, ``rank{r:05d}.safetensors``, streamed from the
tensors' memory and checksummed (crc32) on the way; ``manifest.json`` describes them (read, and
every field checked, by ``zfunc.checkpoint.manifest``). These two kinds of file are all a
checkpoint directory holds; a loader opens only regular files within it (``inside``) and checks
each safetensors header entry before it allocates the tensor's buffer.

Format 2 checksums each file's header and each tensor on its own (the manifest holds the crc32s),
so a loader reads, and checks, only the tensors it needs, one at a time (``RankFiles``). Format 1
(one crc32 per file) is still read: its files are checked whole when first opened. Format 3 is
format 2 with tensor-parallel slices: a leaf's ``slicing`` and each piece's ``slice``
(``zfunc.checkpoint.layout``), which a format-2 reader would misread as rows of the whole leaf.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from zfunc.checkpoint import landing
from zfunc.checkpoint.disk_io import Pace, Reader, flat_bytes, write_file
from zfunc.offloading.swap.file_format import ALIGN, crc32

FORMAT = 2
FORMAT_SLICED = 3  # a checkpoint with tensor-parallel slices (format 2 and a leaf's ``slicing``)
FORMATS = (1, 2, 3)  # what zfunc.checkpoint.manifest.read_manifest accepts
HEADER = "__header__"  # write_safetensors' key for the crc32 of the file's header
MANIFEST = "manifest.json"
LATEST = "latest"
RANK_FILE = re.compile(r"rank\d{5}\.safetensors")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match what it is loaded into; or a save would
    overwrite something that is not a zfunc checkpoint."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


# ----------------------------------------------------------------------------- manifest


def inside(directory: Path, path: Path) -> None:
    """Refuse ``path`` (a file of ``directory``) unless it is a regular file within ``directory``
    once links are followed: a checkpoint must not make zfunc read another file (or block on a pipe)."""
    real, home = os.path.realpath(path), os.path.realpath(directory)
    if os.path.commonpath([real, home]) != home:
        raise CheckpointError(f"{path}: a link to {real}, outside the checkpoint's directory {home}; refused")
    if not os.path.isfile(real):
        raise CheckpointError(f"{path}: not a regular file")


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


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], pace: Pace | None = None) -> dict[str, int]:
    """Write ``tensors`` (contiguous, CPU) as a safetensors file, fsynced; returns the crc32 of
    each tensor's bytes by name, and of the header (length and JSON) under ``HEADER``.

    Moves each tensor's memory straight to the file (no serialised copy) in parallel ``O_DIRECT``
    blocks, checksummed on another thread (``zfunc.checkpoint.disk_io``). The header is padded with
    spaces so the data starts at byte 4096; wider dtypes first, so every tensor's offset stays
    aligned for zero-copy reads, and within a width the tensors whose size is a multiple of 4096
    first, so those start 4096-aligned and move without a staging copy. ``pace``: how fast
    (``zfunc.checkpoint.disk_io.Pace``; default full speed).
    """
    for n, t in tensors.items():
        if t.dtype not in ST_DTYPES:
            raise CheckpointError(f"state: leaf {n} has dtype {t.dtype}, which safetensors cannot hold")
    nbytes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), nbytes[n] % ALIGN != 0, n))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for n in names:
        t = tensors[n]
        header[n] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes[n]]}
        offset += nbytes[n]
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % ALIGN)
    prefix = torch.frombuffer(bytearray(struct.pack("<Q", len(blob)) + blob), dtype=torch.uint8)
    crcs = write_file(path, [prefix] + [flat_bytes(tensors[n]) for n in names], pace=pace)
    return dict(zip([HEADER, *names], crcs))


_BLOCK = 64 << 20
# Bytes of planned tensors read ahead (``RankFiles.plan``), besides the one being read. Two tensors
# in flight keep the disk's queue full across tensor ends, where one at a time drained it.
AHEAD_BYTES = 256 << 20
AHEAD_TENSORS = 2


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _blocks(data: memoryview):
    for i in range(0, len(data), _BLOCK):
        yield data[i : i + _BLOCK]


class _Crc32:
    """Running crc32s computed on one helper thread (zlib releases the GIL), in update order;
    ``cut()`` ends a span and starts the next one at 0."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1)
        self._crc = 0
        self._spans: list[int] = []
        self._last = None

    def _step(self, block: memoryview) -> None:
        self._crc = crc32(block, self._crc)

    def _cut(self) -> None:
        self._spans.append(self._crc)
        self._crc = 0

    def update(self, block: memoryview) -> None:
        self._last = self._pool.submit(self._step, block)

    def cut(self) -> None:
        self._last = self._pool.submit(self._cut)

    def spans(self) -> list[int]:
        """The crc32 of every span cut so far (waits for them)."""
        if self._last is not None:
            self._last.result()
        return self._spans

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _read_into(f, offset: int, out: memoryview, path: Path, checksum: _Crc32 | None = None) -> None:
    """Fill ``out`` with the file's bytes from ``offset``, block by block (each checksummed)."""
    f.seek(offset)
    for block in _blocks(out):
        got = 0
        while got < len(block):
            n = f.readinto(block[got:])
            if not n:
                raise CheckpointError(f"{path}: file ended after {got} of {len(block)} bytes of a block")
            got += n
        if checksum is not None:
            checksum.update(block)  # checksums block k while block k+1 is read


def _tensor_meta(path: Path, name: str, meta: Any, data_bytes: int) -> tuple[torch.dtype, list[int], int, int]:
    """``(dtype, shape, start, stop)`` of tensor ``name`` from its safetensors header entry, checked
    before a buffer is allocated for it: a known dtype, a shape of ints >= 0 whose bytes are
    ``stop - start``, offsets within the file's ``data_bytes``."""
    def refuse(expected: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {name}'s header entry {str(meta)[:200]!r}: expected {expected}")

    if not isinstance(meta, dict) or meta.get("dtype") not in _TORCH_DTYPES:
        raise refuse(f"an object with a dtype in {sorted(_TORCH_DTYPES)}")
    shape, offsets = meta.get("shape"), meta.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise refuse("a shape: a list of ints >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise refuse(f"data_offsets [start, stop] with 0 <= start <= stop <= {data_bytes} (the file's data bytes)")
    dtype = _TORCH_DTYPES[meta["dtype"]]
    if math.prod(shape) * dtype.itemsize != offsets[1] - offsets[0]:
        raise refuse("as many bytes between its data_offsets as its shape and dtype take")
    return dtype, shape, offsets[0], offsets[1]


class RankFiles:
    """The rank files of one checkpoint, read tensor by tensor: each file's header once (parsed
    and checked), then only the bytes of the tensors asked for, each checked against its crc32
    when ``verify``. Format 1 files, which have one crc32 each, are checked whole when opened.
    ``plan`` the reads to come and they are read ahead. Use as a context manager (it holds the
    files open)."""

    def __init__(self, directory: Path, manifest: dict, verify: bool):
        self.directory, self.manifest, self.verify = directory, manifest, verify
        self.opened: dict[int, tuple] = {}  # rank -> (file, path, header, data offset, data bytes)
        self.readers: dict[int, Reader] = {}  # rank -> its file, for tensors' bytes
        self.checksum = _Crc32()
        self.pending: list[tuple[int, int, Path, str]] = []  # (span, expected crc32, file, what)
        self.cuts = 0
        self._plan: deque[tuple[int, str]] = deque()
        self._ahead: dict[tuple[int, str], deque[tuple[Future, int]]] = {}  # reads under way, by tensor
        self._ahead_bytes = 0
        self._issuers: ThreadPoolExecutor | None = None

    def __enter__(self) -> RankFiles:
        return self

    def __exit__(self, kind, *exc) -> None:
        try:
            if kind is None:
                self.check()
        finally:
            for queued in self._ahead.values():  # reads ahead nobody asked for: let them land first
                for future, _ in queued:
                    future.exception()
            if self._issuers is not None:
                self._issuers.shutdown(wait=True)
            for f, *_ in self.opened.values():
                f.close()
            for reader in self.readers.values():
                reader.close()
            self.checksum.close()

    def check(self) -> None:
        """Wait for the checksums of the tensors read so far; raise ``CheckpointError`` naming the
        file at the first mismatch. (Each is computed on the helper thread while the next is
        read; leaving the ``with`` block checks the rest.)"""
        spans = self.checksum.spans()
        pending, self.pending = self.pending, []
        for span, expected, path, what in pending:
            if spans[span] != expected:
                raise CheckpointError(f"{path}: checksum mismatch, the file is corrupt ({what})")

    def _open(self, rank: int) -> tuple:
        if rank not in self.opened:
            name = rank_file(rank)
            path = self.directory / name
            if not os.path.lexists(path):
                raise CheckpointError(f"{path}: shard file missing (the checkpoint was written by "
                                      f"{self.manifest['world']} ranks)")
            inside(self.directory, path)
            f = open(path, "rb", buffering=0)
            try:
                self.opened[rank] = (f, path, *self._header(f, path, self.manifest["files"].get(name)))
            except BaseException:
                f.close()
                raise
        return self.opened[rank]

    def _read_checked(self, f, offset: int, out: memoryview, path: Path, expected: int | None, what: str,
                      wait: bool = False) -> None:
        if not self.verify or expected is None:
            _read_into(f, offset, out, path)
            return
        _read_into(f, offset, out, path, self.checksum)
        self.checksum.cut()
        self.pending.append((self.cuts, expected, path, what))
        self.cuts += 1
        if wait:
            self.check()

    def _header(self, f, path: Path, crc: int | None) -> tuple[dict, int, int]:
        size = os.fstat(f.fileno()).st_size
        if self.manifest["format"] == 1:  # one crc32 for the whole file
            self._read_checked(f, 0, memoryview(bytearray(size)), path, crc, "the whole file", wait=True)
        try:
            prefix = memoryview(bytearray(8))
            _read_into(f, 0, prefix, path)
            (n_header,) = struct.unpack("<Q", prefix)
            if n_header > size - 8:
                raise ValueError(f"a header of {n_header} bytes in a file of {size}")
            whole = memoryview(bytearray(8 + n_header))
            self._read_checked(f, 0, whole, path, crc if self.manifest["format"] > 1 else None, "its header",
                               wait=True)
            header = json.loads(bytes(whole[8:]))
            if not isinstance(header, dict):
                raise ValueError(f"its header is {type(header).__name__}, not an object")
        except (struct.error, ValueError) as e:
            raise CheckpointError(f"{path}: not a safetensors file ({e})") from e
        except RecursionError:
            raise CheckpointError(f"{path}: not a safetensors file (its header nests too deeply)") from None
        return header, 8 + n_header, size - 8 - n_header

    def plan(self, reads: list[tuple[int, str]]) -> None:
        """The ``(rank, tensor)`` reads to come, in order: while ``read`` is called for them, up to
        ``AHEAD_TENSORS`` of them (``AHEAD_BYTES``, past the first) are read in the background into
        their buffers. A read not in the plan is read when asked."""
        self._plan.extend(reads)
        if self._issuers is None:
            self._issuers = ThreadPoolExecutor(AHEAD_TENSORS)
        self._fill()

    def _fill(self) -> None:
        while self._plan and self._ahead_bytes < AHEAD_BYTES and sum(map(len, self._ahead.values())) < AHEAD_TENSORS:
            rank, name = self._plan.popleft()
            try:
                where = self._locate(rank, name)
            except CheckpointError:  # read() raises it when the tensor is asked for
                self._plan.clear()
                return
            nbytes = where[-1].numel() * where[-1].element_size()
            self._ahead.setdefault((rank, name), deque()).append((self._issuers.submit(self._fetch, *where), nbytes))
            self._ahead_bytes += nbytes

    def _locate(self, rank: int, name: str) -> tuple:
        """Where tensor ``name`` of rank ``rank``'s file lies, and a buffer of its own for it."""
        f, path, header, base, data_bytes = self._open(rank)
        if name not in header or name == "__metadata__":
            raise CheckpointError(f"{path}: tensor {name} missing")
        dtype, shape, start, stop = _tensor_meta(path, name, header[name], data_bytes)
        out = landing.empty(shape, dtype)
        if rank not in self.readers:
            self.readers[rank] = Reader(path)
        return self.readers[rank], path, name, base + start, out

    @staticmethod
    def _fetch(reader: Reader, path: Path, name: str, offset: int, out: torch.Tensor) -> torch.Tensor:
        if reader.read_into(offset, flat_bytes(out)) < out.numel() * out.element_size():
            raise CheckpointError(f"{path}: file ended inside tensor {name} (bytes from {offset})")
        landing.settle(out)
        return out

    def read(self, rank: int, name: str, crc: int | None = None) -> torch.Tensor:
        """Tensor ``name`` of rank ``rank``'s file, in a buffer of its own (read on 4 KiB pages, merged
        into huge pages later where large: ``zfunc.checkpoint.landing``); ``crc``: its crc32 (format 2)."""
        queued = self._ahead.get((rank, name))
        if queued:  # planned: read ahead, or under way
            future, nbytes = queued.popleft()
            if not queued:
                del self._ahead[(rank, name)]
            self._ahead_bytes -= nbytes
            self._fill()
            out = future.result()
        else:
            out = self._fetch(*self._locate(rank, name))
        if self.verify and crc is not None:  # checked on the helper thread while the next tensor is read
            self.checksum.update(_bytes_of(out))
            self.checksum.cut()
            self.pending.append((self.cuts, crc, self.opened[rank][1], f"tensor {name}"))
            self.cuts += 1
        return out
