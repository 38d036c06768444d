"""Why a checkpoint's first read can be slow on this VM: the disk, or the memory it lands in?

    python benchmarks/checkpoint_memory.py [--mib 600] [--rounds 3] [--dir /tmp/zfunc-ckpt-memory]

A file of ``--mib`` random bytes is written by ``zfunc.checkpoint.disk_io.write_file`` with ``O_DIRECT``
(the default) and through the page cache (``DIRECT_WRITES = False``), fsynced, and read back by
``zfunc.checkpoint.disk_io.Reader`` (parallel ``O_DIRECT`` blocks) with the file dropped from the page cache
(``posix_fadvise(DONTNEED)``) before each read, into:

- a fresh buffer right after the drop (the page cache of a file written through it is freed by
  the drop, and the read lands in that memory);
- a buffer touched before (no page faults);
- a fresh buffer after the memory sat free 3 s (on this VM it is then back with the host:
  the guest kernel reports free pages, ``page_reporting``);
- a fresh buffer right after as many bytes were touched and freed.

Then the fault cost alone: fresh huge-page (``zfunc.ops.cpu.hostmem``) and 4 KiB (``torch.empty``)
memory touched after sitting free 3 s, and again at once. Prints median seconds per case and
every round's. (Measured 2026-11-24, under load, 600 MiB, 3 rounds: the same ``O_DIRECT``-written
file read in 0.16-0.33 s into recently freed memory in most rounds and 0.5-2.4 s into memory free
3 s, where a file written through the page cache, read right after the drop, took 0.17-0.21 s;
600 MiB of cold huge pages faulted in 0.9-2.2 s, of recently freed ones in 0.07-0.3 s in most
rounds. ``--rounds 3`` prints a table in 2-3 minutes.)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zfunc.checkpoint import disk_io as cio  # noqa: E402
from zfunc.offloading.swap.file_format import aligned_empty  # noqa: E402
from zfunc.ops.cpu import hostmem  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/tmp/zfunc-ckpt-memory")
    args = p.parse_args(argv)
    n, root = args.mib << 20, Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "f"
    src = aligned_empty(n)
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    touched = aligned_empty(n)
    touched.fill_(0)

    def drop() -> None:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    def read(out: torch.Tensor) -> None:
        with cio.Reader(path) as r:
            r.read_into(0, out)

    def fresh_read() -> None:
        read(hostmem.empty(n, torch.uint8))

    res: dict[str, list[float]] = {}

    def rec(k: str, fn) -> None:
        res.setdefault(k, []).append(timed(fn))

    direct = cio.DIRECT_WRITES
    try:
        for _ in range(args.rounds):
            for mode in (True, False):
                w = "O_DIRECT-written" if mode else "page-cache-written"
                path.unlink(missing_ok=True)
                os.sync()
                time.sleep(1)
                cio.DIRECT_WRITES = mode
                cio.write_file(path, [src])
                drop()
                rec(f"{w}: fresh buffer, right after the drop", fresh_read)
                time.sleep(3)
                drop()
                rec(f"{w}: buffer touched before", lambda: read(touched))
                time.sleep(3)
                drop()
                rec(f"{w}: fresh buffer, memory free 3 s", fresh_read)
                torch.empty(n, dtype=torch.uint8).fill_(1)
                drop()
                rec(f"{w}: fresh buffer, {args.mib} MiB freed just before", fresh_read)
            for kind, make in (("huge pages", lambda: hostmem.empty(n, torch.uint8)),
                               ("4 KiB pages", lambda: torch.empty(n, dtype=torch.uint8))):
                time.sleep(3)
                rec(f"touch fresh {kind}, free 3 s", lambda: make().fill_(1))
                rec(f"touch fresh {kind}, again at once", lambda: make().fill_(1))
    finally:
        cio.DIRECT_WRITES = direct
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.mib} MiB, {args.rounds} rounds: median s (GB/s), every round's s")
    for k, v in res.items():
        m = statistics.median(v)
        print(f"| {k} | {m:.2f} ({n / 1e9 / m:.2f}) | " + " ".join(f"{x:.2f}" for x in v) + " |")


if __name__ == "__main__":
    main()
