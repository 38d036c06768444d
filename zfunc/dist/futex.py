"""Sleeping in the kernel until a peer process changes a word of a shared mapping: Linux's futex.

A wait on shared memory that polls either burns a core (spinning) or answers late (sleeping between
looks); on a host with more ranks than cores both cost the rank that computes. ``wait_until``
instead spins a little (not at all when told ``busy_s=0``), then flags itself asleep in the shared
segment and blocks in ``futex(FUTEX_WAIT)`` on the 32-bit word its peer changes; the peer, after
changing that word, calls ``wake_if_asleep``, which enters the kernel only when the flag is set.

**Law: no lost wake-up.** The waiter reads the word's value ``v``, sets its flag, checks ``ready()``
again and only then waits on ``v``: the kernel compares the word to ``v`` under its own lock and
returns at once if it changed. The peer stores the word, then a full fence (x86 orders a store
before a later load only across a locked instruction), then reads the flag. Store-buffering with
a fence on both sides (the syscall's entry is the waiter's, ``fence`` the peer's) cannot leave
both sides reading the old value: either the waiter's kernel sees the new word, or the peer
sees the flag and wakes it. Each wait still ends after ``check_s`` so the caller's liveness
checks (a dead peer, the group's timeout) run in between.

**Scope.** x86-64 Linux (syscall 202), the only place zfunc's shared-memory channels run. The
word lives in a ``MAP_SHARED`` mapping, so the process-private flag (``FUTEX_PRIVATE_FLAG``) is
not used. No file, no descriptor.

**Cost.** A wake: one fence (a lock's acquire and release, ~0.1 us) per publish, plus one system
call (~1-2 us) only while the peer sleeps. A wait: one system call and two context switches.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Callable

import numpy as np

SYS_FUTEX = 202  # x86-64
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the word is in a segment several processes map
WAKE_ALL = 0x7FFFFFFF
_SPIN_S = 20e-6
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_fence_lock = threading.Lock()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wait(addr: int, expected: int, timeout_s: float) -> None:
    """Block until a ``wake`` on ``addr`` (a 4-byte aligned address in a shared mapping), ``timeout_s``,
    or a signal; at once if the 32-bit word there is not ``expected`` (its low 32 bits)."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    r = _syscall(ctypes.c_long(SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(FUTEX_WAIT),
                 ctypes.c_long(expected & 0xFFFFFFFF), ctypes.byref(ts), None, ctypes.c_long(0))
    if r < 0:
        e = ctypes.get_errno()
        if e not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(e, f"futex wait on {addr:#x}: {os.strerror(e)}")


def wake(addr: int, count: int = WAKE_ALL) -> int:
    """Wake up to ``count`` processes blocked in ``wait`` on ``addr``; how many it woke."""
    r = _syscall(ctypes.c_long(SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(FUTEX_WAKE), ctypes.c_long(count),
                 None, None, ctypes.c_long(0))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"futex wake on {addr:#x}: {os.strerror(e)}")
    return r


def fence() -> None:
    """A full memory fence: an uncontended lock's acquire and release, each a locked instruction on x86."""
    with _fence_lock:
        pass


def wake_if_asleep(word: np.ndarray, asleep: np.ndarray) -> None:
    """After storing ``word`` (a one-element int64 view of a shared segment): wake whoever waits on it if
    ``asleep`` (a one-element view there) is set."""
    fence()
    if asleep[0]:
        wake(word.ctypes.data)


def wait_until(ready: Callable[[], bool], word: np.ndarray | Callable[[], tuple[np.ndarray, int]],
               asleep: np.ndarray, stalled: Callable[[float], None], busy_s: float, check_s: float = 1.0) -> None:
    """Return once ``ready()``, which turns true only after a peer changes ``word`` (a one-element int64 view
    of a shared segment; its low 32 bits are the futex word) and calls ``wake_if_asleep(word, asleep)``.
    Spins, then yields the core, for ``busy_s`` in all (0: neither), then sleeps in the kernel with
    ``asleep`` set to 1 (only this waiter sets and clears it), calling ``stalled(seconds waited)`` every
    ``check_s`` (it raises to give up). ``word`` may be a function giving, before each sleep, the word
    that must move next and the mark to set ``asleep`` to (1 or more; then the peer that moves the word
    wakes it when ``asleep`` holds that mark)."""
    if ready():
        return
    start = time.monotonic()
    while busy_s > 0:
        waited = time.monotonic() - start
        if waited >= busy_s:
            break
        if waited >= _SPIN_S:
            os.sched_yield()
        if ready():
            return
    last_check = start
    try:
        while True:
            target, mark = (word, 1) if isinstance(word, np.ndarray) else word()
            value = int(target[0])
            asleep[0] = mark
            if ready():
                return
            wait(target.ctypes.data, value, check_s)
            if ready():
                return
            now = time.monotonic()
            if now - last_check >= check_s:
                last_check = now
                stalled(now - start)
    finally:
        asleep[0] = 0
