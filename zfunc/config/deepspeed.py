"""zf.config.from_deepspeed: a DeepSpeed JSON config (Hugging Face's among them) read into a Plan.

``from_deepspeed(path_or_dict, world_size=N, **auto)`` returns the ``zf.config.Plan`` the config
asks for, by DeepSpeed's rules; keys with no meaning here are named in one ``IgnoredKeysWarning``,
anything zfunc lacks is refused by key path. Both names are also ``zf.config``'s.

DeepSpeed key -> Plan field (key paths as in DeepSpeed's "Configuration JSON" reference):

| DeepSpeed key                                                   | Plan field                  |
|-----------------------------------------------------------------|-----------------------------|
| ``world_size=`` argument (DeepSpeed's data-parallel world size)  | ``dp``                      |
| ``train_batch_size``                                            | ``global_batch``            |
| ``train_micro_batch_size_per_gpu``                              | ``micro_batch``             |
| ``gradient_accumulation_steps``                                 | ``accum``                   |
| ``gradient_clipping`` (absent: 1.0 as DeepSpeed >= 0.19.3)       | ``gradient_clipping``       |
| ``zero_optimization.stage`` (legacy ``true``/``false``: 1/0)     | ``zero_stage``              |
| ``zero_optimization.zero_quantized_weights`` (ZeRO++ qwZ)       | ``quantized_weights``       |
| ``zero_optimization.zero_quantized_gradients`` (qgZ, int4)      | ``quantized_grads`` (4)     |
| ``zero_optimization.zero_hpz_partition_size`` (hpZ; 0/1: off)    | ``hpz_partition``           |
| ``zero_optimization.offload_optimizer.device`` (stage 1-3)      | ``offload_optimizer``       |
| ``zero_optimization.offload_param.device`` (stage 3)            | ``offload_params``          |
| ``zero_optimization.offload_{optimizer,param}.nvme_path``       | ``nvme_path`` (one for both)|
| ``zero_optimization.cpu_offload`` / ``cpu_offload_param`` (old) | the offloads, "cpu"         |
| ``fp16.enabled`` / ``bf16.enabled`` (old name ``bfloat16``)     | ``precision``               |
| ``fp16.initial_scale_power``, ``.loss_scale_window``,           | the same names              |
| ``.hysteresis``, ``.consecutive_hysteresis``, ``.min_loss_scale`` |                           |
| ``optimizer.type``, ``optimizer.params``                        | ``optimizer``, ``optimizer_params`` |
| ``scheduler.type``, ``scheduler.params``                        | ``scheduler``, ``scheduler_params`` |
| ``activation_checkpointing`` (the section present)              | ``remat=True``              |
| ``activation_checkpointing.cpu_checkpointing``                  | ``remat_offload``           |
| ``sequence_parallel_size`` (Ulysses; ``world_size`` stays dp)   | ``sp_size``                 |
Not in DeepSpeed's JSON, set on the Plan: ``pp``, ``microbatches``, ``pipeline_schedule``, ``units``,
``tile_lm_head``, ``sp_kind``, ``tile_mlp``.

Choices where DeepSpeed leaves room, each stated once:
- Batch sizes follow DeepSpeed's rule ``train_batch_size = micro * accum * world_size``: any two
  give the third, one alone sets accum to 1; a disagreement (or a third that does not divide out)
  is an error naming the three values and the world size.
- Optimizers: type is case-insensitive. "Adam" with ``adam_w_mode`` (default true) is AdamW, as
  DeepSpeed's FusedAdam/CPUAdam; "AdamW" is AdamW whatever ``adam_w_mode`` says. Params left out
  take DeepSpeed's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0 (torch's 0.01
  for AdamW with ``torch_adam``); SGD as ``torch.optim.SGD``; Lion as DeepSpeed's (betas 0.9, 0.999);
  LAMB as DeepSpeed's FusedLamb (``bias_correction``, ``max_coeff`` 10, ``min_coeff`` 0.01);
  OneBitAdam, ZeroOneAdam, OneBitLamb as ``zf.optim.onebit_adam``, ``zero_one_adam``, ``onebit_lamb``
  with DeepSpeed's defaults (their ``cuda_aware``, ``comm_backend_name``, and the ``bias_correction``
  and ``max_grad_norm`` they never read, are ignored); ZeRO stage 0 only (the rulebook).
  Weight decay applies to every param, as in a DeepSpeed config (``zf.config.optimizer(plan, mask=)``
  narrows).
- Schedulers: WarmupLR, WarmupDecayLR and WarmupCosineLR, the type case-insensitive; their
  formulas and DeepSpeed's step counting are zf.config's (``warmup_lr``, ``warmup_decay_lr``,
  ``warmup_cosine_lr``, ``schedule``; see its docstring).
- fp16: ``loss_scale`` 0 is the dynamic scale zfunc has; a nonzero (static) scale is refused.
- Combinations: DeepSpeed's own (the optimizer offloads with ZeRO stage 1-3, params with stage 3)
  are refused as DeepSpeed refuses them; then ``zfunc.core.compose``'s rulebook refuses what
  contradicts or what zfunc does not run (params offload without optimizer offload), naming the key
  path and the Plan field (``zero_optimization.offload_param.device (plan offload_params): ...``).
- ``activation_checkpointing``: DeepSpeed configures the checkpointing that model code calls; here
  the model is unchanged, so the section itself asks for remat (applied per unit by the builder).
  ``partition_activations`` splits checkpoints over model-parallel ranks, which zfunc has none of.
- "auto" values (the Hugging Face convention) come from ``**auto``, by these names (HF's
  ``TrainingArguments`` source in brackets): ``train_micro_batch_size_per_gpu``
  [per_device_train_batch_size], ``gradient_accumulation_steps``, ``train_batch_size``,
  ``gradient_clipping`` [max_grad_norm], ``lr`` [learning_rate; fills ``optimizer.params.lr`` and
  ``scheduler.params.warmup_max_lr``], ``betas`` [adam_beta1, adam_beta2], ``eps`` [adam_epsilon],
  ``weight_decay``, ``warmup_min_lr`` [HF fills 0, so does this when not given],
  ``warmup_num_steps`` [warmup_steps], ``total_num_steps`` [num_training_steps], ``fp16``, ``bf16``
  (bools: ``fp16.enabled``, ``bf16.enabled``). An "auto" batch size with no value is worked out by
  the batch rule; any other "auto" with no value is an error naming its key. As in HF, a value given
  for a key the config sets explicitly must agree with it, and values for absent keys are unused.
- Values: a file is read within ``zfunc.config.json_file``'s bounds (nesting, size, no duplicate keys, no
  NaN), a dict is refused past the same nesting. Every value read is typed and in range, in a
  section that is off too (fp16's loss-scale values with fp16 disabled): batch sizes, accum and
  fp16 counts ints >= 1 (never bools), stage in 0..3, lr, weight decay and clip >= 0 and finite,
  betas in [0, 1), eps > 0, cosine ratios in [0, 1], offload devices "none"/"cpu"/"nvme", an
  nvme_path a non-empty string; errors name the dotted key path (and the file).
- Tuning knobs with no meaning here (bucket sizes, overlap_comm, pin_memory, aio, logging,
  monitors, ...) are accepted, recorded in ``plan.ignored`` and named in one ``IgnoredKeysWarning``.
  A feature zfunc lacks (Muon/Adagrad optimizers, MoE/expert parallel, tensor or sequence
  parallel, sparse attention, curriculum/data efficiency, compression, Apex AMP, ZeRO++'s hpZ,
  partial offload, ...) and any unknown key are refused before training with a ``ValueError``
  naming the key path and value.
"""
from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from zfunc.config import json_file
from zfunc.core import compose
from zfunc.config.checks import _check_bool, _check_choice, _check_int, _check_number
from zfunc.config.params import (OPTIMIZER_DEFAULTS, SCHEDULER_DEFAULTS, SCHEDULERS, _optimizer_params,
                                 _scheduler_params)
from zfunc.config.plan import PLACES, Plan


class IgnoredKeysWarning(UserWarning):
    """``from_deepspeed`` read keys that have no meaning in zfunc (listed once, in one warning)."""


_MISSING = object()

# Where "auto" may stand, and the ``**auto`` name that fills it (the Hugging Face Trainer's set).
_AUTO_NAMES = {
    "train_batch_size": "train_batch_size",
    "train_micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "optimizer.params.lr": "lr",
    "optimizer.params.betas": "betas",
    "optimizer.params.eps": "eps",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_min_lr": "warmup_min_lr",
    "scheduler.params.warmup_max_lr": "lr",
    "scheduler.params.warmup_num_steps": "warmup_num_steps",
    "scheduler.params.total_num_steps": "total_num_steps",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
    "bfloat16.enabled": "bf16",
}
AUTO_NAMES = tuple(sorted(set(_AUTO_NAMES.values())))
_AUTO_DEFAULTS = {"warmup_min_lr": 0.0}  # HF fills it with 0 ("not a trainer arg") and checks nothing
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _enabled(v: Any) -> bool:
    return not isinstance(v, Mapping) or v.get("enabled", False) not in (False, None)


def _tp_on(v: Any) -> bool:
    if not isinstance(v, Mapping):
        return v not in (None, 0, 1, False)
    tp = v.get("tp")
    tp_size = tp.get("tp_size") if isinstance(tp, Mapping) else tp
    return any(s not in (None, 0, 1) for s in (v.get("autotp_size"), tp_size))


# Top level. Knobs: tuning, logging and tooling with no meaning here. Features: (on?, what it is).
_TOP_MAPPED = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                         "gradient_clipping", "zero_optimization", "fp16", "bf16", "bfloat16", "optimizer",
                         "scheduler", "activation_checkpointing", "tensor_parallel", "sequence_parallel_size"})
_TOP_KNOBS = frozenset({
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "prescale_gradients", "gradient_predivide_factor", "communication_data_type",
    "seq_parallel_communication_data_type", "disable_allgather", "graph_harvesting", "dataloader_drop_last", "aio",
    "checkpoint", "nebula", "datastates", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet",
    "comms_logger", "timers", "autotuning", "log_level", "managed_gradient_accumulation",
    "use_data_before_expert_parallel_", "data_types", "pipeline", "vocabulary_size"})
_TOP_FEATURES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "amp": (_enabled, "Apex AMP (use fp16 or bf16)"),
    "torch_autocast": (_enabled, "DeepSpeed's torch.autocast mode (use bf16 or fp16)"),
    "sparse_attention": (lambda v: True, "sparse attention"),
    "moe": (lambda v: True, "mixture of experts"),
    "expert_parallel": (_enabled, "expert parallelism (MoE)"),
    "curriculum_learning": (_enabled, "curriculum learning"),
    "data_efficiency": (_enabled, "data efficiency (curriculum learning, random-LTD)"),
    "compression_training": (lambda v: True, "compression training"),
    "weight_quantization": (lambda v: True, "weight quantization"),
    "quantize_training": (_enabled, "quantized training"),
    "progressive_layer_drop": (_enabled, "progressive layer drop"),
    "eigenvalue": (_enabled, "eigenvalue computation"),
    "hybrid_engine": (_enabled, "the hybrid (RLHF) engine"),
    "elasticity": (_enabled, "elastic training"),
    "compile": (lambda v: isinstance(v, Mapping) and bool(v.get("deepcompile")), "DeepCompile"),
    "sparse_gradients": (bool, "sparse embedding gradients"),
    "gradient_allreduce_op": (lambda v: v != "mean", "a summed (not averaged) gradient all-reduce"),
}
_ZERO_KNOBS = frozenset({
    "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "sub_group_size", "cpu_offload_use_pin_memory", "grad_hooks", "round_robin_gradients", "ignore_unused_parameters",
    "legacy_stage1", "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
    "mics_hierarchical_params_gather", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
    "stage3_param_persistence_threshold", "param_persistence_threshold", "stage3_model_persistence_threshold",
    "model_persistence_threshold", "stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance",
    "max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
    "module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential", "allgather_sequential"})
_ZERO_FEATURES = {
    "zero_quantized_nontrainable_weights": (bool, "ZeRO++ quantized weights"),
    "zeropp_loco_param": (lambda v: v is not None, "ZeRO++ LoCo"),
    "mics_shard_size": (lambda v: v not in (-1, 0), "MiCS sharding"),
    "zenflow": (lambda v: v is not None, "ZenFlow"),
}
_OFFLOAD_KNOBS = {
    "offload_optimizer": frozenset({"buffer_count", "pin_memory", "pipeline_read", "pipeline_write", "pipeline",
                                    "fast_init", "cpuadam_cores_perc"}),
    "offload_param": frozenset({"buffer_count", "buffer_size", "max_in_cpu", "pin_memory"}),
}
_OFFLOAD_FEATURES = {
    "offload_optimizer": {"ratio": (lambda v: v != 1, "partial optimizer offload (ratio < 1)"),
                          "super_offload": (bool, "SuperOffload")},
    "offload_param": {},
}
_FP16_MAPPED = frozenset({"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                          "consecutive_hysteresis", "min_loss_scale"})
_FP16_FEATURES = {"fp16_master_weights_and_grads": (bool, "fp16 master weights (zfunc keeps fp32 masters)")}
_BF16_FEATURES = {"bf16_master_weights_and_grads": (bool, "bf16 master weights (zfunc keeps fp32 masters)"),
                  "bf16_optimizer_states": (bool, "bf16 optimizer states (zfunc keeps them in fp32)")}
_CHECKPOINTING_KNOBS = frozenset({"partition_activations", "contiguous_memory_optimization", "number_checkpoints",
                                  "synchronize_checkpoint_boundary", "profile"})
_OPTIMIZER_TYPES = {"adam": "adam", "adamw": "adamw", "sgd": "sgd", "lion": "lion", "lamb": "lamb",
                    "onebitadam": "onebit_adam", "zerooneadam": "zero_one_adam", "onebitlamb": "onebit_lamb"}
_OPTIMIZERS_LACKING = {"adagrad": "Adagrad", "muadam": "MuAdam", "muadamw": "MuAdamW",
                       "musgd": "MuSGD", "muon": "Muon"}
_OPTIMIZER_PARAM_KNOBS = frozenset({"fp32_optimizer_states", "set_grad_none", "foreach", "fused", "capturable",
                                    "differentiable"})
# DeepSpeed's 1-bit optimizers take these and never read them (or pick a backend zfunc has no choice of).
_ONEBIT_KNOBS = frozenset({"cuda_aware", "comm_backend_name", "bias_correction", "max_grad_norm", "amsgrad",
                           "eps_inside_sqrt"})
# Params whose only value zfunc has (FusedAdam's and torch's flags), by optimizer.
_OPTIMIZER_PARAM_FIXED = {"adam": {"bias_correction": True, "amsgrad": False, "maximize": False},
                          "adamw": {"bias_correction": True, "amsgrad": False, "maximize": False},
                          "sgd": {"maximize": False}, "lion": {}, "lamb": {}, "onebit_adam": {}, "zero_one_adam": {},
                          "onebit_lamb": {}}
_SCHEDULER_NAMES = {s.lower(): s for s in SCHEDULERS}


def _as_int(value: Any) -> Any:
    """JSON numbers such as ``1e4`` arrive as floats; integral ones count as ints."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _same(a: Any, b: Any) -> bool:
    as_list = lambda x: list(x) if isinstance(x, (list, tuple)) else x  # noqa: E731
    return as_list(a) == as_list(b)


class _Reader:
    """One pass over a DeepSpeed config: "auto" filled, keys sorted into mapped / ignored / refused."""

    def __init__(self, auto: dict[str, Any]):
        unknown = sorted(set(auto) - set(AUTO_NAMES))
        if unknown:
            raise ValueError(f"auto: unknown names {unknown}; the auto names are {list(AUTO_NAMES)}")
        self.auto, self.used, self.ignored = auto, set(), []

    def value(self, section: Mapping, key: str, path: str, default: Any = _MISSING) -> Any:
        """``section[key]`` with "auto" filled (None for a batch size left to the batch rule)."""
        value = section.get(key, _MISSING)
        name = _AUTO_NAMES.get(path)
        if isinstance(value, str) and value == "auto":
            if name is None:
                raise ValueError(f"{path}: 'auto' is filled only at {sorted(_AUTO_NAMES)}; give a value here")
            if name in self.auto:
                self.used.add(name)
                return self.auto[name]
            if name in _AUTO_DEFAULTS or path in _BATCH_KEYS:
                return _AUTO_DEFAULTS.get(name)
            raise ValueError(f"{path}: the config says 'auto' and no value was given; pass {name}=... to "
                             "from_deepspeed")
        if value is _MISSING:
            return default
        if name in self.auto and name not in _AUTO_DEFAULTS:  # HF: explicit values must match the given ones
            if not _same(value, self.auto[name]):
                raise ValueError(f"{path}: the config sets {value!r} and the auto value {name}={self.auto[name]!r} "
                                 "differs")
            self.used.add(name)
        return value

    def sort(self, section: Any, path: str, mapped, knobs, features) -> dict:
        """Check ``section`` is a dict whose keys are all known: knobs go to ``ignored``, features
        that are on are refused, unknown keys are refused."""
        if not isinstance(section, Mapping):
            raise ValueError(f"{path or 'config'}: expected a dict, got {section!r}")
        prefix = f"{path}." if path else ""
        for key, value in section.items():
            if key in mapped:
                continue
            if key in features:
                on, what = features[key]
                if on(value):
                    raise ValueError(f"{prefix}{key}: zfunc has no {what}; refused before training, got {value!r}")
            elif key not in knobs:
                raise ValueError(f"{prefix}{key}: not a key zfunc knows here (got {value!r}); unknown keys are "
                                 "refused rather than ignored, so a typo cannot pass")
            self.ignored.append(prefix + key)
        return section

    def int_value(self, section: Mapping, key: str, path: str, default: Any, minimum: int) -> int | None:
        value = _as_int(self.value(section, key, path, default))
        if value is not None:
            _check_int(path, value, minimum)
        return value

    def bool_value(self, section: Mapping, key: str, path: str, default: bool) -> bool:
        value = self.value(section, key, path, default)
        _check_bool(path, value)
        return value


def _read(config: dict, world_size: int, auto: dict[str, Any]) -> Plan:
    r = _Reader(auto)
    r.sort(config, "", _TOP_MAPPED, _TOP_KNOBS, _TOP_FEATURES)
    fields = {"dp": world_size, **_read_batch(r, config, world_size), **_read_zero(r, config, world_size),
              **_read_precision(r, config), **_read_optimizer(r, config), **_read_remat(r, config),
              **_read_tensor_parallel(config)}
    fields.update(_read_scheduler(r, config, fields))
    fields["sp_size"] = r.value(config, "sequence_parallel_size", "sequence_parallel_size", 1)
    clip = r.value(config, "gradient_clipping", "gradient_clipping", 1.0)
    _check_number("gradient_clipping", clip)
    try:  # Plan asks the rulebook for settings that contradict, then for what zfunc does not run
        plan = Plan(**fields, gradient_clipping=float(clip), ignored=tuple(r.ignored))
        refusal = compose.check_plan(plan, compose.UNSUPPORTED)
    except ValueError as e:
        refusal = str(e)
    if refusal is not None:
        raise ValueError(_by_key_path(refusal)) from None
    _warn_ignored(r.ignored, sorted(set(auto) - r.used))
    return plan


def _read_tensor_parallel(config: dict) -> dict:
    """``"tensor_parallel": {"autotp_size": N}`` (DeepSpeed's AutoTP) -> ``tp=N`` (``world_size`` stays the
    data-parallel size, as DeepSpeed's batch rule counts it). Any other key of it is refused, naming it."""
    v = config.get("tensor_parallel")
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError(f"tensor_parallel: expected a mapping such as {{\"autotp_size\": 2}}, got {v!r}")
    other = sorted(k for k in v if k != "autotp_size" and _tp_on({k: v[k]}))
    if other:
        raise ValueError(f"tensor_parallel.{other[0]}: zfunc reads AutoTP's autotp_size only (its plan is found from "
                         f"the module graph); got {v[other[0]]!r}")
    size = v.get("autotp_size", 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel.autotp_size: expected an int >= 1, got {size!r}")
    return {"tp": size}


# Plan field -> the key path (or argument) it is read from, for the refusals that name a field.
_KEY_PATHS = {
    "dp": "world_size", "zero_stage": "zero_optimization.stage",
    "offload_optimizer": "zero_optimization.offload_optimizer.device",
    "offload_params": "zero_optimization.offload_param.device",
    "nvme_path": "zero_optimization.offload_param.nvme_path",
    "remat": "activation_checkpointing", "remat_offload": "activation_checkpointing.cpu_checkpointing",
    "accum": "gradient_accumulation_steps", "micro_batch": "train_micro_batch_size_per_gpu",
    "global_batch": "train_batch_size", "precision": "fp16.enabled, bf16.enabled",
    "gradient_clipping": "gradient_clipping", "tp": "tensor_parallel.autotp_size", "sp_size": "sequence_parallel_size",
    "hpz_partition": "zero_optimization.zero_hpz_partition_size",
}


def _by_key_path(refusal: str) -> str:
    """A Plan refusal "field: why" as "key.path (plan field): why"."""
    field, sep, why = refusal.partition(": ")
    return f"{_KEY_PATHS[field]} (plan {field}): {why}" if sep and field in _KEY_PATHS else refusal


def _read_batch(r: _Reader, config: dict, world_size: int) -> dict:
    """DeepSpeed's batch rule (``_set_batch_related_parameters`` + ``_batch_assertion``), exact."""
    tb, mb, ga = (r.int_value(config, key, key, None, 1) for key in _BATCH_KEYS)
    shown = ", ".join(f"{k}={'not given' if v is None else v}" for k, v in zip(_BATCH_KEYS, (tb, mb, ga)))

    def fail(why: str):
        raise ValueError(f"{shown}, world_size={world_size}: {why}")

    def divide(total: int, by: int, what: str) -> int:
        quotient, rest = divmod(total, by)
        if rest or not quotient:
            fail(f"expected train_batch_size = micro * accum * world_size, and {total} is not a positive multiple "
                 f"of {by}, so no whole {what} fits")
        return quotient

    if tb is None and mb is None:
        fail("give train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed needs one of them)")
    if ga is None and (tb is None or mb is None):  # one size alone: DeepSpeed sets accum to 1
        ga = 1
    if tb is None:
        tb = mb * ga * world_size
    elif mb is None:
        mb = divide(tb, ga * world_size, "train_micro_batch_size_per_gpu")
    elif ga is None:
        ga = divide(tb, mb * world_size, "gradient_accumulation_steps")
    if tb != mb * ga * world_size:
        fail(f"expected train_batch_size = micro * accum * world_size = {mb} * {ga} * {world_size} = "
             f"{mb * ga * world_size}")
    return {"global_batch": tb, "micro_batch": mb, "accum": ga}


def _read_zero(r: _Reader, config: dict, world_size: int = 1) -> dict:
    z = config.get("zero_optimization", {})
    if isinstance(z, bool):  # DeepSpeed's deprecated form: true is stage 1
        r.ignored.append("zero_optimization") if not z else None
        return {"zero_stage": int(z)}
    r.sort(z, "zero_optimization", {"stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param",
                                    "zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size"},
           _ZERO_KNOBS, _ZERO_FEATURES)
    stage = r.int_value(z, "stage", "zero_optimization.stage", 0, 0)
    _check_choice("zero_optimization.stage", stage, (0, 1, 2, 3))
    zpp = {key: r.bool_value(z, key, f"zero_optimization.{key}", False)
           for key in ("zero_quantized_weights", "zero_quantized_gradients")}
    if zpp["zero_quantized_weights"] and stage != 3:
        raise ValueError(f"zero_optimization.zero_quantized_weights: ZeRO++ quantizes stage 3's param gathers; "
                         f"the stage is {stage}")
    if zpp["zero_quantized_gradients"] and stage == 0:
        raise ValueError("zero_optimization.zero_quantized_gradients: ZeRO++ quantizes the grad reduce-scatter of "
                         "stages 1-3; the stage is 0")
    hpz = r.int_value(z, "zero_hpz_partition_size", "zero_optimization.zero_hpz_partition_size", 1, 0)
    if hpz in (0, 1) and "zero_hpz_partition_size" in z:  # off: read, and listed as ignored
        r.ignored.append("zero_optimization.zero_hpz_partition_size")
    elif hpz > 1 and (stage != 3 or world_size % hpz):
        raise ValueError(f"zero_optimization.zero_hpz_partition_size: hpZ's groups serve stage 3 and divide the "
                         f"{world_size} data-parallel ranks; the stage is {stage}, got {hpz}")
    places, paths = {}, {}
    for key, legacy in (("offload_optimizer", "cpu_offload"), ("offload_param", "cpu_offload_param")):
        places[key], paths[key] = _read_offload(r, z, key, legacy)
    if places["offload_optimizer"] != "none" and stage == 0:
        raise ValueError(f"zero_optimization.offload_optimizer.device: DeepSpeed offloads the optimizer with ZeRO "
                         f"stage 1-3, the stage is 0; got {places['offload_optimizer']!r}")
    if places["offload_param"] != "none" and stage != 3:
        raise ValueError(f"zero_optimization.offload_param.device: DeepSpeed offloads params only with ZeRO stage 3, "
                         f"the stage is {stage}; got {places['offload_param']!r}")
    nvme = sorted({p for p in paths.values() if p is not None})
    if len(nvme) > 1:
        raise ValueError(f"zero_optimization.offload_param.nvme_path: zfunc keeps optimizer and params in one swap "
                         f"directory, got {nvme[0]!r} and {nvme[1]!r}")
    return {"zero_stage": stage, "quantized_weights": zpp["zero_quantized_weights"],
            "quantized_grads": 4 if zpp["zero_quantized_gradients"] else 0,  # DeepSpeed's qgZ is int4
            "hpz_partition": max(hpz, 1),
            "offload_optimizer": places["offload_optimizer"],
            "offload_params": places["offload_param"], "nvme_path": nvme[0] if nvme else None}


def _read_offload(r: _Reader, z: Mapping, key: str, legacy: str) -> tuple[str, str | None]:
    """(device, nvme path or None) of ``zero_optimization.<key>`` or its deprecated bool ``legacy``."""
    path = f"zero_optimization.{key}"
    section = z.get(key)
    if legacy in z:
        flag = r.bool_value(z, legacy, f"zero_optimization.{legacy}", False)
        if section is not None and flag:
            raise ValueError(f"zero_optimization.{legacy}: deprecated form of {key}; give one of them, got both")
        if section is None:
            return ("cpu" if flag else "none"), None
    if section is None:
        return "none", None
    r.sort(section, path, {"device", "nvme_path"}, _OFFLOAD_KNOBS[key], _OFFLOAD_FEATURES[key])
    device = r.value(section, "device", f"{path}.device", "none")
    _check_choice(f"{path}.device", device, PLACES)
    nvme_path = r.value(section, "nvme_path", f"{path}.nvme_path", None)
    if nvme_path is not None and not (isinstance(nvme_path, str) and nvme_path):
        raise ValueError(f"{path}.nvme_path: expected the directory for the swap files, a non-empty string, got "
                         f"{nvme_path!r}")
    if device != "nvme":
        if nvme_path is not None:
            r.ignored.append(f"{path}.nvme_path")
        return device, None
    if nvme_path is None:
        raise ValueError(f"{path}.nvme_path: device 'nvme' needs the directory for its swap files, got None")
    return device, nvme_path


def _read_precision(r: _Reader, config: dict) -> dict:
    if "bf16" in config and "bfloat16" in config:
        raise ValueError("bfloat16: the old name of bf16; give one of them, got both")
    fp16 = r.sort(config.get("fp16", {}), "fp16", _FP16_MAPPED, {"auto_cast"}, _FP16_FEATURES)
    bf16_key = "bfloat16" if "bfloat16" in config else "bf16"
    bf16 = r.sort(config.get(bf16_key, {}), bf16_key, {"enabled"},
                  {"immediate_grad_update", "check_grad_overflow", "check_overflow"}, _BF16_FEATURES)
    fp16_on = r.bool_value(fp16, "enabled", "fp16.enabled", False)
    bf16_on = r.bool_value(bf16, "enabled", f"{bf16_key}.enabled", False)
    if fp16_on and bf16_on:
        raise ValueError("fp16.enabled, bf16.enabled: both true; DeepSpeed refuses the two at once")
    scaling = _read_loss_scaling(r, fp16)  # checked even when fp16 is off: a bad value is a bad config
    if not fp16_on:
        return {"precision": "bf16" if bf16_on else "fp32"}
    static = scaling.pop("loss_scale")
    if static != 0:
        raise ValueError(f"fp16.loss_scale: zfunc's fp16 scales the loss dynamically; a static scale is refused "
                         f"(0 = dynamic, starting at 2**initial_scale_power), got {static!r}")
    return {"precision": "fp16", **scaling}


def _read_loss_scaling(r: _Reader, fp16: Mapping) -> dict:
    """The fp16 section's loss-scale values, each typed and in range, DeepSpeed's defaults for the absent."""
    out = {"loss_scale": _check_number("fp16.loss_scale", r.value(fp16, "loss_scale", "fp16.loss_scale", 0)),
           "initial_scale_power": r.int_value(fp16, "initial_scale_power", "fp16.initial_scale_power", 16, 0),
           "loss_scale_window": r.int_value(fp16, "loss_scale_window", "fp16.loss_scale_window", 1000, 1),
           "hysteresis": r.int_value(fp16, "hysteresis", "fp16.hysteresis", 2, 1),
           "consecutive_hysteresis": r.bool_value(fp16, "consecutive_hysteresis", "fp16.consecutive_hysteresis",
                                                  False),
           "min_loss_scale": _check_number("fp16.min_loss_scale", r.value(fp16, "min_loss_scale",
                                                                          "fp16.min_loss_scale", 1))}
    if out["initial_scale_power"] > 127:  # 2**128 is inf in fp32
        raise ValueError(f"fp16.initial_scale_power: expected an int in [0, 127], got {out['initial_scale_power']}")
    if out["min_loss_scale"] <= 0:
        raise ValueError(f"fp16.min_loss_scale: expected a number > 0, got {fp16.get('min_loss_scale')!r}")
    return out


def _read_optimizer(r: _Reader, config: dict) -> dict:
    if "optimizer" not in config:
        return {"optimizer": None}  # DeepSpeed then trains with the client's optimizer
    section = r.sort(config["optimizer"], "optimizer", {"type", "params"}, {"legacy_fusion"}, {})
    name = section.get("type")
    if not isinstance(name, str):
        raise ValueError(f"optimizer.type: expected an optimizer name (Adam, AdamW, SGD, Lion, LAMB, ...), "
                         f"got {name!r}")
    kind = _OPTIMIZER_TYPES.get(name.lower())
    if kind is None:
        lacking = _OPTIMIZERS_LACKING.get(name.lower())
        what = f"{lacking}, a DeepSpeed optimizer zfunc does not have" if lacking else "not an optimizer zfunc has"
        raise ValueError(f"optimizer.type: {what}; zfunc maps Adam, AdamW, SGD, Lion, LAMB, OneBitAdam, "
                         f"ZeroOneAdam and OneBitLamb, got {name!r}")
    fixed = _OPTIMIZER_PARAM_FIXED[kind]
    knobs = _OPTIMIZER_PARAM_KNOBS | (_ONEBIT_KNOBS if kind in compose.ONEBIT_OPTIMIZERS else frozenset())
    mapped = set(OPTIMIZER_DEFAULTS[kind]) | {"adam_w_mode", "torch_adam", *fixed} | ({"max_grad_norm"} - knobs)
    params = dict(r.sort(_params(section), "optimizer.params", mapped, knobs, {}))
    for key in knobs:
        params.pop(key, None)
    if "max_grad_norm" in params:  # DeepSpeed's own refusal
        raise ValueError(f"optimizer.params.max_grad_norm: not an optimizer param in DeepSpeed; use the top-level "
                         f"gradient_clipping, got {params['max_grad_norm']!r}")
    for key, required in fixed.items():
        if key in params:
            given = params.pop(key)
            _check_bool(f"optimizer.params.{key}", given)
            if given != required:
                raise ValueError(f"optimizer.params.{key}: zfunc's optimizers have only {key}={required}, got "
                                 f"{given!r}")
    if kind in ("adam", "adamw"):
        adam_w_mode = params.pop("adam_w_mode", True)
        torch_adam = params.pop("torch_adam", False)
        _check_bool("optimizer.params.adam_w_mode", adam_w_mode)
        _check_bool("optimizer.params.torch_adam", torch_adam)
        kind = "adamw" if kind == "adamw" or adam_w_mode else "adam"  # DeepSpeed's effective_adam_w_mode
        if torch_adam and kind == "adamw" and "weight_decay" not in params:
            params["weight_decay"] = 0.01  # torch.optim.AdamW's default, not FusedAdam's 0
    for key in list(params):
        params[key] = r.value(params, key, f"optimizer.params.{key}")
    return {"optimizer": kind, "optimizer_params": _optimizer_params(kind, params, "optimizer.params")}


def _params(section: Mapping) -> Any:
    """An optimizer's or scheduler's ``params``: absent or null is no params (DeepSpeed's defaults)."""
    params = section.get("params")
    return {} if params is None else params


def _read_scheduler(r: _Reader, config: dict, fields: dict) -> dict:
    if "scheduler" not in config:
        return {}
    section = r.sort(config["scheduler"], "scheduler", {"type", "params"}, set(), {})
    name = section.get("type")
    kind = _SCHEDULER_NAMES.get(name.lower()) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"scheduler.type: zfunc maps DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR "
                         f"(not LRRangeTest, OneCycle or torch schedulers), got {name!r}")
    given = dict(r.sort(_params(section), "scheduler.params",
                        set(SCHEDULER_DEFAULTS[kind]) | {"last_batch_iteration"}, set(), {}))
    if given.pop("last_batch_iteration", -1) != -1:
        raise ValueError(f"scheduler.params.last_batch_iteration: zfunc counts from the state's own step; expected -1, "
                         f"got {section['params']['last_batch_iteration']!r}")
    for key in list(given):
        value = r.value(given, key, f"scheduler.params.{key}")
        given[key] = _as_int(value) if key in ("warmup_num_steps", "total_num_steps") else value
    if "total_num_steps" in SCHEDULER_DEFAULTS[kind] and given.get("total_num_steps") is None:
        raise ValueError(f"scheduler.params.total_num_steps: {kind} needs it (for 'auto', pass total_num_steps=...)")
    if kind == "WarmupLR" and "warmup_max_lr" not in given and fields["optimizer"] is None:
        raise ValueError("scheduler.params.warmup_max_lr: WarmupLR without it peaks at the optimizer's lr, and the "
                         "config has no optimizer")
    if kind == "WarmupCosineLR" and fields["optimizer"] is None:
        raise ValueError("scheduler.type: WarmupCosineLR scales the optimizer's lr, and the config has no optimizer")
    return {"scheduler": kind, "scheduler_params": _scheduler_params(kind, given, "scheduler.params")}


def _read_remat(r: _Reader, config: dict) -> dict:
    if "activation_checkpointing" not in config:
        return {}
    section = r.sort(config["activation_checkpointing"], "activation_checkpointing", {"cpu_checkpointing"},
                     _CHECKPOINTING_KNOBS, {})
    offload = r.bool_value(section, "cpu_checkpointing", "activation_checkpointing.cpu_checkpointing", False)
    return {"remat": True, "remat_offload": offload}


def from_deepspeed(config: str | os.PathLike | Mapping[str, Any], *, world_size: int = 1, **auto: Any) -> Plan:
    """A Plan from a DeepSpeed config: a path to a JSON file, or the dict itself (not modified).

    ``world_size``: DeepSpeed's data-parallel world size (``dp``). ``auto``: values for "auto"
    entries, by the names in the module docstring. The mapping, the refusals and the notice of
    ignored keys are in the module docstring. Raises ``ValueError`` naming the key path (and the
    file) for anything refused, ``FileNotFoundError`` for a missing file.
    """
    _check_int("world_size", world_size, 1)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            return _read(load(path), world_size, auto)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    if not isinstance(config, Mapping):
        raise TypeError(f"config: expected a path to a JSON file or a dict, got {type(config).__name__}")
    try:
        json_file.check_depth(config)  # before the copy, which recurses
    except ValueError as e:
        raise ValueError(f"config: {e}") from None
    return _read(copy.deepcopy(dict(config)), world_size, auto)


def load(path: str | os.PathLike) -> dict:
    """The JSON object in the DeepSpeed config file at ``path``, read within ``zfunc.config.json_file``'s
    bounds (nesting, size, no duplicate keys, no NaN). ``FileNotFoundError`` names the path;
    ``ValueError`` says what is wrong (the caller adds the path)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config: no DeepSpeed config file at {str(path)!r}")
    data = json_file.read(path)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object at the top, got {type(data).__name__}")
    return data


def _warn_ignored(keys: list[str], unused_auto: list[str]) -> None:
    """One warning naming every ignored key (and any auto value that filled nothing)."""
    parts = [f"{len(keys)} DeepSpeed keys have no meaning in zfunc and were ignored: {', '.join(keys)}"] if keys else []
    if unused_auto:
        parts.append(f"auto values with no 'auto' to fill: {', '.join(unused_auto)}")
    if parts:
        warnings.warn("zf.config.from_deepspeed: " + "; ".join(parts), IgnoredKeysWarning, stacklevel=4)
