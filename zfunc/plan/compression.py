"""Compressed communication in the estimate: the 1-bit optimizers' all-reduce and ZeRO++'s quantized collectives,
in bytes as ``dist.Comm`` counts them (the kinds ``step.memory(state)["comm"]`` reports).

Per call, over ``N`` ranks:
- ``compressed_all_reduce`` (``zfunc.dist.compressed``) of a message of ``n`` elements: ``2 (n' / 8 + 4 N)``
  bytes, ``n'`` = ``n`` rounded up to a multiple of ``8 N`` (signs out and back, a scale per chunk each way);
- ``quantized_reduce_scatter`` / ``quantized_all_gather`` (``zfunc.dist.quantized``) of ``k`` elements per
  rank: ``N (k' bits / 8 + 4 k' / 256)``, ``k'`` = ``k`` rounded up to a block of 256 (payload and a scale
  per block, int8 or int4 for grads, int8 for params).

What they replace, per step and rank:
- a 1-bit optimizer (``onebit_adam``, ``zero_one_adam``, ``onebit_lamb``) at ZeRO stage 0 over ``N > 1``
  ranks, after its warm-up: the fp32 grad all-reduce (``8P``) is gone; 1-bit and 0/1 Adam send one message per
  param tensor (0/1 Adam's frozen phase at one local step per sync, the default's for its first
  ``local_step_scaler`` updates; each doubling of the interval halves it), 1-bit LAMB one message of all
  momenta. Where the model's tensors are not known, one message of ``P``. The warm-up moves AdamW's bytes.
- ``quantized_grads`` (stages 1-3): every fp32 grad reduce-scatter, ``4P`` each, goes in ``quantized_grads``
  bits, one call per bucket of ``strategy.BUCKET_MB``;
- ``quantized_weights`` (stage 3): every param gather, ``2eP`` per microbatch, goes in int8.

**Codec time** (``codec_time``, the step time's "codec" part, not overlapped): the passes compression makes
over memory, at ``hbm_bw x memory_efficiency``: the 1-bit all-reduce ``CODEC_BYTES["onebit"]`` = 32 bytes per
element (4 passes over the fp32 message and its error), a quantized reduce-scatter 12 per element of the
whole grads (quantize, dequantize, sum), a quantized gather 8 per element (quantize this rank's, dequantize
all). Together with each axis's link (``Cluster.links``, ``cost.link_bandwidth``) it says when compression
pays: ``core.compression_speedup`` (the plan's step without compression over the step with it) is above 1
on a slow link and below it on NVLink.
"""
from __future__ import annotations

import math
from dataclasses import replace

from zfunc.config.params import OPTIMIZER_DEFAULTS
from zfunc.config.plan import Plan
from zfunc.plan.cost import engine_comm
from zfunc.plan.memory import partition_params
from zfunc.plan.model import ModelSpec
from zfunc.plan.strategy import BUCKET_MB, elem, microbatches, shard_ranks

ONEBIT = ("onebit_adam", "zero_one_adam", "onebit_lamb")
BLOCK = 256  # zfunc.dist.quantized's values per scale


def onebit_message(numel: int, world: int) -> int:
    """Bytes ``Comm`` counts for one 1-bit compressed all-reduce of ``numel`` elements over ``world`` ranks."""
    if world <= 1:
        return 0
    padded = -(-numel // (8 * world)) * 8 * world
    return 2 * (padded // 8 + 4 * world)


def quantized_call(numel: int, world: int, bits: int) -> int:
    """Bytes ``Comm`` counts for one quantized reduce-scatter / all-gather of ``numel`` elements per rank."""
    if world <= 1:
        return 0
    padded = -(-numel // BLOCK) * BLOCK
    return world * (padded * bits // 8 + 4 * (padded // BLOCK))


def onebit_bytes(numels: list[int], world: int, optimizer: str) -> int:
    """Bytes per step of ``optimizer``'s compressed all-reduce after warm-up, for param tensors of ``numels``."""
    if optimizer not in ONEBIT:
        raise ValueError(f"optimizer: expected one of {ONEBIT}, got {optimizer!r}")
    if optimizer == "onebit_lamb":
        return onebit_message(sum(numels), world)
    return sum(onebit_message(n, world) for n in numels)


def compressed_bytes(model: ModelSpec, s: Plan, fp32: dict[str, float]) -> dict[str, float]:
    """``fp32`` (``cost.comm_bytes``' count of the plan in full precision) with the compressed collectives the
    plan's optimizer and ZeRO++ fields replace it by (module docstring)."""
    out = dict(fp32)
    P, _ = partition_params(model, s)
    N, m = shard_ranks(s), microbatches(s)  # zf.shard splits over the dp x sp ranks
    if N <= 1:
        return out
    if s.optimizer in ONEBIT and s.zero_stage == 0:
        whole = model.leaves is not None and s.pp == 1 and s.tp == 1
        numels = [math.prod(shape) for shape in model.leaves] if whole else [P]
        out["all_reduce"] -= 8 * P
        out["compressed_all_reduce"] = float(onebit_bytes(numels, N, s.optimizer))
    if s.quantized_grads and s.zero_stage in (1, 2, 3):
        reduces = 1 if s.zero_stage == 1 else m
        out["reduce_scatter"] -= 4 * P * reduces
        out["quantized_reduce_scatter"] = float(reduces * _bucketed(P, N, s.quantized_grads))
    if s.quantized_weights and s.zero_stage == 3:
        out["all_gather"] -= 2 * elem(s) * P * m
        out["quantized_all_gather"] = float(2 * m * _bucketed(P, N, 8))
    return out


CODEC_BYTES = {"onebit": 32, "quantized_grads": 12, "quantized_weights": 8}  # bytes touched per element


def codec_time(model: ModelSpec, s: Plan, cluster) -> float:
    """Seconds per step the plan's compression spends quantizing and packing (module docstring)."""
    P, _ = partition_params(model, s)
    N, m = shard_ranks(s), microbatches(s)
    if N <= 1:
        return 0.0
    touched = 0.0
    if s.optimizer in ONEBIT and s.zero_stage == 0:
        touched += CODEC_BYTES["onebit"] * P
    if s.quantized_grads and s.zero_stage in (1, 2, 3):
        touched += CODEC_BYTES["quantized_grads"] * P * (1 if s.zero_stage == 1 else m)
    if s.quantized_weights and s.zero_stage == 3:
        touched += CODEC_BYTES["quantized_weights"] * P * 2 * m
    return touched / (cluster.device.hbm_bw * cluster.device.memory_efficiency)


def uncompressed(s: Plan) -> Plan:
    """``s`` without its compression: a 1-bit optimizer's full-precision counterpart (Adam, LAMB), no ZeRO++."""
    plain = {"onebit_adam": "adam", "zero_one_adam": "adam", "onebit_lamb": "lamb"}.get(s.optimizer, s.optimizer)
    params = s.optimizer_params
    if plain != s.optimizer:  # the counterpart's own params: the 1-bit schedule's are not its
        params = {k: v for k, v in params.items() if k in OPTIMIZER_DEFAULTS[plain]}
    return replace(s, optimizer=plain, optimizer_params=params, quantized_weights=False, quantized_grads=0)


REPLACED = {"all_reduce": "compressed_all_reduce", "reduce_scatter": "quantized_reduce_scatter",
            "all_gather": "quantized_all_gather"}


def wire(model: ModelSpec, s: Plan, kind: str, nbytes: float) -> tuple[str, float]:
    """The collective a data-parallel fp32 ``kind`` of ``nbytes`` (the step-time model's) becomes under the
    plan's compression, and its bytes: scaled as ``compressed_bytes`` scales the step's ``kind`` in all
    (``kind`` and ``nbytes`` unchanged where nothing is compressed)."""
    if kind not in REPLACED:
        return kind, nbytes
    P, _ = partition_params(model, s)
    m, e = microbatches(s), elem(s)
    fp32 = {"all_reduce": 8 * P, "all_gather": 2 * e * P * m,
            "reduce_scatter": 4 * P * (1 if s.zero_stage == 1 else m)}
    squeezed = compressed_bytes(model, s, {k: float(v) for k, v in fp32.items()}).get(REPLACED[kind])
    if squeezed is None or not fp32[kind]:
        return kind, nbytes
    return REPLACED[kind], nbytes * squeezed / fp32[kind]


def _bucketed(P: int, N: int, bits: int) -> int:
    calls = max(1, math.ceil(4 * P / (BUCKET_MB * 2 ** 20)))
    return calls * quantized_call(math.ceil(P / N / calls), N, bits)


def engine_compressed_comm(leaves, world: int, stage: int, *, optimizer: str | None = None, quantized_grads: int = 0,
                           precision: str = "fp32", accum: int = 1, clip: bool = True) -> dict[str, int]:
    """The bytes ``step.memory(state)["comm"]`` reports for one step of ``zf.shard(step, Mesh(dp=world), stage,
    quantize_grads=quantized_grads)`` with a 1-bit ``optimizer`` after its warm-up (stage 0) or ZeRO++'s
    quantized grads (stages 1-2), for a model whose params are ``leaves`` (shapes) and whose grads are
    reduce-scattered in one bucket (a model under ``zf.shard``'s bucket size): stage 0 all-reduces only the loss
    (the grads stay local and the clip's norm is each rank's own); stages 1-2 as ``cost.engine_comm``, the
    reduce-scatter quantized (one call per reduce of each rank's padded segment)."""
    numels = [math.prod(shape) if shape else 1 for shape in leaves]
    if stage == 0:
        if optimizer not in ONEBIT:
            raise ValueError(f"optimizer: stage 0 compresses only with a 1-bit optimizer {ONEBIT}, got {optimizer!r}")
        return {"compressed_all_reduce": onebit_bytes(numels, world, optimizer), "all_reduce": 2 * 4}
    if stage not in (1, 2):
        raise ValueError(f"stage: engine_compressed_comm knows stages 0-2, got {stage!r}")
    out = engine_comm(leaves, world, stage, precision=precision, accum=accum, clip=clip)
    if quantized_grads:
        reduces = 1 if stage == 1 else accum
        wire = 4 if precision == "fp32" or (stage == 1 and accum > 1) else 2  # engine_comm's bytes per grad
        per_rank = out.pop("reduce_scatter") // (wire * reduces * world)
        out["quantized_reduce_scatter"] = reduces * quantized_call(per_rank, world, quantized_grads)
    return out
