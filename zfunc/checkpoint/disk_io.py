"""Checkpoint file I/O at disk speed: one file written or a tensor read as aligned blocks, several
in flight, with ``O_DIRECT`` where the file system takes it (``zfunc.checkpoint.files`` says what the
files hold).

**Law.** ``write_file(path, segments)`` leaves ``path`` holding exactly the concatenation of the
segments' bytes, fsynced, and returns each segment's crc32 (zlib's; ``isal``'s when installed, the
same values ~10x faster). ``read_into(file, offset, out)`` fills ``out`` with the file's bytes from
``offset``. The checksums are of the memory the bytes came from or went to; nothing here changes
the segments.

**Why.** One buffered stream is throttled by the page cache's write-back (``balance_dirty_pages``).
``O_DIRECT`` blocks, ``THREADS`` in flight, skip the page cache (no copy into it, no dirty
throttling) and keep the disk's queue busy; the file's blocks are allocated up front
(``posix_fallocate``) so the parallel writers leave it in order. How a file is written does not
change how fast it reads back; what a read costs beyond the disk is the memory it lands in: memory
that sat free may have gone back to a VM's host (free page reporting) and must be faulted in again
(``benchmarks/checkpoint_memory.py`` measures both). ``DIRECT_WRITES = False`` writes through the
page cache instead (same blocks and threads): for file systems that refuse or punish ``O_DIRECT``.
Reads: ``READ_THREADS`` ``O_DIRECT`` blocks straight into the tensors' buffers, with the next
tensors read ahead (``zfunc.checkpoint.files.RankFiles.plan``): they skip ``torch.load``'s copy and
keep a cold checkpoint from evicting the training's page cache (``benchmarks/checkpoint.py``
compares both with ``torch.save``/``torch.load`` and DCP; the README's results hold the figures).

**Cost.** A block whose file offset and memory address are both 4096-aligned moves straight from
the tensor's memory (no copy): ``write_safetensors`` starts the data at 4096 and puts tensors
whose size is a multiple of 4096 first, so the bulk of a state moves without a copy. Other blocks
(the header, tails, unaligned tensors) go through a per-thread staging buffer of ``BLOCK`` bytes
(one memcpy, done by torch without the GIL). The crc32s run on one more thread, overlapped with the
writes. Memory: ``THREADS`` staging buffers of ``BLOCK`` bytes, allocated when first needed.
Where ``O_DIRECT`` is refused (tmpfs, some network file systems) the same blocks go through the
page cache with ``pwrite``/``pread``.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from bisect import bisect_right
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from zfunc.offloading.swap.file_format import ALIGN, aligned_empty, crc32

THREADS = 4  # blocks written in flight per file
# False: write through the page cache (pwrite), same blocks and threads: throttled by write-back,
# and the files read back no faster (module docstring).
DIRECT_WRITES = True
READ_THREADS = 8  # blocks read in flight
BLOCK = 8 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_staging = threading.local()


def _staging_buffer() -> torch.Tensor:
    buf = getattr(_staging, "buf", None)
    if buf is None:
        buf = _staging.buf = aligned_empty(BLOCK)
    return buf


def _mv(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy())


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's memory as a flat uint8 tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _open(path: Path, flags: int) -> tuple[int, bool]:
    """An fd on ``path`` opened with ``O_DIRECT`` where the file system takes it; and whether it was."""
    if _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], pos + done)


def _pread_all(fd: int, data: memoryview, pos: int, path: Path) -> int:
    """Read ``len(data)`` bytes from ``pos``; fewer only at the file's end. Returns how many."""
    done = 0
    while done < len(data):
        n = os.preadv(fd, [data[done:]], pos + done)
        if n == 0:
            break
        done += n
    return done


# ----------------------------------------------------------------------------- write


class Pace:
    """Paces a write's blocks so that each I/O thread is busy at most ``duty`` of the wall time:
    after a block that took ``t`` s, that thread sleeps ``t * (1 / duty - 1)`` s. ``hurry()``
    lifts it (sleeps under way end at once): a background save writes slowly while training
    runs and at full speed once someone waits for it. ``duty = 1``: no pacing.

    Why: on the 2-core VM a background save of 0.6 GB cost the training ~0.47 s of step time on
    a quiet machine (11 steps at 1.32x), of which its own threads' CPU is ~0.14 s (copy 0.03,
    crc32 0.02, the rest the writes' system calls); the rest comes with the bytes moved (the
    host's side of the I/O), so the same bytes spread over more steps cost each step less
    (``benchmarks/checkpoint.py``)."""

    def __init__(self, duty: float = 1.0):
        if not 0 < duty <= 1:
            raise ValueError(f"duty: expected a fraction in (0, 1], got {duty!r}")
        self.duty = duty
        self._hurry = threading.Event()

    def hurry(self) -> None:
        self._hurry.set()

    def block(self, move, *args) -> None:
        """Run ``move(*args)``, then sleep as the duty cycle says (unless hurried)."""
        t0 = time.perf_counter()
        move(*args)
        if self.duty < 1 and not self._hurry.is_set():
            self._hurry.wait((time.perf_counter() - t0) * (1 / self.duty - 1))


def write_file(path: Path, segments: list[torch.Tensor], *, threads: int = THREADS,
               pace: Pace | None = None) -> list[int]:
    """Write the concatenation of ``segments`` (flat uint8 CPU tensors) as the new file ``path``,
    fsynced; returns each segment's crc32. Raises the first ``OSError`` (the file is then partial:
    the caller writes into a scratch directory). ``pace``: how fast (default: at full speed)."""
    starts, total = [], 0
    for s in segments:
        starts.append(total)
        total += s.numel()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd, direct = _open(path, flags) if DIRECT_WRITES else (os.open(path, flags, 0o644), False)
    try:
        _reserve(fd, -(-total // ALIGN) * ALIGN)
        with ThreadPoolExecutor(threads + 1) as pool:
            crcs = pool.submit(lambda: [crc32(_mv(s)) if s.numel() else 0 for s in segments])
            pace = pace or Pace()
            blocks = [pool.submit(pace.block, _write_block, fd, direct, segments, starts, pos, min(BLOCK, total - pos))
                      for pos in range(0, total, BLOCK)]
            for b in blocks:
                b.result()
            result = crcs.result()
        if total % ALIGN:
            os.ftruncate(fd, total)  # the reservation (and an O_DIRECT last block) was padded to the alignment
        os.fsync(fd)
    finally:
        os.close(fd)
    return result


def _write_block(fd: int, direct: bool, segments: list[torch.Tensor], starts: list[int], pos: int, n: int) -> None:
    i = bisect_right(starts, pos) - 1
    while segments[i].numel() == 0:  # empty segments share their start with the next one
        i += 1
    seg, at = segments[i], pos - starts[i]
    whole = at + n <= seg.numel()
    if whole and (not direct or ((seg.data_ptr() + at) % ALIGN == 0 and n % ALIGN == 0)):
        _pwrite_all(fd, _mv(seg[at : at + n]), pos)  # straight from the tensor's memory
        return
    buf, filled = _staging_buffer(), 0
    while filled < n:
        seg, at = segments[i], pos + filled - starts[i]
        take = min(seg.numel() - at, n - filled)
        buf[filled : filled + take].copy_(seg[at : at + take])
        filled, i = filled + take, i + 1
    padded = -(-n // ALIGN) * ALIGN if direct else n
    buf[n:padded].zero_()
    _pwrite_all(fd, _mv(buf[:padded]), pos)


def _reserve(fd: int, size: int) -> None:
    """Allocate the file's blocks in one extent run before the blocks are written: the parallel
    writers would otherwise allocate as they land, out of order, and a full disk fails here."""
    if not size:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


# ----------------------------------------------------------------------------- read


class Reader:
    """One file open for reading: ``O_DIRECT`` blocks in parallel where the bytes' file offset and
    memory address line up, else ``pread`` through the page cache. Several threads may read at
    once (their blocks share the pool). Close it (or use ``with``)."""

    def __init__(self, path: Path, *, threads: int = READ_THREADS):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.direct_fd: int | None = None
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the lazily opened fd and pool

    def close(self) -> None:
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_into(self, offset: int, out: torch.Tensor) -> int:
        """Fill ``out`` (flat uint8, CPU) with the bytes from ``offset``; returns how many the file
        held (fewer than ``out.numel()`` only at its end)."""
        n = out.numel()
        head = min(-offset % ALIGN, n)
        body = (n - head) // ALIGN * ALIGN if (out.data_ptr() - offset) % ALIGN == 0 else 0
        if body < 4 * ALIGN or not self._direct():
            return self._parallel(self.fd, offset, out)
        got = _pread_all(self.fd, _mv(out[:head]), offset, self.path) if head else 0
        if got < head:
            return got
        got += self._parallel(self.direct_fd, offset + head, out[head : head + body])
        if got < head + body:
            return got
        rest = n - head - body
        return got + (_pread_all(self.fd, _mv(out[head + body :]), offset + head + body, self.path) if rest else 0)

    def _direct(self) -> bool:
        with self._lock:
            if self.direct_fd is None and _O_DIRECT:
                try:
                    self.direct_fd = os.open(self.path, os.O_RDONLY | _O_DIRECT)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.direct_fd = -1
        return self.direct_fd is not None and self.direct_fd >= 0

    def _parallel(self, fd: int, offset: int, out: torch.Tensor) -> int:
        n = out.numel()
        if n <= BLOCK:
            return _pread_all(fd, _mv(out), offset, self.path)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads)
        jobs = [self._pool.submit(_pread_all, fd, _mv(out[p : p + BLOCK]), offset + p, self.path)
                for p in range(0, n, BLOCK)]
        got = [j.result() for j in jobs]
        short = next((i for i, g in enumerate(got) if g < min(BLOCK, n - i * BLOCK)), None)
        return n if short is None else short * BLOCK + got[short]
