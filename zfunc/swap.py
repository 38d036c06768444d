"""Swap: the async I/O engine that keeps tensors in files on NVMe (used by ``zfunc.offload``).

    with SwapEngine("/scratch/zfunc", need_bytes=2 * total_file_bytes) as swap:
        swap.write("opt.group0", buf)          # -> Future; don't touch buf until it completes
        swap.read("opt.group0", out).result()  # -> SwapHeader; out holds what was written

One directory, one file per name (``<quoted name>.swap``): a 4096-byte header block (magic, format,
version counter, dtype, shape, nbytes, crc32 of the payload, crc32 of the header itself), then the
payload zero-padded to 4096, so every O_DIRECT transfer has an aligned offset and length.

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
``.tmp`` and overwrites it in place: no blocks allocated, converted or freed per write, which made
writes ~1.5x faster here (ext4 mounted with ``discard``: freeing a 1 GiB file took 0.2 s), for 2x
the disk space. Rename rather than two slots per name with the header's version deciding: a rename
never exposes a torn file and data and header need no ordering.

**One engine per directory.** An engine holds an exclusive ``flock`` on the directory's
``.zfunc-swap.lock`` for its lifetime; a second engine on the directory, in this process or another,
is refused with ``SwapInUseError`` naming the directory and the holder's pid (two writers of one name
would overwrite each other's versions and spares). The kernel drops the lock when the engine closes
or its process dies, ``kill -9`` included, so the next run on the directory (a resumed one) starts.
``lock=False`` takes no lock, for a reader beside the holder (``zfunc.offload.in_ram`` between
steps); a reader that keeps a file open across two writes of its name would see its spare
overwritten (``spare=False`` gives such readers the version they opened). Ranks of one job given
one path use ``rank_dir(path)``: ``path/rank00003/`` for global rank 3, ``path`` itself for a
process alone.

**Checked.** Each worker crc32s the block it moved; block crcs combine (``crc32_combine``) into the
payload's crc32. A bad header, a truncated file or a payload mismatch raises ``SwapChecksumError``
naming the file (``out`` is then unspecified). zlib's crc32 runs ~4 GB/s per core: on this loaded
2-core machine verify halved write GB/s (1.5 vs 3.0, benchmarks/swap.py). With ``isal`` installed
its crc32 (the same values, ~50 GB/s) is used and verify costs little (3.9-4.7 vs 4.9 GB/s in one
run). ``verify=False`` skips it (the header then holds no crc, and readers check none).

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
import fcntl
import gc
import itertools
import json
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import quote

import torch

try:  # same crc32 as zlib, ~10x faster (carry-less multiply)
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

ALIGN = 4096
FORMAT = 1
MAGIC = b"ZFSWAP\x00\x01"
FSYNC = ("never", "write")
LOCK_FILE = ".zfunc-swap.lock"
_O_DIRECT = getattr(os, "O_DIRECT", 0)


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


# ----------------------------------------------------------------------------- paths and files


def rank_dir(path: str | os.PathLike, rank: int | None = None, world: int | None = None) -> Path:
    """The directory under ``path`` for the swap files of process ``rank`` of ``world``: ``path``
    itself for a process alone (``world == 1``), else ``path/rank{rank:05d}``, so the ranks of a job
    given one path never write one file. Default: the global rank and world size of
    ``torch.distributed`` (alone when it is not initialised)."""
    if (rank is None) != (world is None):
        raise ValueError(f"rank, world: pass both or neither, got rank={rank!r}, world={world!r}")
    if rank is None:
        import torch.distributed as dist

        on = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank, world: expected ints with 0 <= rank < world, got rank={rank!r}, world={world!r}")
    return Path(path) if world == 1 else Path(path) / f"rank{rank:05d}"


def check_path(path: str | os.PathLike, need_bytes: int = 0, files: Iterable[int] = ()) -> Path:
    """Create ``path`` if needed; check files can be written there and there is room for
    ``need_bytes`` plus swap files holding ``files`` (payload bytes each): ``disk_bytes(n, block)``
    each, ``block`` being the file system's allocation unit (``statvfs``'s ``f_frsize``, the unit
    free space is counted in), so many small files are not undercounted.

    Raises ``SwapPathError`` naming the path otherwise. Call it before training starts.
    """
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".probe.{os.getpid()}.{threading.get_ident()}.tmp"
        probe.write_bytes(bytes(ALIGN))
        probe.unlink()
    except OSError as e:
        raise SwapPathError(f"path: swap directory {p} cannot be created or written ({e})") from e
    st = os.statvfs(p)
    block = st.f_frsize or ALIGN
    free, sizes = st.f_bavail * block, list(files)
    need = need_bytes + sum(disk_bytes(n, block) for n in sizes)
    if need > free:
        raise SwapPathError(f"path: swap directory {p} has {free / 2**30:.2f} GiB free, needs "
                            f"{need / 2**30:.2f} GiB (need_bytes={need_bytes} + {len(sizes)} files "
                            f"in {block}-byte blocks)")
    return p


def _hold_directory(directory: Path) -> int:
    """Hold ``directory``'s lock file (``flock``, exclusive, not waiting): its fd, the holder's pid
    written in it. The kernel drops the lock with the fd's last close or the process's death."""
    file, collected = directory / LOCK_FILE, False
    while True:
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise SwapPathError(f"path: swap directory {directory} cannot be locked ({e})") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_pid(fd)
            os.close(fd)
            if holder == os.getpid() and not collected:
                # the engine of a dropped step may be waiting in a reference cycle: collecting it
                # runs its finalizer, which releases the lock
                gc.collect()
                collected = True
                continue
            who = "pid unknown" if holder is None else f"pid {holder}"
            who += ", this process" if holder == os.getpid() else ""
            raise SwapInUseError(f"path: swap directory {directory} is in use by another live SwapEngine ({who}); "
                                 "two engines on one directory overwrite each other's files: give each run its "
                                 "own path, or close the engine (drop the step) holding it") from None
        except OSError as e:
            os.close(fd)
            raise SwapPathError(f"path: swap directory {directory} cannot be locked ({e}); its file system must "
                                "support flock") from e
        if _is_file(fd, file):
            break
        os.close(fd)  # its holder removed it between our open and flock: lock the one there now
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _release_directory(fd: int, file: Path) -> None:
    """Remove the lock file while still holding it (a waiter that opened it then sees it gone, see
    ``_hold_directory``), then release it."""
    try:
        if _is_file(fd, file):
            file.unlink()
    except OSError:
        pass  # left behind, harmless: the next engine locks it
    finally:
        os.close(fd)


def _is_file(fd: int, file: Path) -> bool:
    """Whether ``fd`` is the file at ``file`` now."""
    try:
        a, b = os.fstat(fd), os.stat(file)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _holder_pid(fd: int) -> int | None:
    """The pid the lock file's holder wrote (None if not yet written)."""
    try:
        return int(os.pread(fd, 32, 0))
    except ValueError:
        return None


def _o_direct_works(directory: Path) -> bool:
    """Whether the filesystem takes O_DIRECT opens and aligned writes (some refuse with EINVAL)."""
    probe = directory / f".probe.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | _O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [_mv(aligned_empty(ALIGN).zero_())], 0)
        finally:
            os.close(fd)
        return bool(_O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise SwapPathError(f"path: swap directory {directory} cannot be written ({e})") from e
        return False
    finally:
        probe.unlink(missing_ok=True)


def _remove_stale_temporaries(directory: Path) -> None:
    """Remove the ``.<file>.<pid>.<seq>.tmp`` of writers that died mid-write."""
    for tmp in directory.glob(".*.tmp"):
        try:
            os.kill(int(tmp.name.rsplit(".", 3)[1]), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError):
            pass  # not ours, or its writer is alive


def _reserve(fd: int, size: int, file: Path) -> None:
    """Allocate the file's blocks up front: a full disk fails here, before any data moves."""
    try:
        if os.fstat(fd).st_size > size:  # a spare from a bigger tensor
            os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise SwapPathError(f"{file}: no space left for {size} bytes") from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def _spare(file: Path) -> Path:
    return file.with_name(f".{file.name}.spare")


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwritev(fd, [data[done:]], pos + done)


def _pread_all(fd: int, data: memoryview, pos: int, file: Path) -> None:
    n = os.preadv(fd, [data], pos)  # a regular file reads short only at its end (blocks are <= 1 GiB)
    if n < len(data):
        raise SwapChecksumError(f"{file}: truncated, ends at byte {pos + n}, expected {pos + len(data)}")


# ----------------------------------------------------------------------------- one transfer


class _Transfer:
    """One file's blocks, at most ``depth`` in flight on ``pool``; then ``finish(crc)`` or ``cleanup()``.

    A finished block submits the next, so no worker waits on another (no deadlock at any pool size)
    and the blocks of concurrent transfers interleave in the pool's queue. ``fd`` is closed at the
    end, after ``finish`` or ``cleanup``; the future gets finish's value or a ``SwapError`` naming
    ``file`` and saying ``what`` failed.
    """

    def __init__(self, pool: ThreadPoolExecutor, depth: int, nbytes: int, block: int, fd: int, file: Path,
                 what: str, move: Callable[[int, int], int], finish: Callable[[int], object],
                 cleanup: Callable[[], None], fut: Future):
        self.pool, self.fd, self.file, self.what, self.fut = pool, fd, file, what, fut
        self.move, self.finish, self.cleanup = move, finish, cleanup
        self.blocks = [(off, min(block, nbytes - off)) for off in range(0, nbytes, block)]
        self.crcs = [0] * len(self.blocks)
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.next = self.running = min(depth, len(self.blocks))

    def start(self) -> None:
        if not self.blocks:
            return self._end()
        for i in range(self.next):
            self.pool.submit(self._run, i)

    def _run(self, i: int) -> None:
        try:
            self.crcs[i] = self.move(*self.blocks[i])
        except BaseException as e:  # noqa: BLE001 - handed to the future
            with self.lock:
                self.error = self.error or e
        with self.lock:
            j = self.next if self.error is None and self.next < len(self.blocks) else None
            self.next += j is not None
            self.running -= j is None
            last = self.running == 0
        if j is not None:
            self.pool.submit(self._run, j)
        elif last:
            self._end()

    def _end(self) -> None:
        try:
            try:
                if self.error is not None:
                    raise self.error
                result = self.finish(self._crc())
            finally:
                os.close(self.fd)
        except BaseException as e:  # noqa: BLE001 - never leave the future pending
            with contextlib.suppress(BaseException):
                self.cleanup()
            if isinstance(e, OSError) and not isinstance(e, SwapError):
                e = SwapError(f"{self.file}: {self.what} ({e})")
            self.fut.set_exception(e)
        else:
            self.fut.set_result(result)

    def _crc(self) -> int:
        total = self.crcs[0] if self.crcs else 0
        for crc, (_, n) in zip(self.crcs[1:], self.blocks[1:], strict=True):
            total = crc32_combine(total, crc, n)
        return total


# ----------------------------------------------------------------------------- the engine


class SwapEngine:
    """One directory of swap files, read and written by a pool of I/O threads.

    Args:
      path: the directory (created if missing, checked with ``check_path``).
      threads: I/O worker threads, each with one blocking preadv/pwritev in flight (8: checked writes
        reached fio's best at 8 and 16 in benchmarks/swap.py, 4 left them at 0.75x).
      block_bytes: transfer piece size, a multiple of 4096 up to 1 GiB.
      queue_depth: pieces of one transfer in flight at once (default: ``threads``).
      o_direct: use O_DIRECT where the filesystem takes it; ``self.o_direct`` tells what is used.
      fsync: ``"never"`` (atomic against process crashes) or ``"write"`` (and against power loss).
      verify: write a crc32 of every payload and check it on read.
      spare: keep each name's previous version as a hidden spare file that the next write overwrites
        in place and renames: steady-state writes then allocate and free nothing (~1.5x faster on
        ext4, more where freed blocks are discarded) for 2x the disk space; False: fresh files,
        2x only while a name is being written.
      need_bytes: free space to require now, beyond ``files``.
      files: payload bytes of each file to be written: their room is required now, in the file
        system's blocks (``check_path``), twice with ``spare`` (each file and its spare), else
        plus the largest (one new version beside its old).
      lock: hold the directory's lock while open (``SwapInUseError`` if another engine holds it);
        False only for a reader beside the holder, which must not write while the holder does.
    """

    def __init__(self, path: str | os.PathLike, *, threads: int = 8, block_bytes: int = 8 << 20,
                 queue_depth: int | None = None, o_direct: bool = True, fsync: str = "never",
                 verify: bool = True, spare: bool = True, need_bytes: int = 0, files: Iterable[int] = (),
                 lock: bool = True):
        for arg, value in (("threads", threads), ("queue_depth", threads if queue_depth is None else queue_depth)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg}: expected an int >= 1, got {value!r}")
        if not isinstance(block_bytes, int) or not ALIGN <= block_bytes <= 1 << 30 or block_bytes % ALIGN:
            raise ValueError(f"block_bytes: expected a multiple of {ALIGN} up to 1 GiB, got {block_bytes!r}")
        if fsync not in FSYNC:
            raise ValueError(f"fsync: expected one of {FSYNC}, got {fsync!r}")
        files = list(files)
        self.path = check_path(path, need_bytes, files * 2 if spare else files + [max(files, default=0)])
        # closing the lock's fd releases it: on close(), or when an unclosed engine is collected
        self._unlock = (weakref.finalize(self, _release_directory, _hold_directory(self.path), self.path / LOCK_FILE)
                        if lock else lambda: None)
        self.o_direct = bool(o_direct) and _o_direct_works(self.path)
        self.threads, self.block_bytes, self.queue_depth = threads, block_bytes, queue_depth or threads
        self.fsync, self.verify, self.spare = fsync, verify, spare
        self.bytes_written = self.bytes_read = 0  # payload bytes of completed transfers
        _remove_stale_temporaries(self.path)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="zfunc-swap")
        self._lock = threading.Lock()
        self._last: dict[str, Future] = {}  # the last operation issued on each name
        self._pending: set[Future] = set()
        self._versions: dict[str, int] = {}
        self._staging: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._seq = itertools.count()
        self._closed = False

    def file(self, name: str) -> Path:
        """The file that holds ``name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, got {name!r}")
        return self.path / (quote(name, safe="") + ".swap")

    def write(self, name: str, tensor: torch.Tensor) -> Future:
        """Write ``tensor`` (contiguous, CPU, any dtype) as the new version of ``name``.

        Returns a Future of the new file's ``SwapHeader``; don't modify ``tensor`` until it is done.
        If it fails (``SwapError`` naming the file), the previous version of ``name`` is unchanged.
        """
        file, src = self.file(name), _flat_bytes("tensor", tensor)
        header = SwapHeader(0, tensor.dtype, tuple(tensor.shape), src.numel(), None)
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
        file = self.file(name)

        def unlink(fut: Future) -> None:
            existed = file.exists()
            file.unlink(missing_ok=True)
            _spare(file).unlink(missing_ok=True)
            fut.set_result(existed)

        return self._after(name, unlink).result()

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

    def _forget(self, name: str, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)
            if self._last.get(name) is fut:
                del self._last[name]

    # ------------------------------------------------------------------------- write and read

    def _write(self, name: str, file: Path, header: SwapHeader, src: torch.Tensor, fut: Future) -> None:
        version = (self._versions.get(name) or _version_on_disk(file)) + 1
        self._versions[name] = version  # operations on one name run one at a time
        _pack_header(header)  # a shape too long for the header fails here, before any file exists
        tmp = file.with_name(f".{file.name}.{os.getpid()}.{next(self._seq)}.tmp")
        fd = self._open_target(file, tmp)

        def finish(crc: int) -> SwapHeader:
            done = replace(header, version=version, crc32=crc if self.verify else None)
            with self._staged(ALIGN) as buf:
                buf.copy_(torch.frombuffer(bytearray(_pack_header(done)), dtype=torch.uint8))
                _pwrite_all(fd, _mv(buf), 0)
            if self.fsync == "write":
                os.fsync(fd)
            if self.spare:  # the version being replaced becomes the next write's target
                with contextlib.suppress(OSError):  # none yet, or no hard links here: no spare
                    os.link(file, _spare(file))
            os.replace(tmp, file)  # the commit point
            if self.fsync == "write":
                fsync_dir(self.path)
            with self._lock:
                self.bytes_written += header.nbytes
            return done

        try:
            _reserve(fd, file_nbytes(header.nbytes), tmp)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        _Transfer(self._pool, self.queue_depth, header.nbytes, self.block_bytes, fd, file,
                  f"writing {name!r} failed, its previous version is unchanged",
                  lambda off, n: self._move(fd, src[off : off + n], ALIGN + off, file, write=True),
                  finish, lambda: tmp.unlink(missing_ok=True), fut).start()

    def _open_target(self, file: Path, tmp: Path) -> int:
        """Open ``tmp`` for the next version: the spare renamed (overwritten in place), else a new file."""
        if self.spare:
            try:
                os.replace(_spare(file), tmp)
            except FileNotFoundError:
                pass
            else:  # a crash between link and replace leaves the spare a second name of the live file
                if not (file.exists() and os.path.samefile(tmp, file)):
                    return os.open(tmp, os.O_WRONLY | self._direct)
                tmp.unlink()
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._direct, 0o644)

    def _read(self, name: str, file: Path, out: torch.Tensor, dst: torch.Tensor, fut: Future) -> None:
        try:
            fd = os.open(file, os.O_RDONLY | self._direct)
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

        _Transfer(self._pool, self.queue_depth, header.nbytes, self.block_bytes, fd, file, f"reading {name!r} failed",
                  lambda off, n: self._move(fd, dst[off : off + n], ALIGN + off, file, write=False),
                  finish, lambda: None, fut).start()

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


def _flat_bytes(arg: str, t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a flat uint8 tensor; ``t`` must be a contiguous CPU tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous CPU tensor, got device={t.device}, "
                         f"contiguous={t.is_contiguous()}")
    return t.detach().reshape(-1).view(torch.uint8)
