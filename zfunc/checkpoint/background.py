"""Background checkpoint saves: the state's snapshot, the writer thread, and the handle a caller
waits on (``zfunc.checkpoint.save_load`` says what a save writes and guarantees).

``zf.checkpoint.save(state, path, blocking=False)`` does on the calling thread what needs the
caller: the argument checks, the collectives that decide who writes what, the claim of ``path``
(rank 0's lock), and it starts the snapshot. It returns a ``SaveHandle`` while one thread per
process copies, writes, and -- with several ranks -- gathers the checksums, writes the manifest
and puts the checkpoint in place, on a process group of its own (gloo, made once by every rank
on its first background save), so its collectives never interleave with training's.

**The snapshot.** What is written is the state as it was when ``save`` was called:

- CUDA tensors are copied into pinned host buffers before ``save`` returns, enqueued on the
  current stream (the training's later kernels, in place or not, run after the copy).
- CPU tensors are copied into host buffers by the writer thread, and a donating step waits for
  that copy before it first writes into any state (``zfunc.core.state.before_consume``). This is the
  donation rule doing the protecting: a step writes into a state only once it consumes it, so the
  forward and backward of the next step overlap the copy, and training is blocked only when the
  copy takes longer than they do. A copy rather than writing from the state's own memory: the
  copy runs at memory speed (several GB/s), the write at disk speed, so a step waiting for the
  copy waits a fraction of what it would wait for the write. Module buffers (``state.buffers``,
  which the forward updates before the state is consumed) and small leaves are copied before
  ``save`` returns.
- The host buffers are kept for the next background save of the same sizes (no page faults, no
  re-pinning, the second time): up to ``KEEP_BYTES`` (default: all), so a run that saves in the
  background holds a second copy of this rank's state in host memory between saves, as torch
  DCP's async staging does. ``free_buffers()`` drops them; ``KEEP_BYTES = 0`` frees them when
  each save finishes (``handle.wait()`` returns after that).

**The write** runs at ``WRITER_NICE`` and is paced (``SAVE_DUTY``, ``zfunc.checkpoint.disk_io.Pace``): each
I/O thread writes at most that share of the wall time, so the save spans more steps and costs
each of them less, until someone waits for it -- ``handle.wait()`` or the next ``save`` -- and the
rest goes at full speed; so does a save under way when the interpreter exits, which waits for it.

So between ``save`` and the step that consumes the state, the state must not be changed by other
means (an in-place edit by hand): the copy may not have been taken yet. ``handle.wait()`` returns
once the checkpoint is in place on every rank (and re-raises the writer's error);
``handle.done()`` says whether it has finished. The next ``save`` waits for the previous one; an
error nobody waited for is raised by the next ``save``. A crash or ``kill -9`` during a
background save leaves what a crash during a blocking save leaves: the previous checkpoint, whole.
"""
from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from zfunc.core import env, state as state_module
from zfunc.checkpoint.disk_io import Pace
from zfunc.offloading.swap.file_format import aligned_empty

EAGER_BYTES = 1 << 20  # leaves smaller than this are copied before save returns
# Host buffers of a finished background save kept for the next one, at most this many bytes
# (0: all freed when the save finishes; the default keeps them all). Keeping them saves the next
# snapshot its page faults (memory that sat free may have gone back to a VM's host, 0.5-2 s per GB
# to fault in again; pinned CUDA buffers also their re-pinning), at the price of holding them
# between saves; benchmarks/checkpoint.py --no-save-load measures a step during a save either way.
KEEP_BYTES: float = math.inf


class SaveHandle:
    """A save under way in the background: ``wait()`` (the directory, or the writer's error) and
    ``done()``."""

    def __init__(self, directory: Path, pace: Pace | None = None):
        self.directory = directory
        self._pace = pace
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._reported = False

    def done(self) -> bool:
        """True once the save has finished, in place or failed."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the checkpoint is in place (on every rank); return its directory. Raises
        the writer's error, or ``TimeoutError`` when ``timeout`` seconds pass first. The rest of
        the write goes at full speed (``SAVE_DUTY`` paces it only while nobody waits)."""
        self.hurry()
        if not self._finished.wait(timeout):
            raise TimeoutError(f"zf.checkpoint.save of {self.directory}: not finished after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.directory

    def hurry(self) -> None:
        """Write the rest at full speed: someone waits for it."""
        if self._pace is not None:
            self._pace.hurry()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "running"
        return f"SaveHandle({str(self.directory)!r}, {state})"


_previous: SaveHandle | None = None
_previous_lock = threading.Lock()


def _finished_previous() -> SaveHandle | None:
    """This process's last background save, hurried (no longer paced) and waited for; None if
    there was none."""
    with _previous_lock:
        handle = _previous
    if handle is not None:
        handle.hurry()
        handle._finished.wait()
    return handle


def wait_for_previous() -> None:
    """Wait for this process's last background save; raise its error if nobody has seen it."""
    handle = _finished_previous()
    if handle is not None and handle._error is not None and not handle._reported:
        handle._reported = True
        raise handle._error


# ----------------------------------------------------------------------------- snapshot

_free: dict[tuple[int, bool], list[torch.Tensor]] = {}  # buffers kept (KEEP_BYTES), by (bytes, pinned)
_free_lock = threading.Lock()
_copying: set[threading.Event] = set()  # snapshots whose CPU copies are not taken yet


def _wait_for_copies() -> None:
    for copied in list(_copying):
        copied.wait()


state_module.before_consume.append(_wait_for_copies)


def _host_buffer(like: torch.Tensor, pinned: bool) -> torch.Tensor:
    nbytes = like.numel() * like.element_size()
    with _free_lock:
        kept = _free.get((nbytes, pinned))
        raw = kept.pop() if kept else None
    if raw is None:
        raw = aligned_empty(nbytes, pin=pinned)[:nbytes]
    return raw.view(like.dtype).view(like.shape)


class Snapshot:
    """Host copies of the tensors one rank writes, taken as the module docstring says."""

    def __init__(self, tensors: dict[str, torch.Tensor], eager: Callable[[str], bool]):
        self.copies: dict[str, torch.Tensor] = {}
        self._later: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._event = None
        for name, x in tensors.items():
            x = x.detach()
            on_cuda = x.device.type == "cuda"
            out = self.copies[name] = _host_buffer(x, pinned=on_cuda)
            if on_cuda:
                out.copy_(x, non_blocking=True)
            elif eager(name) or x.numel() * x.element_size() < EAGER_BYTES or not x.is_contiguous():
                out.copy_(x)
            else:
                self._later.append((out, x))
        if any(x.device.type == "cuda" for x in tensors.values()):
            self._event = torch.cuda.Event()
            self._event.record()
        self.copied = threading.Event()
        if self._later:
            _copying.add(self.copied)
        else:
            self.copied.set()

    def take(self) -> dict[str, torch.Tensor]:
        """On the writer thread: finish the copies (CPU ones by memcpy, without the GIL or torch's
        intra-op threads, which training uses); then steps may write into the state again."""
        try:
            for out, x in self._later:
                np.copyto(out.reshape(-1).view(torch.uint8).numpy(), x.reshape(-1).view(torch.uint8).numpy())
            if self._event is not None:
                self._event.synchronize()
        finally:
            self.release_state()
        return self.copies

    def release_state(self) -> None:
        self.copied.set()
        _copying.discard(self.copied)

    def recycle(self) -> None:
        """Drop the host buffers: keep up to ``KEEP_BYTES`` of them for the next save (in place of
        what an earlier save kept), free the rest."""
        kept: dict[tuple[int, bool], list[torch.Tensor]] = {}
        room = KEEP_BYTES
        for t in sorted(self.copies.values(), key=lambda t: -t.numel() * t.element_size()):
            nbytes = t.numel() * t.element_size()
            if nbytes <= room:
                kept.setdefault((nbytes, t.is_pinned()), []).append(t.reshape(-1).view(torch.uint8))
                room -= nbytes
        self.copies, self._later = {}, []
        with _free_lock:
            _free.clear()
            _free.update(kept)


def kept_bytes() -> int:
    """Bytes of host buffers kept for the next background save (at most ``KEEP_BYTES``)."""
    with _free_lock:
        return sum(nbytes * len(ts) for (nbytes, _), ts in _free.items())


def free_buffers() -> None:
    """Free the host buffers kept for the next background save."""
    with _free_lock:
        _free.clear()


# ----------------------------------------------------------------------------- the writer thread

_groups: dict[tuple, object] = {}

# The writer thread's niceness once its copies are taken (Linux: per thread, and the I/O threads it
# starts inherit it): the crc32 and the writes' CPU work then give way to the training step on a
# machine whose cores the step uses all of (the save spans more steps, each slowed less); the
# writes themselves wait on the disk. Set it here or with ZFUNC_WRITER_NICE.
WRITER_NICE = env.number("ZFUNC_WRITER_NICE", 19, int, lambda n: -20 <= n <= 19, "a niceness, an int in [-20, 19]")


# The share of the wall time each of a background save's I/O threads spends writing
# (``zfunc.checkpoint.disk_io.Pace``) until someone waits for the save (``handle.wait()``, the next
# save), which lifts it. 1: no pacing. A save costs training a roughly fixed amount (its ~0.14 s of CPU
# for 0.6 GB, the copy, the host's side of the I/O), so spreading it over more steps costs each step
# less (``benchmarks/checkpoint.py --no-save-load --variant`` compares duties). A save that takes 1/duty
# times as long is still done long before the next one is due (saves are minutes apart), and a save
# someone waits for runs at full speed. Set it here or with ZFUNC_SAVE_DUTY.
SAVE_DUTY = env.number("ZFUNC_SAVE_DUTY", 0.1, float, lambda d: 0 < d <= 1, "a fraction in (0, 1]")


def pace() -> Pace:
    """A new background save's pace (``SAVE_DUTY``)."""
    return Pace(SAVE_DUTY)


def _finish_at_exit() -> None:
    """An exiting interpreter's last background save, finished at full speed (an error nobody
    saw goes to stderr)."""
    handle = _finished_previous()
    if handle is not None and handle._error is not None and not handle._reported:
        e = handle._error
        print(f"zf.checkpoint.save of {handle.directory} (in the background) failed: {type(e).__name__}: {e}",
              file=sys.stderr)


# The interpreter runs threading's exit hooks, last registered first, before it joins the threads
# left; concurrent.futures' hook (registered when zfunc.checkpoint.disk_io imported it, before this one)
# refuses new work from then on, which failed a save still under way at exit ("cannot schedule
# new futures after interpreter shutdown"). So the save is finished first. (A private hook: where
# it is missing, a save under way at exit may fail so; the previous checkpoint stays.)
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_finish_at_exit)


def _taken(snapshot: Snapshot) -> dict[str, torch.Tensor]:
    """The snapshot's copies, taken at training's priority (the next step may be waiting for them);
    then this thread gives way to training for the write."""
    copies = snapshot.take()
    _yield_to_training()
    return copies


def _yield_to_training() -> None:
    """This thread (only) at ``WRITER_NICE``, never less nice than it was."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, max(WRITER_NICE, os.getpriority(os.PRIO_PROCESS, me)))
    except (AttributeError, OSError):  # no per-thread priority here: leave it
        pass


def background_group(world: int):
    """The gloo process group the writer threads' collectives run on (made by every rank, once)."""
    key = (id(dist.group.WORLD), world)
    if key not in _groups:
        _groups[key] = dist.new_group(backend="gloo")
    return _groups[key]


def start(directory: Path, snapshot: Snapshot, write: Callable[[dict[str, torch.Tensor]], None],
          cleanup: Callable[[], None], pace: Pace | None = None) -> SaveHandle:
    """Run ``write(snapshot.take())`` on a new thread, then ``cleanup()``; the handle (whose
    ``wait()`` hurries ``pace``, the write's)."""
    global _previous
    handle = SaveHandle(directory, pace)

    def run() -> None:
        try:
            write(_taken(snapshot))  # no local name: the copies are freed with the snapshot's
        except BaseException as e:  # noqa: BLE001 - handed to the handle
            handle._error = e
        finally:
            snapshot.release_state()
            try:
                cleanup()
            except BaseException as e:  # noqa: BLE001
                handle._error = handle._error or e
            snapshot.recycle()
            handle._finished.set()

    with _previous_lock:
        _previous = handle
    # not a daemon: an interpreter that exits waits for the save to finish
    threading.Thread(target=run, name=f"zf.checkpoint.save {directory}", daemon=False).start()
    return handle
