"""The swap directory: path checks, the one-engine lock, and the raw file operations (used by
``zfunc.offloading.swap.engine``).

**One engine per directory.** An engine holds an exclusive ``flock`` on the directory's
``.zfunc-swap.lock`` for its lifetime (``_hold_directory``); a second engine on the directory, in
this process or another, is refused with ``SwapInUseError`` naming the directory and the holder's
pid (two writers of one name would overwrite each other's versions and spares). The kernel drops the
lock when the engine closes or its process dies, ``kill -9`` included, so the next run on the
directory (a resumed one) starts. Ranks of one job given one path use ``rank_dir(path)``:
``path/rank00003/`` for global rank 3, ``path`` itself for a process alone.

**Room.** ``check_path`` counts each file in the file system's allocation blocks, so many small
files are not undercounted; ``_reserve`` allocates a file's blocks before any data moves, so a full
disk fails before the previous version is touched. A write that finds no room (ENOSPC, EDQUOT)
fails with ``no_room``'s ``SwapPathError``: the directory, its free bytes and the bytes needed,
its ``errno`` the cause's. Temporaries of writers that died mid-write (``.<file>.<pid>.<seq>.tmp``)
are removed by the next engine (``_remove_stale_temporaries``). ``check_readable`` checks a
directory for a reader, writing nothing: a full disk still reads.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from zfunc.offloading.swap.file_format import (ALIGN, SwapChecksumError, SwapInUseError, SwapPathError, _mv,
                                               aligned_empty, disk_bytes)

LOCK_FILE = ".zfunc-swap.lock"
ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a write finds no room: the disk is full, or a quota
_O_DIRECT = getattr(os, "O_DIRECT", 0)


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
    probe = p / f".probe.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        p.mkdir(parents=True, exist_ok=True)
        try:
            probe.write_bytes(bytes(ALIGN))
        finally:  # created, then the write failed (a full disk): not left behind
            probe.unlink(missing_ok=True)
    except OSError as e:
        if e.errno in ROOM_ERRNOS:
            raise no_room(p, ALIGN, "path", e) from e
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


def check_readable(path: str | os.PathLike) -> Path:
    """``path`` if it is a directory this process can read; ``SwapPathError`` naming it otherwise.
    Creates and writes nothing, so a reader works on a full or read-only file system."""
    p = Path(path)
    if not p.is_dir():
        raise SwapPathError(f"path: swap directory {p} does not exist or is not a directory")
    if not os.access(p, os.R_OK | os.X_OK):
        raise SwapPathError(f"path: swap directory {p} cannot be read (permission denied)")
    return p


def free_bytes(path: Path) -> int:
    """Bytes free for this process in ``path``'s file system (``statvfs``: blocks free to non-root)."""
    st = os.statvfs(path)
    return st.f_bavail * (st.f_frsize or ALIGN)


def no_room(directory: Path, need: int, what: str, cause: OSError | None = None) -> SwapPathError:
    """The error for ``what`` (a write, a reservation) finding no room in ``directory``: its free
    bytes and the ``need`` bytes, the cause (ENOSPC; EDQUOT: a quota, which free space does not
    show) kept as ``errno``, ``__cause__`` once raised ``from`` it."""
    quota = cause is not None and cause.errno == errno.EDQUOT
    try:
        free = f"{free_bytes(directory)} bytes free"
    except OSError:
        free = "free space unknown"
    err = SwapPathError(f"{what}: swap directory {directory} {'is over its disk quota' if quota else 'is full'}: "
                        f"{free}, needs {need} bytes{f' ({cause})' if cause is not None else ''}")
    err.errno = errno.ENOSPC if cause is None else cause.errno
    return err


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
        if e.errno in ROOM_ERRNOS:
            raise no_room(directory, ALIGN, "path", e) from e
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


def _reserve(fd: int, size: int, file: Path, what: str) -> None:
    """Allocate the file's ``size`` bytes of blocks up front: a full disk fails here, before any
    data moves, with ``no_room``'s error naming ``file``'s directory (``what``: the operation).
    Blocks the file holds already are kept: reserving them again needs no room."""
    try:
        if os.fstat(fd).st_size > size:  # a spare from a bigger tensor
            os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in ROOM_ERRNOS:
            raise no_room(file.parent, size, what, e) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def reserve_spares(directory: Path, files: Mapping[Path, int]) -> None:
    """Make each file's spare (``spare_path``) hold ``files[file]`` bytes of allocated blocks: created,
    or grown, where missing or short, or where it names the live file (a crash between a commit's
    link and rename). ``SwapPathError`` (``errno`` ENOSPC) naming ``directory``, its free bytes and
    the bytes needed when they do not fit, before anything is allocated. Cost: two stats per file."""
    block = os.statvfs(directory).f_frsize or ALIGN
    short = {}  # file -> (its spare is the live file, bytes of blocks to allocate)
    for file, size in files.items():
        try:
            st = os.stat(spare_path(file))
        except FileNotFoundError:
            short[file] = (False, -(-size // block) * block)
            continue
        alias = _same_file(st, file)
        missing = -(-size // block) * block - (0 if alias else st.st_blocks * 512)
        if missing > 0:
            short[file] = (alias, missing)
    need, free = sum(n for _, n in short.values()), free_bytes(directory)
    if need > free:
        few = ", ".join(sorted(f.name for f in short)[:3]) + (", ..." if len(short) > 3 else "")
        count = f"{len(short)} swap file{'s' if len(short) > 1 else ''}"
        err = SwapPathError(f"path: swap directory {directory} has {free} bytes free, needs {need} more: the room "
                            f"of the next write of {count} ({few}). Free space there, or move the swap files to a "
                            "disk with room")
        err.errno = errno.ENOSPC
        raise err
    for file, (alias, _) in short.items():
        spare = spare_path(file)
        if alias:
            spare.unlink()
        fd = os.open(spare, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            _reserve(fd, files[file], file, f"path: reserving room for {file.name}")
        finally:
            os.close(fd)


def _same_file(st: os.stat_result, file: Path) -> bool:
    try:
        other = os.stat(file)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def _spare_back(file: Path, tmp: Path) -> None:
    """Make ``file``'s spare the file again; the file it replaces becomes the spare (through
    ``tmp``, a hard link: its blocks stay allocated), or is freed without hard links. At every
    moment ``file`` names one complete version."""
    try:
        os.link(file, tmp)
    except OSError:
        tmp = None
    os.replace(spare_path(file), file)  # the commit point
    if tmp is not None:
        os.replace(tmp, spare_path(file))


def spare_path(file: Path) -> Path:
    """Where ``file``'s spare lives (``.<name>.spare`` beside it): the version before its last write,
    whose blocks the next write reuses and ``restore`` renames back. A path only; touches no file."""
    return file.with_name(f".{file.name}.spare")


def _open_target(file: Path, tmp: Path, spare: bool, direct: int) -> int:
    """Open ``tmp`` for ``file``'s next version: the spare renamed (overwritten in place; with
    ``spare``), else a new file; ``direct``: O_DIRECT or 0."""
    if spare:
        try:
            os.replace(spare_path(file), tmp)
        except FileNotFoundError:
            pass
        else:  # a crash between link and replace leaves the spare a second name of the live file
            if not (file.exists() and os.path.samefile(tmp, file)):
                return os.open(tmp, os.O_WRONLY | direct)
            tmp.unlink()
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct, 0o644)


def _put_back(tmp: Path, file: Path, spare: bool) -> None:
    """A failed write's temporary becomes ``file``'s spare (garbage, but its blocks stay
    allocated: the room is kept), or is removed without ``spare``. Gone already if the commit
    happened, or the target was never opened."""
    if spare:
        with contextlib.suppress(FileNotFoundError):
            os.replace(tmp, spare_path(file))
    else:
        tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    """Write all of ``data`` at ``pos``, going on after short writes; a write of nothing (which
    would loop forever) raises OSError(EIO)."""
    done = 0
    while done < len(data):
        n = os.pwritev(fd, [data[done:]], pos + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short write: {done} of {len(data)} bytes at offset {pos} written, then none")
        done += n


def _pread_all(fd: int, data: memoryview, pos: int, file: Path) -> None:
    n = os.preadv(fd, [data], pos)  # a regular file reads short only at its end (blocks are <= 1 GiB)
    if n < len(data):
        raise SwapChecksumError(f"{file}: truncated, ends at byte {pos + n}, expected {pos + len(data)}")

