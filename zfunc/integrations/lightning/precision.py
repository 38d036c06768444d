"""``ZfuncPrecision``: the precision plugin through which Lightning's loop reaches the engine.

Lightning's automatic optimization calls, per batch (the strategy handles accumulation):
``precision.optimizer_step(optimizer, model, closure)``, whose closure runs ``training_step`` and
``precision.backward(loss)``. Here ``backward`` is the engine's (``strategy.engine_backward``) and
``optimizer_step`` runs the closure, Lightning's ``on_before_optimizer_step`` hooks, then the
engine's step (``strategy.engine_step``: the update at the accumulation boundary). Gradient
clipping is the engine's (the plan's ``gradient_clipping``), so ``clip_gradients`` does nothing.
The compute precision is the plan's; ``precision`` only names it as Lightning does.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision

from zfunc.integrations.lightning.config import PRECISIONS, refuse


class ZfuncPrecision(Precision):
    """Lightning's precision plugin for ``ZfuncStrategy`` (module docstring)."""

    def __init__(self, precision: str = "32-true"):
        super().__init__()
        self.precision = precision

    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        if args or kwargs:
            raise refuse("LightningModule.backward arguments", "the engine's backward takes the loss alone")
        model.trainer.strategy.engine_backward(tensor)

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule, closure: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise refuse(f"optimizer.step({', '.join(kwargs)}=...)", "the engine steps on its own")
        result = closure()
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clip_gradients (nothing)
        if result is None:
            raise refuse("training_step returning None", "the engine's step needs each batch's loss")
        model.trainer.strategy.engine_step()
        return result

    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """Nothing: the engine clips (``gradient_clip_val`` is the plan's ``gradient_clipping``)."""


def from_trainer(plugin: Precision) -> ZfuncPrecision:
    """The ``ZfuncPrecision`` for the plugin Lightning made from ``Trainer(precision=...)``: fp32, or
    bf16/fp16 mixed (the engine computes in it and keeps fp32 masters); any other is refused."""
    if isinstance(plugin, ZfuncPrecision):
        return plugin
    kind = str(getattr(plugin, "precision", "32-true"))
    if kind not in PRECISIONS or type(plugin).__name__ not in ("Precision", "MixedPrecision"):
        raise refuse(f"Trainer(precision={kind!r}) (plugin {type(plugin).__name__})",
                     "expected '32-true', 'bf16-mixed' or '16-mixed'; the engine keeps fp32 masters and computes in "
                     "the plan's precision")
    return ZfuncPrecision(kind)
