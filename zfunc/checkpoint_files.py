"""The files of a checkpoint directory: their format, which of them zfunc owns, and how they are
replaced atomically. (Split from ``checkpoint.py``, which says what a saved state means, so that
each stays readable.)

**Format.** Each rank's tensors are one safetensors file, ``rank{r:05d}.safetensors``, streamed
from the tensors' memory and checksummed (crc32) on the way; ``manifest.json`` describes them.

**Ownership.** A checkpoint directory holds only those files. zfunc writes, replaces or deletes
a path only when it is absent or is what zfunc itself writes there: a checkpoint directory (a
readable manifest, no other files), an empty directory, the ``latest`` pointer (a one-line
file), or its own scratch names beside a checkpoint (``.NAME.tmp`` holding only rank files and a
manifest, an empty ``.NAME.lock``). ``foreign`` says why a path is not zfunc's.

**Replacing.** ``exchange`` swaps two directories in one step (Linux ``renameat2`` with
``RENAME_EXCHANGE``), so a checkpoint being replaced is, at every instant, either the old one
or the new one. ``locked`` serialises writers of one path across threads and processes
(``flock`` on a lock file beside it, opened by each writer).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from zfunc.ops import hostmem
from zfunc.swap import fsync_dir

FORMAT = 1
MANIFEST = "manifest.json"
LATEST = "latest"
_RANK_FILE = re.compile(r"rank\d{5}\.safetensors")


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


# ----------------------------------------------------------------------------- ownership


def foreign(path: Path, kind: str) -> str | None:
    """Why ``path`` is not zfunc's to replace or delete, or None when it is (or is absent).

    ``kind``: "checkpoint" (a checkpoint directory, or an empty one), "scratch" (a ``.NAME.tmp``
    left by a crashed save: rank files and at most a manifest, valid or not), "pointer" (``latest``:
    a one-line file), "lock" (an empty file).
    """
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        return "is a symbolic link"
    if kind in ("pointer", "lock"):
        if not path.is_file():
            return "is not a regular file"
        size = path.stat().st_size
        if kind == "lock":
            return f"is a file of {size} bytes, not zfunc's empty lock file" if size else None
        text = path.read_bytes()[:256].decode(errors="replace").strip() if size <= 256 else ""
        ok = text and "\n" not in text and "/" not in text
        return None if ok else "is not zfunc's pointer file (one line naming a checkpoint beside it)"
    if not path.is_dir():
        return "is a file, not a directory"
    names = sorted(os.listdir(path))
    others = [n for n in names if n != MANIFEST and not _RANK_FILE.fullmatch(n)]
    if others:
        return f"holds files a checkpoint does not write: {others[:5]}"
    if kind == "checkpoint" and names:
        try:
            read_manifest(path)
        except CheckpointError as e:
            return f"is not a zfunc checkpoint ({e})"
    return None


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the lock file ``path`` (created empty, removed on exit).

    Each call opens its own descriptor, so threads of one process exclude each other as processes
    do. The file is removed while locked; a waiter that then gets the lock on the removed file
    sees a different inode at ``path`` and tries again, so two writers never both hold it.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        os.unlink(path)
        os.close(fd)


# ----------------------------------------------------------------------------- replacing


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def exchange(a: Path, b: Path) -> bool:
    """Swap directories ``a`` and ``b`` atomically; False where the OS or file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: written beside it, fsynced, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


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
