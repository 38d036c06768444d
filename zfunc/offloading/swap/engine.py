"""Swap: the async I/O engine that keeps tensors in files on NVMe (used by ``zfunc.offloading.step``).

    with SwapEngine("/scratch/zfunc", need_bytes=2 * total_file_bytes) as swap:
        swap.write("opt.group0", buf)          # -> Future; don't touch buf until it completes
        swap.read("opt.group0", out).result()  # -> SwapHeader; out holds what was written

One directory, one file per name (``<quoted name>.swap``), in the format of ``zfunc.offloading.swap.file_format``
(a 4096-byte checked header, then the payload padded to 4096). The engine is in four modules of
``zfunc.offloading.swap``, one concept each; each name is imported from the module that defines it:

    file_format.py    the file format, aligned memory, crc32 and its combine, the errors
    directory.py      the directory: room checks, the one-engine lock, rank_dir, raw pread/pwrite
    transfer.py       one file's transfer cut into blocks on the thread pool
    engine.py         the engine: names, versions, ordering per name, spares, write and read

**Law.** ``read(name, out)`` fills ``out`` with exactly the bytes of the last completed
``write(name, ...)``. Operations on one name run one at a time in issue order (the engine queues
them, the caller need not wait), so ``write(n, a); read(n, b)`` gives ``b == a``. Different names
proceed concurrently.

**Atomic.** A write goes to a ``.<file>.<pid>.<seq>.tmp`` renamed over the old file only once
complete, so a crash or ``kill -9`` at any moment leaves the previous version readable (the next
engine on the directory removes temporaries of dead processes). ``fsync="never"`` survives process
crashes (the kernel holds the data); ``fsync="write"`` also fsyncs the file before and the directory
after the rename: it survives power loss. With ``spare=True`` (default) the version being replaced
is kept as a hidden ``.<file>.spare`` hard link, and the next write renames that spare to its
``.tmp`` and overwrites it in place: no blocks allocated, converted or freed per write (freeing a
file's blocks is slow where the file system discards them), for 2x the disk space. Rename rather
than two slots per name with the header's version deciding: a rename never exposes a torn file and
data and header need no ordering.

**Failures.** A write that cannot complete (no room: ENOSPC or EDQUOT, an I/O error, a short
write) fails its future with a ``SwapError`` naming the file (no room: a ``SwapPathError`` naming
the directory, its free bytes and the bytes needed, ``errno`` the cause's), and the previous
version stays the file; the temporary goes back to being the spare, so its blocks stay allocated.
``restore(name)`` goes back to the version before ``name``'s last write (the spare renamed over the
file): a caller that wrote several names and met a failure puts them all back. ``reserve(sizes)``
allocates the room of the next write of each name ahead (its spare): with the room held, a full
disk fails nothing later on a file system that overwrites in place (not copy-on-write ones).
``write(name, t, in_place=True)`` is for scratch files: the file itself is overwritten, no spare and
no atomic replace (blocks allocated by its first write only).

**One engine per directory.** An engine holds an exclusive ``flock`` on the directory for its
lifetime; a second engine on it is refused with ``SwapInUseError`` (``zfunc.offloading.swap.directory``).
``read_only=True`` takes no lock and creates, writes and removes nothing (so it reads a full
disk), for a reader beside the holder (``zfunc.offloading.placement.in_ram`` between steps); ``lock=False``, a
writer taking no lock, for tests. A reader that keeps a file open across two writes of its name
would see its spare overwritten (``spare=False`` gives such readers the version they opened). Ranks
of one job given one path use ``rank_dir(path)``.

**Checked.** Block crc32s combine into the payload's. A bad header, a truncated file or a payload
mismatch raises ``SwapChecksumError`` naming the file (``out`` is then unspecified); ``verify=False``
skips it (the header then holds no crc, and readers check none). Cost of verify: ``zfunc.offloading.swap.file_format``.

**Cost.** A write or read moves ``file_nbytes(nbytes)`` = 4096 + nbytes rounded up to 4096; on disk
the file takes ``disk_bytes(nbytes, block)``, that rounded up to the file system's block. A
4096-aligned tensor (``aligned_empty``) moves with no copy but for its last partial page; others go
through a staging buffer per block (one memcpy). ``threads`` workers each keep one blocking
``preadv``/``pwritev`` in flight; a transfer is cut into ``block_bytes`` pieces with at most
``queue_depth`` in flight, so concurrent transfers share the workers. Memory: at most ``threads``
staging buffers of ``block_bytes``, allocated on first need.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import torch

from zfunc.offloading.swap.directory import (LOCK_FILE, _O_DIRECT, ROOM_ERRNOS, _hold_directory, _o_direct_works,
                                             _open_target, _pread_all, _put_back, _pwrite_all, _release_directory,
                                             _remove_stale_temporaries, _reserve, spare_path, _spare_back, check_path,
                                             check_readable, fsync_dir, no_room, reserve_spares)
from zfunc.offloading.swap.file_format import (ALIGN, SwapChecksumError, SwapError, SwapHeader, SwapMismatchError, _mv,
                                               _pack_header, _pad, _unpack_header, _version_on_disk, aligned_empty,
                                               crc32, file_nbytes)
from zfunc.offloading.swap.transfer import _Transfer

FSYNC = ("never", "write")

__all__ = ["FSYNC", "SwapEngine"]


class SwapEngine:
    """One directory of swap files, read and written by a pool of I/O threads.

    Args:
      path: the directory (created if missing, checked with ``check_path``).
      threads: I/O worker threads, each with one blocking preadv/pwritev in flight (8: where checked
        writes reach fio's best in ``benchmarks/swap.py``; 4 leave them short of it).
      block_bytes: transfer piece size, a multiple of 4096 up to 1 GiB.
      queue_depth: pieces of one transfer in flight at once (default: ``threads``).
      o_direct: use O_DIRECT where the filesystem takes it; ``self.o_direct`` tells what is used.
      fsync: ``"never"`` (atomic against process crashes) or ``"write"`` (and against power loss).
      verify: write a crc32 of every payload and check it on read.
      spare: keep each name's previous version as a hidden spare file that the next write overwrites
        in place and renames: steady-state writes then allocate and free nothing (faster, most where
        freed blocks are discarded) for 2x the disk space; False: fresh files,
        2x only while a name is being written.
      need_bytes: free space to require now, beyond ``files``.
      files: payload bytes of each file to be written: their room is required now, in the file
        system's blocks (``check_path``), twice with ``spare`` (each file and its spare), else
        plus the largest (one new version beside its old).
      lock: hold the directory's lock while open (``SwapInUseError`` if another engine holds it);
        False: none, for a writer that knows no other engine writes there.
      read_only: read only, beside the holder (which must not write meanwhile): no lock, no room
        checked, nothing created, written or removed in ``path`` (which must exist), so it reads a
        full or read-only disk; ``write``, ``remove``, ``reserve`` and ``restore`` raise SwapError.
    """

    def __init__(self, path: str | os.PathLike, *, threads: int = 8, block_bytes: int = 8 << 20,
                 queue_depth: int | None = None, o_direct: bool = True, fsync: str = "never",
                 verify: bool = True, spare: bool = True, need_bytes: int = 0, files: Iterable[int] = (),
                 lock: bool = True, read_only: bool = False):
        for arg, value in (("threads", threads), ("queue_depth", threads if queue_depth is None else queue_depth)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg}: expected an int >= 1, got {value!r}")
        if not isinstance(block_bytes, int) or not ALIGN <= block_bytes <= 1 << 30 or block_bytes % ALIGN:
            raise ValueError(f"block_bytes: expected a multiple of {ALIGN} up to 1 GiB, got {block_bytes!r}")
        if fsync not in FSYNC:
            raise ValueError(f"fsync: expected one of {FSYNC}, got {fsync!r}")
        files = list(files)
        self.read_only = bool(read_only)
        if self.read_only:  # O_DIRECT where reads take it (``_open_for_read`` falls back)
            self.path, self._unlock = check_readable(path), lambda: None
            self.o_direct = bool(o_direct) and bool(_O_DIRECT)
        else:
            self.path = check_path(path, need_bytes, files * 2 if spare else files + [max(files, default=0)])
            # closing the lock's fd releases it: on close(), or when an unclosed engine is collected
            self._unlock = (weakref.finalize(self, _release_directory, _hold_directory(self.path),
                                             self.path / LOCK_FILE) if lock else lambda: None)
            self.o_direct = bool(o_direct) and _o_direct_works(self.path)
            _remove_stale_temporaries(self.path)
        self.threads, self.block_bytes, self.queue_depth = threads, block_bytes, queue_depth or threads
        self.fsync, self.verify, self.spare = fsync, verify, spare
        self.bytes_written = self.bytes_read = 0  # payload bytes of completed transfers
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="zfunc-swap")
        self._lock = threading.Lock()
        self._last: dict[str, Future] = {}  # the last operation issued on each name
        self._pending: set[Future] = set()
        self._versions: dict[str, int] = {}
        # where the version before each name's last write is: "file" (that write failed before its
        # commit), "spare" (it committed, the spare is the old file); absent: not kept (restore: False)
        self._before: dict[str, str] = {}
        self._staging: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._seq = itertools.count()
        self._closed = False

    def file(self, name: str) -> Path:
        """The file that holds ``name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, got {name!r}")
        return self.path / (quote(name, safe="") + ".swap")

    def write(self, name: str, tensor: torch.Tensor, *, in_place: bool = False) -> Future:
        """Write ``tensor`` (contiguous, CPU, any dtype) as the new version of ``name``.

        Returns a Future of the new file's ``SwapHeader``; don't modify ``tensor`` until it is done.
        If it fails (``SwapError`` naming the file), the previous version of ``name`` is unchanged.
        ``in_place=True`` (scratch files): the file itself is overwritten, no temporary and no spare:
        its blocks are allocated by the first write only and reused after; a failed or interrupted
        write leaves it unreadable (a bad checksum) until the next, and ``restore`` has nothing to
        go back to.
        """
        self._writable("write")
        file, src = self.file(name), _flat_bytes("tensor", tensor)
        header = SwapHeader(0, tensor.dtype, tuple(tensor.shape), src.numel(), None)
        if in_place:
            return self._after(name, lambda fut: self._write_in_place(name, file, header, src, fut))
        return self._after(name, lambda fut: self._write(name, file, header, src, fut))

    def read(self, name: str, out: torch.Tensor) -> Future:
        """Read ``name`` into ``out`` (contiguous, CPU, with the dtype and shape written).

        Returns a Future of the file's ``SwapHeader``. It raises ``SwapMismatchError`` naming the file
        and both dtypes and shapes, or ``SwapChecksumError`` naming a corrupt or truncated file.
        """
        file, dst = self.file(name), _flat_bytes("out", out)
        return self._after(name, lambda fut: self._read(name, file, out, dst, fut))

    def remove(self, name: str) -> bool:
        """Delete ``name``'s file (and spare) once the operations on it issued before end; whether it existed."""
        self._writable("remove")
        file = self.file(name)

        def unlink(fut: Future) -> None:
            existed = file.exists()
            file.unlink(missing_ok=True)
            spare_path(file).unlink(missing_ok=True)
            self._before.pop(name, None)
            fut.set_result(existed)

        return self._after(name, unlink).result()

    def restore(self, name: str) -> Future:
        """Make the version ``name`` had before its last write (issued before this call) its
        version again, once that write ends: undone if it completed (its spare, the previous file,
        renamed back over the file; the newer file's blocks become the spare), nothing to do if it
        failed. A Future of whether that version was there to restore: False where it is not kept
        (``spare=False``, a file system without hard links, a restore or remove since, or no write
        of ``name`` by this engine). Cost: a hard link and two renames, no data moved."""
        self._writable("restore")
        file = self.file(name)

        def back(fut: Future) -> None:
            before = self._before.pop(name, None)
            self._versions.pop(name, None)  # the next write counts on from the file's
            if before == "spare":
                _spare_back(file, file.with_name(f".{file.name}.{os.getpid()}.{next(self._seq)}.tmp"))
                if self.fsync == "write":
                    fsync_dir(self.path)
            fut.set_result(before is not None)

        return self._after(name, back)

    def reserve(self, sizes: Mapping[str, int]) -> None:
        """Allocate now the room of the next write of each name (name -> payload bytes): its
        spare, created or grown to ``file_nbytes``, so that write allocates no block (on a file
        system that overwrites in place; a copy-on-write one needs new blocks for every write).
        Waits for the operations on these names issued before; do not issue more until it returns.
        Raises ``SwapPathError`` naming the directory, its free bytes and the bytes needed before
        allocating anything when they do not fit. Cost: two stats per name; blocks allocated only
        where a spare is missing or short (after ``init``'s first writes, a ``restore`` without
        hard links, a crash). With ``spare=False`` there is nothing to hold the room: no-op."""
        self._writable("reserve")
        if not self.spare or not sizes:
            return
        with self._lock:
            earlier = [self._last[n] for n in sizes if n in self._last]
        wait(earlier)
        reserve_spares(self.path, {self.file(name): file_nbytes(n) for name, n in sizes.items()})

    def close(self) -> None:
        """Wait for every operation issued, stop the workers, release the directory (idempotent)."""
        with self._lock:
            self._closed, pending = True, list(self._pending)
        wait(pending)
        self._pool.shutdown(wait=True)
        self._unlock()

    def __enter__(self) -> SwapEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _after(self, name: str, start: Callable[[Future], None]) -> Future:
        """A future for an operation on ``name``, started on a worker once the one issued before ends."""
        fut: Future = Future()
        fut.set_running_or_notify_cancel()  # ours to complete: a started transfer cannot be cancelled
        with self._lock:
            if self._closed:
                raise SwapError(f"{self.path}: the swap engine is closed")
            before, self._last[name] = self._last.get(name), fut
            self._pending.add(fut)
        fut.add_done_callback(lambda f: self._forget(name, f))

        def run() -> None:
            try:
                start(fut)
            except BaseException as e:  # noqa: BLE001 - handed to the future
                fut.set_exception(e)

        submit = lambda _=None: self._pool.submit(run)  # noqa: E731
        submit() if before is None else before.add_done_callback(submit)
        return fut

    def _writable(self, op: str) -> None:
        if self.read_only:
            raise SwapError(f"{self.path}: {op} on a read-only swap engine (read_only=True)")

    def _forget(self, name: str, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)
            if self._last.get(name) is fut:
                del self._last[name]

    # ------------------------------------------------------------------------- write and read

    def _write(self, name: str, file: Path, header: SwapHeader, src: torch.Tensor, fut: Future) -> None:
        version = (self._versions.get(name) or _version_on_disk(file)) + 1
        self._versions[name] = version  # operations on one name run one at a time
        self._before[name] = "file"  # until the commit, the previous version is the file
        _pack_header(header)  # a shape too long for the header fails here, before any file exists
        tmp = file.with_name(f".{file.name}.{os.getpid()}.{next(self._seq)}.tmp")
        failed = f"{file}: writing {name!r} failed, its previous version is unchanged"
        error = functools.partial(_write_error, self.path, header, failed)

        fd = None
        try:
            fd = _open_target(file, tmp, self.spare, self._direct)
            _reserve(fd, file_nbytes(header.nbytes), file, failed)
        except BaseException as e:
            if fd is not None:
                os.close(fd)
            _put_back(tmp, file, self.spare)
            if isinstance(e, OSError) and not isinstance(e, SwapError):
                raise error(e) from e
            raise

        def finish(crc: int) -> SwapHeader:
            done = replace(header, version=version, crc32=crc if self.verify else None)
            with self._staged(ALIGN) as buf:
                buf.copy_(torch.frombuffer(bytearray(_pack_header(done)), dtype=torch.uint8))
                _pwrite_all(fd, _mv(buf), 0)
            if self.fsync == "write":
                os.fsync(fd)
            kept = False
            if self.spare:  # the version being replaced becomes the next write's target
                with contextlib.suppress(OSError):  # none yet, or no hard links here: no spare
                    os.link(file, spare_path(file))
                    kept = True
            os.replace(tmp, file)  # the commit point
            if kept:
                self._before[name] = "spare"
            else:
                del self._before[name]
            if self.fsync == "write":
                fsync_dir(self.path)
            with self._lock:
                self.bytes_written += header.nbytes
            return done

        _Transfer(self._pool, self.queue_depth, header.nbytes, self.block_bytes, fd, file, error,
                  lambda off, n: self._move(fd, src[off : off + n], ALIGN + off, file, write=True),
                  finish, lambda: _put_back(tmp, file, self.spare), fut).start()

    def _write_in_place(self, name: str, file: Path, header: SwapHeader, src: torch.Tensor, fut: Future) -> None:
        version = (self._versions.get(name) or 0) + 1
        self._versions[name] = version
        self._before.pop(name, None)  # nothing is kept to go back to
        failed = f"{file}: writing {name!r} in place failed, the file is unreadable until its next write"
        error = functools.partial(_write_error, self.path, header, failed)

        fd = None
        try:
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | self._direct, 0o644)
            _reserve(fd, file_nbytes(header.nbytes), file, failed)
        except BaseException as e:
            if fd is not None:
                os.close(fd)
            if isinstance(e, OSError) and not isinstance(e, SwapError):
                raise error(e) from e
            raise

        def finish(crc: int) -> SwapHeader:
            done = replace(header, version=version, crc32=crc if self.verify else None)
            with self._staged(ALIGN) as buf:
                buf.copy_(torch.frombuffer(bytearray(_pack_header(done)), dtype=torch.uint8))
                _pwrite_all(fd, _mv(buf), 0)
            if self.fsync == "write":
                os.fsync(fd)
            with self._lock:
                self.bytes_written += header.nbytes
            return done

        _Transfer(self._pool, self.queue_depth, header.nbytes, self.block_bytes, fd, file, error,
                  lambda off, n: self._move(fd, src[off : off + n], ALIGN + off, file, write=True),
                  finish, lambda: None, fut).start()

    def _read(self, name: str, file: Path, out: torch.Tensor, dst: torch.Tensor, fut: Future) -> None:
        try:
            fd = self._open_for_read(file)
        except FileNotFoundError as e:
            raise SwapError(f"{file}: no swap file for {name!r} (never written, or removed)") from e
        try:
            header = self._check_header(fd, file, out)
        except BaseException:
            os.close(fd)
            raise

        def finish(crc: int) -> SwapHeader:
            if self.verify and header.crc32 is not None and crc != header.crc32:
                raise SwapChecksumError(f"{file}: payload checksum mismatch, the file is corrupt")
            with self._lock:
                self.bytes_read += header.nbytes
            return header

        _Transfer(self._pool, self.queue_depth, header.nbytes, self.block_bytes, fd, file,
                  lambda e: SwapError(f"{file}: reading {name!r} failed ({e})"),
                  lambda off, n: self._move(fd, dst[off : off + n], ALIGN + off, file, write=False),
                  finish, lambda: None, fut).start()

    def _open_for_read(self, file: Path) -> int:
        """``file`` opened for reading, with O_DIRECT while the file system takes it (a read-only
        engine has not probed it: the first refusal turns it off)."""
        try:
            return os.open(file, os.O_RDONLY | self._direct)
        except OSError as e:
            if e.errno != errno.EINVAL or not self._direct:
                raise
            self.o_direct = False
            return os.open(file, os.O_RDONLY)

    def _check_header(self, fd: int, file: Path, out: torch.Tensor) -> SwapHeader:
        with self._staged(ALIGN) as buf:
            _pread_all(fd, _mv(buf), 0, file)
            header = _unpack_header(bytes(_mv(buf)), file)
        if header.dtype != out.dtype or header.shape != tuple(out.shape):
            raise SwapMismatchError(f"{file}: holds {header.dtype} {list(header.shape)}, but out is "
                                    f"{out.dtype} {list(out.shape)}")
        size, need = os.fstat(fd).st_size, file_nbytes(header.nbytes)
        if size < need:
            raise SwapChecksumError(f"{file}: truncated, {size} bytes where its header needs {need}")
        return header

    def _move(self, fd: int, piece: torch.Tensor, pos: int, file: Path, *, write: bool) -> int:
        """Move ``piece`` to/from ``pos``: through its own memory where O_DIRECT allows, the rest staged.

        Never reads into memory past ``piece``: the rest of its storage may hold other tensors.
        """
        n = piece.numel()
        direct = n if not self.o_direct else n - n % ALIGN if piece.data_ptr() % ALIGN == 0 else 0
        io = _pwrite_all if write else lambda fd, data, pos: _pread_all(fd, data, pos, file)
        if direct:
            io(fd, _mv(piece[:direct]), pos)
        if direct < n:
            with self._staged(n - direct) as buf:
                if write:
                    buf[: n - direct].copy_(piece[direct:])  # torch copies without holding the GIL
                    buf[n - direct :].zero_()
                io(fd, _mv(buf), pos + direct)
                if not write:
                    piece[direct:].copy_(buf[: n - direct])
        return crc32(_mv(piece)) if self.verify else 0

    # ------------------------------------------------------------------------- helpers

    @property
    def _direct(self) -> int:
        return _O_DIRECT if self.o_direct else 0

    @contextlib.contextmanager
    def _staged(self, n: int) -> Iterator[torch.Tensor]:
        """Borrow an aligned staging buffer (its first ``n`` rounded up to 4096 bytes); one per worker."""
        try:
            buf = self._staging.get_nowait()
        except queue.Empty:
            buf = aligned_empty(self.block_bytes)
        try:
            yield buf[: _pad(n)]
        finally:
            self._staging.put(buf)


def _write_error(folder: Path, header: SwapHeader, failed: str, e: OSError) -> SwapError:
    """The ``SwapError`` a failed write raises: no room (naming ``folder``, the bytes needed and free),
    else ``failed`` with the OS error, its errno kept."""
    if e.errno in ROOM_ERRNOS:
        return no_room(folder, file_nbytes(header.nbytes), failed, e)
    err = SwapError(f"{failed} ({e})")
    err.errno = e.errno
    return err


def _flat_bytes(arg: str, t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a flat uint8 tensor; ``t`` must be a contiguous CPU tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous CPU tensor, got device={t.device}, "
                         f"contiguous={t.is_contiguous()}")
    return t.detach().reshape(-1).view(torch.uint8)
