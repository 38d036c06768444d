"""``Transformed``: the base of the steps that transformations return, reading its configuration
fields from the step it wraps."""
from __future__ import annotations

from typing import Any

from zfunc.core.step import Step


class _FromInner:
    """A configuration field of a ``Transformed`` step: its ``inner`` step's, unless set on this
    step (an instance attribute of the same name, which this non-data descriptor yields to)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, step: Any, owner: type | None = None) -> Any:
        return self if step is None else getattr(step.inner, self.name)


class Transformed(Step):
    """Base of the steps that transformations return: it *wraps* ``inner``, the step it was given,
    keeps the roles its transformation owns (where params come from, where grads go, how the
    update runs, the microbatch schedule; docs/design.md) and reads the configuration fields below
    from ``inner``: the loss, the optimizer, precision, accumulation, donation, seed and skip
    policy. Nothing is copied, so a chain of wrappers has one source for each field; setting one
    (``step.loss_fn = ...``) sets it on this step only. Anything else a transformation reads of
    the step it wraps, it reads from ``inner`` (or the wrapped step it keeps) by name.
    ``layers`` records the transformation (``zfunc.core.compose``).
    """

    loss_fn = _FromInner()
    optimizer = _FromInner()
    precision = _FromInner()
    accum = _FromInner()
    donate = _FromInner()
    has_aux = _FromInner()
    seed = _FromInner()
    max_skips = _FromInner()
    grad_norm = _FromInner()
    compute_dtype = _FromInner()
    schedule = _FromInner()

    def __init__(self, inner: Step, layer: str):  # no Step.__init__: its fields are inner's
        self.inner = inner
        self.layers = (*inner.layers, layer)
