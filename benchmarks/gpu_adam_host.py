"""Where a call of zfunc's fused AdamW spends its time on a GPU, beside torch's fused kernel, at 10M and
100M params in 32 tensors: the host's time to issue one call, CUDA-event time per call over 10
back-to-back calls, and the kernels' own time (torch.profiler). The first names what the event figure
of ``benchmarks/gpu.py``'s ``adamw`` row includes beyond the kernel.

    python benchmarks/gpu_adam_host.py LABEL     # on a GPU; ZFUNC_GPU_CHUNK=N forces a chunk
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile


def split(n: int, parts: int = 32) -> list[int]:
    """As benchmarks/gpu.py's ``_split``: a model's matrices and a few small ones."""
    sizes = [max(1, n // parts + (k % 3 - 1) * (n // (parts * 7))) for k in range(parts - 1)]
    return sizes + [max(1, n - sum(sizes))]


def measure(label: str, name: str, fn) -> str:
    host, events = [], []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(20):
            fn()
        host.append((time.perf_counter() - t) / 20)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            fn()
        b.record()
        b.synchronize()
        events.append(a.elapsed_time(b) / 10 * 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    kernels = {e.key[:40]: (e.count, round(e.self_device_time_total / max(e.count, 1), 1))
               for e in prof.key_averages() if e.self_device_time_total}
    return (f"{label} {name}: host/call {statistics.median(host) * 1e6:.1f} us, events/call "
            f"{statistics.median(events):.1f} us, kernels {kernels}")


def main(label: str) -> None:
    import zfunc
    from zfunc.ops.gpu import adam as gpu_adam

    print(label, "zfunc from", zfunc.__file__, "chunk env", os.environ.get("ZFUNC_GPU_CHUNK"))
    for n in (10**7, 10**8):
        sizes = split(n)
        p, g, m, v = ([torch.randn(s, device="cuda") for s in sizes] for _ in range(4))
        steps = [torch.ones((), device="cuda")] * len(sizes)
        fns = {"zfunc": lambda: gpu_adam.adamw_many_(p, g, m, v, step=1, lr=1e-4, weight_decay=0.01),
               "torch": lambda: torch._fused_adamw_(p, g, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.999,
                                                    weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)}
        for fn in fns.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        for name, fn in fns.items():
            print(measure(f"{label} n={n:.0e}", name, fn), flush=True)
        fns = p = g = m = v = None  # the closures hold the buffers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        sys.exit("usage: python benchmarks/gpu_adam_host.py LABEL  (on a CUDA device)")
    main(sys.argv[1])
