"""The keys of a DeepSpeed config, by section: which ``from_deepspeed`` maps, which it ignores (knobs:
tuning, logging and tooling with no meaning here) and which it refuses (features zfunc lacks, each with
the test that says it is on); where "auto" may stand and the ``**auto`` name that fills it
(``AUTO_NAMES``); and ``_Reader``, the one pass that fills "auto" and sorts each section's keys by
these tables."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from zfunc.config.checks import _check_bool, _check_int
from zfunc.config.params import SCHEDULERS

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
