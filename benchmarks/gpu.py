"""Every GPU figure zfunc reports, in one process: the kernels against torch's and against the measured
copy bandwidth, the GPT recipe's model in bf16 (tokens/s, MFU), zfunc's step against a plain torch
loop, and the largest GPT that trains with its optimizer (then also its params) offloaded to CPU RAM,
beside the largest that plain torch trains.

    python benchmarks/gpu.py OUT_DIR [--budget-s 300] [--only adamw,gpt] [--dry-run]

Writes OUT_DIR/gpu.json (every figure, as measured, with the device and versions) and OUT_DIR/gpu.txt
(a short table: figure, value, target, met?), rewritten after each figure, so a run cut short keeps
what it measured. Each figure is guarded: an error is recorded in its entry and the next one runs;
a figure whose estimated cost no longer fits ``--budget-s`` is recorded as skipped.

Timing: CUDA events around each call, a warm-up first, then interleaved rounds (one call of each
contender per round) and the median per contender: the paired medians METHOD.md asks for. Bytes per
param: AdamW fp32 reads p, g, m, v and writes p, m, v = 28; the bf16 one-pass variant reads a bf16
grad and also writes a bf16 param = 28; the grad norm reads each grad once. Bandwidth is bytes moved
over time, against a device-to-device copy of 2 GiB counted as bytes read plus bytes written.

``--dry-run`` runs every figure on the CPU at toy sizes: the torch peers and the model figures (GPT
``debug``, two steps) run, zfunc's CUDA kernels are recorded as needing CUDA. It checks the script's
own steps without a GPU (``tests/test_gpu_check.py`` runs it through ``benchmarks/gpu_check.sh``).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zfunc as zf  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12}  # dense, as recipes/report.py


class Run:
    """The run's device, sizes, budget and results (written after each figure)."""

    def __init__(self, out: Path, budget_s: float, dry: bool):
        self.out, self.budget_s, self.dry, self.start = out, budget_s, dry, time.monotonic()
        self.cuda = torch.cuda.is_available() and not dry
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.results: dict[str, dict] = {}
        self.copy_gbps: float | None = None
        self.host_gib: float | None = None  # host RAM to plan offload for (None: MemAvailable)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def n(self, real: int, toy: int) -> int:
        return toy if self.dry else real

    def flavor(self, name: str) -> str:
        return "debug" if self.dry else name  # a toy model in a dry run

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {"device": environment(self), "budget_s": self.budget_s, "dry_run": self.dry,
               "elapsed_s": round(time.monotonic() - self.start, 1), "figures": self.results}
        (self.out / "gpu.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        (self.out / "gpu.txt").write_text(table(doc) + "\n")


def environment(run: Run) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(run.device)}
    if run.cuda:
        p = torch.cuda.get_device_properties(0)
        env.update(name=p.name, memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                   cuda=torch.version.cuda)
        try:
            import cupy

            env["cupy"] = cupy.__version__
        except ImportError:
            env["cupy"] = None
    return env


# ---------------------------------------------------------------------------------------- timing


def _sync(run: Run) -> None:
    if run.cuda:
        torch.cuda.synchronize()


def _time_once(run: Run, fn, calls: int = 1) -> float:
    """Seconds per call over ``calls`` back-to-back calls (device events on CUDA)."""
    if run.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def paired(run: Run, fns: dict, rounds: int = 7, warmup: int = 2, calls: int = 1) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, over interleaved rounds after a warm-up; each
    sample times ``calls`` back-to-back calls (small kernels: the launches overlap, as in a loop)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _sync(run)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(_time_once(run, fn, calls))
    return {k: statistics.median(v) for k, v in samples.items()}


def _gb(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _share(run: Run, gbps: float) -> float | None:
    return None if not run.copy_gbps else gbps / run.copy_gbps


# ---------------------------------------------------------------------------------------- figures


def copy_bandwidth(run: Run) -> dict:
    """Device-to-device copy of 2 GiB (bytes read + written, per second): the bandwidth ceiling."""
    n = run.n(2**29, 2**20)  # fp32 elements: 2 GiB
    src = torch.randn(n, device=run.device)
    dst = torch.empty_like(src)
    t = paired(run, {"copy": lambda: dst.copy_(src)}, rounds=11)["copy"]
    run.copy_gbps = _gb(2 * 4 * n, t)
    return {"bytes": 2 * 4 * n, "s": t, "gbps": run.copy_gbps}


def _split(n: int, parts: int = 32) -> list[int]:
    """``n`` params as ``parts`` tensors of uneven sizes (a model's matrices and a few small ones)."""
    sizes = [max(1, n // parts + (k % 3 - 1) * (n // (parts * 7))) for k in range(parts - 1)]
    return sizes + [max(1, n - sum(sizes))]


def _adam_buffers(run: Run, sizes: list[int], grad_dtype=torch.float32):
    g = [torch.randn(s, device=run.device).to(grad_dtype) for s in sizes]
    return g, lambda: ([torch.randn(s, device=run.device) for s in sizes], [torch.zeros(s, device=run.device)
                       for s in sizes], [torch.rand(s, device=run.device) for s in sizes])


def _torch_fused(p, g, m, v, steps):
    """torch's fused AdamW kernel as torch.optim.AdamW(fused=True) calls it (step counts on the device)."""
    torch._fused_adamw_(p, g, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                        amsgrad=False, maximize=False)


def adamw(run: Run) -> dict:
    """zfunc's fused AdamW vs torch._fused_adamw_ (fp32 grads) at 10M / 100M / 1B params."""
    out = {}
    for label, n in (("10M", run.n(10**7, 10**4)), ("100M", run.n(10**8, 10**5)), ("1B", run.n(10**9, 10**6))):
        calls = max(1, 10**8 // n) if run.cuda else 1  # 10 back-to-back calls at 10M
        if run.left() < 30:
            out[label] = {"skipped": "time budget"}
            continue
        sizes = _split(n)
        g, fresh = _adam_buffers(run, sizes)
        steps = [torch.ones((), device=run.device)] * len(sizes)
        fns = {"torch": lambda b=fresh(): _torch_fused(b[0], g, b[1], b[2], steps)}
        if run.cuda:
            from zfunc.ops.gpu import adam as gpu_adam

            mine = fresh()
            fns["zfunc"] = lambda b=mine: gpu_adam.adamw_many_(b[0], g, b[1], b[2], step=1, lr=1e-4,
                                                               weight_decay=0.01)
        t = paired(run, fns, calls=calls)
        row = {"params": n, "s": t, "calls_per_sample": calls, "torch_gbps": _gb(28 * n, t["torch"])}
        if "zfunc" in t:
            gbps = _gb(28 * n, t["zfunc"])
            row.update(zfunc_gbps=gbps, of_copy=_share(run, gbps), vs_torch=t["torch"] / t["zfunc"])
            if label != "1B":
                row["vs_torch_by_chunk"] = _by_chunk(run, fns, calls)
        else:
            row["zfunc"] = "needs CUDA"
        out[label] = row
        g = fresh = fns = mine = None  # free the buffers (the closures hold them)
        _free(run)
    return out


def _by_chunk(run: Run, fns: dict, calls: int) -> dict[int, float]:
    """zfunc's speed over torch's with each chunk forced (ZFUNC_GPU_CHUNK): what the fitted chunk
    (zfunc.ops.gpu.runtime.fitted_chunk) is chosen against."""
    import os

    from zfunc.ops.gpu import runtime

    found = {}
    try:
        for chunk in (8192, 4096, 2048, 1024):
            os.environ[runtime.CHUNK_ENV] = str(chunk)
            runtime.forget_plans()
            t = paired(run, fns, calls=calls)
            found[chunk] = t["torch"] / t["zfunc"]
    finally:
        os.environ.pop(runtime.CHUNK_ENV, None)
        runtime.forget_plans()
    return found


def bf16_one_pass(run: Run) -> dict:
    """bf16 grads unscaled and a bf16 param copy written in AdamW's pass, vs torch's multi-pass
    equivalent (grads cast to fp32 and scaled, fused AdamW, params cast to bf16)."""
    out = {}
    for label, n in (("100M", run.n(10**8, 10**5)), ("1B", run.n(10**9, 10**6))):
        calls = max(1, 10**8 // n) if run.cuda else 1
        if run.left() < 30:
            out[label] = {"skipped": "time budget"}
            continue
        sizes = _split(n)
        g, fresh = _adam_buffers(run, sizes, torch.bfloat16)
        steps = [torch.ones((), device=run.device)] * len(sizes)
        outs = [torch.empty(s, device=run.device, dtype=torch.bfloat16) for s in sizes]
        scale = 1 / 1024

        def multi_pass(b=fresh()):
            g32 = [x.float() for x in g]
            torch._foreach_mul_(g32, scale)
            _torch_fused(b[0], g32, b[1], b[2], steps)
            torch._foreach_copy_(outs, b[0])

        fns = {"torch": multi_pass}
        if run.cuda:
            from zfunc.ops.gpu import adam as gpu_adam

            mine = fresh()
            fns["zfunc"] = lambda b=mine: gpu_adam.adamw_many_(b[0], g, b[1], b[2], step=1, lr=1e-4,
                                                               weight_decay=0.01, grad_scale=scale, param_outs=outs)
        t = paired(run, fns, calls=calls)
        row = {"params": n, "s": t, "calls_per_sample": calls}
        if "zfunc" in t:
            gbps = _gb(28 * n, t["zfunc"])
            row.update(zfunc_gbps=gbps, of_copy=_share(run, gbps), vs_torch=t["torch"] / t["zfunc"])
        else:
            row["zfunc"] = "needs CUDA"
        out[label] = row
        g = fresh = outs = fns = mine = None
        _free(run)
    return out


def grad_norm(run: Run) -> dict:
    """The global norm and the inf/nan check of 1B grads in one read (bf16 and fp32), vs torch's
    _foreach_norm + isfinite."""
    out = {}
    n = run.n(10**9, 10**6)
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).replace("torch.", "")
        if run.left() < 20:
            out[name] = {"skipped": "time budget"}
            continue
        xs = [torch.randn(s, device=run.device).to(dtype) for s in _split(n)]

        def torch_norm():
            norms = torch._foreach_norm(xs, 2, dtype=torch.float32) if dtype != torch.float32 else \
                torch._foreach_norm(xs)
            total = torch.linalg.vector_norm(torch.stack(norms))
            return total, torch.isfinite(total)

        fns = {"torch": torch_norm}
        if run.cuda:
            from zfunc.ops.gpu import norm as gpu_norm

            fns["zfunc"] = lambda: gpu_norm.norm_and_finite(xs)
        t = paired(run, fns)
        nbytes = n * xs[0].element_size()
        row = {"elements": n, "s": t, "torch_gbps": _gb(nbytes, t["torch"])}
        if "zfunc" in t:
            gbps = _gb(nbytes, t["zfunc"])
            row.update(zfunc_gbps=gbps, of_copy=_share(run, gbps), vs_torch=t["torch"] / t["zfunc"])
            got, want = gpu_norm.norm_and_finite(xs)[0].item(), torch_norm()[0].item()
            row["rel_diff_vs_torch"] = abs(got - want) / want
        out[name] = row
        xs = fns = None
        _free(run)
    return out


def _gpt(run: Run, flavor: str, batch: int, block: int, vocab_multiple: int = 1):
    """(model on the meta device, its config, flops per token) of the GPT recipe's ``flavor``."""
    from recipes import flavors, gpt

    cfg = gpt.GPTConfig(**{**flavors.gpt_flavor(flavor), "block_size": block, "vocab_multiple": vocab_multiple})
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    return model, cfg, model.flops_per_token(block)


def _tokens(run: Run, cfg, batch: int, block: int, seed: int):
    g = torch.Generator(device=run.device).manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (batch, block + 1), generator=g, device=run.device)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _zfunc_step(run: Run, model, precision: str, offload: tuple[str, str | None] | None = None):
    """zfunc's step for ``model`` (AdamW, clip 1.0) and its state; ``offload``: ``(optimizer, params)``
    as ``zf.offload`` takes them (units of GPT blocks), or None for the plain step."""
    from recipes import gpt

    apply, params = zf.functionalize(model)

    def loss_fn(p, batch):
        return F.cross_entropy(apply(p, batch[0]).flatten(0, 1).float(), batch[1].flatten())

    tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0),
                        zf.optim.adamw(3e-4, b2=0.95, weight_decay=0.1, mask=zf.optim.decay_mask))
    step = zf.train_step(loss_fn, tx, precision)
    if offload:
        step = zf.offload(step, *offload, units=zf.units.by_class(gpt.Block) if offload[1] else None)
    return step, step.init(params, model.materializer(0))


def _precision(run: Run) -> str:
    return "bf16" if run.cuda else "fp32"


def gpt_throughput(run: Run, flavor: str, batch: int, block: int, steps: int, vocab_multiple: int = 1,
                   compiled: bool = False) -> dict:
    """Tokens/s and MFU of the GPT recipe's ``flavor`` trained by zfunc's step in bf16 on one GPU;
    ``vocab_multiple``: the embedding's rows padded (``GPTConfig.vocab_multiple``); ``compiled``: each
    block compiled by ``torch.compile`` (``nn.Module.compile``: the module itself is unchanged)."""
    if run.cuda:
        torch.cuda.reset_peak_memory_stats()
    model, cfg, flops = _gpt(run, flavor, batch, block, vocab_multiple)
    compiled = compiled and run.cuda  # a dry run checks the rest; compiling on a CPU takes minutes
    if compiled:
        for b in model.blocks:
            b.compile()
    t0 = time.monotonic()
    step, state = _zfunc_step(run, model, _precision(run))
    data = [_tokens(run, cfg, batch, block, s) for s in range(2)]
    box = [state]

    def one():
        box[0], m = step(box[0], data[0])
        return m

    one()  # compile, allocate
    first_s = time.monotonic() - t0
    times = [_time_once(run, one) for _ in range(steps)]
    t = statistics.median(times)
    tokens_s = batch * block / t
    peak = next((v for k, v in PEAK_BF16.items() if run.cuda and k in torch.cuda.get_device_name(0)), None)
    row = {"flavor": flavor, "params": model.num_params(non_embedding=False), "batch": batch, "block": block,
           "vocab_multiple": vocab_multiple, "compiled": compiled, "init_and_first_step_s": first_s,
           "s_per_step": t, "tokens_per_s": tokens_s, "flops_per_token": flops,
           "mfu": flops * tokens_s / peak if peak else None,
           "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if run.cuda else None}
    step = state = box = data = None
    _free(run)
    return row


def zfunc_vs_torch(run: Run, flavor: str, batch: int, block: int, rounds: int) -> dict:
    """zfunc's step vs a plain torch loop (fp32 params, bf16 autocast, fused AdamW, clip 1.0) on the
    same model and batch: ratio of median step times (goal <= 1.05)."""
    from recipes import gpt

    model, cfg, _ = _gpt(run, flavor, batch, block)
    step, state = _zfunc_step(run, model, _precision(run))
    torch.manual_seed(0)
    plain = gpt.GPT(cfg).to(run.device)
    decay = [p for p in plain.parameters() if p.dim() >= 2]
    rest = [p for p in plain.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), fused=run.cuda)
    x, y = _tokens(run, cfg, batch, block, 0)
    box = [state]

    def zfunc_step():
        box[0], _ = step(box[0], (x, y))

    t = paired(run, {"zfunc": zfunc_step, "torch": lambda: _torch_step(run, plain, opt, x, y)}, rounds=rounds,
               warmup=2)
    step = state = box = plain = opt = None
    _free(run)
    return {"flavor": flavor, "batch": batch, "block": block, "s": t, "zfunc_over_torch": t["zfunc"] / t["torch"]}


def _torch_step(run: Run, model, opt, x, y) -> None:
    """One step of a plain torch loop as a user writes it: bf16 autocast on CUDA, clip 1.0, then ``opt``."""
    with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.cuda):
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def offload_largest(run: Run, candidates: tuple[str, ...], block: int, params: str | None = "cpu") -> dict:
    """The largest GPT flavor (of ``candidates``, ascending) that trains a step with its optimizer
    state and fp32 masters in CPU RAM (``zf.offload(step, "cpu", params)``: ``params="cpu"`` also
    fetches each unit's compute params from RAM; None keeps them whole on the GPU), and each one's
    ``max_memory_allocated`` against the device bytes offload accounts for (compute params kept +
    the step's peak of gathered params): batch 1 so activations stay small beside them."""
    tried = {}
    largest = None
    host = _host_available_bytes() if run.host_gib is None else int(run.host_gib * 2**30)
    for flavor in candidates:
        model, cfg, _ = _gpt(run, flavor, 1, block)
        n = model.num_params(non_embedding=False)
        # fp32 master + m + v (12) + pinned bf16 copies and grads: 14.0 measured at 1.3B and 2.7B; with the params
        # whole on the GPU the host also lands whole fp32 grads: 6.7B planned at 15 (100 GiB) was killed on 128 GiB
        need = (15 if params else 18) * n
        if host is not None and need > 0.9 * host:
            tried[flavor] = {"params": n, "skipped": f"needs ~{need / 2**30:.0f} GiB of host RAM, "
                                                     f"{host / 2**30:.0f} GiB available"}
            break
        if run.left() < max(60, n / 4e7):  # init + three steps: 65 s at 2.7B on an H100 host
            tried[flavor] = {"params": n, "skipped": "time budget"}
            break
        t0 = time.monotonic()
        try:
            step, state = _zfunc_step(run, model, _precision(run), offload=("cpu", params))
            init_s = time.monotonic() - t0
            batch = _tokens(run, cfg, 1, block, 0)
            state, _ = step(state, batch)
            _sync(run)
            if run.cuda:
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if run.cuda else 0  # torch's own between steps: cuBLAS workspaces
            t1 = time.monotonic()
            state, m = step(state, batch)
            _sync(run)
            step_s = time.monotonic() - t1
            mem = step.memory(state)
            on_device = mem["step"]["device"]
            # with the params whole on the device (params=None) the step computes on the kept compute copies
            # themselves (sharding/run.py's _own_whole): whole_params names those bytes a second time
            whole = on_device["whole_params"]
            kept = max(mem["device"], whole) if params is None else mem["device"] + whole
            accounted = kept + on_device["whole_grads"]
            peak = torch.cuda.max_memory_allocated() if run.cuda else None
            row = tried[flavor] = {"params": n, "init_s": init_s, "step_s": step_s, "loss": m["loss"].item(),
                                   "max_memory_allocated": peak, "accounted_device_bytes": accounted,
                                   "peak_over_accounted": peak / accounted if peak and accounted else None,
                                   "live_before_step": before, "memory": {k: mem[k] for k in ("device", "cpu", "nvme")},
                                   "step_device": on_device}
            if run.cuda and largest is None:  # the first flavor: what the device held at the peak, by source line
                box = [state]
                row["peak_breakdown"] = _peak_breakdown(lambda: box.__setitem__(0, step(box[0], batch)[0]))
            step = state = box = None
            _free(run)
            row["activations_saved"] = activations = _activation_bytes(run, flavor, block, batch)
            if peak and accounted:  # the step's own peak (what lived before: the kept bytes, cuBLAS's workspaces)
                row["step_peak_over_accounted_and_activations"] = ((peak - before)
                                                                   / (accounted - mem["device"] + activations))
            largest = flavor
        except Exception as e:  # noqa: BLE001 - the largest that trains is the figure; a failure ends the search
            tried[flavor] = {"params": n, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            break
        finally:
            step = state = None
            _free(run)
    return {"largest": largest, "params": params, "tried": tried, "plain_step_predicted": _plain_largest(run),
            "nvme": "not run: the GPU machine's 64 GiB disk holds the ~14 B/param of at most ~4B params, "
                    "below what RAM already holds",
            "deepspeed": "not run: DeepSpeed is not installed on the GPU machine"}


def plain_largest(run: Run, candidates: tuple[str, ...], block: int) -> dict:
    """The largest GPT flavor (of ``candidates``, ascending) that plain torch trains a step of on the
    GPU, as a user writes it (fp32 params, bf16 autocast, fused AdamW, clip 1.0; batch 1 as
    ``offload_largest``), run until one runs out of memory: the peer of the offloaded rows."""
    from recipes import gpt

    tried, largest = {}, None
    for flavor in candidates:
        _, cfg, _ = _gpt(run, flavor, 1, block)
        model = opt = None
        try:
            torch.manual_seed(0)
            with torch.device(run.device):
                model = gpt.GPT(cfg)
            n = model.num_params(non_embedding=False)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                    fused=run.cuda)
            x, y = _tokens(run, cfg, 1, block, 0)

            _torch_step(run, model, opt, x, y)  # allocates the optimizer state
            if run.cuda:
                torch.cuda.reset_peak_memory_stats()
            step_s = _time_once(run, lambda: _torch_step(run, model, opt, x, y))
            tried[flavor] = {"params": n, "step_s": step_s,
                             "max_memory_allocated": torch.cuda.max_memory_allocated() if run.cuda else None}
            largest = flavor
        except torch.OutOfMemoryError as e:
            tried[flavor] = {"out_of_memory": str(e).splitlines()[0][:200]}
            break
        finally:
            model = opt = None
            _free(run)
    return {"largest": largest, "tried": tried}


def _activation_bytes(run: Run, flavor: str, block: int, batch) -> int:
    """Bytes autograd saves for backward when a fresh ``flavor`` model (uninitialized storage, made here
    and freed) runs ``batch`` in bf16 as the step runs it: the activations, which no offload accounting
    includes. Measured apart from the step, whose stage-3 gatherer installs saved-tensor hooks of its own
    (only the innermost hooks see a saved tensor)."""
    model, _, _ = _gpt(run, flavor, 1, block)
    model = model.to_empty(device=run.device).to(torch.bfloat16 if run.cuda else torch.float32)
    saved = SavedActivations(run.device, model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        loss = F.cross_entropy(model(batch[0]).flatten(0, 1).float(), batch[1].flatten())
    del loss, model
    _free(run)
    return saved.nbytes


class SavedActivations:
    """``saved_tensors_hooks`` that add up the bytes of the distinct storages autograd saves on
    ``device`` for backward, other than those of ``params`` (a linear saves its weight, transposed):
    a model's activations for a batch."""

    def __init__(self, device: torch.device, params):
        self.device = device
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == self.device.type:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.params:
                self.storages[storage.data_ptr()] = storage.nbytes()
        return t.detach()  # t itself: a node saving its own output would hold itself (a cycle gc cannot free)

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _peak_breakdown(call) -> dict:
    """Run ``call()`` with CUDA's allocator recording, replay its trace and name what was allocated at the
    peak above the bytes live before it: summed by the innermost frame in zfunc/, recipes/ or benchmarks/
    (else the innermost frame), the 15 largest. Errors are recorded, not raised."""
    try:
        before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=500_000)
        try:
            call()
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        live, total, peak, at_peak = {}, 0, 0, {}
        for e in snap["device_traces"][torch.cuda.current_device()]:
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e.get("frames") or [])
                total += e["size"]
                if total > peak:
                    peak, at_peak = total, dict(live)
            elif e["action"] == "free_completed" and e["addr"] in live:
                total -= live.pop(e["addr"])[0]
        by_line: dict[str, int] = {}
        for size, frames in at_peak.values():
            ours = [f for f in frames if any(d in f["filename"] for d in ("/zfunc/", "/recipes/", "/benchmarks/"))]
            f = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
            key = f"{'/'.join(Path(f['filename']).parts[-2:])}:{f['line']} {f['name']}"
            by_line[key] = by_line.get(key, 0) + size
        top = sorted(by_line.items(), key=lambda kv: -kv[1])[:15]
        return {"live_before": before, "peak_above_before": peak, "top": top}
    except Exception as e:  # noqa: BLE001 - a diagnostic: the figure stands without it
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _plain_largest(run: Run) -> dict:
    """The largest GPT-3 flavor whose mixed-precision AdamW state (16 B/param: bf16 param and grad,
    fp32 master, m, v) fits the GPU with 10% to spare: what a plain step could hold at most, before
    activations (predicted, not run)."""
    if not run.cuda:
        return {"largest": None, "why": "no GPU"}
    from recipes import flavors

    memory = torch.cuda.get_device_properties(0).total_memory
    fits = None
    for name in ("125M", "350M", "760M", "1.3B", "2.7B", "6.7B", "13B"):
        model, _, _ = _gpt(run, name, 1, flavors.gpt_flavor(name)["block_size"])
        if 16 * model.num_params(non_embedding=False) * 1.1 <= memory:
            fits = name
    return {"largest": fits, "bytes_per_param": 16, "gpu_bytes": memory}


def _host_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _free(run: Run) -> None:
    import gc

    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()


# name -> (estimated seconds on an H100, function of the run)
FIGURES = {
    "copy_bandwidth": (5, copy_bandwidth),
    "adamw": (40, adamw),
    "bf16_one_pass": (30, bf16_one_pass),
    "grad_norm": (20, grad_norm),
    "gpt_125M": (30, lambda run: gpt_throughput(run, run.flavor("125M"), run.n(8, 2), run.n(2048, 32), run.n(5, 2))),
    "gpt_1.3B": (60, lambda run: gpt_throughput(run, run.flavor("1.3B"), run.n(8, 2), run.n(2048, 32), run.n(5, 2))),
    # Megatron's padded vocabulary (make-vocab-size-divisible-by 128), then also each block compiled
    "gpt_1.3B_padded": (30, lambda run: gpt_throughput(run, run.flavor("1.3B"), run.n(8, 2), run.n(2048, 32),
                                                       run.n(5, 2), vocab_multiple=128)),
    "gpt_1.3B_compiled": (120, lambda run: gpt_throughput(run, run.flavor("1.3B"), run.n(8, 2), run.n(2048, 32),
                                                          run.n(5, 2), vocab_multiple=128, compiled=True)),
    "zfunc_vs_torch": (40, lambda run: zfunc_vs_torch(run, run.flavor("125M"), run.n(8, 2), run.n(2048, 32),
                                                      run.n(7, 2))),
    "offload_largest": (90, lambda run: offload_largest(run, ("1.3B", "2.7B", "6.7B") if not run.dry else ("debug",),
                                                        run.n(256, 32))),
    "plain_largest": (30, lambda run: plain_largest(run, ("1.3B", "2.7B", "6.7B") if not run.dry else ("debug",),
                                                    run.n(256, 32))),
    # last: 6.7B's ~100 GB of host RAM takes ~90 s to set up, and the budget check skips what no longer fits
    "offload_optimizer_largest": (90, lambda run: offload_largest(
        run, ("2.7B", "6.7B", "13B") if not run.dry else ("debug",), run.n(256, 32), params=None)),
}

# ---------------------------------------------------------------------------------------- table

TARGETS = {  # (figure, path, target, at least?)
    "adamw 10M vs torch": (("adamw", "10M", "vs_torch"), 1.0, True),
    "adamw 100M vs torch": (("adamw", "100M", "vs_torch"), 1.0, True),
    "adamw 1B vs torch": (("adamw", "1B", "vs_torch"), 1.0, True),
    "adamw 1B % of copy bw": (("adamw", "1B", "of_copy"), 0.85, True),
    "bf16 one-pass 1B vs torch multi-pass": (("bf16_one_pass", "1B", "vs_torch"), 1.3, True),
    "grad norm bf16 % of copy bw": (("grad_norm", "bfloat16", "of_copy"), 0.85, True),
    "grad norm fp32 % of copy bw": (("grad_norm", "float32", "of_copy"), 0.85, True),
    "GPT 125M MFU": (("gpt_125M", "mfu"), None, True),
    "GPT 1.3B MFU, eager": (("gpt_1.3B", "mfu"), None, True),
    "GPT 1.3B MFU, vocab padded to 128": (("gpt_1.3B_padded", "mfu"), None, True),
    "GPT 1.3B MFU, padded + compiled blocks": (("gpt_1.3B_compiled", "mfu"), 0.45, True),
    "zfunc / torch loop step time": (("zfunc_vs_torch", "zfunc_over_torch"), 1.05, False),
}


def _dig(doc: dict, path: tuple):
    x = doc
    for k in path:
        if not isinstance(x, dict) or k not in x:
            return None
        x = x[k]
    return x


def table(doc: dict) -> str:
    figures = doc["figures"]
    dev = doc["device"]
    lines = [f"zfunc GPU figures on {dev.get('name', dev['device'])} (torch {dev['torch']}, cupy {dev.get('cupy')})"
             + (" [dry run: CPU, toy sizes]" if doc["dry_run"] else ""),
             f"{'figure':40} {'value':>10} {'target':>8}  met"]
    for label, (path, target, at_least) in TARGETS.items():
        value = _dig(figures, path)
        shown = "-" if not isinstance(value, (int, float)) else f"{value:.3f}"
        met = "" if target is None or doc["dry_run"] or not isinstance(value, (int, float)) else (
            "yes" if (value >= target if at_least else value <= target) else "NO")
        lines.append(f"{label:40} {shown:>10} {'' if target is None else f'{target:g}':>8}  {met}")
    for name in ("gpt_125M", "gpt_1.3B", "gpt_1.3B_padded", "gpt_1.3B_compiled"):
        tps = _dig(figures, (name, "tokens_per_s"))
        if isinstance(tps, (int, float)):
            lines.append(f"{name + ' tokens/s':40} {tps:>10,.0f}")
    for label, path in (("largest GPT, plain torch (run)", ("plain_largest", "largest")),
                        ("largest GPT, plain step (predicted)", ("offload_largest", "plain_step_predicted", "largest")),
                        ("largest GPT, optimizer in CPU RAM", ("offload_optimizer_largest", "largest"))):
        lines.append(f"{label:40} {str(_dig(figures, path)):>10}")
    largest = _dig(figures, ("offload_largest", "largest"))
    lines.append(f"{'largest GPT, optimizer+params in CPU RAM':40} {str(largest):>10}")
    if largest:
        ratio = _dig(figures, ("offload_largest", "tried", largest, "peak_over_accounted"))
        if isinstance(ratio, (int, float)):
            lines.append(f"{'  max_memory_allocated / accounted':40} {ratio:>10.3f}")
        ratio = _dig(figures, ("offload_largest", "tried", largest, "step_peak_over_accounted_and_activations"))
        if isinstance(ratio, (int, float)):
            lines.append(f"{'  step peak / (accounted + activations)':40} {ratio:>10.3f} {'<=1.1':>8}  "
                         f"{'yes' if abs(ratio - 1) <= 0.1 else 'NO'}")
    bad = [k for k, v in figures.items() if isinstance(v, dict) and ("error" in v or "skipped" in v)]
    if bad:
        lines.append("not measured: " + ", ".join(f"{k} ({'error' if 'error' in figures[k] else 'skipped'})"
                                                  for k in bad))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder for gpu.json and gpu.txt")
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting figures past this many seconds")
    p.add_argument("--only", default="", help="comma-separated figure names (default: all): " + ", ".join(FIGURES))
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: check the script's own steps")
    p.add_argument("--host-gib", type=float, default=None,
                   help="host RAM the offload figure may plan for (default: MemAvailable, which a VM may report low)")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        p.error(f"--only: unknown figures {unknown}; expected some of {list(FIGURES)}")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as the recipes set it
    run = Run(args.out, args.budget_s, args.dry_run)
    run.host_gib = args.host_gib
    if not run.cuda and not run.dry:
        print("no CUDA device: every figure needs one (use --dry-run to check the script on a CPU)", file=sys.stderr)
    if "copy_bandwidth" not in names and any(n in names for n in ("adamw", "bf16_one_pass", "grad_norm")):
        names.insert(0, "copy_bandwidth")  # the kernels' figures are shares of it
    for name in names:
        cost, fn = FIGURES[name]
        if run.left() < cost * (0.1 if run.dry else 1.0):
            run.results[name] = {"skipped": f"time budget ({run.left():.0f} s left, ~{cost} s needed)"}
        else:
            t0 = time.monotonic()
            try:
                run.results[name] = {**fn(run), "wall_s": round(time.monotonic() - t0, 2)}
            except Exception as e:  # noqa: BLE001 - one figure's failure must not lose the others
                run.results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
                _free(run)
        print(f"{name}: {json.dumps(run.results[name], default=str)[:400]}", flush=True)
        run.write()
    run.write()
    print(table({"figures": run.results, "device": environment(run), "dry_run": run.dry}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
