"""What a Plan builds for training: ``optimizer(plan)``, the zf.optim transformation it names, clipped as
DeepSpeed clips, on ``schedule(plan)``, its learning rate."""
from __future__ import annotations

from typing import Any

from zfunc import optim
from zfunc.config.checks import _check_int
from zfunc.config.plan import Plan
from zfunc.config.schedules import warmup_cosine_lr, warmup_decay_lr, warmup_lr


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
