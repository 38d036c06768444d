"""Collectives through shared memory between the ranks of a gloo group that share one host.

gloo moves every byte between ranks of one machine through TCP loopback: a 1.9 MB chunk's
all-gather on 2 ranks costs ~2.4 ms of wall time, most of it the kernel's socket copies and the
wake-ups of gloo's threads. A ``Channel`` instead maps one shared segment into every rank of the
group: each rank writes its input into its own slot, marks it written, waits until every rank
has, and reads what it needs straight from the others' slots (the same gather: ~0.4 ms).

**Law.** ``all_gather`` moves bytes (exact). ``reduce_scatter`` widens every value to the output's
dtype before any addition and adds the others' values to this rank's own in rank order (as zfunc's
gloo path does); ``all_reduce`` sums the ranks' values in rank order, one ``torch.sum`` over a view
of the slots, so every rank computes the same sums from the same bytes and the replicas stay
bit-identical. On 2 ranks both equal gloo's bit for bit (``a + b = b + a``); on more they differ from
gloo's ring order by rounding.

**Protocol.** The segment starts with a page of control words, one 64-byte line per rank: the
number of the last phase whose input it wrote (``written``), the last whose slots it finished
reading (``read``) and its pid. Phase ``k``: wait until every rank has read ``k - 1`` (nobody still
reads this rank's slot), write the slot, publish ``written = k``, wait until every rank has, compute,
publish ``read = k`` (a large all-reduce writes its reduced chunk back and publishes once more
before the copies). One wait is on the critical path; the other is usually met already. An
all-gather given an ``op`` (a few ints naming what the rank is doing) stores it in its line before
``written = k``, and after the wait every rank compares every line's: the ranks agree on the
collective within its own barrier.
Ordering rests on x86's total store order (a store of a word is seen after the stores before it),
so channels open only on x86-64 Linux. A wait spins, then yields the core (for ``BUSY_S`` in all;
on a host with more ranks than cores, not at all), then sleeps in the kernel (``zfunc.dist.futex``)
on the word of a rank it waits for, marking in its own line which; a rank that publishes a word
makes a system call to wake its sleepers only when some line names that word. It checks every
second that the peers' processes live and gives up after the process group's own timeout,
raising ``ShmError`` either way (``Comm`` wraps it in a ``CollectiveError`` naming the operation).

**Setup.** ``open_channel`` is collective over the group: through the default store every rank
posts its host (hostname and boot id); on one host rank 0 creates the segment under a fresh name,
the others attach and check a token, every rank posts whether it could, and all go on with the
channel or all without (gloo). The name is unlinked as soon as everyone has attached, so a crash
leaves nothing in ``/dev/shm``. A collective larger than a slot goes in slot-sized pieces.

**Cost.** Memory: ``world * slot_bytes`` of shared pages per channel (``ZFUNC_SHM_SLOT_MB``, default
16 MiB a slot), allocated when the channel opens (so a full ``/dev/shm`` refuses the channel
rather than failing a write later). Per collective: the writer's copy into its
slot, the readers' copies (or sum) out of the others', and one barrier of a few microseconds when
the ranks arrive together.
"""
from __future__ import annotations

import contextlib
import datetime
import mmap
import os
import platform
import re
import secrets
import socket
import stat
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from zfunc.core import env
from zfunc.dist import futex

SHM_DIR = "/dev/shm"
# the same on every rank: "on" (collectives and point-to-point), "collectives" (point-to-point stays on gloo), "off"
MODE = env.choice("ZFUNC_SHM", "on", ("on", "collectives", "off"))
ENABLED = MODE != "off"
SLOT_BYTES = int(env.number("ZFUNC_SHM_SLOT_MB", 16, int, lambda mb: mb >= 1, "an integer >= 1 (MiB)")) << 20
CONTROL_BYTES = 4096  # one 64-byte line per rank: WRITTEN, READ, PID, ASLEEP, OP_AT, OP; the last line's end: the token
WRITTEN, READ, PID, ASLEEP = 0, 1, 2, 3  # ASLEEP: 0, or 1 + 2 * rank + word of the word this rank sleeps on
OP_AT, OP = 4, 5  # the collective whose op this rank posted, and the op: its length, then up to OP_INTS ints
OP_INTS = 2
_WORDS_PER_RANK = 8
ONE_PHASE_BYTES = 64 << 10  # an all-reduce up to this size: every rank sums every value
BUSY_S = 1e-3  # a wait spins and yields this long before it sleeps in the kernel, where cores outnumber ranks


class ShmError(RuntimeError):
    """A shared-memory collective failed: a peer died or did not arrive within the timeout."""


class Diverged(ShmError):
    """The ranks posted different ops for one collective: ``ops[r]`` is rank ``r``'s (None: it posted none)."""

    def __init__(self, ops: list[list[int] | None]):
        super().__init__(f"the ranks posted different ops: {ops}")
        self.ops = ops


def supported() -> bool:
    """Whether this machine can run channels: x86-64 Linux with ``/dev/shm`` (the protocol needs total store
    order)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir(SHM_DIR)


class Channel:
    """One group's shared segment: ``world`` slots of ``slot_bytes`` after a control page.

    Made by ``open_channel``; every rank of the group makes the same calls in the same order (as
    with any collective). Not thread-safe: one caller at a time (``Comm`` issues in order)."""

    def __init__(self, segment: mmap.mmap, world: int, rank: int, slot_bytes: int, timeout_s: float, label: str,
                 busy_s: float = BUSY_S):
        self.segment, self.world, self.rank, self.slot_bytes = segment, world, rank, slot_bytes
        self.timeout_s, self.label, self.busy_s = timeout_s, label, busy_s
        self.control = np.ndarray((world, _WORDS_PER_RANK), dtype=np.int64, buffer=segment)
        self.words = [[self.control[r, w:w + 1] for w in (WRITTEN, READ)] for r in range(world)]  # futex words
        self.asleep = self.control[rank, ASLEEP:ASLEEP + 1]
        self.slots = torch.frombuffer(segment, dtype=torch.uint8, count=world * slot_bytes,
                                      offset=CONTROL_BYTES).view(world, slot_bytes)
        self.count = int(self.control[rank, WRITTEN])
        self.control[rank, PID] = os.getpid()
        self.lock = threading.Lock()  # Comms over one group share its channel: one collective at a time

    # ------------------------------------------------------------------ collectives
    def all_gather(self, out: torch.Tensor, local: torch.Tensor, op: tuple[int, ...] | None = None) -> None:
        """``out`` (world * local.numel(), contiguous) <- every rank's ``local``, rank-major (``local`` may be
        this rank's chunk of ``out``: then it is not copied).

        ``op`` (up to ``OP_INTS`` ints): every rank must pass the same, or all raise ``Diverged`` before
        anything is read: the agreement rides on the collective's own barrier, at no extra round trip."""
        out, local = out.view(-1), local.reshape(-1)
        n = local.numel()
        chunks = out.view(self.world, n)
        if chunks[self.rank].data_ptr() != local.data_ptr():
            chunks[self.rank].copy_(local)
        others = [r for r in range(self.world) if r != self.rank]
        with self.lock:
            for start, size in self._pieces(n, local.element_size()):
                slots = self._post(local[start:start + size], op=op if start == 0 else None)
                for r in others:
                    chunks[r, start:start + size].copy_(slots[r])
                self._done()

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out`` <- this rank's chunk of the sum over ranks of ``full`` (world * out.numel()), every
        value widened to ``out``'s dtype before the sum: this rank's own value first, then the others'
        in rank order (one addition on 2 ranks: the same bits as gloo's)."""
        out, full = out.view(-1), full.reshape(-1)
        m = out.numel()
        rows = full.view(self.world, m)
        with self.lock:
            for start, size in self._pieces(m, full.element_size(), rows=self.world):
                # this rank posts, for every rank, its piece of that rank's chunk: (world, size)
                slots = self._post(rows[:, start:start + size], skip=self.rank)
                mine = out[start:start + size]
                cut = slice(self.rank * size, (self.rank + 1) * size)
                theirs = [slots[r, cut] for r in range(self.world) if r != self.rank]
                own = rows[self.rank, start:start + size]
                if len(theirs) == 1 and own.dtype == mine.dtype:
                    torch.add(own, theirs[0], out=mine)
                else:
                    mine.copy_(own)
                    for row in theirs:
                        mine.add_(row)
                self._done()

    def all_reduce(self, t: torch.Tensor) -> None:
        """``t`` (contiguous) <- the sum over ranks of ``t`` (in ``t``'s dtype), in place; the same bits on
        every rank. Up to ``ONE_PHASE_BYTES`` every rank sums every value (one barrier); above, as a ring
        does, each rank sums its chunk of the ranks' values and the others copy it (two barriers, a
        ``world``-th of the additions)."""
        flat = t.view(-1)
        with self.lock:
            for start, size in self._pieces(flat.numel(), flat.element_size()):
                piece = flat[start:start + size]
                slots = self._post(piece)
                if size * flat.element_size() <= ONE_PHASE_BYTES:
                    torch.sum(slots, dim=0, dtype=t.dtype, out=piece)
                    self._done()
                    continue
                cuts = [size * r // self.world for r in range(self.world + 1)]
                mine = slice(cuts[self.rank], cuts[self.rank + 1])
                torch.sum(slots[:, mine], dim=0, dtype=t.dtype, out=piece[mine])
                slots[self.rank, mine].copy_(piece[mine])  # nobody else reads this part of this slot before now
                self._publish()
                for r in range(self.world):
                    if r != self.rank:
                        theirs = slice(cuts[r], cuts[r + 1])
                        piece[theirs].copy_(slots[r, theirs])
                self._done()

    # ------------------------------------------------------------------ the protocol
    def _pieces(self, n: int, itemsize: int, rows: int = 1) -> list[tuple[int, int]]:
        """``(start, size)`` pieces of ``n`` elements whose ``rows`` rows fit in a slot."""
        step = max(1, self.slot_bytes // (itemsize * rows))
        return [(s, min(step, n - s)) for s in range(0, n, step)] or [(0, 0)]

    def _post(self, data: torch.Tensor, skip: int | None = None, op: tuple[int, ...] | None = None) -> torch.Tensor:
        """Write ``data`` (row ``skip`` of it left out: nobody reads it) into this rank's slot once every rank
        has read the last collective's; return every rank's copy, ``(world, data.numel())`` of ``data``'s
        dtype, once all have written (and, given ``op``, posted the same one: else ``Diverged``)."""
        self._wait(READ, self.count, "finish reading the previous collective")
        nbytes = data.numel() * data.element_size()
        mine = self.slots[self.rank, :nbytes].view(data.dtype).view(data.shape)
        if skip is None:
            mine.copy_(data)
        else:
            for r in range(len(data)):
                if r != skip:
                    mine[r].copy_(data[r])
        if op is not None:
            self._post_op(op)
        self._publish()
        if op is not None:
            self._compare_ops(op)
        return self.slots[:, :nbytes].view(data.dtype)

    def _post_op(self, op: tuple[int, ...]) -> None:
        """Post ``op`` as this rank's for the collective about to be published (stored before ``WRITTEN``:
        a peer that sees the collective written sees its op)."""
        if len(op) > OP_INTS:
            raise ValueError(f"op={op!r}: a channel posts at most {OP_INTS} ints")
        line = self.control[self.rank]
        line[OP] = len(op)
        line[OP + 1:OP + 1 + len(op)] = op
        line[OP_AT] = self.count + 1

    def _compare_ops(self, op: tuple[int, ...]) -> None:
        """Raise ``Diverged`` unless every rank posted ``op`` for this collective (every rank compares the
        same words, so all raise or none does; each marks the collective read first, so the channel
        stays in step for the next one)."""
        lines = self.control[:, OP_AT:OP + 1 + OP_INTS].copy()
        ops = [[int(x) for x in line[2:2 + int(line[1])]] if line[0] == self.count else None for line in lines]
        if any(o != list(op) for o in ops):
            self._done()
            raise Diverged(ops)

    def _publish(self) -> None:
        """Mark what this rank wrote as collective ``count + 1``'s and wait until every rank has."""
        self.count += 1
        self.control[self.rank, WRITTEN] = self.count
        self._wake(WRITTEN)
        self._wait(WRITTEN, self.count, "write its input")

    def _done(self) -> None:
        self.control[self.rank, READ] = self.count
        self._wake(READ)

    def _wake(self, word: int) -> None:
        """After this rank stored ``word``: wake the ranks asleep on it."""
        futex.fence()
        if (self.control[:, ASLEEP] == 1 + 2 * self.rank + word).any():
            futex.wake(self.words[self.rank][word].ctypes.data)

    def _wait(self, word: int, k: int, what: str) -> None:
        column = self.control[:, word]

        def late() -> tuple[np.ndarray, int]:  # the word to sleep on: a rank's that has yet to reach k
            r = int(column.argmin())
            return self.words[r][word], 1 + 2 * r + word

        futex.wait_until(lambda: column.min() >= k, late, self.asleep,
                         lambda waited: self._check_peers(word, k, what, waited), self.busy_s)

    def _check_peers(self, word: int, k: int, what: str, waited: float) -> None:
        late = {r: int(self.control[r, PID]) for r in range(self.world) if self.control[r, word] < k}
        give_up_if_gone(late, what, waited, self.timeout_s, self.label, f" (collective {k} of this channel)")


_held: dict[tuple[str, int], tuple[weakref.ref, object]] = {}  # (kind, id(process group)) -> (the group, its object)
_opening = threading.Lock()


def channel_of(group) -> Channel | None:
    """The channel of ``group`` (None: the default group), opened at its first call (collective: every rank
    of the group makes that call at the same collective), or None where it cannot be had or
    ``ZFUNC_SHM=off``. One channel per process group, shared by every ``Comm`` over it, dropped with it."""
    return held_for(group, "collectives", open_channel)


def held_for(group, kind: str, opener: Callable) -> object | None:
    """``opener(group, name)`` for ``group``'s first call of this ``kind`` (``name``: the process group's,
    the same on every rank), the same object at later calls; None where ``ZFUNC_SHM=off``."""
    if not ENABLED:
        return None
    pg = group if group is not None else dist.group.WORLD
    key = (kind, id(pg))
    with _opening:
        held = _held.get(key)
        if held is None or held[0]() is not pg:
            name = getattr(pg, "group_name", None) or dist.distributed_c10d._get_process_group_name(pg)
            held = _held[key] = (weakref.ref(pg), opener(group, f"{kind}/{name}"))
            weakref.finalize(pg, _held.pop, key, None)
        return held[1]


def oversubscribed() -> bool:
    """Whether this host runs more ranks than it has cores (``LOCAL_WORLD_SIZE`` under torchrun, else the
    job's world size, against ``os.cpu_count()``: the same answer on every rank of the host): then a wait
    sleeps at once, leaving the core to a rank that computes, instead of spinning first."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or (dist.get_world_size() if dist.is_initialized() else 1)
    return ranks > (os.cpu_count() or 1)


def give_up_if_gone(late: dict[int, int], what: str, waited: float, timeout_s: float, label: str,
                    where: str = "") -> None:
    """Raise ``ShmError`` naming the rank where one of ``late`` (rank -> its pid, 0: unknown), which has yet
    to do ``what``, has died, or naming them all once ``waited`` passes ``timeout_s``; else nothing."""
    for r, pid in late.items():
        if pid and not _alive(pid):
            raise ShmError(f"{label}: rank {r} (pid {pid}) died before it could {what}{where}")
    if waited > timeout_s:
        raise ShmError(f"{label}: rank{'s' * (len(late) > 1)} {', '.join(map(str, late))} did not {what} within "
                       f"{timeout_s:g} s{where}")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (exited, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def open_channel(group, key: str, slot_bytes: int = SLOT_BYTES, timeout_s: float | None = None,
                 busy_s: float | None = None) -> Channel | None:
    """A ``Channel`` over ``group``'s ranks, or None on every rank where one cannot be had (ranks on
    more than one host, an unsupported machine, no room in ``/dev/shm``). Collective: every rank of
    ``group`` calls it with the same ``key`` (unique to this channel and the same on every rank). A wait
    spins and yields ``busy_s`` before it sleeps (default ``BUSY_S``, 0 on a host with more ranks than cores)."""
    world = dist.get_world_size(group)
    if world >= CONTROL_BYTES // (8 * _WORDS_PER_RANK):  # the last line holds the token
        return None
    opened = open_segment(group, key, CONTROL_BYTES + world * slot_bytes, timeout_s)
    if opened is None:
        return None
    segment, timeout_s = opened
    busy_s = (0.0 if oversubscribed() else BUSY_S) if busy_s is None else busy_s
    return Channel(segment, world, dist.get_rank(group), slot_bytes, timeout_s, f"shared-memory channel {key}",
                   busy_s)


def open_segment(group, key: str, nbytes: int, timeout_s: float | None = None) -> tuple[mmap.mmap, float] | None:
    """A shared segment of ``nbytes`` mapped by every rank of ``group`` (the first page's last 16 bytes
    hold a token), and the timeout to wait on peers; or None on every rank where one cannot be had.
    Collective, like ``open_channel``, whose module docstring says how."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    store = dist.distributed_c10d._get_default_store()
    timeout_s = timeout_s or _timeout_s(group)
    wait = datetime.timedelta(seconds=timeout_s)
    # every rank opens ``key`` once per generation (a process group re-made under the same name after a
    # re-init sharing this store is the next): the counter's value names the generation alike on every rank
    generation = -(-store.add(f"zfunc/shm/{key}/opens", 1) // world)
    base = f"zfunc/shm/{key}/{generation}"
    store.set(f"{base}/host/{rank}", f"{_host()}|{int(supported())}")
    store.wait([f"{base}/host/{r}" for r in range(world)], wait)
    hosts = {store.get(f"{base}/host/{r}").decode() for r in range(world)}
    if len(hosts) != 1 or not hosts.pop().endswith("|1"):
        return None
    segment, path = None, None
    try:
        if rank == 0:
            token = secrets.token_hex(8)
            path = os.path.join(SHM_DIR, f"zfunc-{os.getpid()}-{secrets.token_hex(6)}")
            segment = _map(path, nbytes, create=True)
            segment[CONTROL_BYTES - 16:CONTROL_BYTES] = token.encode()
            store.set(f"{base}/segment", f"{path}|{token}")
        else:
            store.wait([f"{base}/segment"], wait)
            path, token = _segment_named(store.get(f"{base}/segment").decode())
            segment = _map(path, nbytes, create=False)
            if segment[CONTROL_BYTES - 16:CONTROL_BYTES] != token.encode():
                raise OSError(f"{path} holds another segment's token")
        ok = "1"
    except OSError:
        ok = "0"
    store.set(f"{base}/ok/{rank}", ok)
    store.wait([f"{base}/ok/{r}" for r in range(world)], wait)
    everyone = all(store.get(f"{base}/ok/{r}").decode() == "1" for r in range(world))
    if rank == 0 and path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)  # every rank has attached (or given up): the name is no longer needed
    return (segment, timeout_s) if everyone else None


def _timeout_s(group) -> float:
    """The process group's own collective timeout (what gloo would wait), else torch's default."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout.total_seconds()


def _segment_named(text: str) -> tuple[str, str]:
    """The path and token rank 0 posted, checked to be what it makes: a ``zfunc-<pid>-<hex>`` file directly
    in ``SHM_DIR`` and 16 hex digits (a store entry naming any other file is refused: ``OSError``)."""
    path, _, token = text.partition("|")
    if not (re.fullmatch(r"zfunc-\d+-[0-9a-f]{12}", os.path.basename(path)) and os.path.dirname(path) == SHM_DIR
            and re.fullmatch(r"[0-9a-f]{16}", token)):
        raise OSError(f"the store names {text!r}, not a zfunc segment in {SHM_DIR}")
    return path, token


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    """``path`` mapped shared, read-write: created with ``size`` bytes (refused if it exists), or attached
    (refused if shorter, a link, or not a regular file of this user's)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        info = os.fstat(fd)
        if create:
            os.posix_fallocate(fd, 0, size)  # the pages now: a full tmpfs fails here, not with SIGBUS on a write
        elif not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise OSError(f"{path} is not a regular file of this user's")
        elif info.st_size < size:
            raise OSError(f"{path} has {info.st_size} bytes, {size} expected")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
