"""A folder of checkpoints: which paths zfunc owns there, and how it claims, replaces, prunes and
points to them (``zfunc.checkpoint.save_load`` says what a saved state means).

**Ownership.** zfunc writes, replaces or deletes a path only when it is absent or is what zfunc
itself writes there: a checkpoint directory (a readable manifest, no files but the manifest and
rank files), an empty directory, the ``latest`` pointer (a one-line file), or its scratch names
beside a checkpoint (``.NAME.tmp`` holding only rank files and a manifest, an empty
``.NAME.lock``). ``foreign`` says why a path is not zfunc's; ``claim`` checks every path a save
will write before it writes any.

**Replacing.** ``exchange`` swaps two directories in one step (Linux ``renameat2`` with
``RENAME_EXCHANGE``), so a checkpoint being replaced is, at every instant, either the old one or
the new one. ``locked`` serialises writers of one path across threads and processes (``flock`` on
a lock file beside it, opened by each writer).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from zfunc.checkpoint.files import LATEST, MANIFEST, RANK_FILE, CheckpointError
from zfunc.checkpoint.manifest import read_manifest
from zfunc.offloading.swap.directory import fsync_dir


def checkpoint_path(directory: Any, argument: str = "directory") -> Path:
    """``directory`` as a ``Path``; ``argument`` names it in the error when it is not a path."""
    if directory is None:
        raise CheckpointError(f"{argument}: expected a checkpoint directory, got None (zf.checkpoint.latest(root) "
                              "returns None when no checkpoint was saved under root yet)")
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"{argument}: expected a path (str or os.PathLike), got {type(directory).__name__}")
    return Path(directory)


def default_run(name: str) -> str:
    """The default run of a checkpoint named ``name``: the name without its trailing digits."""
    return re.sub(r"\d+$", "", name)


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
        ok = text and "\n" not in text and "/" not in text and "\0" not in text and text not in (".", "..")
        return None if ok else "is not zfunc's pointer file (one line naming a checkpoint beside it)"
    if not path.is_dir():
        return "is a file, not a directory"
    names = sorted(os.listdir(path))
    others = [n for n in names if n != MANIFEST and not RANK_FILE.fullmatch(n)]
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


def scratch(final: Path, kind: str) -> Path:
    """The hidden path beside ``final`` a save uses as ``kind``: "tmp", "old", "lock" or "pruned"."""
    return final.with_name(f".{final.name}.{kind}")


def claim(final: Path, held: ExitStack) -> str | None:
    """Rank 0: lock ``final`` for this save (held until ``held`` closes) and check that every path
    the save writes is absent or zfunc's; remove a crashed save's scratch. The refusal, or None."""
    root = final.parent
    refusal = ("{path} {why}; zf.checkpoint.save writes only its own files (expected a new path, an empty "
               "directory or a zfunc checkpoint to replace); nothing was written")
    try:
        if (root / MANIFEST).is_file() and foreign(root, "checkpoint") is None:
            return (f"directory: its parent {root} is a checkpoint itself; save checkpoints beside each other "
                    "(ckpt/000100, ckpt/000200), not inside one; nothing was written")
        root.mkdir(parents=True, exist_ok=True)
        lock = scratch(final, "lock")
        why = foreign(lock, "lock")
        if why:
            return "directory: " + refusal.format(path=lock, why=why)
        held.enter_context(locked(lock))  # a concurrent save to ``final`` finishes first
        checks = [(final, "checkpoint"), (scratch(final, "tmp"), "scratch"), (scratch(final, "old"), "checkpoint"),
                  (root / LATEST, "pointer"), (root / ".latest.lock", "lock")]
        for path, kind in checks:
            why = foreign(path, kind)
            if why:
                return "directory: " + refusal.format(path=path, why=why)
        for kind in ("tmp", "old"):  # a crashed save's: checked above to hold only checkpoint files
            shutil.rmtree(scratch(final, kind), ignore_errors=True)
    except OSError as e:
        return f"directory: cannot save to {final} ({e}); nothing was written"
    return None


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


def put_in_place(tmp: Path, final: Path) -> None:
    """Move the written ``tmp`` to ``final``, swapping it with what is there in one step."""
    if os.path.lexists(final):
        if not exchange(tmp, final):  # no atomic swap here: two renames
            old = scratch(final, "old")
            os.replace(final, old)
            os.replace(tmp, final)
            tmp = old
        fsync_dir(final.parent)
        shutil.rmtree(tmp)  # the checkpoint it replaced
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def prune(root: Path, run: str, keep_last: int, keep: set[str]) -> None:
    """Delete all but the ``keep_last`` checkpoints of ``run`` in ``root`` with the highest step
    (ties: the names' order), sparing ``keep``, what ``latest`` names, and directories holding
    files zfunc did not write."""
    pointer = root / LATEST
    if foreign(pointer, "pointer") is None and pointer.exists():
        keep = keep | {pointer.read_text().strip()}
    ours = []
    for path in root.iterdir():
        if path.name.startswith(".") or not path.is_dir() or foreign(path, "checkpoint"):
            continue
        try:
            manifest = read_manifest(path)
        except CheckpointError:  # an empty directory
            continue
        if manifest.get("run", default_run(path.name)) == run and isinstance(manifest.get("step"), int):
            ours.append((manifest["step"], path.name))
    for _, name in sorted(ours)[:-keep_last]:
        if name not in keep:
            remove(root / name)
    for leftover in root.glob(".*.pruned"):  # a prune killed mid-delete: only zfunc makes these names
        if foreign(leftover, "scratch") is None:
            shutil.rmtree(leftover)
    for lock in root.glob(".*.lock"):  # a save killed while holding its lock leaves the empty file
        if lock.name != ".latest.lock" and foreign(lock, "lock") is None:
            remove_if_free(lock)


def remove_if_free(lock: Path) -> None:
    """Unlink the lock file ``lock`` unless a live writer holds it. A waiter that opened it before
    the unlink sees another inode at the path once it gets the lock, and tries again (``locked``)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return
    try:
        if os.stat(lock).st_ino == os.fstat(fd).st_ino:
            os.unlink(lock)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete the checkpoint ``path``: renamed to ``.NAME.pruned`` first (fsynced), so a kill
    mid-delete leaves a name that the next prune recognises and finishes, never a checkpoint
    without its manifest that nothing would delete."""
    doomed = scratch(path, "pruned")
    if os.path.lexists(doomed) and foreign(doomed, "scratch") is None:
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed)


def latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint ``root/latest`` names (the last one saved into ``root``), or None when
    ``root`` has no ``latest`` yet. Raises ``CheckpointError`` when ``latest`` names something
    that is not a checkpoint (deleted by hand, or not zfunc's file): resuming must not silently
    start over."""
    pointer = checkpoint_path(root, "root") / LATEST
    if not os.path.lexists(pointer):
        return None
    why = foreign(pointer, "pointer")
    if why:
        raise CheckpointError(f"root: {pointer} {why}")
    path = Path(root) / pointer.read_text().strip()
    try:
        read_manifest(path)
    except CheckpointError as e:
        raise CheckpointError(f"root: {pointer} names {path.name!r}, which is not a checkpoint ({e})") from None
    return path
