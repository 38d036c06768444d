"""The sections of a DeepSpeed config read into Plan fields, one function a section: the batch sizes
(DeepSpeed's batch rule), ``zero_optimization`` and its offloads, fp16/bf16 and the loss scale, the
optimizer, the scheduler, ``activation_checkpointing`` and ``tensor_parallel``. Each returns a dict of
Plan fields and refuses, by key path, what zfunc does not run (the mapping: ``zfunc.config.deepspeed``)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zfunc.config.checks import _check_bool, _check_choice, _check_number
from zfunc.config.deepspeed_keys import (_BATCH_KEYS, _BF16_FEATURES, _CHECKPOINTING_KNOBS, _FP16_FEATURES,
                                         _FP16_MAPPED, _OFFLOAD_FEATURES, _OFFLOAD_KNOBS, _ONEBIT_KNOBS,
                                         _OPTIMIZER_PARAM_FIXED, _OPTIMIZER_PARAM_KNOBS, _OPTIMIZER_TYPES,
                                         _OPTIMIZERS_LACKING, _SCHEDULER_NAMES, _ZERO_FEATURES, _ZERO_KNOBS, _Reader,
                                         _as_int, _tp_on)
from zfunc.config.params import OPTIMIZER_DEFAULTS, SCHEDULER_DEFAULTS, _optimizer_params, _scheduler_params
from zfunc.config.plan import PLACES
from zfunc.core import compose


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
