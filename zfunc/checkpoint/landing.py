"""The memory a checkpoint load reads tensors into: 4 KiB pages while they are read, huge pages later.

**Law.** ``empty(shape, dtype)`` is ``torch.empty(shape, dtype=dtype)``'s equal (uninitialised,
contiguous, CPU); ``settle(t)`` changes none of ``t``'s values. Nothing here is needed for
correctness: a tensor computes the same values whatever its pages.

**Why.** A load's time is mostly the first touch of the memory it reads into (a fresh process has
none faulted in). Where huge pages come fresh from the host, as on a VM whose guest reports free
memory back (free page reporting: what sat free ~2 s is handed back, and the host backs it again on
the next touch), transparent huge pages fault in several times slower than 4 KiB pages, which come
from the guest's free fragments, still backed (``benchmarks/resume.py`` times a restarted job's load;
``benchmarks/checkpoint_memory.py`` the memory alone). The optimizer steps run faster on huge pages
(``zfunc.ops.cpu.hostmem``), so once a tensor is read ``settle`` advises its pages ``MADV_HUGEPAGE``
and the kernel's khugepaged merges them into huge pages in the background while training runs (at
Linux's default pace, 16 MiB every 10 s: ``/sys/kernel/mm/transparent_hugepage/khugepaged``). Before
the read they are advised ``MADV_NOHUGEPAGE``, which keeps them 4 KiB where THP is ``always``.

**Cost.** Tensors of ``hostmem.HUGE_MIN`` bytes and more get a mapping of their own (one ``mmap``, two
``madvise``), each starting at its own page offset within a huge page, as ``hostmem.empty`` places
them (its ``_colour``: the same offset in every huge page makes a kernel's streams collide in the
caches); smaller ones, and every one where THP is unavailable, are ``torch.empty``'s.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import random

import torch

from zfunc.ops.cpu import hostmem

__all__ = ["empty", "settle"]

_COLOURS = random.Random(0)
_libc = ctypes.CDLL(None, use_errno=True)


def _huge(nbytes: int) -> bool:
    return nbytes >= hostmem.HUGE_MIN and hostmem.huge_pages_available()


def _advise(addr: int, nbytes: int, advice: int) -> None:
    """``madvise`` the whole pages of ``[addr, addr + nbytes)``; a refusal is ignored (advice only)."""
    _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE),
                  ctypes.c_int(advice))


def empty(shape: list[int] | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor to read into: on 4 KiB pages of a mapping of its own
    where it is at least ``hostmem.HUGE_MIN`` bytes and THP is available (``settle`` it once read)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not _huge(nbytes):
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + hostmem.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping alive
    skip = (_COLOURS.randrange(hostmem.HUGE // mmap.PAGESIZE) * mmap.PAGESIZE - raw.data_ptr()) % hostmem.HUGE
    _advise(raw.data_ptr() + skip, nbytes, mmap.MADV_NOHUGEPAGE)
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def settle(t: torch.Tensor) -> None:
    """Advise the pages of ``t`` (from ``empty``, now read) ``MADV_HUGEPAGE``: khugepaged merges them
    into huge pages in the background. Nothing for a tensor ``empty`` left to ``torch.empty``."""
    nbytes = t.numel() * t.element_size()
    if _huge(nbytes) and t.data_ptr() % mmap.PAGESIZE == 0:
        _advise(t.data_ptr(), nbytes, mmap.MADV_HUGEPAGE)
