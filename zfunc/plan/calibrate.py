"""``--calibrate``: this machine's constants, measured, into a small JSON file; and a cluster from them.

Measured (times are wall clock, best of a few repeats, except where "CPU time" says otherwise):
- ``matmul_flops``: fp32 ``torch.mm`` of 1024 x 1024 matrices, on 1 thread and on all of them
  (and bf16 8192^3 on CUDA when there is a GPU, beside its datasheet peak: the GEMM efficiency).
  In CPU time, the GEMMs of ``benchmarks/``' GPT (1024 x 192 x 576 ... 192 x 1024 x 768, forward and
  both backward products, 128-1024 tokens) run within 5% of this square one (115 vs 109 GFLOP/s on
  one core here): the shapes need no table of their own;
- ``copy_bw``: ``copy_`` of 128 MiB, counted as read + write, on 1 thread and on all;
- ``attention_flops``: causal ``scaled_dot_product_attention`` (8 x 8 heads x 256 x 64), counting the
  half the mask keeps; ``activation_rate``: ``F.gelu`` elements per second (both 1 / all threads);
- ``first_touch_bw``: bytes/s of ``torch.zeros`` of 64 MiB then written once: memory fresh from the
  OS faults on each page's first write and the kernel clears it (~2 us per 4 KiB page on this VM,
  ten times a copy); the engine's per-step fp32 grad slices pay it (``cost.update_time``);
- ``cpu_adam_params_per_s``: zfunc's CPU-Adam kernel (``zf.ops.cpu.adam.adamw_``) on 8M fp32 params;
- ``per_rank_of_2``: the single-thread rates above in each of 2 spawned ranks computing at once
  (1 thread each here), what ``zf.dist.spawn``'s runs see: they share caches and memory bandwidth;
- ``collectives``: zfunc's own ``dist.Comm`` all-gather, reduce-scatter and all-reduce and a
  ``P2P`` send/recv between 2 spawned gloo ranks on loopback, at 64 KiB and 16 MiB: ``[alpha,
  beta]`` with ``t = alpha + wire / beta`` (``wire``: the ring's ``(N-1)/N`` of the Comm bytes),
  best of 21 repeats at 64 KiB (a loaded machine delays a rank's wake-up by milliseconds: best of
  7 once read 2 ms for a 0.3 ms gather) and of 7 at 16 MiB;
- ``disk``: the swap engine (``zfunc.offloading.swap.engine``, O_DIRECT) writing then reading 4 files of 64 MiB.

**Load.** Single-thread rates (the ``"1"`` entries, ``per_rank_of_2``, ``rates_now``) are timed in
the thread's CPU time (``time.thread_time``, median of the repeats): what the kernel costs while it
has a core, which other processes on a shared machine barely change (GEMM: 108-115 GFLOP/s at
loads 5-14 on 2 cores, where wall-clock best-of-5 read 42-68). How much of a core a process gets
now is a separate measurement, ``cpu_share()``: a fixed GEMM's CPU time over its wall time. A
prediction under load divides the CPU-bound parts by that share (``cluster_from(..., share=)``);
on a quiet machine it is 1. Multi-threaded rates (``"all"``), the collectives and the disk stay in
wall clock: OpenMP's spinning threads and the kernel's I/O and loopback work are not one thread's
CPU time.

``cluster_from(cal, ranks)`` makes the ``Cluster`` of ``ranks`` processes on this machine (the way
``zf.dist.spawn`` runs them, ``cpu_count // ranks`` threads each): the CPU is the "device", its
measured matmul rate the peak (efficiency 1), its copy bandwidth the memory bandwidth, and the
calibrated collectives replace the link model.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from zfunc.config import json_file
from zfunc.plan.hardware import GB, Cluster, Device, Node

DEFAULT_PATH = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zfunc" / "plan_calibration.json"
SIZES = (64 << 10, 16 << 20)  # bytes of the collectives' tensors (as Comm counts bytes: output / input / tensor)
VERSION = 3  # 3: single-thread rates in CPU time, first_touch_bw


def _timed(fn, repeats: int, clock, pick) -> float:
    """``pick`` (min, median) of ``repeats`` timings of ``fn()`` on ``clock``, after a warm-up."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        times.append(clock() - t)
    return pick(times)


def _best(fn, repeats: int = 5) -> float:
    """Fastest wall seconds of ``fn()`` after a warm-up."""
    return _timed(fn, repeats, time.perf_counter, min)


def _cpu_seconds(fn, repeats: int = 5) -> float:
    """Median thread CPU seconds of ``fn()`` after a warm-up (module docstring: Load)."""
    return _timed(fn, repeats, time.thread_time, statistics.median)


def _on_threads(n: int, rate):
    """``rate(timer)`` on ``n`` threads: timed in CPU time on one thread, in wall clock on more."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return rate(_cpu_seconds if n == 1 else _best)
    finally:
        torch.set_num_threads(before)


def matmul_flops(timer=_best, n: int = 1024) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return 2 * n**3 / timer(lambda: torch.mm(a, b, out=out))


def attention_flops(timer=_best, b: int = 8, heads: int = 8, seq: int = 256, d: int = 64) -> float:
    """Causal ``scaled_dot_product_attention`` forward, FLOP/s counting the half a causal mask keeps
    (``2 b s^2 heads d``), as ``cost.compute_times`` counts it."""
    q, k, v = (torch.randn(b, heads, seq, d) for _ in range(3))
    fn = torch.nn.functional.scaled_dot_product_attention
    return 2 * b * seq * seq * heads * d / timer(lambda: fn(q, k, v, is_causal=True))


def activation_rate(timer=_best, n: int = 1 << 22) -> float:
    """``F.gelu`` elements per second (erf: bound by arithmetic on a CPU, not by memory)."""
    x = torch.randn(n)
    return n / timer(lambda: torch.nn.functional.gelu(x))


def copy_bw(timer=_best, nbytes: int = 128 << 20) -> float:
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return 2 * nbytes / timer(lambda: dst.copy_(src))


def first_touch_bw(timer=_best, nbytes: int = 64 << 20) -> float:
    """Bytes/s of the first write into fresh memory: ``torch.zeros`` (zero pages, mapped on demand)
    then ``fill_``, counted once. Large blocks come from the OS on every allocation (glibc maps
    them), so each repeat faults anew."""
    return nbytes / timer(lambda: torch.zeros(nbytes // 4).fill_(1.0))


def cpu_adam_rate(timer=_best, n: int = 8 << 20) -> float:
    from zfunc.ops.cpu import adam as cpu_adam

    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    return n / timer(lambda: cpu_adam.adamw_(p, g, m, v, step=1, lr=1e-4))


def cpu_share(n: int = 384, repeats: int = 8, then=None) -> float:
    """The fraction of a core this thread gets now: a fixed GEMM loop's thread CPU time over its
    wall time (1 on a quiet machine; ~0.5 at a load average of 6-8 on 2 cores here). ``then``: a
    call (a barrier) whose wait counts in the wall time, so that ranks that synchronize measure
    the share of the slower of them, as their steps do."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(repeats):
        torch.mm(a, b, out=out)
    cpu = time.thread_time() - cpu
    if then is not None:
        then()
    wall = time.perf_counter() - wall
    return min(1.0, cpu / wall) if wall > 0 else 1.0


RATES = {"matmul_flops": matmul_flops, "copy_bw": copy_bw, "attention_flops": attention_flops,
         "activation_rate": activation_rate, "first_touch_bw": first_touch_bw}


def _collective_worker(rank: int, sizes: tuple[int, ...], repeats: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    import zfunc as zf

    mesh, line = zf.Mesh(dp=2), zf.Mesh(pp=2)  # collectives over dp; point-to-point over a pipeline's pair
    out = {}
    for name, rate in RATES.items():  # both ranks at once, as spawned runs compute: the per-rank rates
        dist.barrier()
        out[name] = [rate(_cpu_seconds if torch.get_num_threads() == 1 else _best)]
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "send"):
        times = []
        for nbytes in sizes:
            n = nbytes // 4
            if kind == "all_gather":
                big = torch.zeros(n)
                op = lambda big=big, n=n: mesh.comm.all_gather(big, big[rank * (n // 2):(rank + 1) * (n // 2)])  # noqa
            elif kind == "reduce_scatter":
                full, part = torch.ones(n), torch.empty(n // 2)
                op = lambda full=full, part=part: mesh.reduce_comm.reduce_scatter(part, full)  # noqa: E731
            elif kind == "all_reduce":
                t = torch.ones(n // 2)  # Comm counts an all-reduce as twice its tensor
                op = lambda t=t: mesh.comm.all_reduce(t)  # noqa: E731
            else:
                t = torch.ones(n)

                def op(t=t):
                    work = line.p2p.send(t, 1, "calibrate") if rank == 0 else line.p2p.recv(t, 0, "calibrate")
                    work.wait()
            times.append(_best(op, repeats * 3 if nbytes < 1 << 20 else repeats))  # small ones: cheap, noisier
        out[kind] = times
    return out


def collectives(sizes: tuple[int, ...] = SIZES, repeats: int = 7) -> dict[str, list[float]]:
    """``{kind: [alpha_s, beta_bytes_per_s]}`` between 2 gloo ranks on loopback (module docstring)."""
    import zfunc as zf

    results = zf.dist.spawn(_collective_worker, 2, sizes, repeats, timeout_s=600)
    fitted = {"per_rank_of_2": {name: min(r[name][0] for r in results) for name in RATES}}
    for kind in results[0]:
        if kind in RATES:
            continue
        t = [max(r[kind][i] for r in results) for i in range(len(sizes))]  # as slow as the slower rank
        wire = [s if kind == "send" else s / 2 for s in sizes]  # a ring of 2 moves half the Comm bytes
        beta = (wire[1] - wire[0]) / max(t[1] - t[0], 1e-9)
        fitted[kind] = [max(t[0] - wire[0] / beta, 0.0), beta]
    return fitted


def rates_now() -> dict[str, float]:
    """The per-rank rates of ``RATES``, measured now in this process (with its threads; in CPU time
    on one thread, as the calibration's)."""
    timer = _cpu_seconds if torch.get_num_threads() == 1 else _best
    return {name: rate(timer) for name, rate in RATES.items()}


def _split(measured: dict) -> dict:
    """``collectives()``'s result as two entries: the fitted collectives, and the per-rank rates of two
    ranks computing at once."""
    per_rank = measured.pop("per_rank_of_2")
    return {"collectives": measured, "per_rank_of_2": per_rank}


def disk(path: str | None = None, files: int = 4, nbytes: int = 64 << 20, timer=_best) -> dict[str, float]:
    """Swap-engine write and read bandwidth (bytes/s) in a scratch folder under ``path``: ``files``
    files of ``nbytes``, all written (then all read) at once; the first write, which allocates the
    files, is a warm-up, as the swap engine's spare files spare a long run those allocations."""
    from zfunc.offloading.swap.engine import SwapEngine
    from zfunc.offloading.swap.file_format import aligned_empty

    root = Path(tempfile.mkdtemp(prefix="zfunc-calibrate-", dir=path))
    try:
        with SwapEngine(root) as engine:
            bufs = [aligned_empty(nbytes)[:nbytes] for _ in range(files)]
            for b in bufs:
                b.fill_(1)

            def write():
                for f in [engine.write(f"f{i}", b) for i, b in enumerate(bufs)]:
                    f.result()

            def read():
                for f in [engine.read(f"f{i}", b) for i, b in enumerate(bufs)]:
                    f.result()

            w = timer(write, 3)
            r = timer(read, 3)
        return {"write_bw": files * nbytes / w, "read_bw": files * nbytes / r}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _cuda() -> dict | None:
    if not torch.cuda.is_available():
        return None
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def mm():
        torch.mm(a, b)
        torch.cuda.synchronize()

    return {"name": torch.cuda.get_device_name(), "bf16_matmul_flops": 2 * n**3 / _best(mm)}


def measure(disk_path: str | None = None) -> dict:
    """Every constant of the module docstring, as a JSON-ready dict."""
    threads = torch.get_num_threads()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "version": VERSION, "date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
        "torch": torch.__version__, "threads": threads, "ram_bytes": ram,
        "load_average": os.getloadavg(),
        "matmul_flops": {"1": _on_threads(1, matmul_flops), "all": _on_threads(threads, matmul_flops)},
        "copy_bw": {"1": _on_threads(1, copy_bw), "all": _on_threads(threads, copy_bw)},
        "attention_flops": {"1": _on_threads(1, attention_flops), "all": _on_threads(threads, attention_flops)},
        "activation_rate": {"1": _on_threads(1, activation_rate), "all": _on_threads(threads, activation_rate)},
        "first_touch_bw": {"1": _on_threads(1, first_touch_bw), "all": _on_threads(threads, first_touch_bw)},
        "cpu_adam_params_per_s": {"1": _on_threads(1, cpu_adam_rate), "all": _on_threads(threads, cpu_adam_rate)},
        **_split(collectives()),
        "disk": disk(disk_path),
        "cuda": _cuda(),
    }


def save(cal: dict, path: str | os.PathLike | None = None) -> Path:
    path = Path(path or DEFAULT_PATH)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cal, indent=1))
    return path


def load(path: str | os.PathLike | None = None) -> dict:
    path = Path(path or DEFAULT_PATH)
    if not path.exists():
        raise OSError(f"no calibration at {path}: run python -m zfunc.plan --calibrate first")
    cal = json_file.read(path)  # bounded: nesting, size, duplicate keys
    if not isinstance(cal, dict):
        raise ValueError(f"{path}: expected a JSON object (a zfunc.plan calibration), got a {type(cal).__name__}")
    if cal.get("version") != VERSION:
        raise ValueError(f"{path}: not a zfunc.plan calibration of version {VERSION} (found "
                         f"{cal.get('version')!r}): run python -m zfunc.plan --calibrate again")
    return cal


def _per_rank(table: dict, threads: int, total: int) -> float:
    """A rate measured on 1 and on ``total`` threads, at ``threads`` (linear between)."""
    one, full = table["1"], table["all"]
    if total <= 1:
        return full
    return one + (full - one) * (threads - 1) / (total - 1)


def cluster_from(cal: dict, ranks: int = 1, threads: int | None = None, rates: dict | None = None,
                 share: float = 1.0) -> Cluster:
    """``ranks`` processes on the calibrated machine, ``threads`` each (default ``cpus // ranks``);
    ``rates`` (``rates_now()`` of the ranks themselves) replace the calibrated per-rank rates.
    ``share``: the fraction of a core each rank gets (``cpu_share()``; module docstring: Load); the
    CPU's rates and the loopback collectives, which are CPU work, are scaled by it, the disk not."""
    if not 0 < share <= 1:
        raise ValueError(f"share: expected a fraction of a core in (0, 1], got {share!r}")
    total = cal["threads"]
    threads = threads or max(1, total // ranks)
    if rates is not None:
        rate = rates.get
    elif ranks == 2 and threads == max(1, total // 2):  # measured as spawn runs them: two ranks at once
        rate = cal["per_rank_of_2"].get
    else:
        rate = lambda name: _per_rank(cal[name], threads, total)  # noqa: E731
    flops, bw = share * rate("matmul_flops"), share * rate("copy_bw")
    attention = share * rate("attention_flops")
    device = Device("this machine (calibrated)", {"fp32": flops, "bf16": None, "fp16": None},
                    cal["ram_bytes"] / ranks, bw, matmul_efficiency=1.0, attention_efficiency=attention / flops,
                    memory_efficiency=1.0, kind="cpu", source=f"calibrated {cal['date']} on {cal['host']}",
                    activation_rate=share * rate("activation_rate"), first_touch_bw=share * rate("first_touch_bw"))
    adam_bytes = 36 * cal["cpu_adam_params_per_s"]["all"]
    colls = {k: (v[0] / share, v[1] * share) for k, v in cal["collectives"].items()}
    node = Node(ranks, colls["all_gather"][1], colls["all_gather"][1], bw, cal["ram_bytes"], cal["copy_bw"]["all"],
                shutil.disk_usage(tempfile.gettempdir()).free, cal["disk"]["read_bw"], cal["disk"]["write_bw"],
                "this machine")
    return Cluster(device, ranks, node, collective_efficiency=1.0, latency=colls["all_reduce"][0],
                   cpu_adam_efficiency=adam_bytes / cal["copy_bw"]["all"], collectives=colls)


def describe(cal: dict) -> str:
    c = cal["collectives"]
    return (f"calibration {cal['date']} ({cal['host']}, load {cal['load_average'][0]:.1f}): matmul "
            f"{cal['matmul_flops']['1'] / GB:.1f} / {cal['matmul_flops']['all'] / GB:.1f} GFLOP/s (1 / "
            f"{cal['threads']} threads), copy {cal['copy_bw']['1'] / GB:.1f} / {cal['copy_bw']['all'] / GB:.1f} GB/s, "
            f"attention {cal['attention_flops']['1'] / GB:.1f} GFLOP/s, GELU {cal['activation_rate']['1'] / 1e9:.2f} "
            f"Gelem/s, first touch {cal['first_touch_bw']['1'] / GB:.2f} / {cal['first_touch_bw']['all'] / GB:.2f} "
            f"GB/s (1 thread in CPU time / all in wall), "
            f"CPU-Adam {cal['cpu_adam_params_per_s']['all'] / 1e6:.0f} Mparam/s, "
            + ", ".join(f"{k} {v[0] * 1e6:.0f} us + {v[1] / GB:.2f} GB/s" for k, v in c.items())
            + f", disk write {cal['disk']['write_bw'] / GB:.2f} / read {cal['disk']['read_bw'] / GB:.2f} GB/s; "
            f"per rank of 2 at once: matmul {cal['per_rank_of_2']['matmul_flops'] / GB:.1f} GFLOP/s, copy "
            f"{cal['per_rank_of_2']['copy_bw'] / GB:.1f} GB/s, "
            f"attention {cal['per_rank_of_2']['attention_flops'] / GB:.1f}"
            f" GFLOP/s, GELU {cal['per_rank_of_2']['activation_rate'] / 1e9:.2f} Gelem/s (CPU time)")
