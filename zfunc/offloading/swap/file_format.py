"""The swap file format: header block, aligned memory, checksums (used by ``zfunc.offloading.swap.engine``).

A swap file is a 4096-byte header block (magic, format, version counter, dtype, shape, nbytes, crc32
of the payload, crc32 of the header itself), then the payload zero-padded to 4096, so every O_DIRECT
transfer has an aligned offset and length: ``file_nbytes(nbytes)`` = 4096 + nbytes rounded up to
4096; on disk it takes ``disk_bytes(nbytes, block)``, that rounded up to the file system's block.

**Checked.** Each I/O worker crc32s the block it moved; block crcs combine (``crc32_combine``,
zlib's, in GF(2)) into the payload's crc32. A bad header raises ``SwapChecksumError`` naming the
file. zlib's crc32 runs ~4 GB/s per core, which can halve checked writes on a machine of few cores;
with ``isal`` installed its crc32 (the same values, ~50 GB/s) is used and verify costs little
(``benchmarks/swap.py`` times both).

**Aligned memory.** ``aligned_empty``/``aligned_like`` give CPU tensors at 4096-aligned addresses
(pinned on request when there is a GPU): such a tensor moves to and from a file with O_DIRECT and
no copy but for its last partial page.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

try:  # same crc32 as zlib, ~10x faster (carry-less multiply)
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

ALIGN = 4096
FORMAT = 1
MAGIC = b"ZFSWAP\x00\x01"


class SwapError(OSError):
    """A swap file or directory is unusable; the message names it."""


class SwapPathError(SwapError):
    """The swap directory cannot be created, written or locked, or has too little free space."""


class SwapInUseError(SwapPathError):
    """Another live engine (this process or another) holds the swap directory."""


class SwapChecksumError(SwapError):
    """A swap file is truncated or corrupt (header or payload crc32 mismatch)."""


class SwapMismatchError(SwapError, ValueError):
    """A read's ``out`` does not have the dtype and shape the file holds."""


@dataclass(frozen=True)
class SwapHeader:
    """What a swap file holds; ``crc32`` is None for files written with ``verify=False``."""

    version: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    crc32: int | None


# ----------------------------------------------------------------------------- aligned memory


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def file_nbytes(nbytes: int) -> int:
    """Bytes of a swap file holding ``nbytes`` of payload (header + padded payload)."""
    return ALIGN + _pad(nbytes)


def disk_bytes(nbytes: int, block: int = ALIGN) -> int:
    """Room a swap file holding ``nbytes`` of payload takes on a file system that allocates whole
    ``block``-byte blocks: ``file_nbytes(nbytes)`` rounded up to ``block`` (file metadata aside)."""
    return -(-file_nbytes(nbytes) // block) * block


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor at a 4096-aligned address, its length rounded up to 4096.

    ``pin``: page-locked (for fast host<->GPU copies) when CUDA is available, else ignored.
    """
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes: expected an int >= 0, got {nbytes!r}")
    size = _pad(nbytes)
    base = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    skip = -base.data_ptr() % ALIGN
    return base[skip : skip + size]


def aligned_like(t: torch.Tensor, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised tensor with ``t``'s dtype and shape whose data is 4096-aligned."""
    nbytes = t.numel() * t.element_size()
    return aligned_empty(nbytes, pin=pin)[:nbytes].view(t.dtype).view(t.shape)


def _mv(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy())


# ----------------------------------------------------------------------------- crc32_combine


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec, i = vec >> 1, i + 1
    return out


_ZEROS: list[list[int]] = []  # _ZEROS[k]: the operator that runs 2**k zero bytes through a crc32
_ZEROS_LOCK = threading.Lock()


def _zeros_operator(k: int) -> list[int]:
    with _ZEROS_LOCK:
        if not _ZEROS:
            op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit (reflected polynomial)
            for _ in range(3):
                op = [_gf2_times(op, col) for col in op]
            _ZEROS.append(op)
        while len(_ZEROS) <= k:
            _ZEROS.append([_gf2_times(_ZEROS[-1], col) for col in _ZEROS[-1]])
        return _ZEROS[k]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``crc32(a + b)`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)`` (zlib's crc32_combine)."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_zeros_operator(k), crc1)
        len2, k = len2 >> 1, k + 1
    return crc1 ^ crc2


# ----------------------------------------------------------------------------- header


def _pack_header(h: SwapHeader) -> bytes:
    body = json.dumps({"format": FORMAT, "version": h.version, "dtype": str(h.dtype).removeprefix("torch."),
                       "shape": list(h.shape), "nbytes": h.nbytes, "crc32": h.crc32}).encode()
    head = MAGIC + len(body).to_bytes(4, "little") + crc32(body).to_bytes(4, "little") + body
    if len(head) > ALIGN:
        raise ValueError(f"tensor: shape {list(h.shape)} has too many dims for a {ALIGN}-byte header")
    return head.ljust(ALIGN, b"\0")


def _unpack_header(raw: bytes, file: Path) -> SwapHeader:
    if raw[:8] != MAGIC:
        raise SwapChecksumError(f"{file}: not a swap file, or its header is corrupt (bad magic)")
    n, crc = int.from_bytes(raw[8:12], "little"), int.from_bytes(raw[12:16], "little")
    if n > ALIGN - 16 or crc32(raw[16 : 16 + n]) != crc:
        raise SwapChecksumError(f"{file}: header checksum mismatch, the file is corrupt")
    meta = json.loads(raw[16 : 16 + n])
    if meta["format"] != FORMAT:
        raise SwapError(f"{file}: swap format {meta['format']}, this zfunc reads format {FORMAT}")
    return SwapHeader(meta["version"], getattr(torch, meta["dtype"]), tuple(meta["shape"]), meta["nbytes"],
                      meta["crc32"])


def _version_on_disk(file: Path) -> int:
    """The version ``file`` holds (0 if missing or unreadable), to go on counting from."""
    try:
        with open(file, "rb") as f:
            return _unpack_header(f.read(ALIGN), file).version
    except (OSError, ValueError, KeyError):
        return 0

