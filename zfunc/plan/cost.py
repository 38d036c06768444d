"""Communication per step and the step time: a roofline over compute, collectives and offload traffic.

**Communication** per rank and step, in bytes as ``dist.Comm`` counts them (all-gather: its output; reduce-scatter:
its input; all-reduce: twice its tensor; send/recv: each tensor), ``P`` params of the rank's partition, ``N = dp x
sp_size`` (``strategy.shard_ranks``), ``m`` microbatches, ``e`` the compute dtype's bytes (``zfunc.sharding.step``):
stage 0 all-reduces fp32 grads once (``8P``); stages 1/2 all-gather ``eP`` once and reduce-scatter ``4P`` fp32
grads, once at stage 1, every microbatch at stage 2; stage 3 gathers ``2eP`` and reduce-scatters ``4P`` every
microbatch. A pipeline sends each microbatch's boundary activation forward and its grad back, and lends the shared
params (``eP_sh`` out, ``4P_sh`` back). Tensor parallelism (modelled as Megatron-LM: 2 all-reduces of ``T h e`` per
layer in forward, 2 in backward, 2 more with remat) stays inside a node when it can. Sequence parallelism
(``sp_size``) moves each attention call's bytes as ``zfunc.sequence`` counts them (``sequence_bytes``), and a rank
computes ``seq / sp_size`` tokens of every sequence (attention: those queries over all ``seq`` keys). On the wire a
ring moves ``(N-1)/N`` of those bytes, at the link of the group: NVLink inside a node, else the node's network
shared by the ``gpus_per_node / members_per_node`` groups crossing it.

**Time** (seconds). Compute per microbatch is a roofline per op: each GEMM takes
``max(FLOPs / (peak x matmul_efficiency), bytes / (hbm_bw x memory_efficiency))``, attention runs
at ``attention_efficiency`` (half its FLOPs when fused and causal), elementwise ops (norms,
activations, residuals, softmax when unfused, the loss) move their bytes at memory speed; backward
is twice the forward (fused attention's 2.5 times: it recomputes the scores), remat adds one
forward of the layers. What overlaps is what the engine
overlaps (read in ``zfunc.sharding.step``, ``prefetch``, ``offload``, ``pipeline``):
- stage 0: bucket all-reduces run during the last microbatch's backward;
- stages 1/2: the param all-gather before the forward is exposed; reduce-scatters overlap
  backward (stage 1 with accumulation reduces once after the last microbatch: exposed);
- stage 3: gathers are prefetched during forward, re-gathers and reduce-scatters during backward;
  it runs one of each per unit (a layer, and the root's remainder), and on a CPU device, where
  nothing hides them, each pays its latency;
- the optimizer runs after backward on the device (28 B/param, +12 with a global-norm clip);
- offload: per leaf the grad and the master cross PCIe (fp32) and CPU-Adam updates it in the
  same thread, while the swap engine reads and writes in parallel: ``max(PCIe + CPU-Adam, disk)``;
  on a CPU device the thread also pays first writes of fresh memory (page faults,
  ``cpu_grad_passes``); the clip's factor and the unscale are folded into CPU-Adam's own pass;
  it runs after backward, or during it when the engine updates on arrival (no clip, no fp16,
  accum 1); params offload fetches each unit's fp32 piece twice per microbatch, read ahead;
- a pipeline's schedule takes ``sum_s t_s + (m - 1) max_s t_s`` (p stages, m microbatches), each
  microbatch slot paying its activation's point-to-point transfer;
- on a CPU device collectives do not overlap compute (gloo's loopback transfers are CPU copies that
  compete with it for the cores), and the offloaded update's disk traffic does not overlap its CPU
  work either: CPU-Adam's thread team takes every core, and the swap engine's threads, which issue
  each next transfer, wait for one: the update with moments on NVMe takes about the sum of the same
  update with moments in RAM and the swap engine moving its bytes alone, not their max
  (``benchmarks/capacity.py``'s offloaded step; ``zfunc.plan.validate`` checks it). On a GPU node
  the CPU has cores to spare and the disk runs beside CPU-Adam.
Exposed overlapped traffic is ``max(traffic - compute, 0)`` plus the last piece, which nothing hides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from zfunc.plan.hardware import Cluster
from zfunc.plan.memory import local_numel, partition_params
from zfunc.plan.model import ModelSpec
from zfunc.config.plan import Plan
from zfunc.plan.strategy import clipped, elem, microbatches, opt_bytes, rank_tokens, shard_ranks

CPU_ADAM_BYTES = 36  # per param: p, g, m, v read; p, m, v written (28) + the fp32 grad and master copies in


@dataclass(frozen=True)
class Compute:
    """Seconds per microbatch on the busiest stage: ``forward``, ``backward`` (with remat's recompute)."""

    forward: float
    backward: float
    flops: float  # FLOPs run per microbatch on this rank (with remat)


def _gemm(device, m: float, k: float, n: float, peak: float, elem: int) -> float:
    flops = 2 * m * k * n
    nbytes = elem * (m * k + k * n + m * n)
    return max(flops / (peak * device.matmul_efficiency), nbytes / (device.hbm_bw * device.memory_efficiency))


def compute_times(model: ModelSpec, s: Plan, cluster: Cluster, layers: int | None = None,
                  logits: bool = True) -> Compute:
    """Forward and backward seconds of one microbatch over ``layers`` layers (default: the busiest
    stage's), with the logits and loss when ``logits``."""
    dev, e, t = cluster.device, elem(s), s.tp
    peak = dev.flops(s.precision)
    mem = dev.hbm_bw * dev.memory_efficiency
    T, h, f, seq = rank_tokens(s), model.hidden, model.ffn_dim, s.seq  # attention: T queries over seq keys
    layers = math.ceil(model.layers / s.pp) if layers is None else layers
    scale = model._scale()
    qkv = h + 2 * h * model.kv // model.heads
    gemms = [(T, h, qkv / t), (T, h / t, h), (T, h, f * (2 if model.glu else 1) / t), (T, f / t, h)]
    layer_gemm = sum(_gemm(dev, *g, peak, e) for g in gemms) * scale
    causal = 0.5 if (model.fused_attention and model.kind != "bert") else 1.0
    attention = 4 * T * seq * h / t * causal / (peak * dev.attention_efficiency)
    elementwise = e * T * (16 * h + (3 if model.glu else 0) * f / t)  # norms, residuals, the GLU product
    if not model.fused_attention:
        elementwise += e * T * 3 * model.heads * seq / t  # softmax read, write, and its mask
    act = T * f / t  # the MLP's activation function, elements
    activation = act / dev.activation_rate if dev.activation_rate else 2 * e * act / mem
    layer_fwd = layer_gemm + attention + elementwise / mem + activation
    # backward: twice each GEMM, and fused attention's backward recomputes the scores (FlashAttention-2:
    # 2.5x its forward's FLOPs)
    layer_bwd = 2 * (layer_fwd - attention) + (2.5 if model.fused_attention else 2.0) * attention
    fwd = layers * layer_fwd + e * T * h / mem  # embeddings
    bwd = layers * layer_bwd + 2 * e * T * h / mem
    if s.remat:
        bwd += layers * layer_fwd
    if logits:
        head = _gemm(dev, T, h, model.vocab / t, peak, e)
        loss = T * model.vocab / t * (e + 8) / mem  # logits read, fp32 log-softmax written and read
        fwd += head + loss
        bwd += 2 * head + loss
    flops = s.micro_batch * s.seq * model.train_flops_per_token(seq, s.remat) / (s.pp * t * s.sp_size)
    return Compute(fwd, bwd, flops)


# ---------------------------------------------------------------------- collectives
def group_bandwidth(cluster: Cluster, members: int, stride: int) -> float:
    """Bytes/s one rank of a ring of ``members`` ranks, ``stride`` apart in rank order, moves."""
    node = cluster.node
    gpn = cluster.gpus_per_node
    per_node = max(1, min(members, gpn // max(1, stride)))
    eff = cluster.collective_efficiency
    if members <= per_node:  # inside a node
        return node.intra_bw * eff
    return min(node.intra_bw, node.inter_bw * per_node / gpn) * eff


def link_bandwidth(cluster: Cluster, axis: str | None, members: int, stride: int) -> float:
    """Bytes/s one rank moves over mesh axis ``axis``: the cluster's link for it (``Cluster.links``), else
    the node model's (``group_bandwidth``: NVLink inside a node, the shared network across)."""
    if axis in cluster.links:
        return cluster.links[axis]
    return group_bandwidth(cluster, members, stride)


def collective_time(cluster: Cluster, kind: str, nbytes: float, members: int, stride: int = 1,
                    axis: str | None = None) -> float:
    """Seconds for a collective of ``nbytes`` (``dist.Comm``'s count) over ``members`` ranks of mesh
    axis ``axis`` (its link, ``Cluster.links``, where given)."""
    if members <= 1 or nbytes <= 0:
        return 0.0
    wire = nbytes * (members - 1) / members
    if axis in cluster.links:
        return cluster.latency * (members - 1) + wire / cluster.links[axis]
    if kind in cluster.collectives:  # calibrated on this machine: alpha per hop, wire bytes/s
        alpha, beta = cluster.collectives[kind]
        return alpha * (members - 1) + wire / beta
    return cluster.latency * (members - 1) + wire / group_bandwidth(cluster, members, stride)


def collective_latency(cluster: Cluster, kind: str, members: int) -> float:
    """Seconds one collective of ``kind`` costs beyond its bytes: its latency per hop, ``members - 1`` hops."""
    if members <= 1:
        return 0.0
    alpha = cluster.collectives[kind][0] if kind in cluster.collectives else cluster.latency
    return alpha * (members - 1)


def comm_bytes(model: ModelSpec, s: Plan) -> dict[str, float]:
    """Bytes per rank per step by collective, in ``dist.Comm`` units (module docstring)."""
    P, shared = partition_params(model, s)
    e, m, N = elem(s), microbatches(s), shard_ranks(s)
    out = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0, "send": 0.0, "recv": 0.0}
    if N > 1 or s.zero_stage == 0:
        if s.zero_stage == 0:
            out["all_reduce"] += 8 * P if N > 1 else 0.0
        elif s.zero_stage in (1, 2):
            out["all_gather"] += e * P
            out["reduce_scatter"] += 4 * P * (m if s.zero_stage == 2 else 1)
        else:
            out["all_gather"] += 2 * e * P * m
            out["reduce_scatter"] += 4 * P * m
        if N == 1:
            out = {k: 0.0 for k in out}
    T = s.micro_batch * s.seq
    if s.tp > 1:
        per_layer = (4 + (2 if s.remat else 0)) * T * model.hidden * e
        layers = math.ceil(model.layers / s.pp)
        if s.sp:
            out["all_gather"] += per_layer * layers * m  # each all-reduce: a gather and a reduce-scatter
            out["reduce_scatter"] += per_layer * layers * m
        else:
            out["all_reduce"] += 2 * per_layer * layers * m
    if s.pp > 1:
        act = T * model.hidden * e / (s.tp if s.sp else 1)
        lent = 0 if s.pipeline_schedule == "zbv" else shared  # ZB-V: the first and last stage share rank 0
        out["send"] += 2 * act * m + e * lent
        out["recv"] += 2 * act * m + 4 * lent
    for kind, nbytes in sequence_bytes(model, s).items():
        out[kind] = out.get(kind, 0.0) + nbytes
    out["all_reduce"] += 2 * 4 * 3  # loss, grad norm and the grads-produced flags (a few bytes)
    return out


def sequence_bytes(model: ModelSpec, s: Plan) -> dict[str, float]:
    """Bytes per rank per step of ``zf.sequence_parallel`` (``sp_size > 1``), as ``zfunc.sequence``'s kinds
    count them per attention call (``ulysses.comm_bytes``, ``ring.comm_bytes``): every layer's attention, every
    microbatch; with remat, each call's forward part once more (the recomputed forward exchanges again).
    Ulysses: ``all_to_all`` (half of a call's bytes are its forward's); ring: ``send`` and as many ``recv``
    (its forward's: ``sp - 1`` key/value blocks in the compute dtype)."""
    from zfunc.sequence import ring, ulysses

    if s.sp_size == 1:
        return {}
    layers, m, e = math.ceil(model.layers / s.pp), microbatches(s), elem(s)
    head_dim, tokens = model.hidden // model.heads, rank_tokens(s) // s.micro_batch
    heads, kv = model.heads // s.tp, max(1, model.kv // s.tp)  # tp replicates kv heads it does not divide
    if s.sp_kind == "ulysses":
        call = ulysses.comm_bytes(s.micro_batch, tokens, heads, kv, head_dim, e, s.sp_size)
        return {"all_to_all": layers * m * (call + (call / 2 if s.remat else 0.0))}
    call = ring.comm_bytes(s.micro_batch, tokens, kv, head_dim, e, s.sp_size)
    forward = (s.sp_size - 1) * 2 * s.micro_batch * tokens * kv * head_dim * e
    moved = layers * m * (call + (forward if s.remat else 0.0))
    return {"send": moved, "recv": moved}


# ---------------------------------------------------------------------- offload
def offload_traffic(model: ModelSpec, s: Plan) -> dict[str, float]:
    """Bytes per rank per step of offload: PCIe each way, NVMe read/written, and params updated."""
    P, _ = partition_params(model, s)
    exact = model.leaves is not None and s.pp == 1 and s.tp == 1 and s.zero_stage > 0
    local = local_numel(model.leaves, s.dp, 0) if exact else (P if s.zero_stage == 0 else math.ceil(P / s.dp))
    out = {"d2h": 0.0, "h2d": 0.0, "nvme_read": 0.0, "nvme_write": 0.0, "updated": 0.0}
    if s.offload_optimizer == "none" and s.offload_params == "none":
        return out
    out["updated"] = local
    out["d2h"] = 4 * local + (4 * local if s.offload_params == "none" else 0)  # grads; masters read back
    out["h2d"] = 4 * local if s.offload_params == "none" else 0.0  # the updated master
    k = opt_bytes(s)
    if s.offload_optimizer == "nvme":
        out["nvme_read"] += k * local
        out["nvme_write"] += k * local
    if s.offload_params != "none":
        fetches = 2 * microbatches(s)  # every unit's piece, in forward and again in backward
        out["h2d"] += 4 * local * fetches
        if s.offload_params == "nvme":
            out["nvme_read"] += 4 * local * (fetches + 1)
            out["nvme_write"] += 4 * local
    return out


def update_time(model: ModelSpec, s: Plan, cluster: Cluster) -> float:
    """Seconds of the optimizer update: on the device, or offloaded (module docstring)."""
    P, _ = partition_params(model, s)
    if not offload_traffic(model, s)["updated"]:
        local = P if s.zero_stage == 0 else math.ceil(P / shard_ranks(s))
        per_param = 28 + (12 if clipped(s) else 0)
        return local * per_param / (cluster.device.hbm_bw * cluster.device.memory_efficiency)
    parts = offload_update_parts(model, s, cluster)
    if cluster.device.kind == "cpu":  # CPU-Adam's team takes every core: the swap threads wait (cost docstring)
        return parts["host"] + parts["disk"]
    return max(parts["host"], parts["disk"])  # O_DIRECT transfers need no CPU: the disk runs beside CPU-Adam


def offload_update_parts(model: ModelSpec, s: Plan, cluster: Cluster) -> dict[str, float]:
    """An offloaded update's two streams, in seconds: ``host`` (PCIe and the CPU's work in the
    updating thread) and ``disk`` (the swap engine's reads and writes beside it)."""
    traffic = offload_traffic(model, s)
    local = traffic["updated"]
    node = cluster.node
    ranks = cluster.gpus_per_node  # CPU-Adam of every rank of a node shares its memory bandwidth
    adam = local * CPU_ADAM_BYTES * ranks / (node.cpu_mem_bw * cluster.cpu_adam_efficiency)
    pcie = 0.0 if cluster.device.kind == "cpu" else (8 * local) / node.pcie_bw
    if cluster.device.kind == "cpu":
        adam += cpu_grad_passes(local, s, cluster)
    disk_r = traffic["nvme_read"] - (4 * local * 2 * microbatches(s) if s.offload_params == "nvme" else 0)
    disk_w = traffic["nvme_write"]
    disk = ranks * (disk_r / node.nvme_read_bw + disk_w / node.nvme_write_bw)
    return {"host": pcie + adam, "disk": disk}


def cpu_grad_passes(local: float, s: Plan, cluster: Cluster) -> float:
    """Seconds a CPU device spends, in the updating thread, on first writes of fresh memory per
    step (page faults: ``first_touch_bw``, 4 B/param). The clip's factor rides in CPU-Adam's
    ``grad_scale`` and adds no pass of its own; the first-touch term is what ``zfunc.plan.validate``'s
    offloaded-update row (``benchmarks/capacity.py``) measures beside CPU-Adam. On a GPU the slices
    come from the caching allocator (no faults) and cross PCIe, which ``update_time`` counts apart."""
    dev = cluster.device
    return 4 * local / dev.first_touch_bw if dev.first_touch_bw else 0.0


def fetch_time(model: ModelSpec, s: Plan, cluster: Cluster) -> float:
    """Seconds per step fetching offloaded params to the device (forward and backward, every microbatch)."""
    if s.offload_params == "none":
        return 0.0
    traffic = offload_traffic(model, s)
    node = cluster.node
    local = traffic["updated"]
    fetched = 4 * local * 2 * microbatches(s)
    t = 0.0 if cluster.device.kind == "cpu" else fetched / node.pcie_bw
    if s.offload_params == "nvme":
        t += cluster.gpus_per_node * fetched / node.nvme_read_bw
    return t


def engine_comm(leaves, world: int, stage: int, *, precision: str = "fp32", accum: int = 1,
                clip: bool = True, backend: str = "gloo") -> dict[str, int]:
    """The bytes ``step.memory(state)["comm"]`` reports for one step of ``zf.shard(step, Mesh(dp=world),
    stage)`` at stages 1-3 (stage 3's gathers: the bound ``[1, 2] x`` the forward's, as the backward
    re-gathers only the units it needs again; ``all_gather`` here is the forward's). Every rank's
    segment is padded to ``ceil(rows / world)`` rows per param, so the collectives move
    ``world x sum(chunk x rowsize)`` elements. The one small all-reduce sums the squared grad norm,
    the loss and one grads-produced flag per leaf (fp32); without a clip the norm is not summed
    across ranks in the optimizer and the loss goes alone. Grads are reduce-scattered in the
    precision backward makes them on gloo (``Comm.reduce_dtype``; stage 1 with ``accum > 1`` sums
    them in fp32 first), in fp32 on ``backend="nccl"``."""
    e = 4 if precision == "fp32" else 2
    padded = world * sum(-(-(s[0] if s else 1) // world) * (math.prod(s[1:]) if s else 1) for s in leaves)
    if stage not in (1, 2, 3):
        raise ValueError(f"stage: engine_comm knows stages 1-3, got {stage!r}")
    gathers = 1 if stage < 3 else accum
    wire = 4 if backend != "gloo" or (stage == 1 and accum > 1) else e
    out = {"all_gather": e * padded * gathers, "reduce_scatter": wire * padded * (1 if stage == 1 else accum)}
    out["all_reduce"] = 2 * 4 * (2 + len(leaves)) if clip else 2 * 4
    return out
