"""Checkpoint save/load GB/s: zfunc.checkpoint vs torch.save/torch.load vs the disk (dd), one run.

    python benchmarks/checkpoint.py [--mparams 50] [--dir /tmp/zfunc-ckpt-bench] [--repeats 3]

The state is an AdamW TrainState of ``--mparams`` million fp32 params (params + two moments:
12 bytes/param). Both writers fsync; before every load the files are dropped from the page cache
(posix_fadvise DONTNEED), so loads read the disk. zfunc's save includes its sha256 pass and its
load verifies it; ``--no-verify`` shows the load without it. The disk limit is dd with O_DIRECT,
16 MiB blocks, on a file of the same size. Best of ``--repeats``, alternating which library writes
first; prints a markdown table. Disk timings here swing by 2x between runs: compare within a run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
from zfunc import checkpoint as ck  # noqa: E402


def make_state(mparams: float) -> tuple[zf.Step, zf.TrainState]:
    n = int(mparams * 1e6)
    rows = 1024
    params = {f"layer{i}.weight": torch.randn(rows, n // (8 * rows)) for i in range(8)}
    step = zf.train_step(lambda p, b: sum(x.sum() for x in p.values()), zf.optim.adamw(1e-3))
    state = step.init(params)
    for x in zf.tree.leaves(state.opt_state):
        if isinstance(x, torch.Tensor):
            x.normal_()
    return step, state


def drop_cache(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def torch_save(state: zf.TrainState, path: Path) -> None:
    path.unlink(missing_ok=True)  # a fresh file, as zfunc writes
    torch.save({"params": state.params, "opt_state": state.opt_state, "step": state.step}, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def dd(path: Path, nbytes: int) -> tuple[float, float]:
    count = max(1, nbytes // (16 << 20))
    w = timed(lambda: subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "oflag=direct",
                                      "conv=fsync"], check=True, capture_output=True))
    r = timed(lambda: subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True,
                                     capture_output=True))
    path.unlink()
    return count * (16 << 20) / w, count * (16 << 20) / r


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mparams", type=float, default=50.0)
    p.add_argument("--dir", default="/tmp/zfunc-ckpt-bench")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    step, state = make_state(args.mparams)
    nbytes = zf.tree.nbytes(state)
    best = {k: float("inf") for k in ("zf save", "zf load", "zf load (no verify)", "torch.save", "torch.load")}
    disk_w = disk_r = 0.0
    try:
        for r in range(args.repeats):
            # alternate who goes first: the disk's write-back of the last writer slows the next one
            for writer in (("zf", "torch") if r % 2 == 0 else ("torch", "zf")):
                if writer == "zf":
                    best["zf save"] = min(best["zf save"], timed(lambda: ck.save(state, root / "zf")))
                    for name, verify in (("zf load", True), ("zf load (no verify)", False)):
                        drop_cache(root / "zf")
                        best[name] = min(best[name], timed(lambda: ck.load(root / "zf", step, verify=verify)))
                else:
                    best["torch.save"] = min(best["torch.save"], timed(lambda: torch_save(state, root / "torch.pt")))
                    drop_cache(root / "torch.pt")
                    best["torch.load"] = min(best["torch.load"],
                                             timed(lambda: torch.load(root / "torch.pt", weights_only=False)))
            w, r_ = dd(root / "dd.bin", nbytes)
            disk_w, disk_r = max(disk_w, w), max(disk_r, r_)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gbs = {k: nbytes / v / 1e9 for k, v in best.items()}
    print(f"state: {nbytes / 1e9:.2f} GB ({args.mparams:g}M params, AdamW), best of {args.repeats}\n")
    print("| operation | GB/s | vs torch | vs disk (dd O_DIRECT) |\n|---|---|---|---|")
    for k in best:
        peer = gbs["torch.save" if "save" in k else "torch.load"]
        disk = disk_w if "save" in k else disk_r
        print(f"| {k} | {gbs[k]:.2f} | {gbs[k] / peer:.2f}x | {gbs[k] * 1e9 / disk:.2f}x |")
    print(f"| dd write / read | {disk_w / 1e9:.2f} / {disk_r / 1e9:.2f} | | |")


if __name__ == "__main__":
    main()
