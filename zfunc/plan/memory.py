"""Bytes per rank: model states as zfunc's engine holds them, activations, working memory, by place.

**Model states, zfunc's layout** (what ``step.memory(state)`` reports; ``zfunc.sharding.step``'s docstring),
for a rank holding ``P`` params of its pipeline stage and tensor slice, ``N = dp x sp_size`` (the ranks
``zf.shard`` splits over, ``strategy.shard_ranks``), ``e`` the
compute dtype's bytes, ``k`` the optimizer's bytes per param (8 for Adam):

| | between steps | during the step (device) |
|---|---|---|
| stage 0 | masters ``4P``, optimizer ``kP`` | fp32 grad buckets ``4P``; compute copy ``eP`` below fp32 |
| stage 1 | ``4P/N``, ``kP/N`` | grad shard ``4P/N``; whole params ``eP``; whole grads ``eP`` (accumulating: ``4P``) |
| stage 2 | ``4P/N``, ``kP/N`` | grad shard ``4P/N``; whole params ``eP``; one bucket of whole grads |
| stage 3 | ``4P/N``, ``kP/N`` | grad shard ``4P/N``; ``(1 + prefetch)`` units of whole params; one unit of grads |

``P/N`` is ``torch.chunk``'s split: each param's rows in chunks of ``ceil(rows/N)``, so rank 0
holds the most; with the model's leaves known the count is exact, per rank. Offload moves masters
(``params=``) and optimizer state (``optimizer=``) to CPU RAM or to swap files; updating during
backward (no clip, no fp16, accum 1) frees the device of the fp32 grad shard, which otherwise waits
there for the norm. Swap files take twice their bytes on disk (the engine keeps a spare of each).

**The ZeRO paper's layout** (``zero_paper``; Rajbhandari et al. 2019, Figure 1): fp16 params ``2Psi``,
fp16 grads ``2Psi``, ``K Psi`` of optimizer state (fp32 master, momentum, variance: K = 12),
partitioned over ``N`` from stage 1 (optimizer), 2 (+grads), 3 (+params). zfunc differs by design:
it keeps the fp32 grad slice the optimizer reads, as DeepSpeed does outside the paper's count
(``+4Psi/N`` at stage 1, ``+2Psi/N`` at stage 2 where the paper has an fp16 slice), and gathers
stage-3 units from the fp32 masters (no fp16 param shard: ``-2Psi/N``, so stage 3 is the paper's
``16Psi/N``), besides the step's buffers (stage 2's bucket, stage 3's gathered units).

**Activations and working memory**: ``ModelSpec.activation_bytes_per_layer`` per layer and microbatch, over the
tokens a rank computes (``micro_batch x seq / sp_size``: Ulysses keeps a rank's attention inputs over ``T`` tokens
of ``H / sp`` heads, the same bytes; ring its own tokens'); a pipeline's first stage keeps ``min(m, p)``
microbatches under 1F1B and ``m`` under GPipe; logits in the compute dtype plus their fp32 softmax on the last
stage. Working memory: the collectives' buffers (a bucket's fp32 reduce-scatter input and its gather buffer) and
``RESERVE`` for the CUDA context, NCCL and the allocator's slack (an assumption: 2 GB).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from zfunc.offloading import accounting
from zfunc.plan.model import ModelSpec
from zfunc.config.plan import Plan
from zfunc.pipelining.schedules import peak_live, virtual_per_rank
from zfunc.plan.strategy import (BUCKET_MB, PREFETCH, elem, microbatches, opt_bytes, offload_overlaps, rank_tokens,
                                  shard_ranks, tiles)

RESERVE = 2e9  # CUDA context, NCCL buffers, allocator slack per GPU (assumption)
CHUNK = 64 << 20  # offload's default chunk_bytes: held grads within it stay in RAM (accounting.held_grads)
STAGING = 3 * CHUNK  # offload: chunk_bytes of reads ahead and twice that of writes in flight


def local_numel(leaves: Sequence[tuple[int, ...]], world: int, rank: int) -> int:
    """Elements rank ``rank`` of ``world`` holds of ``leaves`` split along dim 0 as ``zf.shard`` splits
    them (``chunk = ceil(rows / world)``; 0-d params count as one row)."""
    total = 0
    for shape in leaves:
        rows = shape[0] if shape else 1
        rowsize = math.prod(shape[1:]) if shape else 1
        chunk = -(-rows // world)
        total += max(0, min(chunk, rows - rank * chunk)) * rowsize
    return total


def engine_bytes(leaves: Sequence[tuple[int, ...]], world: int, rank: int, stage: int, *, precision: str = "fp32",
                 accum: int = 1, optimizer_bytes: int = 8, bucket_mb: float = 25.0) -> dict[str, int]:
    """The bytes ``zf.shard(step, Mesh(dp=world), stage).memory(state)`` reports on ``rank`` after a
    step: ``params`` (fp32 masters), ``optimizer``, ``grad_shard``, and, at stages 0-2, the step's
    ``whole_params`` (stage 0: the compute copy, none at fp32, where it computes on the masters) and,
    at stage 1 and at stage 2 when all grads fit one bucket, ``whole_grads``
    (stage 3's gathered peaks depend on the order units run in: ``working_bound`` bounds them).
    Stage 1 with accumulation holds the fp32 sums and, while one is added to, that leaf's new grad:
    exact at fp32, and below when the largest leaf's grad comes last (an embedding's does)."""
    numel = sum(math.prod(s) for s in leaves)
    mine = numel if stage == 0 else local_numel(leaves, world, rank)
    e = 4 if precision == "fp32" else 2
    out = {"params": 4 * mine, "optimizer": optimizer_bytes * mine, "grad_shard": 4 * mine}
    if stage in (1, 2):
        out["whole_params"] = e * numel
    elif stage == 0:
        out["whole_params"] = e * numel if e < 4 else 0
    bucket = _bucket_elems(bucket_mb)
    segment = sum(-(-(s[0] if s else 1) // world) * (math.prod(s[1:]) if s else 1) for s in leaves)
    if stage == 1:  # with accumulation: fp32 sums, and the microbatch's grad being added in
        largest = max((math.prod(s) for s in leaves), default=0)
        out["whole_grads"] = e * numel if accum == 1 else 4 * numel + e * largest
    elif stage == 2 and segment < bucket:  # one bucket: every grad is held until it is reduced
        out["whole_grads"] = e * numel
    return out


def working_bound(unit_numels: Sequence[int], precision: str = "fp32", prefetch: int = 1) -> int:
    """Stage 3's bound on whole-param bytes held at once (``zfunc.sharding.prefetch``): ``(1 + prefetch)``
    times the largest unit, plus one more for a unit whose params a module outside it reads."""
    e = 4 if precision == "fp32" else 2
    largest = sorted(unit_numels, reverse=True)
    return e * (sum(largest[: 2 + prefetch]))


def offload_bytes(leaves: Sequence[tuple[int, ...]], world: int, rank: int, *, optimizer: str,
                  params: str | None, optimizer_bytes: int = 8, precision: str = "fp32", held: bool = False,
                  accum: int = 1) -> dict[str, int]:
    """What ``zf.offload(...).memory(state)`` reports by place between steps: "device" (the compute-dtype
    params it keeps with ``params=None``), "cpu" (host RAM), "nvme" (swap files, logical bytes; the disk
    holds twice that): ``zfunc.offloading.accounting``'s formulas for this rank's pieces. ``held``:
    plus the grads a step holds for the norm (``offload_holds_grads``), where the optimizer is."""
    mine = local_numel(leaves, world, rank)
    where = accounting.totals(accounting.resting(mine, precision=precision, optimizer=optimizer, params=params,
                                                 optimizer_bytes=optimizer_bytes))
    for place, n in accounting.held_grads(mine, precision=precision, optimizer=optimizer, world=world, accum=accum,
                                          held=held, ram_bytes=CHUNK).items():
        where[place] += n
    return where


def offload_holds_grads(s: Plan) -> bool:
    """Whether an offloaded step of plan ``s`` holds its grads until backward ends (a clip, fp16,
    accumulation), rather than updating each unit as its grads arrive."""
    return not offload_overlaps(s)


def zero_paper(psi: float, n: int, stage: int, k: int = 12) -> dict[str, float]:
    """Per-device model-state bytes in the ZeRO paper's accounting (fp16 params and grads, K bytes
    of optimizer state per param): Figure 1's 120 / 31.4 / 16.6 / 1.9 GB for 7.5B params on 64."""
    params = 2 * psi / (n if stage >= 3 else 1)
    grads = 2 * psi / (n if stage >= 2 else 1)
    optimizer = k * psi / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def _bucket_elems(bucket_mb: float) -> int:
    return max(1, int(bucket_mb * 2**18))  # as zf.shard: fp32 MiB of a rank's segment


# ---------------------------------------------------------------------- the plan's view
def partition_params(model: ModelSpec, s: Plan) -> tuple[float, float]:
    """``(P, shared)``: params of the busiest rank's model partition (pipeline stage 0, which owns
    the embeddings, tensor slice 1/tp) and the shared params a pipeline lends its last stage."""
    total = model.total_params
    embed = min(total, model.embedding_params())
    layers = total - embed
    if s.pp == 1:
        return total / s.tp, 0.0
    per_stage = layers * math.ceil(model.layers / s.pp) / model.layers
    return (per_stage + embed) / s.tp, embed / s.tp


def rank_memory(model: ModelSpec, s: Plan, device_kind: str = "cuda") -> dict[str, dict[str, float]]:
    """Bytes on the busiest rank by place ("gpu", "cpu", "nvme") and component."""
    P, _ = partition_params(model, s)
    N, e, k, stage = shard_ranks(s), elem(s), opt_bytes(s), s.zero_stage
    exact = model.leaves is not None and s.pp == 1 and s.tp == 1
    if stage == 0:
        local = P
    elif exact:
        local = local_numel(model.leaves, N, 0)
    else:
        local = math.ceil(P / N)
    unit = min(P, model.largest_unit_params(tiles(s)) / s.tp)
    bucket_whole = min(P, _bucket_elems(BUCKET_MB) * N)
    offloaded = s.offload_optimizer != "none" or s.offload_params != "none"
    eff_stage = 3 if (s.offload_params != "none" and N == 1) else stage
    gpu: dict[str, float] = {}
    cpu: dict[str, float] = {}
    nvme: dict[str, float] = {}
    places = {"none": gpu, "device": gpu, "cpu": cpu, "nvme": nvme}
    if offloaded:
        _offloaded_states(places, s, P, local, unit, bucket_whole, eff_stage, device_kind)
    else:
        gpu["masters"], gpu["optimizer"] = 4 * local, k * local
    if offloaded:
        pass  # every state is placed by _offloaded_states
    elif eff_stage == 0:
        gpu["grad_shard"] = 4 * P
        gpu["compute_params"] = e * P if e < 4 else 0.0
        gpu["whole_grads"] = 0.0
    else:
        gpu["grad_shard"] = 4 * local
        gpu["compute_params"] = e * P if eff_stage < 3 else (1 + PREFETCH) * e * unit
        gpu["whole_grads"] = {1: (e if microbatches(s) == 1 else 4) * P, 2: e * bucket_whole}.get(eff_stage, e * unit)
        gpu["comm_buffers"] = (4 + e) * (bucket_whole if eff_stage < 3 else unit)
    gpu["activations"] = activation_bytes(model, s)
    if s.remat_offload:
        cpu["remat_inputs"] = remat_input_bytes(model, s)
    if device_kind != "cpu":
        gpu["reserve"] = RESERVE
    if offloaded:
        cpu["staging"] = STAGING
    return {"gpu": gpu, "cpu": cpu, "nvme": nvme}


def _offloaded_states(places: dict[str, dict[str, float]], s: Plan, P: float, local: float, unit: float,
                      bucket_whole: float, stage: int, device_kind: str) -> None:
    """An offloaded plan's model states by place (``zfunc.offloading.accounting``, the formulas
    ``step.memory`` reports): masters and optimizer state where they are placed, the device's
    compute-dtype params (whole, stages 0-2; the live units at stage 3), its grad buckets, and the
    grads held for the norm with the optimizer (none when updated on arrival). On a CPU device at fp32
    with the masters in RAM, the masters are the compute params: counted once."""
    N, e = shard_ranks(s), elem(s)
    params = None if s.offload_params == "none" else s.offload_params
    optimizer = "device" if s.offload_optimizer == "none" else s.offload_optimizer
    resting = accounting.resting(local, precision=s.precision, optimizer=optimizer, params=params,
                                 optimizer_bytes=opt_bytes(s))
    for place, kinds in resting.items():
        places[place].update(kinds)
    gpu = places["device"]
    group = bucket_whole if stage < 3 else unit
    alias = device_kind == "cpu" and e == 4 and (params or optimizer) == "cpu"
    if stage < 3:  # one rank computes on its own copy; more gather it whole
        gpu["compute_params"] = (0.0 if alias else e * local) + (e * P if N > 1 else 0.0)
    else:  # the units gathered (from the kept copies with params=None)
        gpu["compute_params"] = gpu.get("compute_params", 0.0) + (1 + PREFETCH) * e * unit
    gpu["whole_grads"] = accounting.GRAD_BUCKETS * e * group
    gpu["comm_buffers"] = (4 + e) * group if N > 1 else 0.0
    held = accounting.held_grads(local, precision=s.precision, optimizer=optimizer, world=N,
                                 accum=microbatches(s), held=not offload_overlaps(s), ram_bytes=CHUNK)
    for place, nbytes in held.items():
        places[place]["held_grads"] = nbytes


def _live_microbatches(s: Plan) -> float:
    """Microbatches whose activations the busiest stage (rank 0) holds at once, as its schedule's
    docstring states (``zfunc.pipelining.schedules.peak_live``), in whole stages' worth: each of an
    interleaved schedule's live chunks is ``1/v`` of the rank's layers."""
    if s.pp == 1:
        return 1
    v = virtual_per_rank(s.pipeline_schedule, s.virtual_stages)
    return peak_live(s.pipeline_schedule, s.pp, microbatches(s), 0, v) / v


def remat_input_bytes(model: ModelSpec, s: Plan, whole_model: bool = False) -> float:
    """The layer inputs ``zf.remat`` keeps for the busiest stage's live microbatches (with
    ``whole_model``: for one microbatch through every layer)."""
    tokens = rank_tokens(s)
    layers = model.layers if whole_model else math.ceil(model.layers / s.pp)
    live = 1 if whole_model else _live_microbatches(s)
    return live * layers * tokens * model.hidden * elem(s) / (s.tp if s.sp else 1)


def activation_bytes(model: ModelSpec, s: Plan) -> float:
    """Activations on the busiest stage's device at its peak: live microbatches x its layers, and
    the logits where the stage computes them; with remat the layer inputs instead (in CPU RAM for
    "offload": two in flight on the GPU) and one layer's full activations while it is recomputed."""
    tokens = rank_tokens(s)
    layers = math.ceil(model.layers / s.pp)
    per_layer = model.activation_bytes_per_layer(tokens, s.seq, s.tp, s.sp, model.fused_attention, elem(s))
    live = _live_microbatches(s)
    logits = model.logits_bytes(tokens, s.tp, elem(s)) if s.pp == 1 else 0.0  # stage 0 is not the last
    if not s.remat:  # (the embeddings' output is the first layer's input, counted there)
        return live * layers * per_layer + logits
    inputs = remat_input_bytes(model, s) if not s.remat_offload else 2 * tokens * model.hidden * elem(s)
    return inputs + per_layer + logits
