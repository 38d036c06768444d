"""Continue training from what users bring: DeepSpeed ZeRO checkpoints and torch DCP checkpoints.

    state = zf.checkpoint.load_deepspeed("ds_ckpt", step)      # root with `latest`, or a global_stepN dir
    state = zf.checkpoint.load_dcp("dcp_ckpt", step)            # torch.distributed.checkpoint (FSDP2) dir
    state = zf.checkpoint.load("ds_ckpt", step)                 # either, found by what the directory holds

**Law.** The state is the one ``step.init`` lays out (plain, ZeRO 0-3 on any number of ranks,
offloaded, pipelined) with the checkpoint's values: every param bit-equal to what the tool's own
consolidation gives (DeepSpeed's ``zero_to_fp32``, DCP's ``dcp_to_torch_save``), Adam's moments and
step count from the checkpoint's optimizer, ``state.step`` its training step. So training continues
as it would have in DeepSpeed or torch, provided the zfunc optimizer has the same hyperparameters
(``zf.optim.adamw(lr, b1, b2, eps, weight_decay)`` equals ``torch.optim.AdamW``: bias correction on,
decoupled decay applied to the params the mask selects; DeepSpeed's ``AdamW`` with ``torch_adam``
or its fused/CPU Adam with ``adam_w_mode``).

**Cost.** Each rank reads only the rows it holds, leaf by leaf (``common``): from a DeepSpeed
checkpoint the slices of the ranks' flat partitions holding them (memory-mapped: only their pages
are read); from DCP the saved chunks overlapping them. No rank ever holds the whole model unless
its layout does (DeepSpeed issue #4025's pain: ``zero_to_fp32`` gathers everything in one process).

**From someone else.** Loading a checkpoint never runs code from it. Its pickles (DeepSpeed's
``.pt`` files, DCP's ``.metadata``) are read by ``safe_unpickle``: tensors, containers, DCP's
metadata classes, and DeepSpeed's own classes as inert stand-ins; any other global (``os.system``,
``exec``, ``getattr``, numpy's, another framework's) is a ``CheckpointError`` naming the file and
the global, raised before anything can call it. DCP's chunks are read by torch's
``weights_only`` unpickler. Every file a checkpoint names (DeepSpeed's ``latest``, DCP's data
files) is a plain name in its own directory. So a checkpoint from someone else can give the
state any values of the shapes the model has, make the load fail with a ``CheckpointError``, and
take memory and time as its size does; it cannot run code, import a module, write a file or make
the load read a path outside its directory (a symlink placed in it is followed, as any file is).

Names are the model's ``named_parameters()`` names; a ``module.`` prefix (DDP, DeepSpeed's engine)
or ``_orig_mod.`` (``torch.compile``) on every name is dropped. Errors are ``CheckpointError``
naming the path and what differs: not a checkpoint, an unknown format, params missing, unexpected
or mis-shaped, an optimizer state that is not Adam's, files missing for the world size that wrote it.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from zfunc.checkpoint.files import MANIFEST, CheckpointError
from zfunc.checkpoint.importers import common
from zfunc.core.step import Step
from zfunc.core.state import TrainState

__all__ = ["load_deepspeed", "load_dcp", "deepspeed_config", "detect", "foreign_format", "load_foreign", "FORMATS"]

FORMATS = ("zfunc", "deepspeed", "dcp")


def detect(path: str | os.PathLike) -> str:
    """The format of the checkpoint at ``path``: ``"zfunc"``, ``"deepspeed"`` or ``"dcp"``.

    Raises ``CheckpointError`` when it is none of them (naming what was looked for)."""
    d = common.directory(path)
    if (d / MANIFEST).is_file():
        return "zfunc"
    if (d / ".metadata").is_file():
        return "dcp"
    from zfunc.checkpoint.importers.deepspeed_zero import MODEL_GLOB, OPTIM_GLOB, named_tag

    inner = d / (named_tag(d) or "")
    if any(inner.glob(OPTIM_GLOB)) or any(inner.glob(MODEL_GLOB)):
        return "deepspeed"
    raise CheckpointError(f"{d}: not a checkpoint zfunc knows: no {MANIFEST} (zfunc), no .metadata "
                          f"(torch.distributed.checkpoint), no {OPTIM_GLOB} files or 'latest' naming a directory "
                          "of them (DeepSpeed)")


def load_deepspeed(path: str | os.PathLike, step_or_template: Step | TrainState, *, tag: str | None = None,
                   params: Any = None, device: str | torch.device = "cpu", optimizer: bool = True) -> TrainState:
    """A DeepSpeed ZeRO checkpoint (stages 1-3, any world size) as the state of ``step_or_template``.

    Args:
      path: the directory ``engine.save_checkpoint`` was given (holding ``latest``) or one tag's
        directory (``global_step100``, holding the ``*_optim_states.pt`` files).
      step_or_template: as ``zf.checkpoint.load``: the step that will train the state (any layout)
        or a ``TrainState`` to follow.
      tag: the tag to read (default: what ``latest`` names).
      params: the model's params (``zf.functionalize``'s, meta allowed); default what the step's
        ``init`` last received, else the checkpoint's own shapes.
      device: where the tensors go.
      optimizer: load the Adam moments and step count (the zfunc optimizer must be ``adam``/``adamw``);
        False starts the optimizer state fresh.
    Every rank of a sharded step calls it and reads only its own rows (no collectives). Reads fp32
    masters (bf16/fp16 runs keep fp32 partitions too; zfunc's step casts as its precision says).
    """
    from zfunc.checkpoint.importers.deepspeed_zero import DeepSpeedSource

    return common.fill(DeepSpeedSource(common.directory(path), tag), step_or_template, params=params, device=device,
                       optimizer=optimizer)


def deepspeed_config(path: str | os.PathLike, *, tag: str | None = None) -> dict:
    """The DeepSpeed config the run saved in its checkpoint (``ds_config``; ``path`` and ``tag`` as
    ``load_deepspeed``), e.g. to rebuild its optimizer and LR schedule, which then continue from
    the loaded step count::

        plan = zf.config.from_deepspeed(zf.checkpoint.deepspeed_config(path), world_size=world)
        step = zf.parallelize(zf.train_step(loss_fn, zf.config.optimizer(plan)), model, plan)

    Raises ``CheckpointError`` when the checkpoint holds none (it was saved without a config dict)."""
    from zfunc.checkpoint.importers.deepspeed_zero import DeepSpeedSource

    source = DeepSpeedSource(common.directory(path), tag)
    if source.config is None:
        raise CheckpointError(f"{source.where}: the model states file holds no ds_config dict")
    return source.config


def load_dcp(path: str | os.PathLike, step_or_template: Step | TrainState, *, model_key: str | None = "model",
             optimizer_key: str | None = "optim", params: Any = None, device: str | torch.device = "cpu",
             optimizer: bool = True) -> TrainState:
    """A ``torch.distributed.checkpoint`` directory as the state of ``step_or_template``.

    The checkpoint is what ``dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)``
    writes with ``model_sd, optim_sd = get_state_dict(model, optimizer)`` (FSDP2, DDP or a plain
    module; any world size): ``model_key``/``optimizer_key`` name the two entries (None: the model's
    state dict was saved at the top level). Params are the model entries that have Adam state
    (``state.<name>.exp_avg``), or all of them without optimizer state; the others are buffers.
    Other arguments as ``load_deepspeed``. Reads only the saved chunks overlapping this rank's rows.
    """
    from zfunc.checkpoint.importers.dcp import DCPSource

    source = DCPSource(common.directory(path), model_key, optimizer_key)
    return common.fill(source, step_or_template, params=params, device=device, optimizer=optimizer)


def foreign_format(path: str | os.PathLike) -> str | None:
    """``"deepspeed"`` or ``"dcp"`` for such a checkpoint directory, else None (zfunc's, or unknown)."""
    try:
        fmt = detect(path)
    except CheckpointError:
        return None
    return None if fmt == "zfunc" else fmt


def load_foreign(path: str | os.PathLike, step_or_template: Step | TrainState, **kwargs: Any) -> TrainState:
    """``load_deepspeed`` or ``load_dcp``, as ``detect`` finds the format (``zf.checkpoint.load`` calls it)."""
    fmt = detect(path)
    if fmt == "deepspeed":
        return load_deepspeed(path, step_or_template, **kwargs)
    if fmt == "dcp":
        return load_dcp(path, step_or_template, **kwargs)
    raise CheckpointError(f"{path}: a zfunc checkpoint; load it with zf.checkpoint.load")
