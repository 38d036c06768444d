"""``TrainerOptimizer``: a torch optimizer a trainer holds while a zfunc engine trains.

Trainers (transformers' ``Trainer``, Lightning's) keep a ``torch.optim.Optimizer`` in their loop:
they read its learning rate, call ``zero_grad``, save its ``state_dict``. When a zfunc engine
(``zfunc.deepspeed.Engine``) trains, the update and the optimizer state are the engine's, so the
trainer is given this view: one param group (one empty tensor, no model param), whose ``lr`` is the
engine's next update's, refreshed by ``step``; ``step`` updates nothing and ``zero_grad`` clears
nothing (the engine keeps no grads between its steps). Its ``state_dict`` is torch's for an empty
state: the engine's state goes into the trainer's checkpoint through the adapter's own hooks.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class TrainerOptimizer(torch.optim.Optimizer):
    """The trainer's optimizer over the engine ``engine()`` returns (None before it is built: the
    group's ``lr`` stays ``lr``)."""

    def __init__(self, engine: Callable[[], Any], lr: float):
        super().__init__([torch.zeros(0, requires_grad=True)], {"lr": lr})
        self._engine = engine

    def refresh(self) -> None:
        """Set the group's ``lr`` to the engine's next update's."""
        engine = self._engine()
        if engine is not None:
            self.param_groups[0]["lr"] = engine.get_lr()[0]

    def step(self, closure: Any = None) -> None:
        """Nothing is updated here (the engine updates at its own step); the ``lr`` is refreshed."""
        self.refresh()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine holds no grads between steps."""
