"""``--papers``: the published headline runs beside zfunc's prediction for the same setup.

Each ``Headline`` is a published claim, its source, the setup as published (model shape, batch,
sequence, hardware, strategy), and what zfunc predicts for that setup when zfunc's engine runs it.
Capacity claims ("N params fit on G GPUs") are compared as the largest model (or the fewest GPUs)
zfunc's planner finds that fits; throughput claims as TFLOP/s per GPU or scaling efficiency. Where
the setup leaves something out (a batch size, a sequence length), the value used is an assumption,
named in the row. ``table()`` prints the README's table.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from zfunc.config.plan import Plan
from zfunc.plan.core import Estimate, plan
from zfunc.plan.hardware import GB, Cluster, Device, Node, cluster
from zfunc.plan.model import ModelSpec, from_params, from_shape
from zfunc.plan.strategy import from_flags, tiles

# Habana Gaudi (HL-205) in an AWS dl1.24xlarge: 32 GB HBM2 at 1 TB/s (Habana's product brief); its
# dense bf16 peak is in no datasheet we found: 100 TFLOP/s is an assumption (the predicted scaling
# efficiency moves by under a point between 50 and 200). 8 per node on a RoCE mesh of 700 Gb/s per
# card (both ways), 4 x 100 Gb/s EFA per node (the AWS post).
GAUDI = Device("Gaudi (HL-205, assumed peak)", {"bf16": 100e12, "fp16": 100e12, "fp32": 25e12}, 32 * GB, 1000 * GB,
               source="Habana HL-205 product brief; bf16 peak assumed")
DL1 = Node(8, 43.75 * GB, 50 * GB, 12 * GB, 768 * GB, 200 * GB, 8e12, 8 * GB, 4 * GB, "AWS dl1.24xlarge")


@dataclass
class Headline:
    claim: str
    source: str
    published: str
    predicted: str
    ratio: float | None
    explanation: str


def _smallest_tiles(model: ModelSpec, c: Cluster, s: Plan) -> Estimate:
    """The estimate with the fewest ``zf.tile`` tiles that fits (the last tried when none does)."""
    for k in (1, 2, 4, 8, 16, 32, 64):
        p = plan(model, c, replace(s, tile_lm_head=0 if k == 1 else k))
        if p.fits:
            return p
    return p


def _largest(make: Callable[[float], ModelSpec], fits: Callable[[ModelSpec], Estimate | None], lo: float, hi: float):
    """The largest parameter count in ``[lo, hi]`` whose model ``fits`` (bisection on a log scale)."""
    best = None
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        p = fits(make(mid))
        if p is not None:
            best, lo = p, mid
        else:
            hi = mid
        if hi / lo < 1.01:
            break
    return best


def _efficiency_to_match(p: Estimate, published_tflops: float) -> float:
    """The matmul efficiency at which ``p``'s compute (the rest unchanged) gives the published TFLOP/s."""
    exposed = p.step_time - p.time["compute"]
    published_step = p.step_time * p.tflops_per_gpu / published_tflops
    return p.cluster.device.matmul_efficiency * p.time["compute"] / (published_step - exposed)


def azure_2t() -> Headline:
    model = from_shape(160, 32768, 128, vocab=50257, max_seq=1024, name="GPT 2T (160 x 32768)")
    c = cluster("A100-80GB", 1024, cpu_ram=1700 * GB)
    s = from_flags(zero=3, offload_optimizer="cpu", remat="offload", micro_batch=8, seq=1024)
    p = _smallest_tiles(model, c, s)
    needed = _efficiency_to_match(p, 157)
    return Headline(
        "2T params, 1024 A100-80GB, ZeRO-3 + CPU offload",
        "DeepSpeed blog 2022-07-26 (Azure; docs/_posts/2022-07-26-deepspeed-azure.md): 160 layers, hidden 32768, "
        "128 heads, 8 x 1024 tokens per GPU, NDm A100 v4 (8 x 200 Gb/s HDR, 1.7 TB RAM per node)",
        "157 TFLOP/s per GPU",
        f"{p.tflops_per_gpu:.0f} TFLOP/s per GPU ({'fits' if p.fits else 'does not fit'} "
        f"with zf.tile k={tiles(p.plan)}"
        f", {p.gpu_bytes / GB:.0f} GB per GPU; step {p.step_time:.0f} s, of which exposed traffic "
        f"{p.step_time - p.time['compute']:.1f} s)",
        p.tflops_per_gpu / 157,
        f"Compute-bound in both: the prediction's GEMMs run at {c.device.matmul_efficiency:.2f} of the A100's 312 "
        "TFLOP/s (``hardware.A100_MATMUL``: Megatron-LM's 1T run on 3072 A100, Narayanan et al. SC21, an independent "
        f"source), the published run at 0.50 overall; a matmul efficiency of {needed:.2f} reproduces it exactly.")


def megatron_1t_3d() -> Headline:
    model = from_shape(128, 25600, 160, vocab=50257, max_seq=2048, kind="gpt", name="GPT 1T (128 x 25600)")
    best = None
    for gpus in range(16, 4097, 16):
        for tp, pp in itertools.product((8, 16), (8, 16, 25, 32, 64, 128)):
            if gpus % (tp * pp):
                continue
            c = cluster("V100-32GB", gpus)
            s = from_flags(tp=tp, pp=pp, sp=True, zero=1, remat="full", micro_batch=1, accum=pp, seq=2048,
                           precision="fp16")
            try:
                p = plan(model, c, s)
            except ValueError:
                continue
            if p.fits:
                best = p
                break
        if best:
            break
    s, gpu = best.plan, best.memory["gpu"]
    states = sum(gpu.get(k, 0.0) for k in ("masters", "optimizer", "grad_shard", "compute_params", "whole_grads"))
    return Headline(
        "1T params, 800 V100-32GB, 3D parallelism (DeepSpeed + Megatron)",
        "DeepSpeed ZeRO-3 Offload post 2021-03-08 (docs/_posts/2021-03-08-zero3-offload.md): 3D parallelism "
        "needs 800 V100 GPUs to fit 1T; shape as Azure's 1T (128 layers, hidden 25600, 160 heads); sequence 2048, "
        "micro-batch 1 and activation checkpoints partitioned over the tensor-parallel group (ZeRO-R) assumed",
        "fits on 800 GPUs",
        f"fits on {best.cluster.gpus} GPUs at the fewest (tp={s.tp} x pp={s.pp} x dp={s.dp}, ZeRO-1, remat; "
        f"{best.gpu_bytes / GB:.1f} GB per GPU, {states / GB:.1f} of them model states)",
        best.cluster.gpus / 800,
        f"zfunc's layout under a pipeline: each stage sums its microbatches' grads in fp32 (4 bytes/param) beside "
        f"the fp16 compute copy and the fp32 slice, {6 + 16 / s.dp:.0f} bytes/param on this rank where "
        f"Megatron-DeepSpeed holds {4 + 12 / s.dp:.0f} (fp16 params and grads + 12/dp); at 800 GPUs "
        f"(tp 16 x pp 25 x dp 2) that is 42 GB of model states per GPU against 30. Tensor parallelism under a "
        "pipeline is modelled (Megatron's layout), not run by zfunc yet.")


def _fastest_fit(model: ModelSpec, c: Cluster, grid: list[Plan]) -> Estimate | None:
    """The fastest estimate of ``grid`` that fits (each with its fewest tiles), or None."""
    best = None
    for s in grid:
        p = _smallest_tiles(model, c, s)
        if p.fits and (best is None or p.step_time < best.step_time):
            best = p
    return best


def infinity_32t() -> Headline:
    c = cluster("V100-32GB", 512)
    base = from_flags(zero=3, offload_optimizer="nvme", offload_params="nvme", remat="offload", micro_batch=1,
                      seq=1024, precision="fp16")
    same = _largest(lambda n: from_params(n, max_seq=1024), lambda m: _fastest_fit(m, c, [base]), 1e11, 1e14)
    n = same.model.total_params
    bigger = _smallest_tiles(from_params(n * 1.05, max_seq=1024), c, base)
    return Headline(
        "32T params, 512 V100-32GB (32 DGX-2), ZeRO-Infinity (params + optimizer on NVMe)",
        "ZeRO-Infinity (Rajbhandari et al., SC21, arXiv:2104.07857): 32T trainable on 32 DGX-2 nodes; "
        "DGX-2: 1.5 TB RAM, 30 TB NVMe; fp16, sequence 1024 and micro-batch 1 assumed",
        "32T params fit",
        f"{n / 1e12:.1f}T at the most in the same setup (fp16, clip; tiles k={tiles(same.plan)}, "
        f"{same.gpu_bytes / GB:.1f} GB per GPU, {same.nvme_bytes_per_node / 1e12:.1f} TB of NVMe per node, of which "
        f"the held grads {same.memory['nvme'].get('held_grads', 0) * c.gpus_per_node / 1e12:.1f})",
        n / 32e12,
        "The GPU holds fp16 units and grad buckets only; masters, moments and the fp32 grads held for the "
        "clip and fp16's overflow check live on NVMe. At 5% more: " + "; ".join(bigger.why_not()) + " (zfunc's "
        "swap files take 2 x 12 bytes per param, a spare of each, where DeepSpeed's take 2 + 12).")


def infinity_1t_one_gpu() -> Headline:
    c = cluster("V100-32GB", 1)
    base = from_flags(zero=3, offload_optimizer="nvme", offload_params="nvme", remat="offload", micro_batch=1,
                      seq=1024, precision="fp16")
    same = _largest(lambda n: from_params(n, max_seq=1024), lambda m: _fastest_fit(m, c, [base]), 1e10, 1e14)
    n = same.model.total_params
    bigger = _smallest_tiles(from_params(n * 1.05, max_seq=1024), c, base)
    return Headline(
        "1T params on one V100-32GB of a DGX-2 node, ZeRO-Infinity",
        "ZeRO-Infinity (Rajbhandari et al., SC21, arXiv:2104.07857), 'a trillion parameters on a single V100 of a "
        "DGX-2 node' (1.5 TB RAM, 30 TB NVMe); fp16, sequence 1024 and micro-batch 1 assumed",
        "1T params fit",
        f"{n / 1e12:.2f}T at the most in the same setup (fp16, clip; tiles k={tiles(same.plan)}, "
        f"{same.gpu_bytes / GB:.1f} GB on the GPU, {same.nvme_bytes_per_node / 1e12:.1f} TB of NVMe)",
        n / 1e12,
        "NVMe binds: at 5% more, " + "; ".join(bigger.why_not()) + ". zfunc's swap files take 2 x 12 bytes per "
        "param (a spare of each) and the held grads 2 more, 26 against DeepSpeed's 14 (fp16 params and fp32 "
        "optimizer state); the GPU holds fp16 units and grad buckets only.")


def zero3_offload_1t() -> Headline:
    model = from_shape(128, 25600, 160, vocab=50257, max_seq=1024, name="GPT 1T (128 x 25600)")
    c = cluster("V100-32GB", 512)
    best = None
    for mb in (16, 8, 4, 2, 1):
        s = from_flags(zero=3, offload_optimizer="cpu", remat="offload", micro_batch=mb, seq=1024, precision="fp16")
        p = _smallest_tiles(model, c, s)
        if p.fits:
            best = p
            break
    return Headline(
        "1T params, 512 V100-32GB, ZeRO-3 Offload (the 25 PFLOP/s of ZeRO-Infinity)",
        "DeepSpeed ZeRO-3 Offload post 2021-03-08: 'with 1 Trillion parameters ... 25 PetaFlops on 512 V100 GPUs, "
        "49 TFlops/GPU'; shape as Azure's 1T, sequence 1024 assumed, micro-batch: the largest that fits",
        "49 TFLOP/s per GPU",
        f"{best.tflops_per_gpu:.0f} TFLOP/s per GPU (micro-batch {best.plan.micro_batch}, tiles "
        f"k={tiles(best.plan)}, {best.gpu_bytes / GB:.1f} GB per GPU)",
        best.tflops_per_gpu / 49,
        f"Within 30%. The roofline runs GEMMs at {c.device.matmul_efficiency:.2f} of the V100's 125 TFLOP/s "
        "(``hardware.V100_MATMUL``: Megatron-LM v1.0's single-GPU 48%, a source independent of this post; a "
        f"matmul efficiency of {_efficiency_to_match(best, 49):.2f} reproduces it exactly: a 1T step over 512 "
        f"GPUs keeps less of the peak than one GPU's 1.2B). At micro-batch {best.plan.micro_batch} the exposed "
        f"traffic is {best.step_time - best.time['compute']:.1f} of {best.step_time:.1f} s.")


def bert_scaling() -> Headline:
    model = from_shape(48, 1600, 25, kind="bert", vocab=30522, max_seq=512, name="BERT 1.5B (48 x 1600)")
    s = from_flags(zero=1, micro_batch=16, accum=24, seq=128, precision="bf16")
    one = plan(model, Cluster(GAUDI, 1, DL1), s)
    many = plan(model, Cluster(GAUDI, 128, DL1), s)
    eff = one.step_time / many.step_time
    return Headline(
        "BERT 1.5B, 128 Gaudi accelerators, ZeRO-1 + bf16: scaling efficiency",
        "AWS ML blog, 'Accelerate PyTorch with DeepSpeed ... Habana Gaudi-based DL1' (16 dl1.24xlarge, 4 x 100 Gb/s "
        "EFA per node, micro-batch 16, accumulation 24); shape from Habana's Model-References (48 layers, hidden "
        "1600, 25 heads), phase-1 sequence 128",
        "82.7%",
        f"{100 * eff:.1f}% (step {one.step_time:.2f} s alone, {many.step_time:.2f} s on 128; exposed communication "
        f"{many.time['dp_comm']:.2f} s)",
        eff / 0.827,
        "With 24 microbatches per step the 3 GB gather and 6 GB reduce-scatter take ~0.2 s of a ~10 s step on "
        "50 GB/s per node, so the model sees near-linear scaling; the published 17% loss is elsewhere: "
        "the scale-out path (DL1's Gaudi RoCE ports do not leave the node; inter-node traffic goes through host "
        "EFA and host memory), data loading and the per-step host work the roofline does not see.")


def offload_13b() -> Headline:
    c = cluster("V100-32GB", 1)
    zero_offload = from_flags(zero=2, offload_optimizer="cpu", remat="full", micro_batch=1, seq=1024, precision="fp16")
    same = _largest(lambda n: from_params(n, max_seq=1024), lambda m: _fastest_fit(m, c, [zero_offload]), 1e8, 1e12)
    ten = from_shape(50, 4096, 32, vocab=50257, max_seq=1024)
    tens = plan(ten, c, replace(zero_offload, micro_batch=10))
    gpu = tens.memory["gpu"]
    return Headline(
        "13B params on one V100-32GB, ZeRO-Offload (10B at 40 TFLOP/s)",
        "ZeRO-Offload (Ren et al., USENIX ATC 2021, arXiv:2101.06840) and the DeepSpeed ZeRO-Offload tutorial "
        "(10B: 50 layers, hidden 4096, batch 10, activation checkpointing, ZeRO-2 + optimizer on CPU; 40 TFLOP/s); "
        "fp16, sequence 1024 assumed",
        "13B fits; 10B at 40 TFLOP/s",
        f"{same.model.total_params / 1e9:.1f}B at the most in the same setup (fp16, optimizer and masters on the CPU, "
        f"fp16 params on the GPU); the 10B setup: {tens.gpu_bytes / GB:.0f} GB on the GPU (fp16 params "
        f"{gpu['compute_params'] / GB:.0f}, grad buckets {gpu['whole_grads'] / GB:.1f}), {tens.tflops_per_gpu:.0f} "
        "TFLOP/s",
        same.model.total_params / 13e9,
        f"Within 30% (capacity); the 10B setup's throughput is {tens.tflops_per_gpu / 40:.2f} of the published: "
        "the held fp32 grads cross PCIe and CPU-Adam runs after backward (fp16's overflow check), behind the GPU's "
        "compute. As ZeRO-Offload: 2 bytes/param on the GPU, fp32 masters, moments and grads on the CPU.")


# Llama 3.1 as torchtitan's docs/performance.md publishes it: 128,256-token vocabulary, sequence 8192 (its
# train configs'); its H100s are Grand Teton's, 96 GB of HBM2e at 2.4 TB/s, at a 500 W power limit.
TITAN_H100 = {"hbm_bytes": 96 * GB, "hbm_bw": 2400 * GB}


def _titan(model: ModelSpec, gpus: int, s: Plan) -> Estimate:
    return plan(model, cluster("H100-80GB", gpus, **TITAN_H100), s)


def torchtitan_8b() -> Headline:
    model = from_shape(32, 4096, 32, kind="llama", kv_heads=8, ffn=14336, vocab=128256, max_seq=8192,
                       name="Llama 3.1 8B")
    p = _titan(model, 8, from_flags(zero=3, remat="full", micro_batch=2, seq=8192, precision="bf16"))
    per_gpu = p.tokens_per_step / p.step_time / 8
    return Headline(
        "Llama 3.1 8B, 8 H100, FSDP (torchtitan)",
        "torchtitan docs/performance.md, Table 1: 1D FSDP, local batch 2, selective activation checkpointing, "
        "eager; 5,762 tokens/s per GPU ('33% to 39% MFU'); sequence 8192; selective AC modelled as full remat "
        "(no remat does not fit 96 GB)",
        "5,762 tokens/s per GPU",
        f"{per_gpu:,.0f} tokens/s per GPU (MFU {100 * p.mfu:.0f}%, {'fits' if p.fits else 'does not fit'}: "
        f"{p.gpu_bytes / GB:.0f} GB per GPU)",
        per_gpu / 5762,
        "H100's GEMM efficiency is Megatron-LM's published 47% (``hardware.H100_MATMUL``), not fitted to this row; "
        "full remat recomputes more than torchtitan's selective checkpointing, which the 500 W power limit offsets.")


def torchtitan_405b() -> Headline:
    model = from_shape(126, 16384, 128, kind="llama", kv_heads=8, ffn=53248, vocab=128256, max_seq=8192,
                       name="Llama 3.1 405B")
    p = _titan(model, 128, from_flags(dp=16, tp=8, sp=True, zero=3, remat="full", micro_batch=2, seq=8192,
                                      precision="bf16"))
    per_gpu = p.tokens_per_step / p.step_time / 128
    return Headline(
        "Llama 3.1 405B, 128 H100, FSDP 16 x TP 8 (torchtitan)",
        "torchtitan docs/performance.md, Llama 3.1 performance numbers: 2D (FSDP + tensor parallel 8, with its "
        "sequence parallelism), local batch 2, full activation checkpointing, no Float8: 109 tokens/s per GPU, "
        "MFU 29.0%; sequence 8192",
        "109 tokens/s per GPU",
        f"{per_gpu:,.0f} tokens/s per GPU (MFU {100 * p.mfu:.0f}%, {'fits' if p.fits else 'does not fit'}: "
        f"{p.gpu_bytes / GB:.0f} GB per GPU; "
        f"tensor-parallel all-reduces {p.time.get('tp_comm', 0.0):.1f} of a {p.step_time:.1f} s step)",
        per_gpu / 109,
        "The tensor-parallel all-reduces are not overlapped in the roofline (async TP was off in this row).")


HEADLINES = (azure_2t, megatron_1t_3d, infinity_32t, infinity_1t_one_gpu, zero3_offload_1t, bert_scaling, offload_13b,
             torchtitan_8b, torchtitan_405b)


def table() -> str:
    rows = ["| published claim | source and setup | published | zfunc predicts | predicted / published | "
            "where they differ by > 30%: the assumption that explains it |", "|---|---|---|---|---|---|"]
    for make in HEADLINES:
        h = make()
        ratio = "-" if h.ratio is None else f"{h.ratio:.2f}"
        near = h.ratio is not None and abs(h.ratio - 1) <= 0.3
        why = ("Within 30%. " if near and not h.explanation.startswith("Within 30%") else "") + h.explanation
        rows.append(f"| {h.claim} | {h.source} | {h.published} | {h.predicted} | {ratio} | {why} |")
    return "\n".join(rows)
