"""Optimizer and scheduler params as a Plan holds them: DeepSpeed's defaults (``OPTIMIZER_DEFAULTS``,
``SCHEDULER_DEFAULTS``, torch's for SGD), every given key known and every value checked, the rest completed."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from zfunc.config.checks import (_check_betas, _check_bool, _check_choice, _check_fraction, _check_int, _check_number,
                                 _check_positive)


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
