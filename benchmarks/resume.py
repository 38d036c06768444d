"""Resuming: a fresh process loads an AdamW checkpoint after the page cache is dropped, as a restarted job does.

    PYTHONPATH=<a zfunc tree> python benchmarks/resume.py [--mparams 50 200] [--rounds 5] [--pause 3]
                                                          [--dir /tmp/zfunc-resume-bench] [--verbose]

The state is an AdamW ``TrainState`` of ``--mparams`` million fp32 params (8 matrices; params and two
moments: 12 bytes/param). Each round the parent writes it three ways (the save row, interleaved, the
writers' order rotating): ``zf.checkpoint.save``, ``torch.save`` of the same tensors (plain dicts and
lists, so ``weights_only=True`` reads them) followed by an fsync, and ``torch.distributed.checkpoint.save``
(DCP, one process). Then for each loader, order rotating, it drops every file of the round from the page
cache (``posix_fadvise(DONTNEED)``: this machine is shared, so never ``/proc/sys/vm/drop_caches``), waits
``--pause`` s (memory freed by the last process sits free, as a restarted job finds it; on this VM the
guest hands it back to its host: ``benchmarks/checkpoint.py``) and starts a fresh Python process that
imports torch and zfunc, builds the step (``zf.train_step``, ``zf.optim.adamw``, the model's params on
the meta device) and only then times the load call:

- zfunc: ``zf.checkpoint.load(directory, step, params=params)`` (every crc32 checked);
- torch: ``torch.load(file, weights_only=True)``;
- DCP: ``torch.distributed.checkpoint.load`` into tensors it allocates first (allocation counted, as
  the other two allocate what they read into).

Two columns per loader: the load call alone (what the restarted job waits for after its setup), and the
whole process (Python start, imports, building the step, the load, exit). Ratios are medians over rounds
of the paired ratio (zfunc over the peer, same round): > 1 is zfunc faster. Only the public API is used,
so any zfunc tree given by ``PYTHONPATH`` runs it (the header prints which one was imported).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

try:
    import zfunc as zf
except ImportError:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import zfunc as zf

LOADERS = ("zfunc", "torch", "dcp")
ROWS = 1024  # each param is (ROWS, n / (8 * ROWS))


def shapes(mparams: float) -> dict[str, tuple[int, int]]:
    return {f"layer{i}.weight": (ROWS, int(mparams * 1e6) // (8 * ROWS)) for i in range(8)}


def make_step() -> zf.Step:
    return zf.train_step(lambda p, b: sum(x.sum() for x in p.values()), zf.optim.adamw(1e-3))


def make_state(mparams: float) -> zf.TrainState:
    state = make_step().init({n: torch.randn(s) for n, s in shapes(mparams).items()})
    for x in zf.tree.leaves(state.opt_state):
        if isinstance(x, torch.Tensor):
            x.normal_()
    return state


def plain(state: zf.TrainState) -> dict:
    """The state's tensors as plain dicts and lists: what ``torch.load(weights_only=True)`` reads."""
    return {"params": dict(state.params), "opt_state": zf.tree.leaves(state.opt_state), "step": state.step}


def flat(state: zf.TrainState) -> dict[str, torch.Tensor]:
    """The state's tensors as the flat dict DCP saves."""
    tensors = [x for x in zf.tree.leaves((state.params, state.opt_state)) if isinstance(x, torch.Tensor)]
    return {f"t{i}": x for i, x in enumerate(tensors)}


def flat_shapes(mparams: float) -> dict[str, tuple[int, ...]]:
    """``flat``'s shapes, known without the state: AdamW keeps two moments shaped like each param."""
    return {f"t{i}": s for i, s in enumerate(list(shapes(mparams).values()) * 3)}


def torch_save(state: zf.TrainState, path: Path) -> None:
    torch.save(plain(state), path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def drop_cache(root: Path) -> None:
    for f in [p for p in root.rglob("*") if p.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def settle(*paths: Path) -> None:
    """Delete the last round's files, then let the file system finish freeing their blocks."""
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    os.sync()
    time.sleep(1.0)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- the restarted process


def child(loader: str, where: str, mparams: float) -> None:
    """Set up as a restarted job does, then time the load call alone; print the seconds and the
    bytes of tensors loaded as JSON."""
    if loader == "dcp":
        import torch.distributed.checkpoint as dcp
    step = make_step()
    params = {n: torch.empty(s, device="meta") for n, s in shapes(mparams).items()}
    t0 = time.perf_counter()
    if loader == "zfunc":
        loaded = zf.checkpoint.load(where, step, params=params)
    elif loader == "torch":
        loaded = torch.load(where, weights_only=True)
    else:
        loaded = {k: torch.empty(shape) for k, shape in flat_shapes(mparams).items()}
        dcp.load(loaded, checkpoint_id=where)
    seconds = time.perf_counter() - t0
    nbytes = sum(x.numel() * x.element_size() for x in zf.tree.leaves(loaded) if isinstance(x, torch.Tensor))
    print(json.dumps({"seconds": seconds, "bytes": nbytes}))


def restart(loader: str, where: Path, mparams: float) -> tuple[float, float, int]:
    """(load call s, whole process s, bytes loaded) of one fresh process."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-W", "ignore", __file__, "--child", loader, str(where), str(mparams)],
                         check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - t0
    got = json.loads(out.strip().splitlines()[-1])
    return got["seconds"], wall, got["bytes"]


# ----------------------------------------------------------------------------- rounds


def resume(mparams: float, rounds: int, root: Path, pause: float, verbose: bool) -> None:
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process, on purpose
    state = make_state(mparams)
    if {k: tuple(x.shape) for k, x in flat(state).items()} != flat_shapes(mparams):
        raise RuntimeError("flat_shapes: the AdamW state's tensors are not the params and two moments")
    nbytes = sum(x.numel() * x.element_size() for x in zf.tree.leaves((state.params, state.opt_state))
                 if isinstance(x, torch.Tensor))
    times: dict[str, list[float]] = {f"{name} {what}": [] for name in LOADERS for what in ("save", "load", "wall")}
    last: list[Path] = []
    for r in range(rounds):
        where = {"zfunc": root / f"zf/{r:06d}", "torch": root / f"torch{r}.pt", "dcp": root / f"dcp{r}"}
        settle(*last)
        last = [where["zfunc"].parent, where["torch"], where["dcp"]]
        order = LOADERS[r % 3:] + LOADERS[: r % 3]
        writers = {"zfunc": lambda: zf.checkpoint.save(state, where["zfunc"]),
                   "torch": lambda: torch_save(state, where["torch"]),
                   "dcp": lambda: dcp.save(flat(state), checkpoint_id=str(where["dcp"]))}
        for name in order:
            times[f"{name} save"].append(timed(writers[name]))
            os.sync()
        settle()  # the saves' write-back, before any load
        for name in order:
            drop_cache(root)
            time.sleep(pause)
            seconds, wall, got = restart(name, where[name], mparams)
            if got < nbytes:
                raise RuntimeError(f"{name} loaded {got} bytes of tensors, expected {nbytes}")
            times[f"{name} load"].append(seconds)
            times[f"{name} wall"].append(wall)
    settle(*last)
    if verbose:
        for k, v in times.items():
            print(f"{k}: " + " ".join(f"{t:.2f}" for t in v) + " s")
    med = {k: statistics.median(v) for k, v in times.items()}

    def ratio(peer: str, what: str) -> float:  # zfunc's speed over the peer's, paired by round
        return statistics.median(b / a for a, b in zip(times[f"zfunc {what}"], times[f"{peer} {what}"]))

    print(f"\n{mparams:g}M params, AdamW: {nbytes / 1e9:.2f} GB, {rounds} interleaved rounds, page cache dropped, "
          f"a fresh process per load\n")
    print("| | zfunc | torch | DCP | zfunc vs torch | zfunc vs DCP |")
    print("|---|---|---|---|---|---|")
    for what, label in (("save", "save (fsynced), GB/s"), ("load", "load call, GB/s"),
                        ("wall", "whole process, s")):
        cells = [med[f"{name} {what}"] if what == "wall" else nbytes / med[f"{name} {what}"] / 1e9
                 for name in LOADERS]
        print(f"| {label} | " + " | ".join(f"{c:.2f}" for c in cells)
              + f" | {ratio('torch', what):.2f}x | {ratio('dcp', what):.2f}x |")


def main(argv=None) -> None:
    if argv is None and len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mparams", type=float, nargs="+", default=[50.0, 200.0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pause", type=float, default=3.0, help="seconds between dropping the cache and each process")
    p.add_argument("--dir", default="/tmp/zfunc-resume-bench")
    p.add_argument("--verbose", action="store_true", help="print every round's times")
    args = p.parse_args(argv)
    print(f"zfunc from {Path(zf.__file__).parent}, torch {torch.__version__}, load average "
          f"{os.getloadavg()[0]:.1f}")
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        for m in args.mparams:
            resume(m, args.rounds, root, args.pause, args.verbose)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
