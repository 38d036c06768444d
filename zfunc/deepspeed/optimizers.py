"""The optimizer a DeepSpeed ``initialize`` call names, as a ``zf.config.Plan``'s, and the objects it returns.

``deepspeed.initialize`` takes the optimizer from the config's ``optimizer`` section or from the
client (a ``torch.optim`` instance); ``plan_optimizer`` puts either into the plan, so the optimizer
is always ``zf.config.optimizer(plan)`` (the config's scheduler and clipping on it):

- the config's section: as ``zf.config.from_deepspeed`` reads it; ``model_parameters`` given as
  param groups (dicts) decide weight decay per param (a group with ``weight_decay`` 0 is left
  undecayed, as Hugging Face's Trainer groups biases and norms); any other per-group setting is
  refused, naming the group and key.
- a client ``torch.optim.Adam`` / ``AdamW`` / ``SGD``: its hyperparameters (``lr``, ``betas``,
  ``eps``, ``weight_decay``, ``momentum``, ``dampening``, ``nesterov``) become the plan's, its
  groups decide weight decay as above; other torch optimizers and options zfunc lacks
  (``amsgrad``, ``maximize``, ...) are refused naming them. Giving both is refused, as DeepSpeed does.

``EngineOptimizer`` and ``EngineScheduler`` are what ``initialize`` returns in the optimizer and
scheduler slots: views of the engine (its learning rate), whose ``step`` is the engine's to call.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zfunc.config import Plan

_TORCH_KINDS = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}
_TORCH_KEYS = {"adamw": ("lr", "betas", "eps", "weight_decay"), "adam": ("lr", "betas", "eps", "weight_decay"),
               "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov")}
# torch options whose default is what zfunc's optimizer does; another value is refused
_TORCH_OFF = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
_GROUP_IGNORED = {"params", "initial_lr", "foreach", "fused", "name", "param_names", "decoupled_weight_decay"}


def _groups(source: Any, names: dict[int, str], where: str) -> list[tuple[list[str], dict]]:
    """``[(param names, settings)]`` of a list of params or of param-group dicts."""
    items = list(source)
    if not items or not isinstance(items[0], dict):
        items = [{"params": items}]
    out = []
    for i, group in enumerate(items):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"{where}[{i}]: expected a param group dict with 'params', got {type(group).__name__}")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        unknown = [p for p in params if id(p) not in names]
        if unknown:
            raise ValueError(f"{where}[{i}]: {len(unknown)} params are not trainable params of the model (shapes "
                             f"{[tuple(p.shape) for p in unknown[:3]]}); zfunc trains the model's own params")
        out.append(([names[id(p)] for p in params], {k: v for k, v in group.items() if k != "params"}))
    return out


def _decay_mask(groups: list[tuple[list[str], dict]], trainable: list[str], decay: float, where: str
                ) -> dict[str, bool] | None:
    """Which params decay: those in groups whose ``weight_decay`` (default ``decay``) is nonzero; None: all."""
    given = set()
    mask = dict.fromkeys(trainable, True)
    for i, (params, settings) in enumerate(groups):
        wd = settings.get("weight_decay", decay)
        if wd not in (0, 0.0, decay):
            raise ValueError(f"{where}[{i}].weight_decay: zfunc decays every decayed param alike ({decay}) or not at "
                             f"all (0), got {wd!r}")
        for name in params:
            given.add(name)
            mask[name] = wd != 0
    missing = sorted(set(trainable) - given)
    if missing and len(groups) > 1:
        raise ValueError(f"{where}: the groups leave out trainable params {missing[:5]}; zfunc trains them all")
    return None if all(mask.values()) else mask


def _check_group_settings(groups: list[tuple[list[str], dict]], base: dict, where: str) -> None:
    for i, (_, settings) in enumerate(groups):
        for key, value in settings.items():
            if key in _GROUP_IGNORED or key == "weight_decay":
                continue
            if key in _TORCH_OFF:
                if value not in (_TORCH_OFF[key], None, False):
                    raise ValueError(f"{where}[{i}].{key}: zfunc's optimizers have no {key}; expected "
                                     f"{_TORCH_OFF[key]!r}, got {value!r}")
                continue
            if key not in base or _norm(value) != _norm(base[key]):
                raise ValueError(f"{where}[{i}].{key}: zfunc takes one {key} for every param (the optimizer's "
                                 f"{base.get(key)!r}), got {value!r} in this group")


def _norm(v: Any) -> Any:
    return [float(x) for x in v] if isinstance(v, (list, tuple)) else v


def plan_optimizer(plan: Plan, client: Any, model_parameters: Any, named: dict[int, str]) -> tuple[Plan, Any]:
    """``(plan, mask)``: the plan with the optimizer ``initialize`` was given, and the weight-decay
    mask (name -> bool, None: every param decays). ``named``: id of each trainable param -> its name."""
    trainable = list(named.values())
    if client is not None:
        if plan.optimizer is not None:
            raise ValueError("initialize(optimizer=...): the config has an 'optimizer' section too; DeepSpeed takes "
                             "one of them, give one")
        kind = _TORCH_KINDS.get(type(client))
        if kind is None:
            raise ValueError(f"initialize(optimizer=...): zfunc maps torch.optim.Adam, AdamW and SGD, got "
                             f"{type(client).__module__}.{type(client).__name__}")
        base = dict(client.param_groups[0])
        if kind == "adam" and base.get("decoupled_weight_decay"):
            kind = "adamw"  # torch's Adam(decoupled_weight_decay=True) is AdamW
        groups = _groups(client.param_groups, named, "optimizer.param_groups")
        _check_group_settings(groups, base, "optimizer.param_groups")
        params = {k: _norm(base[k]) for k in _TORCH_KEYS[kind]}
        decay = float(params["weight_decay"])
        mask = _decay_mask(groups, trainable, decay, "optimizer.param_groups")
        if mask is not None and decay == 0:
            mask = None
        return dataclasses.replace(plan, optimizer=kind, optimizer_params=params), mask
    if plan.optimizer is None:
        return plan, None
    if model_parameters is None:
        return plan, None
    groups = _groups(model_parameters, named, "model_parameters")
    decay = plan.optimizer_params.get("weight_decay", 0.0)
    for i, (_, settings) in enumerate(groups):
        for key in settings:
            if key not in _GROUP_IGNORED and key != "weight_decay":
                raise ValueError(f"model_parameters[{i}].{key}: the config's optimizer sets every param alike; a group "
                                 f"may only turn weight decay off (weight_decay 0), got {key}={settings[key]!r}")
    mask = _decay_mask(groups, trainable, decay, "model_parameters") if decay else None
    return plan, mask


class EngineOptimizer:
    """The optimizer slot of ``initialize``'s result: the engine's optimizer, seen from outside.

    ``param_groups[0]["lr"]`` is the engine's ``get_lr()``; ``zero_grad()`` does nothing (the engine
    keeps no grads between steps); ``step()`` and ``state_dict()`` are the engine's
    (``engine.step()``, ``engine.save_checkpoint``) and refused here, naming them.
    """

    def __init__(self, engine: Any):
        self._engine = engine

    @property
    def param_groups(self) -> list[dict]:
        return [{"lr": self._engine.get_lr()[0], "params": list(self._engine.module.parameters())}]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine's grads live inside its step."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("optimizer.step(): the zfunc engine updates in engine.step() at the accumulation "
                                  "boundary; call engine.step()")

    def state_dict(self) -> dict:
        raise NotImplementedError("optimizer.state_dict(): the optimizer state is the engine's; use "
                                  "engine.save_checkpoint(dir)")

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("optimizer.load_state_dict(): use engine.load_checkpoint(dir)")


class EngineScheduler:
    """The scheduler slot of ``initialize``'s result when the config has a ``scheduler``: the engine
    steps it (``engine.step()``); ``get_last_lr()`` / ``get_lr()`` read the learning rate the next
    update uses, ``step()`` by the caller is refused (it would step it twice)."""

    def __init__(self, engine: Any):
        self._engine = engine

    def get_last_lr(self) -> list[float]:
        return self._engine.get_lr()

    def get_lr(self) -> list[float]:
        return self._engine.get_lr()

    @property
    def last_batch_iteration(self) -> int:
        return self._engine.global_steps - 1

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("lr_scheduler.step(): the zfunc engine steps the config's scheduler in "
                                  "engine.step(), as DeepSpeed does; do not call it")

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("lr_scheduler.load_state_dict(): the schedule follows the engine's step count; use "
                                  "engine.load_checkpoint(dir)")
