"""Swap engine read/write GB/s vs dd and fio on the same disk, file size and block size, in one run.

    python benchmarks/swap.py [--gib 2] [--block-mib 8] [--dir /tmp/zfunc-swap-bench] [--repeats 3] [--threads 8,16]

Each repeat runs every contender once, in a rotated order (disk timings on this shared machine
swing ~2x between runs, so compare within a run):
- zfunc's ``SwapEngine`` writing and reading a ``--gib`` tensor from a 4096-aligned buffer, with
  and without crc32 verification, for each ``--threads`` count (8 is the engine's default, 16
  matches fio's deepest queue), each on its own file;
- ``dd`` with ``oflag=direct`` / ``iflag=direct`` and ``bs=--block-mib``;
- ``fio`` with ``direct=1`` and the same ``bs``: libaio at iodepth 1/4/16, psync with 4 jobs.
dd and fio read the first engine's swap file (cold: O_DIRECT bypasses the page cache, and files
are also dropped from it) and overwrite a file of the same size beside it in place (their fastest
case); the engine's writes include its open, fallocate, link and rename, and after its first two
writes of a name overwrite its spare in place. Nothing is fsynced (the engine's default
``fsync="never"``). Prints best and median GB/s (1e9 bytes/s) per contender and the engine's
ratio to fio's best and to dd's; the target is >= 0.9x fio's best. As fio's best is a max over 4
configs x repeats, also shown: the median over repeats of engine / best fio config of that repeat.
Removes its files at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zfunc.offloading.swap.engine import SwapEngine  # noqa: E402
from zfunc.offloading.swap.file_format import aligned_empty, crc32  # noqa: E402

FIO_CONFIGS = [("libaio", 1, 1), ("libaio", 4, 1), ("libaio", 16, 1), ("psync", 1, 4)]  # engine, iodepth, jobs


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def engine_run(engine: SwapEngine, name: str, buf: torch.Tensor, op: str) -> float:
    if op == "read":
        drop_cache(engine.file(name))
    t0 = time.perf_counter()
    (engine.write(name, buf) if op == "write" else engine.read(name, buf)).result()
    return buf.numel() / (time.perf_counter() - t0) / 1e9


def dd_run(path: Path, op: str, nbytes: int, block: int) -> float:
    count = nbytes // block
    if op == "write":
        args = ["if=/dev/zero", f"of={path}", "oflag=direct", "conv=notrunc"]  # in place, like fio
    else:
        drop_cache(path)
        args = [f"if={path}", "of=/dev/null", "iflag=direct"]
    out = subprocess.run(["dd", *args, f"bs={block}", f"count={count}"], capture_output=True, text=True, check=True)
    seconds = float(re.search(r"copied, ([\d.]+) s", out.stderr).group(1))
    return count * block / seconds / 1e9


def fio_run(path: Path, op: str, nbytes: int, block: int, config: tuple[str, int, int]) -> float:
    ioengine, depth, jobs = config
    if op == "read":
        drop_cache(path)
    per_job = nbytes // jobs // block * block
    cmd = ["fio", "--name=bench", f"--filename={path}", f"--rw={op}", f"--bs={block}", "--direct=1",
           f"--ioengine={ioengine}", f"--iodepth={depth}", f"--numjobs={jobs}", f"--size={per_job}",
           f"--offset_increment={per_job}", "--group_reporting", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    return job[op]["bw_bytes"] / 1e9


def contenders(args, swap_dir: Path, buf: torch.Tensor) -> dict:
    """name -> {op: callable returning GB/s}."""
    engines = {(threads, verify): SwapEngine(swap_dir / f"threads{threads}-verify{verify}", threads=threads,
                                             block_bytes=args.block_mib << 20, verify=verify,
                                             need_bytes=3 * buf.numel())
               for threads in args.threads for verify in (True, False)}
    names = {key: f"bench-{key[0]}-{key[1]}" for key in engines}  # each reads what it wrote: verified or not
    for key, e in engines.items():  # twice: the steady state, where a spare exists
        e.write(names[key], buf).result()
        e.write(names[key], buf).result()
    first = next(iter(engines))
    raw, swapfile = swap_dir / "raw.bin", engines[first].file(names[first])
    block, nbytes = args.block_mib << 20, buf.numel()
    dd_run(raw, "write", nbytes, block)  # laid out once; dd and fio then overwrite it in place
    out = {f"zfunc SwapEngine verify={v} threads={t}":
           {op: (lambda op=op, e=e, n=names[t, v]: engine_run(e, n, buf, op)) for op in ("write", "read")}
           for (t, v), e in engines.items()}
    out[f"dd {args.block_mib} MiB direct"] = {"write": lambda: dd_run(raw, "write", nbytes, block),
                                              "read": lambda: dd_run(swapfile, "read", nbytes, block)}
    for c in FIO_CONFIGS:
        out[f"fio {c[0]} iodepth={c[1]} jobs={c[2]}"] = {
            "write": lambda c=c: fio_run(raw, "write", nbytes, block, c),
            "read": lambda c=c: fio_run(swapfile, "read", nbytes, block, c)}
    return out, engines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="file size in GiB")
    p.add_argument("--block-mib", type=int, default=8, help="block size in MiB for every contender")
    p.add_argument("--dir", default="/tmp/zfunc-swap-bench")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", default="8,16", help="the engine's I/O threads, a comma list (8 is the default)")
    args = p.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    if not shutil.which("fio"):
        sys.exit("fio not found: apt-get install -y fio")
    swap_dir = Path(args.dir)
    block = args.block_mib << 20
    buf = aligned_empty(int(args.gib * 2**30) // block * block).random_()
    results: dict[str, dict[str, list[float]]] = {}
    try:
        table, engines = contenders(args, swap_dir, buf)
        first = next(iter(engines.values()))
        print(f"# {buf.numel() / 2**30:.2f} GiB, {args.block_mib} MiB blocks, {args.dir} "
              f"(O_DIRECT {'on' if first.o_direct else 'refused: buffered'}), {args.repeats} repeats, "
              f"crc32 from {crc32.__module__}, torch {torch.__version__}, {os.uname().release}")
        runs = [(name, op) for op in ("write", "read") for name in table]
        for r in range(args.repeats):
            shift = r * len(runs) // max(args.repeats, 1)
            for name, op in runs[shift:] + runs[:shift]:
                results.setdefault(name, {}).setdefault(op, []).append(table[name][op]())
        report(results, args.repeats)
    finally:
        for e in locals().get("engines", {}).values():
            e.close()
        shutil.rmtree(swap_dir, ignore_errors=True)


def report(results: dict[str, dict[str, list[float]]], repeats: int) -> None:
    print("\n| contender | write best | write median | read best | read median |")
    print("|---|---|---|---|---|")
    for name, ops in results.items():
        w, r = ops["write"], ops["read"]
        print(f"| {name} | {max(w):.2f} | {statistics.median(w):.2f} | {max(r):.2f} | {statistics.median(r):.2f} |")
    for op in ("write", "read"):
        fio = max((max(v[op]), n) for n, v in results.items() if n.startswith("fio"))
        dd = next(v[op] for n, v in results.items() if n.startswith("dd"))
        for name in (n for n in results if n.startswith("zfunc")):
            mine = results[name][op]
            verdict = "meets" if max(mine) >= 0.9 * fio[0] else "MISSES"
            paired = statistics.median(m / max(v[op][r] for n, v in results.items() if n.startswith("fio"))
                                       for r, m in enumerate(mine))
            print(f"{op:5s} {name}: best {max(mine):.2f} GB/s = {max(mine) / fio[0]:.2f}x fio's best "
                  f"({fio[0]:.2f}, {fio[1]}), {max(mine) / max(dd):.2f}x dd's best; paired per repeat "
                  f"{paired:.2f}x -- {verdict} the >= 0.9x target")
    print(f"(GB/s = 1e9 bytes/s; best and median of {repeats} interleaved repeats)")


if __name__ == "__main__":
    main()
