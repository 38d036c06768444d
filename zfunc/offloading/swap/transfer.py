"""One swap file's transfer, cut into blocks that run on the engine's thread pool (``zfunc.offloading.swap.engine``).

**Cost.** A transfer of ``nbytes`` is cut into ``block`` pieces with at most ``depth`` in flight;
each finished block submits the next, so concurrent transfers share the workers and interleave in
the pool's queue, and no worker ever waits on another. The per-block crc32s combine into the
payload's (``crc32_combine``: O(log n) per block, no second pass over the data).
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from zfunc.offloading.swap.file_format import SwapError, crc32_combine


class _Transfer:
    """One file's blocks, at most ``depth`` in flight on ``pool``; then ``finish(crc)`` or ``cleanup()``.

    A finished block submits the next, so no worker waits on another (no deadlock at any pool size)
    and the blocks of concurrent transfers interleave in the pool's queue. ``fd`` is closed at the
    end, after ``finish`` or ``cleanup``; the future gets finish's value or a ``SwapError``:
    ``error(e)`` for an OSError ``e`` that is not one already (it names the file and what failed).
    """

    def __init__(self, pool: ThreadPoolExecutor, depth: int, nbytes: int, block: int, fd: int, file: Path,
                 error: Callable[[OSError], SwapError], move: Callable[[int, int], int],
                 finish: Callable[[int], object], cleanup: Callable[[], None], fut: Future):
        self.pool, self.fd, self.file, self.error_of, self.fut = pool, fd, file, error, fut
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
                e = _caused(self.error_of(e), e)
            self.fut.set_exception(e)
        else:
            self.fut.set_result(result)

    def _crc(self) -> int:
        total = self.crcs[0] if self.crcs else 0
        for crc, (_, n) in zip(self.crcs[1:], self.blocks[1:], strict=True):
            total = crc32_combine(total, crc, n)
        return total



def _caused(err: SwapError, cause: OSError) -> SwapError:
    err.__cause__ = cause
    return err
