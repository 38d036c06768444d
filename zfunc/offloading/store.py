"""Where offloaded tensors live between steps: RAM or swap files, read ahead and written back.

``Store.put`` places a tensor (a handle back: the tensor itself, or an ``OnDisk`` naming its swap
file), ``fetch`` starts reading it, ``store_back`` makes a new value its content. ``ReadAhead``
keeps reads running ahead of their use along an expected order, within a byte budget.

**Packed files.** ``Store.pack`` places several tensors in one swap file (a *group*: one payload,
one crc, written whole; each ``OnDisk`` names its file, its offset in it and the file's size), so
that many small tensors move as one large read or write: a file costs ~0.3 ms of open, header,
thread hand-offs and rename per transfer whatever its size, which dominates a leaf-by-leaf
update of small leaves. A store reads a group once per pass: the first ``fetch`` of a member
reads the whole file, the others take views of that read until every member was fetched (then
the next fetch reads it again). ``store_back`` of a member writes into that read's buffer; the
file is written, whole, once every member was stored back (``flush`` writes the groups begun
and not completed). **Law:** ``fetch(x)`` gives the value of the last ``store_back(x, t)`` or
``pack``: a group is written only once all its members hold their new values, so the file and
the views never mix versions (a member is fetched once, and stored back once, per pass).

Pending reads are plain objects holding plain references, never future callbacks: closures
registered between futures form reference cycles that keep read buffers alive until Python's
cyclic GC happens to run (hundreds of MB of peak RSS on a model of tens of millions of params).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from zfunc.ops.cpu import hostmem

PACK_ALIGN = 64  # a packed tensor's offset in its file: every dtype's alignment, a cache line


@dataclass(frozen=True)
class OnDisk:
    """A tensor kept in a swap file: the file's name in the engine, and the tensor's shape/dtype;
    packed with others (``Store.pack``): its byte ``offset`` in the file's payload, the payload's
    bytes (``packed``) and the number of tensors in the file (``members``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0
    packed: int = 0  # 0: the file holds this tensor alone
    members: int = 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def file_bytes(self) -> int:
        """Payload bytes of its file (what a read or write of the file moves)."""
        return self.packed or self.nbytes


class Read:
    """``result()`` waits for the swap read ``io`` and returns its buffer ``out``."""

    def __init__(self, io: Future, out: torch.Tensor):
        self.io, self.out = io, out

    def result(self) -> torch.Tensor:
        self.io.result()
        return self.out


class Member:
    """``result()`` waits for the read of a packed file and returns the view of one member ``x``."""

    def __init__(self, read: Read, x: OnDisk):
        self.read, self.x = read, x

    def result(self) -> torch.Tensor:
        return _view(self.read.result(), self.x)


def _view(buf: torch.Tensor, x: OnDisk) -> torch.Tensor:
    return buf[x.offset : x.offset + x.nbytes].view(x.dtype).view(x.shape)


class _Group:
    """A packed file in use this pass: its read (buffer and future), members not yet fetched
    from it, members not yet stored back into it."""

    def __init__(self, read: Read, members: int):
        self.read, self.members, self.unread, self.unwritten = read, members, members, members


class All:
    """``result()``: the results of ``parts``, in order."""

    def __init__(self, parts: list):
        self.parts = parts

    def result(self) -> list:
        return [p.result() for p in self.parts]


def done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class Store:
    """Tensors kept in RAM (``engine=None``) or in swap files, read and written by future."""

    def __init__(self, engine=None, pin: bool = False, track: Callable[[Future | None, int], None] | None = None):
        self.engine, self.pin, self.track = engine, pin, track
        self._reading: dict[str, _Group] = {}  # packed files being fetched from this pass
        self._writing: dict[str, _Group] = {}  # packed files being stored back into (written once complete)

    def put(self, name: str, t: torch.Tensor) -> torch.Tensor | OnDisk:
        """Keep ``t`` (a CPU tensor the store takes over); returns its handle. A file's write is
        handed to ``track(future, nbytes)``, which bounds the writes in flight."""
        if self.engine is None:
            return t.pin_memory() if self.pin else t
        self.track(self.engine.write(name, t.contiguous()), t.numel() * t.element_size())
        return OnDisk(name, tuple(t.shape), t.dtype)

    def pack(self, name: str, tensors: list[torch.Tensor]) -> list[torch.Tensor | OnDisk]:
        """Keep ``tensors`` (CPU tensors the store takes over) in one file ``name``: their handles,
        in order (in RAM, the tensors themselves). One write of their bytes laid end to end, each at
        a multiple of ``PACK_ALIGN``; a lone tensor gets a file of its own (``put``)."""
        if self.engine is None or len(tensors) == 1:
            return [self.put(name, t) for t in tensors]
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end = -(-(end + t.numel() * t.element_size()) // PACK_ALIGN) * PACK_ALIGN
        buf = _aligned(end, self.pin)
        handles = []
        for t, offset in zip(tensors, offsets):
            x = OnDisk(name, tuple(t.shape), t.dtype, offset, end, len(tensors))
            _view(buf, x).copy_(t)
            handles.append(x)
        self.track(self.engine.write(name, buf), end)
        return handles

    def fetch(self, x: torch.Tensor | OnDisk) -> Future | Read | Member:
        """A future of the tensor behind ``x`` (for a file, a fresh aligned buffer read from it; for
        a packed file, a view of the pass's one read of it)."""
        if not isinstance(x, OnDisk):
            return done(x)
        if not x.packed:
            out = _aligned(x.nbytes, self.pin).view(x.dtype).view(x.shape)
            return Read(self.engine.read(x.name, out), out)
        group = self._reading.get(x.name)
        if group is None:
            out = _aligned(x.packed, self.pin)
            group = self._reading[x.name] = _Group(Read(self.engine.read(x.name, out), out), x.members)
        group.unread -= 1
        if group.unread == 0:  # every member has its view: the next pass reads the file again
            del self._reading[x.name]
        self._writing.setdefault(x.name, _Group(group.read, x.members))  # where store_back puts the new values
        return Member(group.read, x)

    def store_back(self, x: torch.Tensor | OnDisk, t: torch.Tensor) -> tuple[torch.Tensor | OnDisk, Future | None]:
        """Make ``t`` the new value of ``x``: a file is rewritten (the future), RAM keeps ``t``. A
        packed ``x`` (fetched this pass) takes ``t`` into the buffer its fetch read; its file is
        written once every member was stored back (the future then; None before)."""
        if not isinstance(x, OnDisk):
            return t, None
        if not x.packed:
            return x, self.engine.write(x.name, t.contiguous())
        group = self._writing.get(x.name)
        if group is None:
            raise ValueError(f"x: {x.name!r} is packed and was not fetched from this store; fetch it first")
        view = _view(group.read.out, x)
        if view.data_ptr() != t.data_ptr():  # the optimizer returned a new tensor, not its update in place
            view.copy_(t)
        group.unwritten -= 1
        if group.unwritten:
            return x, None
        return x, self._write_group(x.name)

    def flush(self) -> list[tuple[str, int, Future]]:
        """Write every packed file with members stored back this pass but not all of them (the
        others keep the values read): ``(name, bytes, future)`` of each write."""
        return [(name, g.read.out.numel(), self._write_group(name))
                for name, g in list(self._writing.items()) if 0 < g.unwritten < g.members]

    def _write_group(self, name: str) -> Future:
        group = self._writing.pop(name)
        self._reading.pop(name, None)  # a later fetch reads the new version (the engine orders it after the write)
        return self.engine.write(name, group.read.out)


def packed_bytes(sizes: list[int]) -> int:
    """Payload bytes of a packed file holding tensors of ``sizes`` bytes, in order (``Store.pack``)."""
    end = 0
    for n in sizes:
        end = -(-(end + n) // PACK_ALIGN) * PACK_ALIGN
    return end if len(sizes) != 1 else sizes[0]


def leaf_groups(spec: Any, group_bytes: int) -> list[list[int]]:
    """The offloaded state's groups: consecutive leaves of ``spec`` (a ``ShardSpec``) up to
    ``group_bytes`` of fp32 local pieces each (a larger leaf alone), whose masters share one swap
    file and whose optimizer states share another (``Store.pack``)."""
    groups: list[list[int]] = []
    size = 0
    for i, leaf in enumerate(spec.leaves):
        n = 4 * math.prod(leaf.local_shape(spec.rank))
        if not groups or size + n > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def _aligned(nbytes: int, pin: bool) -> torch.Tensor:
    """A read or write buffer of one pass, 4096-aligned (O_DIRECT moves it with no copy). From
    ``hostmem.HUGE_MIN`` bytes, where huge pages exist, a mapping of its own on them, unmapped when
    the buffer is freed: from the heap, glibc would keep the freed buffers resident (up to 1 GiB,
    ``hostmem.reuse_freed_memory``), the RAM NVMe offload is there to save (a 12.8M GPT's two-rank
    NVMe step: 590-640 MB of RSS this way, 700-820 MB from the heap)."""
    from zfunc.offloading.swap.file_format import aligned_empty

    if not pin and nbytes >= hostmem.HUGE_MIN and hostmem.huge_pages_available():
        return hostmem.empty(nbytes, torch.uint8)  # page-aligned
    return aligned_empty(nbytes, pin=pin)[:nbytes]


class ReadAhead:
    """Futures of store reads, launched ahead along an expected order within a byte budget.

    ``get(i)`` returns the tensor for key ``i`` (waiting for its read, or reading it now if it was
    not expected), then tops up: reads along ``order`` after the last one launched start until
    ``budget`` bytes are in flight. Keys are read once per ``get``; the order can repeat keys.
    """

    def __init__(self, fetch: Callable[[int], Future], nbytes: Callable[[int], int], order: list[int], budget: int):
        self.fetch, self.nbytes, self.order, self.budget = fetch, nbytes, order, budget
        self.ahead: dict[int, deque[Future]] = {}
        self.inflight = 0
        self.next = 0  # position in ``order`` of the next read to launch
        self.seen: list[int] = []  # the order of this pass's requests (the next pass's ``order``)

    def start(self) -> ReadAhead:
        """Launch the first reads along ``order`` now, before any ``get`` (up to ``budget`` bytes)."""
        self._top_up()
        return self

    def get(self, i: int) -> torch.Tensor:
        self.seen.append(i)
        queued = self.ahead.get(i)
        if queued:
            future = queued.popleft()
            self.inflight -= self.nbytes(i)
        else:
            future = self.fetch(i)
            if self.next < len(self.order) and self.order[self.next] == i:
                self.next += 1  # on schedule: do not read it again ahead
        self._top_up()
        return future.result()

    def _top_up(self) -> None:
        while self.next < len(self.order) and self.inflight < self.budget:
            i = self.order[self.next]
            self.next += 1
            self.ahead.setdefault(i, deque()).append(self.fetch(i))
            self.inflight += self.nbytes(i)
