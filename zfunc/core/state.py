"""The state a training step carries from call to call: ``TrainState``, an optree node.

A donating step *consumes* the state it is given (it may update its tensors in place) and marks
it, so that reading it afterwards raises ``ConsumedStateError`` instead of showing changed values
(JAX's buffer donation; see ``zfunc.core.step``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

from zfunc.core import tree

PyTree = Any


class ConsumedStateError(RuntimeError):
    """A ``TrainState`` was read after a donating step consumed it."""


FIELDS = ("params", "opt_state", "step", "rng", "loss_scale", "buffers")  # a TrainState's fields, in pytree order
# Called before a donating step first writes into any state's buffers: a background
# ``zf.checkpoint.save`` registers one that waits until it has copied the state it is saving
# (``zfunc.checkpoint.background``), so donation stays safe while a save is under way.
before_consume: list[Callable[[], None]] = []


class TrainState:
    """Everything a training run carries from step to step; an optree node (namespace "zfunc").

    Fields: ``params`` (pytree of fp32 master tensors), ``opt_state`` (the optimizer's state),
    ``step`` (int, steps taken), ``rng`` (int, the base seed; step ``k`` seeds torch's RNG from
    ``(rng, k)``), ``loss_scale`` (``precision.LossScale``: fp16's dynamic scale, a fixed 1.0 for
    fp32/bf16; in all three it also counts the non-finite steps skipped in a row), ``buffers``
    (keyword; dict name -> tensor: the module buffers the forward updates in training, BatchNorm's
    running statistics; empty until a step first writes one, see ``zfunc.model.functional``; whole, never
    split, on every rank of a sharded state).
    ``placement`` is static metadata, not a pytree child: ``None`` for a plain state, else the spec
    of the transformation that placed ``params`` and ``opt_state``: ``zfunc.sharding.layout.ShardSpec``
    (split over ranks), ``zfunc.offloading.placement.OffloadSpec`` (and kept in RAM or swap files),
    ``zfunc.pipelining.step.PipelineSpec`` (one pipeline stage's share).
    """

    __slots__ = ("_values", "_taken", "placement")

    def __init__(self, params: PyTree, opt_state: PyTree, step: int = 0, rng: int = 0, loss_scale=None,
                 placement: Any = None, *, buffers: dict[str, Any] | None = None):
        if buffers is not None and not isinstance(buffers, dict):
            raise TypeError("buffers: expected a dict[str, Tensor] (name -> module buffer), "
                            f"got {type(buffers).__name__}")
        self._values = (params, opt_state, step, rng, loss_scale, {} if buffers is None else buffers)
        self._taken = False  # not ``_consumed``, whose setter runs only on taking
        self.placement = placement

    def _get(self, i: int) -> Any:
        if self._consumed:
            raise ConsumedStateError(
                "this TrainState was consumed by a step (its buffers may have been updated in place); "
                "use the state that step returned, or build the step with train_step(..., donate=False)"
            )
        return self._values[i]

    params = property(lambda self: self._get(0), doc="pytree of fp32 master params")
    opt_state = property(lambda self: self._get(1), doc="the optimizer's state")
    step = property(lambda self: self._get(2), doc="number of steps taken (skipped ones included)")
    rng = property(lambda self: self._get(3), doc="base seed of the step's random numbers")
    loss_scale = property(lambda self: self._get(4), doc="precision.LossScale (and the skips in a row)")
    buffers = property(lambda self: self._get(5), doc="module buffers training updates: dict name -> tensor")

    @property
    def _consumed(self) -> bool:
        return self._taken

    @_consumed.setter
    def _consumed(self, value: bool) -> None:
        if value:  # a step is about to write into the state's buffers
            for wait in before_consume:
                wait()
        self._taken = value

    @property
    def consumed(self) -> bool:
        """True once a donating step has taken this state."""
        return self._consumed

    def replace(self, **changes: Any) -> TrainState:
        """A new state with ``changes`` applied (``dataclasses.replace``-style)."""
        unknown = changes.keys() - set(FIELDS)
        if unknown:
            raise TypeError(f"replace: unknown fields {sorted(unknown)}; expected some of {FIELDS}")
        values = dict(zip(FIELDS, (self._get(i) for i in range(len(FIELDS)))))
        return TrainState(**{**values, **changes}, placement=self.placement)

    def __repr__(self) -> str:
        if self._consumed:
            return "TrainState(<consumed>)"
        n = tree.numel(self._values[0])
        buffers = f", buffers={len(self._values[5])}" if self._values[5] else ""
        return f"TrainState(step={self._values[2]}, params={n} elements{buffers}, loss_scale={self._values[4]})"


optree.register_pytree_node(
    TrainState,
    lambda s: (tuple(s._get(i) for i in range(len(FIELDS))), s.placement, FIELDS),
    lambda placement, children: TrainState(*children[:-1], placement=placement, buffers=children[-1]),
    namespace=tree.NAMESPACE,
)


def require_train_state(state: Any) -> None:
    """Raise a ``TypeError`` naming what was passed unless ``state`` is a ``TrainState``."""
    if not isinstance(state, TrainState):
        raise TypeError(f"state: expected a TrainState from step.init(params), got {type(state).__name__}")
