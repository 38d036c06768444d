"""The state a checkpoint load fills, shared by ``zf.checkpoint.load`` and the importers.

``template`` is the state to fill, laid out as the step's ``init`` lays it out (on the meta device,
within ``shapes_only``) or a given template state; ``check_model`` checks the checkpoint holds the
model, by name, whole shape and dtype; ``to_device`` and ``restored`` place the leaves read into
it (``restored``: as the state's placement puts them in place, e.g. an offloaded step's stores).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from zfunc.checkpoint.files import CheckpointError
from zfunc.checkpoint.layout import BUFFERS, PARAMS, Slot
from zfunc.core import placement, tree
from zfunc.core.step import Step, TrainState


_LIKE = {torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like}


class shapes_only(TorchFunctionMode):
    """Within it, ``torch.*_like`` of a meta tensor is ``torch.empty`` on the meta device, of the
    shape and dtype asked for; every other call runs as usual.

    Why: a step's ``init`` on meta params (its structure, shapes and dtypes: what a load fills) is
    C++ meta kernels but for the optimizers' ``zeros_like``, whose meta kernel is torch's Python
    reference, which imports torch's symbolic-shape machinery (sympy) on its first call: ~0.5-1 s,
    once per process, that a restarted job pays before it reads a byte. A meta tensor has no values,
    so ``empty`` is the same template. Cost: one Python call per torch call made within it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        like = args[0] if args else kwargs.get("input")
        if func in _LIKE and isinstance(like, torch.Tensor) and _device(kwargs.get("device"), like) == "meta":
            return torch.empty(like.shape, dtype=kwargs.get("dtype") or like.dtype, device="meta",
                               requires_grad=kwargs.get("requires_grad", False))
        return func(*args, **kwargs)


def _device(asked: Any, like: torch.Tensor) -> str:
    return torch.device(asked).type if asked is not None else like.device.type


def _saved_buffers(manifest: dict, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like the checkpoint's module buffers (``state.buffers``: never split)."""
    return {e["path"][len(BUFFERS):]: torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]), device=device)
            for e in manifest["leaves"] if e["path"].startswith(BUFFERS)}


def _meta(x: Any) -> Any:
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x


def _model(manifest: dict, step: Step, params: Any) -> tuple[Any, str]:
    """The model's params (on the meta device) and where they came from."""
    if params is not None:
        model, source = params, "params="
    elif getattr(step, "initialized_with", None) is not None:
        model, source = step.initialized_with, "the params step.init last received"
    else:  # nothing says what the model is: the checkpoint's own params
        model = {e["path"][len(PARAMS):]: torch.empty(e["full_shape"], dtype=getattr(torch, e["dtype"]), device="meta")
                 for e in manifest["leaves"] if e["path"].startswith(PARAMS)}
        source = "the checkpoint"
    return tree.map(_meta, model), source


def template(manifest: dict, step_or_template: Any, params: Any) -> tuple[TrainState, str, Any]:
    """The state to fill (a step's: on the meta device), where its model came from, and the
    model's meta params (None for a template state)."""
    from zfunc.offloading.store import OnDisk

    if isinstance(step_or_template, TrainState):
        if params is not None:
            raise ValueError("params: give it with a Step; a TrainState template's own params say the model")
        if any(isinstance(x, OnDisk) for x in tree.leaves((step_or_template.params, step_or_template.opt_state))):
            raise ValueError("step_or_template: an offloaded state's leaves live in its swap files; pass the "
                             "offloaded step, and the checkpoint is written into them")
        tensors = [x for x in tree.leaves(step_or_template.params) if isinstance(x, torch.Tensor)]
        saved = _saved_buffers(manifest, tensors[0].device if tensors else "cpu")
        if step_or_template.buffers and saved:
            return step_or_template, "the template state", None
        # buffers join a state at the first step that writes them: where the template or the
        # checkpoint has none yet, the checkpoint's (or their absence) are what is loaded
        return step_or_template.replace(buffers=saved), "the template state", None
    if not isinstance(step_or_template, Step):
        raise TypeError(f"step_or_template: expected a Step or a TrainState, got {type(step_or_template).__name__}")
    model, source = _model(manifest, step_or_template, params)
    with shapes_only():
        template = step_or_template.init_meta(model)
    buffers = step_or_template.own_buffers(_saved_buffers(manifest, "meta"))
    return template.replace(buffers=buffers), source, model


def _said(shape: tuple, dtype: str | None) -> str:
    return f"{shape} {dtype}" if dtype else str(shape)


def check_model(directory: Path, manifest: dict, template: TrainState, slots: list[Slot], leaves: list,
                 source: str) -> None:
    """Every param of the model is in the checkpoint with its whole shape and dtype, and no other
    (a pipeline stage holds some of the model's params: the others are checked by shape,
    ``Placement.model``)."""
    saved = {e["path"][len(PARAMS):]: (tuple(e["full_shape"]), e["dtype"])
             for e in manifest["leaves"] if e["path"].startswith(PARAMS) and "dtype" in e}
    whole_model = placement.of(template.placement).model(template.placement) or {}
    model = {n: (tuple(shape), None) for n, shape in whole_model.items()}
    model.update({s.split_like: (s.full_shape, str(x.dtype).removeprefix("torch."))
                  for s, x in zip(slots, leaves) if s.path.startswith(PARAMS)})
    missing, unexpected = sorted(model.keys() - saved.keys()), sorted(saved.keys() - model.keys())
    differ = [f"{n}: {_said(*saved[n])} in the checkpoint, {_said(*model[n])} in the model"
              for n in sorted(model.keys() & saved.keys())
              if saved[n][0] != model[n][0] or model[n][1] not in (None, saved[n][1])]
    if missing or unexpected or differ:
        parts = [f"{len(missing)} params of the model not in the checkpoint {missing[:5]}" if missing else "",
                 f"{len(unexpected)} params in the checkpoint not in the model {unexpected[:5]}" if unexpected else "",
                 f"{len(differ)} differ: {'; '.join(differ[:5])}" if differ else ""]
        raise CheckpointError(f"{directory}: the checkpoint does not hold this model (from {source}): "
                              + "; ".join(p for p in parts if p))


def to_device(value: Any, like: Any, device: str | torch.device) -> Any:
    """``value`` (a leaf read from a checkpoint) where ``like`` lives (on ``device`` for a meta
    ``like``); a non-tensor value as it is. Cost: one copy when the device differs."""
    if not isinstance(like, torch.Tensor):
        return value
    return value.to(device if like.device.type == "meta" else like.device)


def restored(step_or_template: Step | TrainState, template: TrainState, lazy: TrainState, model: Any,
              device: str | torch.device) -> TrainState | None:
    """The step's state as its placement puts a checkpoint's leaves in place (``Placement.restore``:
    an offloaded step's, leaf by leaf into its stores), or None: the template is filled here."""
    if not isinstance(step_or_template, Step):
        return None
    return placement.of(template.placement).restore(step_or_template, lazy, model, device)
