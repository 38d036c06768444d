"""zfunc.deepspeed: DeepSpeed's training API over zfunc (``import zfunc.deepspeed as deepspeed``).

    import zfunc.deepspeed as deepspeed
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                   training_data=dataset, config="ds_config.json")
    for x, y in loader:
        loss = criterion(engine(x), y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("ckpt", client_state={"epoch": 1})
    path, client_state = engine.load_checkpoint("ckpt")

``initialize`` reads the config with ``zf.config.from_deepspeed`` (every key it reads, the same
refusals, the world size from ``torch.distributed``), builds ``zf.train_step`` over the model with
the config's (or the client's) optimizer and scheduler, lays it out with ``zf.parallelize`` and
returns DeepSpeed's four values: the engine (``zfunc.deepspeed.engine``: forward, ``backward``,
``step``, checkpoints, getters), an optimizer and a scheduler seen from the engine
(``zfunc.deepspeed.optimizers``), and a data loader over ``training_data`` sampled as DeepSpeed's
(a ``DistributedSampler`` over the data-parallel ranks, a ``RandomSampler`` on one process).
``zero.Init`` and ``zero.GatheredParameters`` are ``zfunc.deepspeed.zero``'s. Launch with torchrun
(or the ``zfunc`` console script, ``zfunc.deepspeed.launcher``). What DeepSpeed offers and this
does not is refused naming the call (``initialize``'s ``mpu``, ``lr_scheduler`` objects, engine
calls in ``zfunc.deepspeed.refused``).
"""
from __future__ import annotations

import argparse
import atexit
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zfunc as zf
from zfunc.config import deepspeed as ds_config
from zfunc.deepspeed import zero
from zfunc.deepspeed.engine import Engine
from zfunc.deepspeed.optimizers import EngineOptimizer, EngineScheduler, plan_optimizer

__all__ = ["Engine", "add_config_arguments", "build_engine", "init_distributed", "initialize", "zero"]


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: Any = None, init_method: Any = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """The default process group from torchrun's environment (``zf.dist.init_from_env``); nothing
    when it exists already or when the process was started alone (no ``WORLD_SIZE``)."""
    if dist.is_initialized() or dist_init_required is False:
        return
    if init_method is not None or rank != -1 or world_size != -1:
        raise NotImplementedError("init_distributed(init_method=, rank=, world_size=): not supported by "
                                  "zfunc.deepspeed; launch with torchrun (or the zfunc launcher)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or "RANK" in os.environ:
        timeout_s = timeout.total_seconds() if timeout is not None else 300.0
        zf.dist.init_from_env(dist_backend, timeout_s=timeout_s)
        _close_at_exit()


_failed: list[bool] = []


def _close_at_exit() -> None:
    """Close the group this module opened when the script ends: the ranks meet, then the group is
    destroyed. Left to interpreter teardown, gloo's threads abort a rank whose peer has already
    exited ("terminate called without an active exception"). After an uncaught exception the
    ranks do not meet (the others may never come): the process exits as it would."""
    hook = sys.excepthook

    def note(*exc: Any) -> None:
        _failed.append(True)
        hook(*exc)

    def close() -> None:
        if _failed or not dist.is_initialized():
            return
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - at exit, a peer gone is not this rank's error
            pass

    sys.excepthook = note
    atexit.register(close)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's ``--deepspeed`` and ``--deepspeed_config PATH`` arguments, added to ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (zfunc)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    return parser


def _config(args: Any, config: Any, config_params: Any) -> dict:
    if config is not None and config_params is not None:
        raise ValueError("initialize(config=, config_params=): the same argument twice; give one")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if config is not None and from_args is not None:
        raise ValueError(f"initialize(config=...) and args.deepspeed_config={from_args!r}: give one config")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("initialize: no DeepSpeed config; pass config= (a dict or a JSON path) or "
                         "args.deepspeed_config")
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        try:
            return ds_config.load(config)
        except ValueError as e:
            raise ValueError(f"{config}: {e}") from None
    raise TypeError(f"initialize(config=...): expected a dict or a path to a JSON file, got {type(config).__name__}")


def _data_loader(data: Any, plan: zf.config.Plan, config: dict, collate_fn: Any) -> torch.utils.data.DataLoader:
    """DeepSpeed's training loader: micro-batch sized, a DistributedSampler over the dp ranks (a
    RandomSampler on one), ``dataloader_drop_last`` from the config."""
    if plan.dp > 1:
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=plan.dp, rank=dist.get_rank())
    else:
        sampler = torch.utils.data.RandomSampler(data)
    return torch.utils.data.DataLoader(data, batch_size=plan.micro_batch, sampler=sampler, collate_fn=collate_fn,
                                       drop_last=bool(config.get("dataloader_drop_last", False)))


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None) -> tuple[Engine, Any, Any, Any]:
    """``(engine, optimizer, training_dataloader, lr_scheduler)`` as ``deepspeed.initialize`` returns them.

    Args as DeepSpeed's: ``model`` (an ``nn.Module``; built under ``zero.Init`` it is on the meta
    device and each rank makes its rows), ``optimizer`` (None: the config's; a ``torch.optim``
    Adam/AdamW/SGD: its settings, ``zfunc.deepspeed.optimizers``), ``model_parameters`` (params or
    param groups: which decay), ``training_data`` (a dataset: the loader), ``config`` (dict or JSON
    path; or ``args.deepspeed_config``), ``collate_fn``. Refused, naming the argument: ``mpu`` and
    ``mesh_param`` (model parallelism), an ``lr_scheduler`` object (the config's ``scheduler``
    section is zfunc's), a config without an optimizer and no client optimizer.
    """
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise NotImplementedError(f"initialize({name}=...): not supported by zfunc.deepspeed (model parallelism)")
    if lr_scheduler is not None:
        raise NotImplementedError("initialize(lr_scheduler=...): not supported by zfunc.deepspeed; give the schedule "
                                  "in the config's 'scheduler' section (WarmupLR, WarmupDecayLR, WarmupCosineLR)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(model=...): expected a torch.nn.Module, got {type(model).__name__}")
    raw = _config(args, config, config_params)
    init_distributed(dist_init_required=dist_init_required)
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine = build_engine(model, zf.config.from_deepspeed(raw, world_size=world), raw, optimizer, model_parameters)
    loader = _data_loader(training_data, engine.plan, raw, collate_fn) if training_data is not None else None
    return engine, engine.optimizer, loader, EngineScheduler(engine) if engine.plan.scheduler else None


def build_engine(model: nn.Module, plan: zf.config.Plan, config: dict, optimizer: Any = None,
                 model_parameters: Any = None) -> Engine:
    """The engine ``initialize`` returns, for a plan already read (``zf.config.from_deepspeed``, with
    any "auto" values filled): the model prepared and functionalized, ``zf.train_step`` with the
    plan's (or the client's) optimizer, laid out by ``zf.parallelize``, its state made (each rank
    its rows for a model built under ``zero.Init``)."""
    named = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    plan, mask = plan_optimizer(plan, optimizer, model_parameters, named)
    if plan.optimizer is None:
        raise ValueError("initialize: no optimizer: the config has no 'optimizer' section and optimizer=None; "
                         "zfunc.deepspeed trains (give one of them)")
    engine_holder: list[Engine] = []

    def loss_fn(params, micro):
        return engine_holder[0]._running.loss_fn(params, micro)

    model = zf.config.prepare(model, plan)
    meta = any(p.is_meta for p in model.parameters())
    apply, params = zf.functionalize(model)
    opt = zf.config.optimizer(plan, mask=mask)
    step = zf.parallelize(zf.train_step(loss_fn, opt, plan.precision, plan.accum), model, plan)
    state = step.init(params, materialize=zf.materialize.from_module(model, 0) if meta else None)
    if plan.precision == "fp16":
        state = state.replace(loss_scale=zf.precision.deepspeed_loss_scale(
            plan.initial_scale_power, plan.loss_scale_window, plan.hysteresis, plan.min_loss_scale,
            plan.consecutive_hysteresis))
    engine = Engine(model, plan, config, None, step, state, apply, zf.config.schedule(plan))
    engine._optimizer = EngineOptimizer(engine)
    engine_holder.append(engine)
    zero.track(engine)
    return engine
