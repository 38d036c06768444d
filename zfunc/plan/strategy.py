"""How the estimator reads a ``zf.config.Plan``: parallelism, ZeRO stage, offload, remat, batch and precision.

The estimator takes the plan a run takes (``zf.config.Plan``). ``resolve`` fills ``dp`` from what tp and
pp leave of the cluster's GPUs (when the plan leaves it at 1), ``seq`` from the model's context and
``micro_batch`` with 1, then asks ``zfunc.core.compose``'s rulebook what zfunc does not run (offload
under a pipeline beyond a stage's CPU optimizer, tensor and sequence parallelism, ...): those are
modelled and listed in ``notes`` (``Plan`` itself refuses what is inconsistent). The helpers below read
the plan as the cost model does (``microbatches``: accumulation steps or the pipeline's microbatches;
``tiles``; ``elem``, the compute dtype's bytes). ``from_flags`` builds a plan from ``python -m
zfunc.plan``'s flag names (``zero``, ``remat="full"``, ``accum``, ``clip``, ``tiles``, ``schedule``).
"""
from __future__ import annotations

from dataclasses import replace

from zfunc.config.plan import PIPELINE_SCHEDULES, PLACES, PRECISIONS, Plan
from zfunc.core import compose

SCHEDULES = PIPELINE_SCHEDULES
REMATS = ("none", "full", "offload")
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lion": 4, "sgd": 4, "lamb": 8, "onebit_adam": 8,
                         "zero_one_adam": 12, "onebit_lamb": 12}  # fp32 moments per param
DEFAULT_OPTIMIZER = "adamw"  # a plan with no optimizer (the caller brings one) is estimated with AdamW's state
PREFETCH = 1  # zf.shard's stage-3 prefetch depth
BUCKET_MB = 25.0  # zf.shard's bucket size (fp32 MiB)
NVME_PATH = "<nvme>"  # the swap directory ``from_flags`` names: an estimate reads no files

__all__ = ["PLACES", "PRECISIONS", "SCHEDULES", "REMATS", "OPTIMIZER_STATE_BYTES", "from_flags", "resolve",
           "describe", "elem", "opt_bytes", "microbatches", "tiles", "clipped", "offload_overlaps", "shard_ranks",
           "rank_tokens"]


def from_flags(dp: int | None = None, pp: int = 1, tp: int = 1, sp: bool = False, zero: int = 1,
               offload_optimizer: str = "none", offload_params: str = "none", remat: str | bool = "none",
               micro_batch: int = 1, accum: int = 1, seq: int | None = None, precision: str = "bf16",
               optimizer: str = "adamw", clip: bool = True, tiles: int = 1, schedule: str = "1f1b",
               virtual_stages: int = 1, sp_size: int = 1, sp_kind: str = "ulysses") -> Plan:
    """The ``zf.config.Plan`` of ``python -m zfunc.plan``'s flags: ``zero`` is ``zero_stage``; ``remat`` "none",
    "full" (``zf.remat`` on every layer: only layer inputs kept) or "offload" (those inputs in CPU RAM),
    True/False meaning "full"/"none"; ``accum`` the microbatches per step (the pipeline's microbatches when
    ``pp > 1``); ``clip`` a global-norm clip of 1 (it keeps offload from updating during backward); ``tiles``
    ``zf.tile(k)`` on the largest Linears (1: untiled); ``schedule`` the pipeline's, ``virtual_stages`` per rank
    with "interleaved-1f1b"; ``sp_size``, ``sp_kind``: ``zf.sequence_parallel``'s ranks per sequence and kind
    (``sp`` is Megatron's sequence parallelism, with tp). ``dp=None`` spreads over the cluster's GPUs; "nvme"
    offload gets the placeholder ``NVME_PATH``. Errors name the argument (``zero: ...``)."""
    if isinstance(remat, bool):
        remat = "full" if remat else "none"
    if remat not in REMATS:
        raise ValueError(f"remat: expected one of {REMATS} (or a bool), got {remat!r}")
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
        raise ValueError(f"tiles: expected an int >= 1, got {tiles!r}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer: expected one of {sorted(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}")
    piped = isinstance(pp, int) and pp > 1
    try:
        return Plan(dp=1 if dp is None else dp, pp=pp, tp=tp, sp=sp, zero_stage=zero,
                    offload_optimizer=offload_optimizer, offload_params=offload_params,
                    nvme_path=NVME_PATH if "nvme" in (offload_optimizer, offload_params) else None,
                    remat=remat != "none", remat_offload=remat == "offload", tile_lm_head=0 if tiles == 1 else tiles,
                    microbatches=accum if piped else 1, accum=1 if piped else accum, pipeline_schedule=schedule,
                    virtual_stages=virtual_stages, precision=precision, gradient_clipping=1.0 if clip else 0.0,
                    optimizer=optimizer, micro_batch=micro_batch, seq=seq, sp_size=sp_size, sp_kind=sp_kind)
    except ValueError as e:  # named as the caller named it
        field, sep, why = str(e).partition(": ")
        raise ValueError(f"{FLAG_OF_FIELD.get(field, field)}{sep}{why}") from None


# Plan field -> ``from_flags``'s (and the CLI's) name for it, where they differ
FLAG_OF_FIELD = {"zero_stage": "zero", "tile_lm_head": "tiles", "pipeline_schedule": "schedule",
                 "microbatches": "accum", "remat_offload": "remat", "gradient_clipping": "clip",
                 "virtual_stages": "virtual_stages"}


def resolve(plan: Plan, gpus: int, max_seq: int) -> tuple[Plan, list[str]]:
    """``plan`` with ``dp`` (when 1: what tp, pp and sp_size leave of the ``gpus``), ``seq`` (default
    ``max_seq``) and ``micro_batch`` (default 1) filled in, checked against the GPUs; and notes,
    one per rulebook rule zfunc does not run (modelled here all the same)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a zf.config.Plan, got {type(plan).__name__}")
    other = plan.tp * plan.pp * plan.sp_size
    if gpus % other:
        raise ValueError(f"tp, pp, sp_size: tp * pp * sp_size = {other} does not divide the {gpus} GPUs")
    dp = gpus // other if plan.dp == 1 else plan.dp
    if dp * other != gpus:
        raise ValueError(f"dp, tp, pp, sp_size: dp * tp * pp * sp_size = {dp} * {plan.tp} * {plan.pp} * "
                         f"{plan.sp_size} = {dp * other}, but there are {gpus} GPUs")
    if plan.sp_size > 1 and (plan.seq or max_seq) % (plan.sp_size * (2 if plan.sp_kind == "ring" else 1)):
        raise ValueError(f"seq: {plan.seq or max_seq} tokens do not split over sp_size={plan.sp_size} ranks "
                         f"({plan.sp_kind}: {'2 chunks' if plan.sp_kind == 'ring' else 'a chunk'} each)")
    s = replace(plan, dp=dp, seq=plan.seq or max_seq, micro_batch=plan.micro_batch or 1)
    notes = [f"{refusal} (modelled here; zfunc does not run it yet)"
             for _, refusal in compose.broken(s, compose.UNSUPPORTED)]
    if dp == 1 and s.zero_stage != 0 and s.offload_optimizer == "none" and s.offload_params == "none":
        notes.append("dp=1: ZeRO has no ranks to shard over; the plain step is what runs")
    return s, notes


def describe(s: Plan) -> str:
    """The layout in one line: ``dp=8 pp=1 tp=1 zero=3 offload optimizer=cpu micro_batch=2 accum=1 seq=4096 bf16``."""
    par = f"dp={s.dp} pp={s.pp} tp={s.tp}" + (" sp" if s.sp else "") + \
        (f" sp_size={s.sp_size} {s.sp_kind}" if s.sp_size > 1 else "")
    off = "" if s.offload_optimizer == "none" else f" offload optimizer={s.offload_optimizer}"
    off += "" if s.offload_params == "none" else f" params={s.offload_params}"
    extra = ("" if not s.remat else f" remat={'offload' if s.remat_offload else 'full'}") + \
        ("" if tiles(s) == 1 else f" tiles={tiles(s)}")
    return (f"{par} zero={s.zero_stage}{off}{extra} micro_batch={s.micro_batch} accum={microbatches(s)} "
            f"seq={s.seq} {s.precision}")


def elem(s: Plan) -> int:
    """Bytes of the compute dtype."""
    return 4 if s.precision == "fp32" else 2


def opt_bytes(s: Plan) -> int:
    """Optimizer state bytes per param (AdamW's when the plan names no optimizer)."""
    return OPTIMIZER_STATE_BYTES[s.optimizer or DEFAULT_OPTIMIZER]


def microbatches(s: Plan) -> int:
    """Microbatches per step: the accumulation steps, or the pipeline's microbatches when ``pp > 1``."""
    return s.microbatches if s.pp > 1 else s.accum


def tiles(s: Plan) -> int:
    """Tiles of the largest Linears (``zf.tile``; 1: untiled)."""
    return max(1, s.tile_lm_head)


def clipped(s: Plan) -> bool:
    """Whether the plan clips the global grad norm."""
    return s.gradient_clipping > 0


def offload_overlaps(s: Plan) -> bool:
    """Whether offload updates units during backward (zfunc.offloading.step: no clip, no fp16, accum 1)."""
    return not clipped(s) and s.precision != "fp16" and microbatches(s) == 1 and s.pp == 1


def shard_ranks(s: Plan) -> int:
    """Ranks ZeRO splits the model states over: the ``dp x sp`` ranks (``zf.sequence_parallel``'s ranks hold
    the same params, ``mesh.dp_sp``)."""
    return s.dp * s.sp_size


def rank_tokens(s: Plan) -> int:
    """Tokens of one microbatch a rank computes: ``micro_batch x seq / sp_size``."""
    return s.micro_batch * s.seq // s.sp_size
