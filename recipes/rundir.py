"""The run folder (``--out``): one run at a time, and a previous run never overwritten.

- **One run at a time.** A run holds an exclusive ``flock`` on ``OUT/run.lock`` from before it
  writes anything in OUT until it ends; the file names the holder (pid, host, command, start
  time). A second run into OUT is refused naming them. The kernel drops an ``flock`` with the last
  descriptor of its process, so a run killed (``kill -9`` included) blocks nothing: the file it
  leaves is rewritten by the next holder, and emptied by a holder that ends normally. Only rank 0
  of a torchrun job locks (its other ranks share OUT and follow rank 0's verdict: ``claimed``).
  On NFS, Linux turns ``flock`` into a POSIX lock the server holds.
- **A previous run is kept.** A fresh start (no ``--resume``) into an OUT that holds a run's own
  files (RUN_FILES: ``metrics.jsonl``, ``loss.png``, checkpoints under ``ckpt``) is refused,
  naming ``--resume``, ``--overwrite`` and another ``--out``. ``--overwrite`` moves those files,
  under the lock, into a new ``OUT/previous-<UTC time>/`` (renames within OUT: nothing is copied or
  deleted; a crash midway leaves each file in one of the two places). ``OUT/tokens``, the token
  cache any run on the same corpus may share, stays where it is.

Costs: an open, an ``flock`` and a write of a few hundred bytes; the check lists OUT/ckpt.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

from recipes import layout
from recipes.layout import FlagError
from recipes.watch import every_rank

LOCK = "run.lock"
RUN_FILES = ("ckpt", "loss.png", "metrics.jsonl")  # what a run writes in OUT (OUT/tokens is a cache)
RECORD_BYTES = 1 << 16  # at most this much of a lock file is read: it holds one small JSON record


class RunDirError(ValueError):
    """OUT is in use by another run, or holds a previous run that a fresh start would overwrite."""


class RunLock:
    """A held lock on ``OUT/run.lock``; ``moved``: where ``claim`` put a previous run (or None).
    ``release()`` (or leaving its ``with``) empties the record and lets go."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd, self.moved = path, fd, None

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)  # drops the flock
            self.fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holder(path: Path) -> dict | None:
    """The record in the lock file ``path`` (pid, host, command, started), or None if unreadable."""
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(RECORD_BYTES))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _described(record: dict | None) -> str:
    if record is None:
        return "a process whose lock record is not written yet"
    return (f"pid {record.get('pid')} on {record.get('host')}, started {record.get('started')}, command: "
            f"{record.get('command')}")


def acquire(out: str | os.PathLike) -> RunLock:
    """Lock ``out`` (created if missing) for this process and write its record in ``out/run.lock``.
    Raises RunDirError naming the holder when another open of the lock file holds it, in this
    process or another."""
    path = Path(out) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirError(f"--out: {str(out)!r} is in use by another run: {_described(holder(path))}; wait for it "
                          "to end, or pass another --out") from None
    except BaseException:
        os.close(fd)
        raise
    lock = RunLock(path, fd)
    try:
        record = dict(pid=os.getpid(), host=socket.gethostname(), command=shlex.join(sys.orig_argv),
                      started=time.strftime("%Y-%m-%d %H:%M:%S %z"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except BaseException:
        lock.release()
        raise
    return lock


def previous_run(out: str | os.PathLike) -> list[str]:
    """The RUN_FILES a run left in ``out``: a non-empty metrics.jsonl, loss.png, a ckpt folder
    holding anything but scratch (names starting with '.')."""
    out, found = Path(out), []
    for name in RUN_FILES:
        p = out / name
        if name == "ckpt":
            if p.is_dir():
                with os.scandir(p) as entries:
                    there = any(not e.name.startswith(".") for e in entries)
            else:
                there = os.path.lexists(p)
        else:
            there = p.exists() and (name != "metrics.jsonl" or p.stat().st_size > 0)
        if there:
            found.append(name)
    return found


def move_aside(out: str | os.PathLike) -> Path | None:
    """Move ``out``'s RUN_FILES into a new ``out/previous-<UTC time>[-n]``; returns it (None: nothing
    to move). Every file is renamed, none copied or deleted."""
    out = Path(out)
    names = [n for n in RUN_FILES if os.path.lexists(out / n)]
    if not names:
        return None
    stamp, n = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), 1
    while True:
        dest = out / (f"previous-{stamp}" if n == 1 else f"previous-{stamp}-{n}")
        try:
            dest.mkdir()
            break
        except FileExistsError:
            n += 1
    for name in names:
        os.rename(out / name, dest / name)
    return dest


def claim(out: str | os.PathLike, *, resume: bool, overwrite: bool) -> RunLock:
    """Lock ``out`` for a run, then check what it holds: ``resume`` continues a previous run in
    place; ``overwrite`` moves a previous run aside (``RunLock.moved``); neither refuses one.
    Raises RunDirError (the lock let go) naming the holder, or the previous run and the ways on."""
    lock = acquire(out)
    try:
        if resume:
            return lock
        found = previous_run(out)
        if found and not overwrite:
            raise RunDirError(f"--out: {str(out)!r} holds a previous run ({', '.join(found)}) that a fresh start "
                              "would overwrite; pass --resume to continue it, --overwrite to move it aside into "
                              f"{str(Path(out) / 'previous-<time>')!r}, or another --out")
        if found:
            lock.moved = move_aside(out)
        return lock
    except BaseException:
        lock.release()
        raise


@contextlib.contextmanager
def claimed(args: argparse.Namespace, launch: layout.Launch) -> Iterator[RunLock | None]:
    """OUT held for this run (``claim``): rank 0 locks it, refuses it if another run holds it
    or a fresh start would overwrite a previous run, and moves that run aside for --overwrite; every
    rank then raises rank 0's refusal (a collective), so a torchrun job's ranks share one verdict and
    never lock against each other. A dry run writes nothing in OUT and claims nothing."""
    if args.dry_run:
        yield None
        return
    lock, refused = None, None
    if launch.rank == 0:
        try:
            lock = claim(Path(args.out), resume=args.resume, overwrite=args.overwrite)
        except RunDirError as e:
            refused = str(e)
        except OSError as e:
            refused = f"--out: cannot lock {str(Path(args.out) / LOCK)!r} ({e})"
    refused = every_rank(refused, launch.world)[0]
    if refused is not None:
        raise FlagError(refused)
    try:
        if lock is not None and lock.moved is not None:
            print(f"--overwrite: moved the previous run ({', '.join(sorted(p.name for p in lock.moved.iterdir()))}) "
                  f"to {lock.moved}")
        yield lock
    finally:
        if lock is not None:
            lock.release()
