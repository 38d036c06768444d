"""CPU optimizer step throughput: zfunc's Numba kernels vs torch.optim and DeepSpeedCPUAdam.

    python benchmarks/cpu_adam.py [--sizes 1e5 1e6 1e7 1e8] [--repeats 7] [--no-jit-times]
                                  [--no-deepspeed]

DeepSpeed is optional: ``pip install --no-build-isolation deepspeed`` after torch (so pip keeps
the CPU torch); its CPU-Adam extension JIT-builds on first use (~1 min) with DS_ACCELERATOR=cpu,
which this script sets.

Each implementation updates flat fp32 buffers (param, exp_avg, exp_avg_sq) allocated the way its
owner allocates them: torch.optim's and DeepSpeed's state come from torch's allocator (4 KiB
pages), zfunc's from ``zfunc.ops.cpu.hostmem`` (transparent huge pages: what zf.optim, shard and
offload hold). The rows "... on torch's buffers" run our kernels on the peers' own buffers: the
kernel alone, like for like. Grads and the bf16 param copy are torch tensors for everyone. Samples
are interleaved (one sample of each implementation per round) and the best of ``--repeats``
rounds is kept, because on a shared machine separate runs of the same kernel vary by 1.5x. Small
sizes are timed over back-to-back calls (state stays in cache there).

Bytes per param a kernel must move: fp32 AdamW reads p, g, m, v and writes p, m, v = 28; the
fused bf16 pass reads p, m, v (12) + bf16 g (2) and writes p, m, v (12) + bf16 param copy (2) = 28.
"GB/s" below is that count / time. Bandwidth probes run over a buffer pair of the same 28 B/param
footprint: torch ``copy_`` counted as read + write ("x copy"), and in-place ``add_`` (read 2,
write 1). A copy also pays a hidden read of each destination line before writing it
(write-allocate), which in-place kernels do not, so the limit ("x limit") is the larger of 1.5x
the copy figure and the add_ figure, each probe run on 4 KiB and on huge pages: what the memory
system was seen to deliver.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before any deepspeed import
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numba  # noqa: E402
import torch  # noqa: E402
from torch.optim.adam import adam as torch_adam  # noqa: E402

from zfunc.ops.cpu import adam as cpu_adam, hostmem  # noqa: E402

LR, BETAS, EPS, WD, SCALE = 1e-3, (0.9, 0.999), 1e-8, 0.1, 1.0 / 1024
BYTES_PER_PARAM = 28
OURS32 = "zfunc numba AdamW fp32"
BF16_OURS = "zfunc numba bf16 g + unscale + AdamW + bf16 p, one pass"
COPY_PROBE, ADD_PROBE = "copy_ probe", "add_ probe"


def deepspeed_adam():
    """(adam_update callable, None) or (None, reason it is not available)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))], lr=LR, betas=BETAS, eps=EPS,
                               weight_decay=WD, adamw_mode=True)
    except Exception as e:  # ImportError, or its C++ extension failed to build
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:120]
    return (lambda step, p, g, m, v: opt.ds_opt_adam.adam_update(
        opt.opt_id, step, LR, BETAS[0], BETAS[1], EPS, WD, True, p, g, m, v)), None


def state_buffers(n: int, empty) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(param, exp_avg, exp_avg_sq) of n params from ``empty(n)``, param values seeded."""
    p, m, v = empty(n), empty(n), empty(n)
    p.copy_(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    return p, m.zero_(), v.zero_()


def implementations(n: int, ds_update):
    """name -> (kind, zero-arg callable). Param and optimizer state are allocated as each one's
    owner allocates them: torch.optim and DeepSpeed on torch's allocator, zfunc through
    ``hostmem`` (huge pages; what zf.optim, shard and offload hold). Grads and the bf16 param copy
    are the caller's, from torch, for everyone. "zfunc ... on torch's buffers" runs our kernel on
    the peers' own memory: the kernel alone, like for like."""
    gen = torch.Generator().manual_seed(1)
    p, m, v = state_buffers(n, torch.empty)
    zp, zm, zv = state_buffers(n, hostmem.empty)
    g = torch.randn(n, generator=gen) * 1e-2
    g_bf16, out_bf16, g32 = (g / SCALE).bfloat16(), torch.empty(n, dtype=torch.bfloat16), torch.empty(n)
    step_t, inv_scale = torch.tensor(1.0), torch.tensor(1.0 / SCALE)  # step 0 would divide by 0
    probes = {kind: (empty(n * 7 // 2).normal_(), empty(n * 7 // 2)) for kind, empty in  # 28 B/param in all
              (("", torch.empty), (", huge pages", hostmem.empty))}
    steps = iter(range(1, 1 << 40))

    def fused_kernel(grad, **kw):  # torch.optim's fused path without its Python bookkeeping
        torch._fused_adamw_([p], [grad], [m], [v], [], [step_t], lr=LR, beta1=BETAS[0],
                            beta2=BETAS[1], weight_decay=WD, eps=EPS, amsgrad=False,
                            maximize=False, **kw)

    def torch_step(grad, **kw):
        torch_adam([p], [grad], [m], [v], [], [step_t], decoupled_weight_decay=True,
                   amsgrad=False, beta1=BETAS[0], beta2=BETAS[1], lr=LR, weight_decay=WD,
                   eps=EPS, maximize=False, **kw)

    impls = {
        OURS32: ("fp32", lambda: cpu_adam.adamw_(
            zp, g, zm, zv, step=next(steps), lr=LR, weight_decay=WD)),
        OURS32 + " on torch's buffers": ("fp32", lambda: cpu_adam.adamw_(
            p, g, m, v, step=next(steps), lr=LR, weight_decay=WD)),
        "torch._fused_adamw_ (kernel called directly)": ("fp32", lambda: fused_kernel(g)),
        "torch AdamW fused=True (functional torch.optim.adam)": ("fp32", lambda: torch_step(
            g, fused=True)),
        "torch AdamW foreach": ("fp32", lambda: torch_step(g, foreach=True)),
        "torch AdamW for-loop": ("fp32", lambda: torch_step(g, foreach=False)),
        BF16_OURS: ("bf16", lambda: cpu_adam.adamw_(
            zp, g_bf16, zm, zv, step=next(steps), lr=LR, weight_decay=WD, grad_scale=SCALE,
            param_out=out_bf16)),
        BF16_OURS + " on torch's buffers": ("bf16", lambda: cpu_adam.adamw_(
            p, g_bf16, m, v, step=next(steps), lr=LR, weight_decay=WD, grad_scale=SCALE,
            param_out=out_bf16)),
        "torch ops: upcast, mul_(scale), _fused_adamw_, downcast": ("bf16", lambda: (
            g32.copy_(g_bf16), g32.mul_(SCALE), fused_kernel(g32), out_bf16.copy_(p))),
        "torch ops: upcast, _fused_adamw_(grad_scale=), downcast": ("bf16", lambda: (
            g32.copy_(g_bf16), fused_kernel(g32, grad_scale=inv_scale), out_bf16.copy_(p))),
    }
    for kind, (src, dst) in probes.items():
        impls[COPY_PROBE + kind] = ("probe", lambda src=src, dst=dst: dst.copy_(src))
        impls[ADD_PROBE + kind] = ("probe", lambda src=src, dst=dst: dst.add_(src))
    if ds_update is not None:
        impls["DeepSpeedCPUAdam"] = ("fp32", lambda: ds_update(next(steps), p, g, m, v))
        impls["torch upcast + mul_ + DeepSpeedCPUAdam + downcast"] = ("bf16", lambda: (
            g32.copy_(g_bf16), g32.mul_(SCALE), ds_update(next(steps), p, g32, m, v),
            out_bf16.copy_(p)))
    if n >= 10**8:  # the for-loop takes ~0.6 s per call here; one round of it says enough
        impls["torch AdamW for-loop"] = ("fp32-once", impls["torch AdamW for-loop"][1])
    return impls


def measure(impls: dict, n: int, repeats: int) -> dict:
    """Seconds per call of each implementation, one sample per round, rounds interleaved. The
    order rotates from round to round: what runs just before a sample (a probe that flushed the
    caches, or a kernel that left its state in them) would otherwise favour some rows for good."""
    inner = max(1, 2 * 10**7 // n)  # >= ~5 ms per sample, so timer and call noise stay small
    samples = {name: [] for name in impls}
    for name, (_, fn) in impls.items():
        fn()  # warm up: JIT load, page faults, lazy state
    names = list(impls)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            kind, fn = impls[name]
            if kind == "fp32-once" and samples[name]:
                continue
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - t0) / inner)
    return samples


def _paired_ratio(samples: dict, others: list[str], ours: str) -> float:
    """Median over rounds of (fastest of ``others`` in that round) / ours: robust to a noisy
    machine, because both sides of each ratio ran within the same few milliseconds."""
    rounds = zip(*(samples[o] for o in others), samples[ours])
    return statistics.median(min(r[:-1]) / r[-1] for r in rounds)


def report(n: int, samples: dict, impls: dict, ds_missing: str | None) -> None:
    best = {name: min(ts) for name, ts in samples.items()}
    elems = n * 7 // 2  # per probe buffer: two of them make the kernels' 28 B/param footprint
    pages = ("", ", huge pages")
    copy_gbs = max(8 * elems / best.pop(COPY_PROBE + k) / 1e9 for k in pages)  # read + write
    add_gbs = max(12 * elems / best.pop(ADD_PROBE + k) / 1e9 for k in pages)  # in place: read 2, write 1
    limit = max(1.5 * copy_gbs, add_gbs)
    kind_of = {name: impls[name][0].replace("-once", "") for name in best}
    ds = {k: [nm for nm in best if "DeepSpeed" in nm and kind_of[nm] == k] for k in ("fp32", "bf16")}
    tf = {k: [nm for nm in best if "_fused_adamw_" in nm and kind_of[nm] == k] for k in ds}
    print(f"\n### {n:,} params\n\nBandwidth probes over the same 28 B/param footprint (the faster of 4 KiB "
          f"and huge pages): copy_ {copy_gbs:.1f} GB/s counted read+write ({1.5 * copy_gbs:.1f} with write-allocate), "
          f"in-place add_ {add_gbs:.1f} GB/s; limit = the larger physical one = {limit:.1f} GB/s "
          f"= {limit / BYTES_PER_PARAM * 1e3:.0f} Mparam/s. Ratios are of best times; x DeepSpeed"
          f" and x torch fused compare like with like (fp32 rows with fp32, bf16 with bf16).\n")
    print("| implementation | best ms | median ms | Mparam/s | GB/s | x DeepSpeed | x torch fused |"
          " x copy | x limit |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, t in best.items():
        gbs = BYTES_PER_PARAM * n / t / 1e9
        vs_ds = f"{best[ds[kind_of[name]][0]] / t:.2f}" if ds[kind_of[name]] else "n/a"
        vs_tf = f"{min(best[o] for o in tf[kind_of[name]]) / t:.2f}"
        once = " (1 round)" if impls[name][0].endswith("-once") else ""
        print(f"| {name}{once} | {t * 1e3:.3f} | {statistics.median(samples[name]) * 1e3:.3f} | "
              f"{n / t / 1e6:.0f} | {gbs:.1f} | {vs_ds} | {vs_tf} | {gbs / copy_gbs:.2f} | "
              f"{gbs / limit:.2f} |")
    if ds_missing:
        print(f"| DeepSpeedCPUAdam | not available: {ds_missing} | | | | | | | |")
    ours32, ours16, kernel_only = OURS32, BF16_OURS, " on torch's buffers"
    torch_ops = [nm for nm in best if nm.startswith("torch ops")]
    checks = [("fp32 vs torch fused", tf["fp32"], ours32, 1.0),
              ("fp32 vs DeepSpeed", ds["fp32"], ours32, 1.0),
              ("bf16 pass vs torch ops", torch_ops, ours16, 1.5),
              ("bf16 pass vs DeepSpeed + torch ops", ds["bf16"], ours16, 1.5),
              ("kernel alone, fp32 on torch's buffers vs torch fused", tf["fp32"], ours32 + kernel_only, None),
              ("vs DeepSpeed", ds["fp32"], ours32 + kernel_only, None)]
    lines = [f"{label} {min(best[o] for o in others) / best[ours]:.2f}x best, "
             f"{_paired_ratio(samples, others, ours):.2f}x paired median "
             f"({'for reference' if goal is None else f'target >= {goal}'})"
             for label, others, ours, goal in checks if others]
    lines.append(f"bf16 pass vs limit {BYTES_PER_PARAM * n / best[ours16] / 1e9 / limit:.2f}x "
                 "(target >= 0.9 where the footprint is past the caches)")
    print("\nTargets: " + "; ".join(lines))


JIT_PROBE = """
import time, torch
t0 = time.perf_counter()
from zfunc.ops.cpu import adam as cpu_adam
t1 = time.perf_counter()
for n in (1000, 100_000):  # the one-thread and the threaded kernel
    p, g, m, v = (torch.randn(n) for _ in range(4))
    cpu_adam.adamw_(p, g, m, v, step=1, lr=1e-3)
t2 = time.perf_counter()
cpu_adam.adamw_(p, g.bfloat16(), m, v, step=1, lr=1e-3, param_out=torch.empty(n, dtype=torch.bfloat16))
t3 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t3 - t2:.3f}")
"""


def jit_times() -> None:
    """Import and first-call time with an empty Numba cache (compile) and a filled one (load)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=root)
        print("\n### JIT: import zfunc.ops.cpu.adam, then first calls (fresh process each)\n")
        print("| cache | import s | first fp32 AdamW (1-thread + threaded kernels) s | "
              "first bf16-grad + bf16-out call s |")
        print("|---|---:|---:|---:|")
        for label in ("cold (empty NUMBA_CACHE_DIR: compiles)", "warm (cached on disk)"):
            out = subprocess.run([sys.executable, "-c", JIT_PROBE], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()
            print(f"| {label} | {out[0]} | {out[1]} | {out[2]} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e5, 1e6, 1e7, 1e8])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-jit-times", action="store_true", help="skip the cold/warm JIT probe")
    ap.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeedCPUAdam out")
    args = ap.parse_args()
    ds_update, ds_missing = (None, "--no-deepspeed") if args.no_deepspeed else deepspeed_adam()
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), numba "
          f"{numba.__version__} ({cpu_adam.get_num_threads()} threads, "
          f"{numba.config.THREADING_LAYER} layer), load average {os.getloadavg()[0]:.2f}, "
          f"best of {args.repeats} interleaved rounds")
    for n in (int(s) for s in args.sizes):
        impls = implementations(n, ds_update)
        report(n, measure(impls, n, args.repeats), impls, ds_missing)
        del impls
    if not args.no_jit_times:
        jit_times()


if __name__ == "__main__":
    main()
