"""``Plan``: how to train, as checked plain data (``zf.config.Plan``).

A ``Plan`` says how to train and nothing else: data/pipeline/tensor parallel sizes, ZeRO stage,
offload, remat, tiling, pipeline schedule, precision and fp16 loss scaling, accumulation, clipping,
optimizer, scheduler, batch sizes and sequence length. It is a frozen dataclass of JSON types,
checked field by field when made (``json.dumps(dataclasses.asdict(plan))`` writes it, ``Plan(**d)``
reads it back), its combinations by ``zfunc.core.compose``'s rulebook (what contradicts is refused
here; ``zf.config.check`` also refuses what zfunc does not run); optimizer and scheduler params are
completed with DeepSpeed's defaults. ``selector(plan.units)``
resolves its units string to a ``zf.units`` selector; ``optimizer(plan)`` builds the ``zf.optim``
transformation it names, on ``schedule(plan)``.

Schedules are DeepSpeed's formulas at DeepSpeed's step: the scheduler is made at iteration -1 and
stepped after each applied update, so update ``n`` (zfunc's ``count = n``) uses DeepSpeed's
iteration ``n - 1`` (WarmupLR/WarmupDecayLR: ``warmup_min_lr``; WarmupCosineLR: 0). Warmup lengths
below 2 count as 2, as there. An unknown ``warmup_type`` is refused (DeepSpeed warns and uses
"log"). zf.optim's ``linear_warmup``/``warmup_cosine`` count differently, hence the schedules here
(``warmup_lr``, ``warmup_decay_lr``, ``warmup_cosine_lr``).

DeepSpeed configs: ``zf.config.from_deepspeed(path_or_dict, world_size=N, **auto)`` reads one into a
Plan and ``zf.config.IgnoredKeysWarning`` names the keys it ignored (``zfunc.config.deepspeed``: the key
mapping, "auto" values and refusals are in its docstring).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zfunc import optim
from zfunc.core import compose
from zfunc.model import units as units_mod

PLACES = ("none", "cpu", "nvme")
PRECISIONS = ("fp32", "bf16", "fp16")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv")  # zfunc.pipelining.schedules
SP_KINDS = ("ulysses", "ring")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
WARMUP_TYPES = ("log", "linear")

# Optimizer params a Plan holds, with the defaults DeepSpeed's optimizers (and torch's SGD) use.
OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
    "adam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    "lion": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0},
    "lamb": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
             "max_coeff": 10.0, "min_coeff": 0.01},
    "onebit_adam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "freeze_step": 100000},
    "zero_one_adam": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "var_freeze_step": 100000,
                      "var_update_scaler": 16, "local_step_scaler": 32678, "local_step_clipper": 16},
    "onebit_lamb": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "freeze_step": 100000,
                    "max_coeff": 10.0, "min_coeff": 0.01, "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5,
                    "factor_threshold": 0.1},
}
# Scheduler params with DeepSpeed's defaults (lr_schedules.py). None: WarmupLR's max is the
# optimizer's lr; total_num_steps may wait for ``optimizer(plan, total_steps)``.
SCHEDULER_DEFAULTS: dict[str, dict[str, Any]] = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
}


# ----------------------------------------------------------------------------- value checks


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


def _check_number(name: str, value: Any, minimum: float = 0.0, below: float | None = None) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (below is not None and value >= below):
        bound = f" and < {below}" if below is not None else ""
        raise ValueError(f"{name}: expected a number >= {minimum}{bound}, got {value!r}")
    return float(value)


def _check_positive(name: str, value: Any) -> float:
    _check_number(name, value)
    if value <= 0:
        raise ValueError(f"{name}: expected a number > 0, got {value!r}")
    return float(value)


def _check_fraction(name: str, value: Any) -> float:
    _check_number(name, value)
    if value > 1:
        raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
    return float(value)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected true or false, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def _check_betas(name: str, value: Any) -> list[float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{name}: expected two numbers [b1, b2], got {value!r}")
    for i, b in enumerate(value):
        _check_number(f"{name}[{i}]", b, 0.0, 1.0)
    return [float(b) for b in value]


_PARAM_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "lr": _check_number, "eps": _check_positive, "weight_decay": _check_number, "betas": _check_betas,
    "momentum": lambda n, v: _check_number(n, v, 0.0, 1.0), "dampening": lambda n, v: _check_number(n, v, 0.0, 1.0),
    "nesterov": _check_bool, "bias_correction": _check_bool, "max_coeff": _check_positive,
    "min_coeff": _check_positive, "freeze_step": lambda n, v: _check_int(n, v, 0),
    "var_freeze_step": lambda n, v: _check_int(n, v, 0), "var_update_scaler": lambda n, v: _check_int(n, v, 1),
    "local_step_scaler": lambda n, v: _check_int(n, v, 1), "local_step_clipper": lambda n, v: _check_int(n, v, 1),
    "coeff_beta": lambda n, v: _check_number(n, v, 0.0, 1.0), "factor_max": _check_positive,
    "factor_min": _check_positive, "factor_threshold": _check_number,
    "warmup_min_lr": _check_number, "warmup_max_lr": _check_number, "warmup_min_ratio": _check_fraction,
    "cos_min_ratio": _check_fraction, "warmup_num_steps": lambda n, v: _check_int(n, v, 1),
    "total_num_steps": lambda n, v: _check_int(n, v, 1), "warmup_type": lambda n, v: _check_choice(n, v, WARMUP_TYPES),
}


def _complete(given: Mapping[str, Any], defaults: dict[str, Any], where: str, what: str) -> dict[str, Any]:
    """``defaults`` updated by ``given``, every key known and every value checked (None: unset)."""
    if not isinstance(given, Mapping):
        raise ValueError(f"{where}: expected a dict of params, got {given!r}")
    for key in given:
        if key not in defaults:
            raise ValueError(f"{where}.{key}: {what} takes {sorted(defaults)}, got {key!r} = {given[key]!r}")
    out = {**defaults, **given}
    for key, value in out.items():
        if value is not None:
            checked = _PARAM_CHECKS[key](f"{where}.{key}", value)
            out[key] = checked if checked is not None else value
    return out


def _optimizer_params(kind: str, given: Mapping[str, Any], where: str = "optimizer_params") -> dict[str, Any]:
    """``given`` params of zfunc optimizer ``kind`` completed with DeepSpeed's defaults, checked."""
    _check_choice("optimizer", kind, tuple(OPTIMIZER_DEFAULTS))
    out = _complete(given, OPTIMIZER_DEFAULTS[kind], where, kind)
    if out.get("nesterov") and (out["momentum"] <= 0 or out["dampening"] != 0):
        raise ValueError(f"{where}.nesterov: needs momentum > 0 and dampening == 0, got momentum="
                         f"{out['momentum']!r}, dampening={out['dampening']!r}")
    return out


def _scheduler_params(kind: str, given: Mapping[str, Any], where: str = "scheduler_params") -> dict[str, Any]:
    """``given`` params of DeepSpeed scheduler ``kind`` completed with DeepSpeed's defaults, checked."""
    _check_choice("scheduler", kind, SCHEDULERS)
    return _complete(given, SCHEDULER_DEFAULTS[kind], where, kind)


# ----------------------------------------------------------------------------- the plan


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


# ----------------------------------------------------------------------------- schedules


def _warmup_fraction(it: int, steps: int, warmup_type: str) -> float:
    """DeepSpeed's warmup gamma at iteration ``0 <= it < steps``."""
    return math.log(it + 1) / math.log(steps) if warmup_type == "log" else it / steps


def warmup_lr(warmup_min_lr: float, warmup_max_lr: float, warmup_num_steps: int = 1000,
              warmup_type: str = "log") -> optim.Schedule:
    """DeepSpeed's WarmupLR as a zf.optim schedule: at iteration ``it = count - 1`` (DeepSpeed
    steps its scheduler after each update; ``it < 0`` gives ``min``), ``min + (max - min) * g`` with
    ``g = log(it + 1) / log(W)`` ("log") or ``it / W`` ("linear") while ``it < W = max(2, steps)``, then 1."""
    _check_choice("warmup_type", warmup_type, WARMUP_TYPES)
    _check_int("warmup_num_steps", warmup_num_steps, 1)
    steps = max(2, warmup_num_steps)

    def schedule(count: int) -> float:
        it = count - 1
        if it < 0:
            return warmup_min_lr
        gamma = _warmup_fraction(it, steps, warmup_type) if it < steps else 1.0
        return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma

    return schedule


def warmup_decay_lr(total_num_steps: int, warmup_min_lr: float, warmup_max_lr: float, warmup_num_steps: int = 1000,
                    warmup_type: str = "log") -> optim.Schedule:
    """DeepSpeed's WarmupDecayLR: ``warmup_lr``, then ``g = max(0, (T - it) / max(1, T - W))``
    (linear from max at the end of warmup to ``min`` at ``it = T = total_num_steps``)."""
    _check_int("total_num_steps", total_num_steps, 1)
    warmup = warmup_lr(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
    steps = max(2, warmup_num_steps)

    def schedule(count: int) -> float:
        it = count - 1
        if it < steps:
            return warmup(count)
        gamma = max(0.0, (total_num_steps - it) / max(1.0, total_num_steps - steps))
        return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma

    return schedule


def warmup_cosine_lr(lr: float, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                     cos_min_ratio: float = 0.0001, warmup_type: str = "log") -> optim.Schedule:
    """DeepSpeed's WarmupCosineLR: ``lr * ratio``; ``ratio`` rises from ``warmup_min_ratio`` to 1
    like ``warmup_lr``'s gamma, then ``cos_min + (1 - cos_min) (1 + cos(pi p)) / 2`` with
    ``p = min(1, (it - W + 1) / max(1, T - W))``; 0 before the first scheduler step (``it < 0``)."""
    _check_int("total_num_steps", total_num_steps, 1)
    _check_choice("warmup_type", warmup_type, WARMUP_TYPES)
    _check_int("warmup_num_steps", warmup_num_steps, 1)
    steps = max(2, warmup_num_steps)

    def schedule(count: int) -> float:
        it = count - 1
        if it < 0:
            return 0.0
        if it < steps:
            ratio = warmup_min_ratio + _warmup_fraction(it, steps, warmup_type) * (1.0 - warmup_min_ratio)
        else:
            progress = min(1.0, (it - steps + 1) / max(1, total_num_steps - steps))
            ratio = max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)
        return lr * ratio

    return schedule


def schedule(plan: Plan, total_steps: int | None = None) -> optim.Schedule:
    """The learning rate of ``plan`` as a zf.optim schedule ``count -> lr``.

    ``total_steps`` supplies ``total_num_steps`` when the plan's scheduler leaves it unset; both
    given must agree.
    """
    if plan.scheduler is None:
        if plan.optimizer is None:
            raise ValueError("plan.optimizer: the plan names no optimizer, so it has no learning rate")
        return optim.constant_schedule(plan.optimizer_params["lr"])
    params = dict(plan.scheduler_params)
    if "total_num_steps" in params:
        params["total_num_steps"] = _total_steps(plan, params["total_num_steps"], total_steps)
    kind = plan.scheduler
    if kind == "WarmupLR":
        return warmup_lr(**params)
    if kind == "WarmupDecayLR":
        return warmup_decay_lr(**params)
    return warmup_cosine_lr(plan.optimizer_params["lr"], **params)


def _total_steps(plan: Plan, planned: int | None, given: int | None) -> int:
    if given is not None:
        _check_int("total_steps", given, 1)
    if planned is not None and given is not None and planned != given:
        raise ValueError(f"total_steps: the plan's {plan.scheduler} has total_num_steps={planned}, got {given}")
    if planned is None and given is None:
        raise ValueError(f"total_steps: {plan.scheduler} needs the number of updates; the plan leaves "
                         "total_num_steps unset, so pass total_steps")
    return planned if planned is not None else given


def optimizer(plan: Plan, total_steps: int | None = None, *, mask: optim.MaskOrFn = None,
              backend: str = "auto", comm: Any = None) -> optim.GradientTransformation:
    """The zf.optim transformation ``plan`` names: ``chain(clip_by_global_norm(c), opt(schedule))``
    (no clip when ``gradient_clipping`` is 0). ``mask``/``backend`` go to the optimizer as in zf.optim;
    ``comm`` (the dp ranks' ``mesh.comm``) to a 1-bit optimizer's compressed all-reduce.

    DeepSpeed clips exactly so (``max_norm / (norm + 1e-6)`` when below 1) before its optimizer.
    """
    if plan.optimizer is None:
        raise ValueError("plan.optimizer: the plan names no optimizer (the DeepSpeed config had none: bring your own)")
    lr, p = schedule(plan, total_steps), plan.optimizer_params
    if plan.optimizer in ("adamw", "adam"):
        make = optim.adamw if plan.optimizer == "adamw" else optim.adam
        opt = make(lr, b1=p["betas"][0], b2=p["betas"][1], eps=p["eps"], weight_decay=p["weight_decay"], mask=mask,
                   backend=backend)
    elif plan.optimizer == "sgd":
        opt = optim.sgd(lr, momentum=p["momentum"], dampening=p["dampening"], nesterov=p["nesterov"],
                        weight_decay=p["weight_decay"], mask=mask, backend=backend)
    elif plan.optimizer == "onebit_adam":
        opt = optim.onebit_adam(lr, b1=p["betas"][0], b2=p["betas"][1], eps=p["eps"], weight_decay=p["weight_decay"],
                                freeze_step=p["freeze_step"], mask=mask, comm=comm)
    elif plan.optimizer == "zero_one_adam":
        opt = optim.zero_one_adam(lr, b1=p["betas"][0], b2=p["betas"][1], eps=p["eps"], weight_decay=p["weight_decay"],
                                  var_freeze_step=p["var_freeze_step"], var_update_scaler=p["var_update_scaler"],
                                  local_step_scaler=p["local_step_scaler"],
                                  local_step_clipper=p["local_step_clipper"], mask=mask, comm=comm)
    elif plan.optimizer == "onebit_lamb":
        opt = optim.onebit_lamb(lr, b1=p["betas"][0], b2=p["betas"][1], eps=p["eps"], weight_decay=p["weight_decay"],
                                freeze_step=p["freeze_step"], max_coeff=p["max_coeff"], min_coeff=p["min_coeff"],
                                coeff_beta=p["coeff_beta"], factor_max=p["factor_max"], factor_min=p["factor_min"],
                                factor_threshold=p["factor_threshold"], mask=mask, comm=comm)
    elif plan.optimizer == "lamb":
        opt = optim.lamb(lr, b1=p["betas"][0], b2=p["betas"][1], eps=p["eps"], weight_decay=p["weight_decay"],
                         bias_correction=p["bias_correction"], max_coeff=p["max_coeff"], min_coeff=p["min_coeff"],
                         mask=mask)
    else:
        opt = optim.lion(lr, b1=p["betas"][0], b2=p["betas"][1], weight_decay=p["weight_decay"], mask=mask,
                         backend=backend)
    if plan.gradient_clipping > 0:
        return optim.chain(optim.clip_by_global_norm(plan.gradient_clipping), opt)
    return opt
