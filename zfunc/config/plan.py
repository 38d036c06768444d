"""``Plan``: how to train, as checked plain data (``zf.config.Plan``).

A ``Plan`` says how to train and nothing else: data/pipeline/tensor parallel sizes, ZeRO stage,
offload, remat, tiling, pipeline schedule, precision and fp16 loss scaling, accumulation, clipping,
optimizer, scheduler, batch sizes and sequence length. It is a frozen dataclass of JSON types,
checked field by field when made (``json.dumps(dataclasses.asdict(plan))`` writes it, ``Plan(**d)``
reads it back), its combinations by ``zfunc.core.compose``'s rulebook (what contradicts is refused
here; ``zf.config.check`` also refuses what zfunc does not run); optimizer and scheduler params are
completed with DeepSpeed's defaults (``zfunc.config.params``). ``selector(plan.units)``
resolves its units string to a ``zf.units`` selector; ``optimizer(plan)`` (``zfunc.config.optimizers``)
builds the ``zf.optim`` transformation it names, on ``schedule(plan)``, DeepSpeed's schedulers
(``zfunc.config.schedules``).

DeepSpeed configs: ``zf.config.from_deepspeed(path_or_dict, world_size=N, **auto)`` reads one into a
Plan and ``zf.config.IgnoredKeysWarning`` names the keys it ignored (``zfunc.config.deepspeed``: the key
mapping, "auto" values and refusals are in its docstring).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zfunc.config.checks import _check_bool, _check_choice, _check_int, _check_number
from zfunc.config.params import _optimizer_params, _scheduler_params
from zfunc.core import compose
from zfunc.model import units as units_mod

PLACES = ("none", "cpu", "nvme")
PRECISIONS = ("fp32", "bf16", "fp16")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv")  # zfunc.pipelining.schedules
SP_KINDS = ("ulysses", "ring")


@dataclass(frozen=True)
class Plan:
    """How to train, as plain data; the defaults are a plain single-process fp32 run.

    Fields (checked in ``__post_init__``; errors name the field, the value and what was expected):
      dp, pp: data-parallel and pipeline-parallel sizes (ranks = dp * pp).
      tp, sp: tensor-parallel size and sequence parallelism (which needs tp > 1): ``zf.config.prepare``
        slices the model (``zf.tensor_parallel``, its plan found from the module graph) and
        ``zf.parallelize`` steps it (``zf.tensor_parallel.step``, under ``zf.shard`` over dp); the
        rulebook refuses what tp does not run yet (with pp, offload, a tiled head; sp under ZeRO).
      sp_size, sp_kind: ranks each sequence is cut over (``zf.sequence_parallel``: ranks = dp * pp * sp_size
        * tp, every rank of a sequence group given the same batch) and how attention sees the whole sequence,
        "ulysses" (with tp > 1: sp_size divides each tp rank's heads / tp) or "ring"; DeepSpeed's
        ``sequence_parallel_size``.
      tile_mlp: token tiles each unit's ``mlp`` runs over (``zf.tiling.tile_tokens``), 0 = untiled.
      zero_stage: 0 (none) to 3; a pipeline (pp > 1) composes with stage 0 or 1.
      quantized_weights, quantized_grads: ZeRO++ (``zf.shard(quantize_weights=, quantize_grads=)``):
        stage 3's int8 param gathers; the grad reduce-scatter in 4 or 8 bits (0: fp32), stages 1-3.
      hpz_partition: ZeRO++'s hpZ (``zf.shard(hpz=)``), stage 3: ranks per group holding the secondary
        param copy, dividing dp; 1: off.
      units: how params group into units (ZeRO-3 gathers, offload fetches, remat, pipeline
        stages): None (the transformation's default), "auto", "auto:<max params>",
        "class:<Name>[,<Name>...]" or "names:<module>[,<module>...]"; ``selector`` resolves it.
      offload_optimizer, offload_params: "none", "cpu" or "nvme" (params: stage 3, or stage 0 on one rank).
      nvme_path: the swap directory, exactly when something goes to "nvme".
      remat, remat_offload: activation checkpointing per unit, its saved inputs in CPU RAM.
      tile_lm_head: tiles of the LM head (``zf.tile``), 0 = untiled.
      microbatches, pipeline_schedule: pipeline microbatches (1 without a pipeline), one of
        ``PIPELINE_SCHEDULES``; virtual_stages: per rank, > 1 only with "interleaved-1f1b".
      precision: "fp32", "bf16" or "fp16". DeepSpeed's fp16 loss scale starts at
        ``2**initial_scale_power``, doubles after ``loss_scale_window`` finite steps and halves
        after ``hysteresis`` overflows (``consecutive_hysteresis``: refilled by a finite step), never
        below ``min_loss_scale``: ``zf.precision.deepspeed_loss_scale`` builds that ``LossScale``.
      accum: gradient accumulation steps (1 with a pipeline, which splits batches itself).
      gradient_clipping: max global grad norm, 0 = off.
      optimizer, optimizer_params: "adamw", "adam", "sgd", "lion" or None (the caller brings its
        own); params by DeepSpeed/torch names, completed with DeepSpeed's defaults.
      scheduler, scheduler_params: None (constant lr) or a DeepSpeed scheduler name, its params
        completed with DeepSpeed's defaults.
      micro_batch, global_batch: samples per rank per forward, and per update over all ranks
        (``global = micro * accum * microbatches * dp`` when both are given); None = not stated.
      seq: tokens per sample (the estimator's activations and FLOPs); None = the model's context.
      ignored: DeepSpeed keys read and ignored (provenance only, not compared).
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    sp: bool = False
    zero_stage: int = 0
    quantized_weights: bool = False
    quantized_grads: int = 0
    hpz_partition: int = 1
    units: str | None = None
    offload_optimizer: str = "none"
    offload_params: str = "none"
    nvme_path: str | None = None
    remat: bool = False
    remat_offload: bool = False
    tile_lm_head: int = 0
    sp_size: int = 1
    sp_kind: str = "ulysses"
    tile_mlp: int = 0
    microbatches: int = 1
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    precision: str = "fp32"
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    accum: int = 1
    gradient_clipping: float = 0.0
    optimizer: str | None = "adamw"
    optimizer_params: dict = field(default_factory=dict)
    scheduler: str | None = None
    scheduler_params: dict = field(default_factory=dict)
    micro_batch: int | None = None
    global_batch: int | None = None
    seq: int | None = None
    ignored: tuple = field(default=(), compare=False)

    def __post_init__(self) -> None:
        _check_layout(self)
        _check_precision(self)
        _check_training(self)
        refusal = compose.check_plan(self, compose.INCONSISTENT)  # the rulebook's: settings that contradict
        if refusal is not None:
            raise ValueError(refusal)
        _check_batch(self)
        if not isinstance(self.ignored, (list, tuple)) or not all(isinstance(k, str) for k in self.ignored):
            raise ValueError(f"ignored: expected a list of key paths, got {self.ignored!r}")
        object.__setattr__(self, "ignored", tuple(self.ignored))


def _check_layout(p: Plan) -> None:
    for name in ("dp", "pp", "tp", "microbatches"):
        _check_int(name, getattr(p, name), 1)
    _check_bool("sp", p.sp)
    _check_int("tile_lm_head", p.tile_lm_head, 0)
    _check_int("sp_size", p.sp_size, 1)
    _check_choice("sp_kind", p.sp_kind, SP_KINDS)
    _check_int("tile_mlp", p.tile_mlp, 0)
    _check_choice("zero_stage", p.zero_stage, (0, 1, 2, 3))
    _check_choice("offload_optimizer", p.offload_optimizer, PLACES)
    _check_choice("offload_params", p.offload_params, PLACES)
    _check_choice("pipeline_schedule", p.pipeline_schedule, PIPELINE_SCHEDULES)
    _check_int("virtual_stages", p.virtual_stages, 1)
    if p.virtual_stages > 1 and p.pipeline_schedule != "interleaved-1f1b":
        raise ValueError(f"virtual_stages: more than one virtual stage per rank needs pipeline_schedule "
                         f"'interleaved-1f1b', got {p.virtual_stages} with {p.pipeline_schedule!r}")
    _check_bool("remat", p.remat)
    _check_bool("quantized_weights", p.quantized_weights)
    _check_choice("quantized_grads", p.quantized_grads, (0, 4, 8))
    if p.quantized_weights and p.zero_stage != 3:
        raise ValueError(f"quantized_weights: ZeRO++'s int8 param gathers are stage 3's; expected zero_stage=3, "
                         f"got {p.zero_stage}")
    if p.quantized_grads and p.zero_stage == 0:
        raise ValueError("quantized_grads: ZeRO++ quantizes the grad reduce-scatter of stages 1-3; expected "
                         "zero_stage >= 1, got 0")
    _check_int("hpz_partition", p.hpz_partition, 1)
    if p.hpz_partition > 1 and (p.zero_stage != 3 or p.dp % p.hpz_partition):
        raise ValueError(f"hpz_partition: hpZ's groups serve stage 3 and divide the {p.dp} data-parallel ranks; "
                         f"expected zero_stage=3 and a divisor of dp, got {p.hpz_partition} at stage {p.zero_stage}")
    _check_bool("remat_offload", p.remat_offload)
    if p.units is not None:
        selector(p.units)  # checks the syntax
    uses_nvme = "nvme" in (p.offload_optimizer, p.offload_params)
    if uses_nvme and not (isinstance(p.nvme_path, str) and p.nvme_path):
        raise ValueError(f"nvme_path: 'nvme' offload needs a directory for its swap files, got {p.nvme_path!r}")
    if not uses_nvme and p.nvme_path is not None:
        raise ValueError(f"nvme_path: only 'nvme' offload uses it (offload_optimizer={p.offload_optimizer!r}, "
                         f"offload_params={p.offload_params!r}), got {p.nvme_path!r}")
    if p.remat_offload and not p.remat:
        raise ValueError("remat_offload: offloads what remat keeps, so it needs remat=True, got remat=False")


def _check_precision(p: Plan) -> None:
    _check_choice("precision", p.precision, PRECISIONS)
    _check_int("initial_scale_power", p.initial_scale_power, 0)
    if p.initial_scale_power > 127:  # 2**128 is inf in fp32
        raise ValueError(f"initial_scale_power: expected an int in [0, 127], got {p.initial_scale_power}")
    _check_int("loss_scale_window", p.loss_scale_window, 1)
    _check_int("hysteresis", p.hysteresis, 1)
    _check_bool("consecutive_hysteresis", p.consecutive_hysteresis)
    _check_number("min_loss_scale", p.min_loss_scale)
    if p.min_loss_scale <= 0:
        raise ValueError(f"min_loss_scale: expected a number > 0, got {p.min_loss_scale!r}")


def _check_training(p: Plan) -> None:
    _check_int("accum", p.accum, 1)
    _check_number("gradient_clipping", p.gradient_clipping)
    if p.optimizer is not None:
        object.__setattr__(p, "optimizer_params", _optimizer_params(p.optimizer, p.optimizer_params))
    elif p.optimizer_params:
        raise ValueError(f"optimizer_params: the plan names no optimizer, got {p.optimizer_params!r}")
    if p.scheduler is not None:
        params = _scheduler_params(p.scheduler, p.scheduler_params)
        needs_lr = p.scheduler == "WarmupCosineLR" or (p.scheduler == "WarmupLR" and params["warmup_max_lr"] is None)
        if needs_lr and p.optimizer is None:
            raise ValueError(f"scheduler: {p.scheduler} takes its peak from the optimizer's lr, and the plan names no "
                             "optimizer (give one, or WarmupLR's warmup_max_lr)")
        if p.scheduler == "WarmupLR" and params["warmup_max_lr"] is None:
            params["warmup_max_lr"] = p.optimizer_params["lr"]
        object.__setattr__(p, "scheduler_params", params)
    elif p.scheduler_params:
        raise ValueError(f"scheduler_params: the plan names no scheduler, got {p.scheduler_params!r}")
    for name in ("micro_batch", "global_batch", "seq"):
        if getattr(p, name) is not None:
            _check_int(name, getattr(p, name), 1)


def _check_batch(p: Plan) -> None:
    if p.micro_batch is not None and p.global_batch is not None:
        expected = p.micro_batch * p.accum * p.microbatches * p.dp
        if p.global_batch != expected:
            raise ValueError(f"global_batch: expected micro_batch * accum * microbatches * dp = {p.micro_batch} * "
                             f"{p.accum} * {p.microbatches} * {p.dp} = {expected}, got {p.global_batch}")


def selector(units: str) -> units_mod.Selector:
    """The ``zf.units`` selector a Plan's ``units`` string names ("class:" names are looked up
    among the model's module classes when the selector runs)."""
    kind, sep, arg = units.partition(":") if isinstance(units, str) else ("", "", "")
    names = [n.strip() for n in arg.split(",")] if sep else []
    if kind == "auto" and not sep:
        return units_mod.auto()
    if kind == "auto" and arg.isdigit() and int(arg) > 0:
        return units_mod.auto(int(arg))
    if kind == "names" and names and all(names):
        return units_mod.by_names(names)
    if kind == "class" and names and all(names):
        def select(model):
            classes = {type(m).__name__: type(m) for m in model.modules()}
            missing = [n for n in names if n not in classes]
            if missing:
                raise ValueError(f"units: the model has no module class named {missing}; it has {sorted(classes)}")
            return units_mod.by_class(*(classes[n] for n in names))(model)

        return select
    raise ValueError(f"units: expected None, 'auto', 'auto:<max params>', 'class:<Name>[,...]' or "
                     f"'names:<module>[,...]', got {units!r}")
