"""Host memory for CPU optimizer state: tensors on transparent huge pages.

A CPU optimizer step streams five to seven arrays at once (AdamW: param, grad, exp_avg, exp_avg_sq
and a low-precision param copy). On 4 KiB pages each stream crosses a page every 4 KiB, and at
each crossing the core takes a TLB miss and its hardware prefetcher, which does not follow a
stream across pages, starts over. On 2 MiB pages both happen 512x less often
(``benchmarks/cpu_adam.py`` times ``zfunc.ops.cpu.adam`` on both; the README's results hold the figures).

Linux backs anonymous memory with huge pages when transparent huge pages (THP) are ``always``, or
for ranges advised ``MADV_HUGEPAGE`` when they are ``madvise`` (many distributions' default).
torch's CPU allocator advises tensors from 2 MiB only when its ``THP_MEM_ALLOC_ENABLE`` is set at
its first allocation (``torch_on_huge_pages`` says whether it does), and starts each on a page
boundary. ``empty`` maps fresh memory, advises it before the first touch and hands it to torch
(``torch.frombuffer``; the mapping is unmapped when the last tensor over it is freed).
Each tensor starts at its own page-aligned offset within a huge page (``_colour``): buffers that
all start on a huge-page boundary make a kernel's streams collide in the caches and DRAM banks,
which cost more than the huge pages gained. Below ``HUGE_MIN`` bytes, where THP is ``never`` or
on systems without it, ``empty`` is plain ``torch.empty``. Nothing here is required for
correctness: whatever pages a tensor has, the kernels compute the same values.

``reuse_freed_memory``: a train step frees and allocates tensors of the same sizes every step (the
grads, the forward's temporaries). glibc gives the top of its heap back to the OS once more than
``M_TRIM_THRESHOLD`` bytes lie free there (by default twice the largest block it has freed, so
two 4 MiB grads freed together), and the next step faults the same bytes in again, ~1 us per 4 KiB
page, in whichever trainer of a process the heap's layout happens to put on the boundary. Kept,
they are reused.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import random

import torch

from zfunc.core import env

__all__ = ["HUGE_MIN", "copy_to", "empty", "huge_pages_available", "reuse_freed_memory", "torch_on_huge_pages",
           "transient", "vm_flags", "zeros_like"]

HUGE = 2 << 20  # bytes in a huge page (x86-64 and aarch64 with 4 KiB base pages)
# Smaller tensors: torch.empty. Huge pages pay where a kernel's streams outgrow the last-level
# cache; below that, each pair of streams keeps one fixed offset within its huge pages, where 4 KiB
# pages spread conflicts at random: AdamW on huge pages is no faster at 4 MiB buffers and gains from
# about 12 MiB.
HUGE_MIN = 8 << 20
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def huge_pages_available() -> bool:
    """Whether advised anonymous memory can get transparent huge pages here (Linux THP
    ``always`` or ``madvise``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_MODE) as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


def torch_on_huge_pages() -> bool:
    """Whether torch's CPU allocator advises tensors from 2 MiB ``MADV_HUGEPAGE`` in this process, as
    it does where ``THP_MEM_ALLOC_ENABLE=1`` was in the environment at its first allocation: allocates
    one 4 MiB tensor and reads its mapping's flags (``vm_flags``: ``hg``). False where
    ``/proc/self/smaps`` does not exist (not Linux).

    zfunc leaves that switch to the user. Its gain and cost, this repository's 2-core VM: memory
    freed and allocated again at once is faster on huge pages (a fresh 400 MB tensor filled in a
    loop: 223 -> 55 ms, 97,657 -> 568 faults), but memory the host takes back while it lies free
    (free page reporting) is slower to fault in on them (the same loop with 3 s pauses: 300-870 ms
    instead of ~200; ``torch.load`` of a 0.6-2.4 GB checkpoint in a fresh process: 0.15-0.24 GB/s
    where earlier runs read 0.47-1.04).
    """
    probe = torch.empty(HUGE, dtype=torch.int16)  # held while its mapping is read
    return "hg" in vm_flags(probe.data_ptr())


def vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address`` (``/proc/self/smaps``:
    ``hg`` advised huge, ``nh`` advised not); empty where there is none, or no such file (not Linux)."""
    if not isinstance(address, int) or address < 0:
        raise ValueError(f"address: expected a non-negative int (a data_ptr()), got {address!r}")
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "VmFlags:":
                    return line.split()[1:]
    except OSError:
        pass
    return []


def empty(shape: int | tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on transparent huge pages where available.

    Args:
      shape: the tensor's shape (an int for 1-D).
      dtype: any torch dtype.
    Returns ``torch.empty(shape, dtype=dtype)``'s equal, whose data lies page-aligned on an
    ``MADV_HUGEPAGE`` mapping when it is at least ``HUGE_MIN`` bytes and THP is available.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape: expected non-negative ints, got {shape!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes < HUGE_MIN or not huge_pages_available():
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping alive
    skip = (_colour() - raw.data_ptr()) % HUGE
    # Advise the tensor's own pages only: a huge page is then never faulted in across the unused
    # head or tail of the mapping (20 tensors of 3 MiB held 86 MiB advised whole, 60 this way).
    mapping.madvise(mmap.MADV_HUGEPAGE, skip, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def transient(n: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``n`` elements on ``device`` that a step allocates and frees every
    step (a collective's gather or reduce buffer): ``torch.empty``, except on the CPU from
    ``_MMAP_MIN`` bytes, which glibc maps afresh and faults in page by page on every step (unless
    ``ZFUNC_HEAP_REUSE=all`` serves it from the heap): those come from ``empty``, on huge pages.

    Cost of a fresh 51 MB buffer filled by a copy, this repository's 2-core EPYC: 21 ms and 12,491
    faults from ``torch.empty``, 7 ms and 200-700 faults here (the kernel zeroes each 2 MiB page in
    one go), 3.4 ms for a buffer kept from step to step (which would hold its memory between steps).
    """
    device = torch.device(device)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < _MMAP_MIN or HEAP_REUSE == "all":
        return torch.empty(n, dtype=dtype, device=device)
    return empty(n, dtype)


def _colour() -> int:
    """Where in its huge page the next tensor starts: a pseudo-random multiple of the page size.

    Tensors that all start at the same offset in their huge pages put element i of every stream
    a kernel reads in the same cache sets and DRAM banks, which costs AdamW more than the huge
    pages gain; offsets spread like mmap's own addresses keep the gain."""
    return _COLOURS.randrange(HUGE // mmap.PAGESIZE) * mmap.PAGESIZE


_COLOURS = random.Random(0)


def zeros_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.zeros_like(t)``; for a contiguous CPU ``t``, in host memory from ``empty``."""
    _check_tensor(t)
    if t.device.type != "cpu" or not t.is_contiguous():
        return torch.zeros_like(t)
    return empty(tuple(t.shape), t.dtype).zero_()


def copy_to(t: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t.to(device, dtype, copy=True)``; a copy on the CPU is contiguous, in host memory from ``empty``."""
    _check_tensor(t)
    device = torch.device(device)
    dtype = t.dtype if dtype is None else dtype
    if device.type != "cpu":
        return t.to(device=device, dtype=dtype, copy=True)
    return empty(tuple(t.shape), dtype).copy_(t)


def _check_tensor(t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t: expected a torch.Tensor, got {type(t).__name__}")


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
# Freed memory kept at the top of the heap: a step's transient tensors up to this size in all are
# reused, not returned; more is (a process that once held much more gives most of it back).
KEEP_FREED = 1 << 30
# Blocks from this size are mmapped and unmapped one by one (glibc's largest allowed threshold,
# which its default also reaches after the first free of a block that size); smaller ones come
# from the heap, where freed ones are reused.
_MMAP_MIN = 32 << 20
_MODES = ("small", "all", "off")


HEAP_REUSE = env.choice("ZFUNC_HEAP_REUSE", "small", _MODES)  # checked at import


@functools.cache
def reuse_freed_memory() -> bool:
    """Keep up to ``KEEP_FREED`` bytes of freed heap memory for reuse instead of returning it to the
    OS (glibc ``mallopt``; once per process, for the whole process). True where applied; False
    where the C library is not glibc or ``ZFUNC_HEAP_REUSE=off`` keeps glibc's defaults.

    ``ZFUNC_HEAP_REUSE``: ``small`` (default): blocks under 32 MiB come from the heap, where freed
    ones are reused; larger ones are mapped and unmapped one by one, so their faults stay (a fresh
    80 MB grad faults ~20K pages every step, in torch as here). ``all``: every block of the main
    thread comes from the heap (``M_MMAP_MAX`` 0), so a step's fresh grads fault no pages; but a
    freed block below the top of the heap is never returned, so the resident size stays at the
    high-water mark and grows with fragmentation (a background checkpoint's host copies stay
    resident after the save). Cost of either: the resident size does not shrink below the heap's
    high-water mark minus ``KEEP_FREED``.
    """
    if HEAP_REUSE == "off":
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, ValueError):
        return False
    # Setting either threshold stops glibc's own adjustment of both, so both are set.
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_MIN)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREED))
    return ok and (HEAP_REUSE == "small" or bool(mallopt(_M_MMAP_MAX, 0)))
