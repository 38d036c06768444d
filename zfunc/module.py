"""Turn an ``nn.Module`` into a pure function of its parameters.

``functionalize(model)`` returns ``(apply, params)``: ``params`` is a ``dict[str, Tensor]`` of the
model's trainable parameters (detached aliases of the module's own tensors: no copy is made, and
tied parameters appear once under their first name); ``apply(params, *args, **kwargs)`` runs the
module through ``torch.func.functional_call`` with those tensors. The module is used unchanged.

Buffers (BatchNorm running statistics, ...) are never mutated. By default ``apply`` reads them
from a private snapshot taken at ``functionalize`` time and discards any update the forward pass
makes. With ``with_buffers=True`` they become explicit state:
``apply, (params, buffers) = functionalize(model, with_buffers=True)`` and
``out, new_buffers = apply(params, buffers, *args)``, with ``buffers`` left untouched.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from zfunc.pipeline import ACTIVE as PIPELINE_STAGE
from zfunc.prefetch import ACTIVE


def _buffer_snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers()}


def _fresh(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # The forward pass may update buffers in place (BatchNorm's running stats): give it copies so
    # the caller's tensors never change.
    return {name: b.clone() for name, b in buffers.items()}


def _check_params(params: Any, expected: frozenset[str]) -> None:
    if not isinstance(params, dict):
        raise TypeError(f"params: expected a dict[str, Tensor], got {type(params).__name__}")
    unknown = params.keys() - expected
    if unknown:
        raise KeyError(
            f"params: names {sorted(unknown)[:5]} are not parameters of the module "
            f"(expected its trainable names {sorted(expected)[:5]}...)"
        )
    missing = expected - params.keys()
    if missing:  # taking them from the module instead would silently never train them
        raise KeyError(
            f"params: {len(missing)} trainable parameters of the module are missing: {sorted(missing)[:5]} "
            f"(expected every name of the params functionalize returned, {len(expected)} in all)"
        )


def functionalize(module: nn.Module, *, with_buffers: bool = False) -> tuple[Callable[..., Any], Any]:
    """Split ``module`` into a pure ``apply`` function and its parameters.

    Args:
      module: any ``nn.Module``; it is not modified, now or when ``apply`` runs.
      with_buffers: also return the module's buffers as explicit state (see the module docstring).

    Returns:
      ``(apply, params)``, or ``(apply, (params, buffers))`` with ``with_buffers=True``. ``params``
      maps each trainable parameter's qualified name to a detached alias of it (same dtype, device
      and storage); parameters with ``requires_grad=False`` are frozen into ``apply`` instead.
      ``apply``'s ``params`` must hold every trainable name, else ``KeyError`` names the missing.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    trainable = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
    names = frozenset(trainable)

    def call(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], args, kwargs):
        _check_params(params, names)
        gatherer = ACTIVE.get()  # a ZeRO-3 step is running: its units gather params around each forward
        stage = PIPELINE_STAGE.get()  # a pipeline stage is running: it runs its own units only
        with stage.running(module) if stage is not None else nullcontext():
            if gatherer is None:
                return functional_call(module, ({**trainable, **params}, frozen, buffers), args, kwargs)
            with gatherer.running(module):
                return functional_call(module, ({**trainable, **params}, frozen, buffers), args, kwargs)

    if with_buffers:

        def apply_with_buffers(params, buffers, *args, **kwargs):
            """``(out, new_buffers)``: the module's output and its updated buffers (copies)."""
            new_buffers = _fresh(buffers)
            return call(params, new_buffers, args, kwargs), new_buffers

        return apply_with_buffers, (trainable, _buffer_snapshot(module))

    snapshot = _buffer_snapshot(module)

    def apply(params, *args, **kwargs):
        """The module's output for ``params``; buffers come from a snapshot and stay unchanged."""
        return call(params, _fresh(snapshot) if snapshot else snapshot, args, kwargs)

    return apply, trainable
