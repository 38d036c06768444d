"""Checkpoint save/load vs torch.save/torch.load and torch DCP, and a background save's cost to training.

    python benchmarks/checkpoint.py [--mparams 50 200] [--rounds 5] [--dir /tmp/zfunc-ckpt-bench]
                                    [--async-mparams 50] [--no-async] [--no-save-load] [--verbose]
                                    [--buffered-writes] [--async-rounds 3] [--step-threads N]
                                    [--variant module.NAME=value[,...] ...]

**Save and load.** The state is an AdamW ``TrainState`` of ``--mparams`` million fp32 params
(params + two moments: 12 bytes/param). Writers: ``zf.checkpoint.save`` (crc32 of every tensor,
computed on the way), ``torch.save`` of the same tensors followed by an fsync, and
``torch.distributed.checkpoint.save`` (DCP, one process, its ``FileSystemWriter`` fsyncs). Loads:
``zf.checkpoint.load`` (checks every crc32), ``torch.load``, ``dcp.load`` into freshly allocated
tensors (allocation counted, as the other two allocate). Cold cache: before every load all the
round's files are dropped from the page cache with ``posix_fadvise(DONTNEED)`` (this benchmark runs as root
here, but ``/proc/sys/vm/drop_caches`` would drop the other users' caches on this shared
machine, so it is not used). Every round writes fresh files and deletes the last round's first,
then ``sync``s and waits a second: the file system (ext4 mounted with ``discard``) frees blocks
in the background for a while after a delete, and that must not land on the next writer. Rounds
are interleaved and the writers' order rotates each round; the table shows each one's median
GB/s and the median over rounds of the paired ratio (zfunc over the peer, same round).

Two loads per round, each with the page cache of every file dropped first, so they differ only in
the memory they land in. On this VM (Firecracker, guest kernel booted with free page reporting,
``page_reporting.page_reporting_order``) memory the guest has freed is handed back to the host a
couple of seconds later, and touching it again costs a host fault per page: 600 MiB of fresh
transparent huge pages faulted in 1.5-2.1 s after sitting free 3 s, against 0.07-0.3 s when
touched again at once (4 KiB pages: 0.5-0.7 s either way, taken from the free fragments the host
was not given); every loader allocates what it reads into, so its time swings with this.

- "memory warm": just before each load, 1.5x the state's bytes are touched and freed, so every
  loader finds recently used memory, as on a machine without free page reporting.
- "memory cold": the last round's and the last load's memory has sat free 3 s, as a fresh process
  on this VM finds it. zfunc reads into huge pages (``zfunc.ops.cpu.hostmem``, where init puts state:
  every optimizer step runs on them), which cost the most to fault here; ``torch.load`` reads into
  4 KiB pages.

Why every file is dropped before every load, not each loader's own files just before it runs:
then ``torch.load`` and DCP would get the memory their file's page cache had just held, and zfunc,
whose ``O_DIRECT``-written files leave nothing in the page cache, cold memory; the disk itself reads
back files written either way at one speed (``benchmarks/checkpoint_memory.py``). The host caches
what the guest writes: a fresh file's first read comes from that cache in both loads; a file the
host has not seen reads several times slower the first time. (``dd`` of ``/dev/zero`` is no disk
reference: zeros are cheap to the host.)

**Background save.** A training step of ``--async-mparams`` million params (an MLP of 8 square
layers, fp32, AdamW, a batch whose forward and backward take ~135 ms here on a quiet machine).
Each of ``--async-rounds`` rounds takes one blocking ``save`` of the state, then for each variant
(``--variant``, order rotating by round): 3 plain steps, a ``save(blocking=False)`` with steps
taken until it is done, 3 plain steps. Per variant it prints the median over rounds of the mean
step during the save over the median of the plain steps around it (paired in time, as load
swings here; min-max beside it), how many steps and seconds the save spans, the time the save
blocks training (the ``save`` call plus what the next step waits for the copy) against the
blocking save, and the CPU seconds of the save's own threads; and, over all variants, the
training threads' CPU time per step during a save against alone (>1: the save slows the step's
own work, e.g. memory bandwidth, rather than taking its cores). Each background save copies into
host buffers kept for the next save (``zfunc.checkpoint.background.KEEP_BYTES``) and writes at the
pace ``zfunc.checkpoint.background.SAVE_DUTY`` sets.

``--variant checkpoint.background.SAVE_DUTY=1.0 --variant checkpoint.background.SAVE_DUTY=0.25`` compares
settings (any ``zfunc`` module attribute, a Python literal) alternated in one run;
``--step-threads 1`` runs the step on one intra-op thread. Under load (other processes taking the
cores) the 2-thread step's ratio says little: its plain steps spin in OpenMP barriers while a
thread waits for a core (their CPU time per step doubles), and steps during a save ran faster
than the plain ones around them (0.5-0.9x); a 1-thread step showed neither. Disk and CPU timings
swing on this shared machine: compare within a run.
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402
from zfunc import checkpoint as ck
from zfunc.core import state as state_module  # noqa: E402
from zfunc.ops.cpu import hostmem  # noqa: E402


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


def warm_memory(nbytes: int) -> None:
    """Touch and free ``nbytes`` of huge-page memory: the next allocations find it recently used."""
    hostmem.empty(nbytes, torch.uint8).fill_(0)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def torch_tensors(state: zf.TrainState) -> dict:
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


def torch_save(state: zf.TrainState, path: Path) -> None:
    torch.save(torch_tensors(state), path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def dcp_state(state: zf.TrainState) -> dict:
    """The state as the flat dict of tensors DCP saves (its optimizer state dicts hold the same)."""
    flat = {}
    for i, leaf in enumerate(zf.tree.leaves(state.opt_state)):
        if isinstance(leaf, torch.Tensor):
            flat[f"opt.{i}"] = leaf
    return {**{f"params.{k}": v for k, v in state.params.items()}, **flat}


def dcp_load(like: dict, path: Path) -> dict:
    out = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load(out, checkpoint_id=str(path))
    return out


def settle(*paths: Path) -> None:
    """Delete the last round's files, then let the file system finish freeing their blocks."""
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    os.sync()
    time.sleep(1.0)


def save_load(mparams: float, rounds: int, root: Path, verbose: bool = False) -> None:
    step, state = make_state(mparams)
    nbytes = zf.tree.nbytes(state)
    like = dcp_state(state)
    times: dict[str, list[float]] = {f"{lib} {op}": [] for op in ("save", "warm", "cold")
                                     for lib in ("zf", "torch", "dcp")}
    last: list[Path] = []
    for r in range(rounds):
        zf_dir, torch_file, dcp_dir = root / f"zf/{r:06d}", root / f"torch{r}.pt", root / f"dcp{r}"
        settle(*last)
        last = [zf_dir.parent, torch_file, dcp_dir]
        writers = [("zf", lambda: ck.save(state, zf_dir)), ("torch", lambda: torch_save(state, torch_file)),
                   ("dcp", lambda: dcp.save(like, checkpoint_id=str(dcp_dir)))]
        readers = {"zf": (zf_dir, lambda: ck.load(zf_dir, step, verify=True)),
                   "torch": (torch_file, lambda: torch.load(torch_file, weights_only=False)),
                   "dcp": (dcp_dir, lambda: dcp_load(like, dcp_dir))}
        order = writers[r % 3:] + writers[: r % 3]  # rotate who writes first
        for name, save in order:
            times[f"{name} save"].append(timed(save))
            os.sync()
        settle()  # the saves' write-back, before any load
        for op in ("warm", "cold"):  # the memory each load lands in (see the docstring)
            for name, _ in order:
                drop_cache(root)
                if op == "warm":
                    warm_memory(int(1.5 * nbytes))
                else:
                    gc.collect()
                    time.sleep(3.0)
                times[f"{name} {op}"].append(timed(readers[name][1]))
    settle(*last)
    med = {k: statistics.median(v) for k, v in times.items()}
    if verbose:
        for k, v in times.items():
            print(f"{k}: " + " ".join(f"{t:.2f}" for t in v) + " s")

    def ratio(a: str, b: str) -> float:  # zfunc's speed over the peer's, paired by round
        return statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))

    print(f"\n{mparams:g}M params, AdamW: {nbytes / 1e9:.2f} GB, {rounds} interleaved rounds, cold cache, fsynced\n")
    print("| operation | zfunc GB/s | torch GB/s | DCP GB/s | zfunc vs torch | zfunc vs DCP |")
    print("|---|---|---|---|---|---|")
    for op, what in (("save", "save (fsynced)"), ("warm", "load, memory warm"),
                     ("cold", "load, memory cold (this VM)")):
        gbs = [nbytes / med[f"{lib} {op}"] / 1e9 for lib in ("zf", "torch", "dcp")]
        print(f"| {what} | {gbs[0]:.2f} | {gbs[1]:.2f} | {gbs[2]:.2f} | {ratio(f'zf {op}', f'torch {op}'):.2f}x | "
              f"{ratio(f'zf {op}', f'dcp {op}'):.2f}x |")


# ----------------------------------------------------------------------------- background save


def mlp_step(mparams: float) -> tuple[zf.Step, zf.TrainState, torch.Tensor]:
    d = int((mparams * 1e6 / 8) ** 0.5)
    torch.manual_seed(0)
    params = {f"w{i}": torch.randn(d, d) / d**0.5 for i in range(8)}

    def loss_fn(p, x):
        for i in range(8):
            x = torch.tanh(x @ p[f"w{i}"])
        return x.square().mean()

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-4))
    return step, step.init(params), torch.randn(32, d)


def _setting(assignment: str) -> tuple[object, str, object]:
    """``"module.NAME=value"`` (a module of zfunc, a Python literal) as ``(module, NAME, value)``."""
    import ast
    import importlib

    where, _, raw = assignment.partition("=")
    module, _, name = where.rpartition(".")
    target = importlib.import_module(f"zfunc.{module}")
    if not hasattr(target, name) or not raw:
        raise SystemExit(f"--variant: expected zfunc module.NAME=value with NAME in that module, got {assignment!r}")
    return target, name, ast.literal_eval(raw)


class _Variant:
    """Module settings applied for one variant's saves (``--variant``), restored after."""

    def __init__(self, spec: str):
        self.label = spec or "defaults"
        self.settings = [_setting(a) for a in spec.split(",") if a]
        self.saved: list = []

    def __enter__(self):
        self.saved = [(m, n, getattr(m, n)) for m, n, _ in self.settings]
        for m, n, v in self.settings:
            setattr(m, n, v)

    def __exit__(self, *exc):
        for m, n, v in self.saved:
            setattr(m, n, v)


def _cpu_seconds() -> tuple[float, dict[int, float]]:
    """CPU seconds this process has run so far, all threads (those gone too), and each live
    thread's (``/proc/self/task/*/schedstat``)."""
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                threads[int(tid)] = int(f.read().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, threads


def _save_cpu(before: tuple[float, dict[int, float]], after: tuple[float, dict[int, float]]) -> float:
    """CPU seconds run between the two readings by threads other than those live at ``before``
    (the training's): the save's writer and I/O threads."""
    training = sum(after[1].get(tid, t) - t for tid, t in before[1].items())
    return after[0] - before[0] - training


def background(mparams: float, root: Path, rounds: int = 3, variants: list[str] | None = None,
               plain_steps: int = 3, verbose: bool = False) -> None:
    """Each round, for each variant (order rotating): ``plain_steps`` steps, a background save with
    steps until it is done, ``plain_steps`` steps; the round's ratio is the mean step during the
    save over the median of the plain steps around it (paired in time, as load swings)."""
    step, state, x = mlp_step(mparams)
    waited = [0.0]
    inner = list(state_module.before_consume)
    variants = [_Variant(v) for v in variants or [""]]

    def timed_wait() -> None:  # what a step waits for the save's copy
        t0 = time.perf_counter()
        for wait in inner:
            wait()
        waited[0] += time.perf_counter() - t0

    training: list[int] = []  # the training's threads (live after the warm-up)
    cpu = {"plain": [], "during": []}

    def steps(n: int, times: list[float], what: str = "plain") -> None:
        nonlocal state
        for _ in range(n):
            c = _cpu_seconds()[1]
            t = time.perf_counter()
            state, _ = step(state, x)
            times.append(time.perf_counter() - t)
            c1 = _cpu_seconds()[1]
            cpu[what].append(sum(c1.get(tid, 0.0) - c.get(tid, 0.0) for tid in training))

    state_module.before_consume[:] = [timed_wait]
    runs = {v.label: {"ratio": [], "steps": [], "blocked": [], "cpu": [], "seconds": []} for v in variants}
    blocking = []
    try:
        steps(2, [])  # warm up
        training[:] = _cpu_seconds()[1]
        for v in variants:
            with v:
                ck.save(state, root / "bg-warm", blocking=False).wait()
        for r in range(rounds):
            settle(root / "bg-a")
            blocking.append(timed(lambda: ck.save(state, root / "bg-a")))
            for v in variants[r % len(variants):] + variants[: r % len(variants)]:
                settle(root / "bg-b")
                plain, during = [], []
                steps(plain_steps, plain)
                with v:
                    waited[0] = 0.0
                    before = _cpu_seconds()
                    t0 = time.perf_counter()
                    handle = ck.save(state, root / "bg-b", blocking=False)
                    call = time.perf_counter() - t0
                    while not handle.done() or not during:
                        steps(1, during, "during")
                    handle.wait()
                    seconds = time.perf_counter() - t0
                    after = _cpu_seconds()
                steps(plain_steps, plain)
                run = runs[v.label]
                run["ratio"].append(statistics.mean(during) / statistics.median(plain))
                run["steps"].append(len(during))
                run["blocked"].append(call + waited[0])
                run["seconds"].append(seconds)
                run["cpu"].append(_save_cpu(before, after))
                if verbose:
                    print(f"{v.label}: plain " + " ".join(f"{t * 1e3:.0f}" for t in plain) + " ms; during "
                          + " ".join(f"{t * 1e3:.0f}" for t in during) + " ms", flush=True)
    finally:
        state_module.before_consume[:] = inner
    nbytes = zf.tree.nbytes(state)
    s = statistics.median(blocking)
    print(f"\nbackground save, {mparams:g}M-param MLP step (AdamW, {nbytes / 1e9:.2f} GB state, "
          f"{torch.get_num_threads()} intra-op threads), {rounds} rounds; "
          f"blocking save {s * 1e3:.0f} ms (median)\n")
    print("| variant | step during a save / step alone (median, min-max) | save spans (steps, s) "
          "| training blocked (ms, share of a blocking save) | save threads' CPU (s) |")
    print("|---|---|---|---|---|")
    for label, run in runs.items():
        ratio, b = run["ratio"], statistics.median(run["blocked"])
        print(f"| {label} | {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) | "
              f"{statistics.median(run['steps']):g}, {statistics.median(run['seconds']):.1f} | "
              f"{b * 1e3:.0f}, {b / s:.0%} | {statistics.median(run['cpu']):.2f} |")
    c = statistics.median(cpu["during"]) / statistics.median(cpu["plain"])
    print(f"\ntraining threads' CPU time per step (medians, all variants): {c:.2f}x during a save; >1 is the save "
          "slowing the step's own work (memory bandwidth, caches), not taking its cores")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mparams", type=float, nargs="+", default=[50.0])
    p.add_argument("--async-mparams", type=float, default=50.0)
    p.add_argument("--no-async", action="store_true")
    p.add_argument("--no-save-load", action="store_true", help="only the background save")
    p.add_argument("--dir", default="/tmp/zfunc-ckpt-bench")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--verbose", action="store_true", help="print every round's times")
    p.add_argument("--variant", action="append", default=None, metavar="module.NAME=value[,...]",
                   help="background save: zfunc settings of one variant, e.g. checkpoint.background.SAVE_DUTY=0.25 "
                        "(repeat to compare, alternated in each round; '' is the defaults)")
    p.add_argument("--async-rounds", type=int, default=3)
    p.add_argument("--step-threads", type=int, default=None,
                   help="background save: torch's intra-op threads for the step (default: torch's, 2 here)")
    p.add_argument("--buffered-writes", action="store_true",
                   help="zfunc writes through the page cache (checkpoint.disk_io.DIRECT_WRITES = False)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process, on purpose
    root = Path(args.dir)
    if args.buffered_writes:
        from zfunc.checkpoint import disk_io as checkpoint_io

        checkpoint_io.DIRECT_WRITES = False
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        for m in [] if args.no_save_load else args.mparams:
            save_load(m, args.rounds, root, args.verbose)
        if not args.no_async:
            if args.step_threads:
                torch.set_num_threads(args.step_threads)
            background(args.async_mparams, root, args.async_rounds, args.variant, verbose=args.verbose)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
