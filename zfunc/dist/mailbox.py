"""Point-to-point transfers through shared memory between the ranks of a gloo group on one host.

gloo sends a pipeline's activations through TCP loopback, each message a few system calls and a
wake-up of gloo's threads on both sides. ``Mailboxes`` gives every ordered pair of the group's ranks
a ring in one shared segment (``zfunc.dist.shm.open_segment``): a send copies the tensor into the
ring behind a 64-byte header (tag, bytes) and publishes the ring's new end; a receive reads the
messages from its sender's ring in order, copying the one it wants into its buffer and setting
aside (a private copy) any other tag's that comes first, so sends and receives between a pair match
in call order per tag, as gloo's do.

**Never blocking a send.** A send that finds no room in its ring (its receiver is behind) is handed
to a thread that writes it once there is; every later send of this rank goes through that thread
too until it is idle, so each ring's messages keep their call order. Its ``wait()`` returns once
written; the tensor must not change until then (``P2P.send``'s contract).

**Law.** A message's bytes arrive unchanged. Only messages up to half a ring (``fits``) use it; both
sides decide by the tensor's bytes, so a larger message goes through gloo on both.

**Ordering** rests on x86's total store order, as the channel's (``zfunc.dist.shm``). **Waiting**
(a receive for its message, the sending thread for room) spins and yields for ``busy_s`` (default
``BUSY_S``: not at all), then sleeps in the kernel (``zfunc.dist.futex``) on the word
its peer moves (the ring's end, or its start), flagged asleep in the pair's control line; a peer
that moves the word makes a system call to wake it only when that flag is set. Every second it
checks that its peer lives and gives up after the process group's timeout with ``ShmError``.

**Cost.** Memory: ``world * world * ring_bytes`` of shared pages (``ZFUNC_SHM_RING_MB``, default 4 MiB a
ring). Per message: one copy in, one copy out (two when set aside), one memory fence on each side, no
system call when both sides are ready (a wake-up: one on each side).
"""
from __future__ import annotations

import collections
import os
import threading

import numpy as np
import torch
import torch.distributed as dist

from zfunc.core import env
from zfunc.dist import futex, shm
from zfunc.dist.shm import CONTROL_BYTES, ShmError, give_up_if_gone, held_for, open_segment

RING_BYTES = int(env.number("ZFUNC_SHM_RING_MB", 4, int, lambda mb: mb >= 1, "an integer >= 1 (MiB)")) << 20
HEADER = 64
_WRAP = -1  # a header's tag: the ring's end is skipped, the next message starts at its beginning
# a pair's control words: bytes written by the sender, bytes consumed by the receiver, and whether the
# receiver sleeps until TAIL moves, the sender (its thread) until HEAD does
TAIL, HEAD, RECV_ASLEEP, SEND_ASLEEP = 0, 1, 2, 3
# A wait spins and yields this long before it sleeps in the kernel; by default not at all: a pipeline's
# receive finds its message already there or waits out a bubble (ms), where a spin only burns the core
# (2 stages on 2 cores: 1 ms of spin measured 0-3% slower than none, four alternated runs of
# benchmarks/pipeline.py each way).
BUSY_S = 0.0


def _padded(nbytes: int) -> int:
    return -(-nbytes // HEADER) * HEADER


class Mailboxes:
    """The rings of one group's ranks (see the module docstring). Made by ``mailboxes_of``."""

    def __init__(self, segment, world: int, rank: int, ring_bytes: int, timeout_s: float, label: str,
                 busy_s: float = BUSY_S):
        self.world, self.rank, self.ring_bytes, self.timeout_s, self.label = world, rank, ring_bytes, timeout_s, label
        self.busy_s = busy_s
        self.control = np.ndarray((world, world, 8), dtype=np.int64, buffer=segment)  # [src, dst]: TAIL, HEAD, ..
        # one-element views of each pair's words: what a futex waits on and is woken at
        self.words = [[[self.control[s, d, w:w + 1] for w in range(4)] for d in range(world)] for s in range(world)]
        self.pids = np.ndarray((world,), dtype=np.int64, buffer=segment, offset=world * world * 64)
        self.rings = torch.frombuffer(segment, dtype=torch.uint8, count=world * world * ring_bytes,
                                      offset=CONTROL_BYTES).view(world, world, ring_bytes)
        self.pids[rank] = os.getpid()
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()
        self._backlog: collections.deque = collections.deque()  # sends waiting for room, in call order
        self._thread: threading.Thread | None = None
        self._set_aside: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)

    def fits(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` goes through a ring (else through gloo, on both sides)."""
        return HEADER + _padded(nbytes) <= self.ring_bytes // 2

    # ------------------------------------------------------------------ sending
    def send(self, t: torch.Tensor, to: int, tag: int) -> _Sent:
        """Copy ``t`` (contiguous) into the ring to ``to`` now if it has room and nothing waits before it,
        else hand it to the sending thread."""
        data = t.reshape(-1).view(torch.uint8)
        if not self.fits(data.numel()):
            raise ValueError(f"t: {data.numel()} bytes do not fit in a ring of {self.ring_bytes} (see fits)")
        sent = _Sent()
        with self._send_lock:
            if not self._backlog and self._write(to, tag, data):
                sent.finished.set()
                return sent
            self._backlog.append((to, tag, data, sent))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._drain, name="zfunc-mailbox", daemon=True)
                self._thread.start()
        return sent

    def _drain(self) -> None:
        while True:
            with self._send_lock:
                if not self._backlog:
                    self._thread = None
                    return
                to, tag, data, sent = self._backlog[0]
            try:
                words = self.words[self.rank][to]
                futex.wait_until(lambda: self._write(to, tag, data), words[HEAD], words[SEND_ASLEEP],
                                 lambda waited: self._stalled(to, waited, "make room"), self.busy_s)
            except Exception as e:  # the receiver died or timed out: this send and every later one fail
                with self._send_lock:
                    for *_, later in self._backlog:
                        later.error = e
                        later.finished.set()
                    self._backlog.clear()
                    self._thread = None
                return
            with self._send_lock:
                self._backlog.popleft()
            sent.finished.set()

    def _write(self, to: int, tag: int, data: torch.Tensor) -> bool:
        """Write one message into the ring to ``to`` if it has room; whether it did."""
        control, size = self.control[self.rank, to], self.ring_bytes
        tail = int(control[TAIL])
        free = size - (tail - int(control[HEAD]))
        at, need = tail % size, HEADER + _padded(data.numel())
        skip = size - at if size - at < need else 0  # the message does not fit before the end: wrap
        if free < skip + need:
            return False
        ring = self.rings[self.rank, to]
        if skip:
            ring[at:at + 16].view(torch.int64).copy_(torch.tensor([_WRAP, 0]))
            at = 0
        ring[at + HEADER:at + HEADER + data.numel()].copy_(data)
        ring[at:at + 16].view(torch.int64).copy_(torch.tensor([tag, data.numel()]))
        control[TAIL] = tail + skip + need  # published after the message's bytes (total store order)
        words = self.words[self.rank][to]
        futex.wake_if_asleep(words[TAIL], words[RECV_ASLEEP])
        return True

    # ------------------------------------------------------------------ receiving
    def recv(self, t: torch.Tensor, frm: int, tag: int) -> _Received:
        """A receive into ``t`` (contiguous) of ``frm``'s next message of ``tag``, done at ``wait()``."""
        return _Received(self, t, frm, tag)

    def take(self, out: torch.Tensor, frm: int, tag: int, block: bool) -> bool:
        """Copy ``frm``'s next message of ``tag`` into ``out``; whether it was there (``block``: wait for it)."""
        out_bytes = out.reshape(-1).view(torch.uint8)
        with self._recv_lock:
            if block:
                words = self.words[frm][self.rank]
                futex.wait_until(lambda: self._take(out_bytes, frm, tag), words[TAIL], words[RECV_ASLEEP],
                                 lambda waited: self._stalled(frm, waited, "send"), self.busy_s)
                return True
            return self._take(out_bytes, frm, tag)

    def _take(self, out: torch.Tensor, frm: int, tag: int) -> bool:
        kept = self._set_aside.get((frm, tag))
        if kept:
            return self._deliver(out, kept.popleft(), frm, tag)
        control, size, ring = self.control[frm, self.rank], self.ring_bytes, self.rings[frm, self.rank]
        found = moved = False
        while not found:
            head = int(control[HEAD])
            if head == int(control[TAIL]):
                break
            at = head % size
            got, nbytes = ring[at:at + 16].view(torch.int64).tolist()
            if got == _WRAP:
                control[HEAD] = head + size - at
                moved = True
                continue
            payload = ring[at + HEADER:at + HEADER + nbytes]
            if got == tag:
                found = self._deliver(out, payload, frm, tag)
            else:
                self._set_aside[(frm, got)].append(payload.clone())
            control[HEAD] = head + HEADER + _padded(nbytes)  # the bytes are copied: the sender may reuse them
            moved = True
        if moved:  # room in the ring: a sender waiting for it wakes
            words = self.words[frm][self.rank]
            futex.wake_if_asleep(words[HEAD], words[SEND_ASLEEP])
        return found

    def _deliver(self, out: torch.Tensor, payload: torch.Tensor, frm: int, tag: int) -> bool:
        if payload.numel() != out.numel():
            raise ShmError(f"{self.label}: a message of {payload.numel()} bytes from rank {frm} (tag {tag}) for a "
                           f"buffer of {out.numel()} bytes")
        out.copy_(payload)
        return True

    def _stalled(self, peer: int, waited: float, what: str) -> None:
        give_up_if_gone({peer: int(self.pids[peer])}, what, waited, self.timeout_s, self.label)


class _Sent:
    """A send through a ring: finished once its bytes are in the ring."""

    def __init__(self):
        self.finished, self.error = threading.Event(), None

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self) -> None:
        self.finished.wait()
        if self.error is not None:
            raise self.error


class _Received:
    """A receive through a ring, taken when waited on (or when ``done()`` finds it there)."""

    def __init__(self, boxes: Mailboxes, out: torch.Tensor, frm: int, tag: int):
        self.boxes, self.out, self.frm, self.tag, self.taken = boxes, out, frm, tag, False

    def done(self) -> bool:
        if not self.taken:
            self.taken = self.boxes.take(self.out, self.frm, self.tag, block=False)
        return self.taken

    def wait(self) -> None:
        if not self.taken:
            self.taken = self.boxes.take(self.out, self.frm, self.tag, block=True)


def open_mailboxes(group, key: str, ring_bytes: int = RING_BYTES, timeout_s: float | None = None,
                   busy_s: float | None = None) -> Mailboxes | None:
    """``Mailboxes`` over ``group``'s ranks, or None on every rank where they cannot be had. Collective:
    every rank of ``group`` calls it with the same ``key``. A wait spins and yields ``busy_s`` before it
    sleeps in the kernel (default: ``BUSY_S``)."""
    world = dist.get_world_size(group)
    if world * world * 64 + world * 8 > CONTROL_BYTES - 16:  # the pairs' lines and the pids in the first page
        return None
    opened = open_segment(group, key, CONTROL_BYTES + world * world * ring_bytes, timeout_s)
    if opened is None:
        return None
    segment, timeout_s = opened
    busy_s = BUSY_S if busy_s is None else busy_s
    return Mailboxes(segment, world, dist.get_rank(group), ring_bytes, timeout_s, f"shared-memory mailboxes {key}",
                     busy_s)


def mailboxes_of(group) -> Mailboxes | None:
    """The group's mailboxes, opened at the first call (collective: every rank of ``group`` calls it, as
    ``P2P`` does when it is made), the same object after; None where ``ZFUNC_SHM`` is ``off`` or
    ``collectives``, or where they cannot be had."""
    if shm.MODE != "on":
        return None
    return held_for(group, "p2p", open_mailboxes)
