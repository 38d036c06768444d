"""Roles: the four jobs a sharded or offloaded step's call is made of, each a plain object, and the
context they read.

A transformation *provides* the roles it owns and leaves the others to the step it wraps
(``ShardedStep.roles``, ``OffloadedStep.roles``); one run class (``zfunc.sharding.run.StepRun``)
drives them for one call. The roles are made for each call, with its run, and dropped after it:
per-call state lives in them and in the run, never on the step (docs/design.md, sections 3-4).

**The contract.** For each call the run makes a ``RunContext`` (frozen: the state's placement, the
grad divisor, the sum over the ranks, the finite check) and asks the step for the call's roles,
``step.roles(context, state) -> Roles``; a role reads the run through that context alone, and the
step's configuration through what its ``roles`` gave it when it made it. After the call (also
when it failed) the run asks the roles what they learned (``Roles.finish``), adds what it learned
itself and hands it all to the step in one call, ``step.learn(learned)``: the one place a step's
learned state (unit and bucket orders, offload's read and update orders, what the call measured)
is written. No role writes onto the step.

Each role is a small object with one job; what the run asks of it:

- **params source** (``params``): where the compute reads params. ``pieces(params) ->
  (pieces, treespec)``: this rank's param pieces, indexable in leaf order (the gather of the
  run's stage then makes them whole, by bucket or per unit); ``device(pieces)``: where the step
  computes. ``zfunc.sharding.run.LocalPieces`` (the state's own tensors), ``zfunc.offloading.run.StoredPieces``
  (compute copies, else masters read ahead from RAM or swap files).
- **grad sink** (``grads``): where reduced grads go. ``open(pieces)``: this call's sink, whose
  ``deliver(group, slices)`` the reducer calls with each group's reduced fp32 slices (stage 0:
  whole-shaped, already divided: ``context.grad_divisor`` is 1.0 there), ``early`` asks for
  delivery as soon as a group is complete, ``result()`` gives the grads (a list in leaf order, or
  None where they were consumed); ``before_backward(loss)`` sees each microbatch's loss between its
  forward and backward. ``zfunc.sharding.run.ReducedSlices`` (fp32 slices like the pieces),
  ``zfunc.offloading.run.HeldSlices`` (fp32 CPU slices), ``zfunc.offloading.grads.UpdateOnArrival`` (updates
  each leaf as its grad arrives).
- **update** (``update``): ``apply(state, grads, loss, aux, produced) -> (state, metrics)``, given
  this rank's loss and, per leaf, 1 where this rank's backward produced a grad (None at stage 0,
  whose loss and grads are totals already). It sums what needs summing over the ranks with
  ``context.sum_across`` (``zfunc.core.totals.sum_over_ranks``: the squared grad norm's parts, the
  loss and the flags in one all-reduce), decides with ``context.finite`` and updates.
  ``zfunc.sharding.run.PlainUpdate`` (the plain step's rule on this rank's pieces),
  ``zfunc.offloading.run.LeafUpdate`` (leaf by leaf from the stores, writes in flight).
- **schedule** (``schedule``): how a batch becomes microbatches: ``count``, ``split(batch)`` and
  ``ops(stages, stage)``, the order of forwards ``("F", i)`` and backwards ``("B", i)`` that the
  one microbatch loop (``zfunc.core.microbatches.run_microbatches``) runs. ``Accumulation`` here:
  each microbatch's backward right after its forward.

Every role has ``finish() -> dict``: called once after the call, also when it failed, it ends the
role's work in flight (offload's writes) and returns what it learned for the next call (offload's
read and update orders), which the run hands to ``step.learn``.

**The pipeline leaves Roles.** ``zf.pipeline``'s run (``zfunc.pipelining.stage._Run``) drives its own
schedule (``PipelineSchedule``, GPipe or 1F1B, a schedule of the one microbatch loop like
``Accumulation``) and is no ``StepRun``: its params source (the stage's own params, shared ones
lent by stage 0, zero-memory stand-ins), its grad sink (``autograd.grad`` with the activation grads
received from the next stage, the shared params' grads sent back) and its update (the plain rule,
summed over pp and dp) are tied to its point-to-point order, and since the pipeline is the
outermost transformation (``zfunc.core.compose``), no transformation wraps it to swap one of them.
So it has no ``roles`` provider, and its schedule is not a ``Role``.

To swap a role, replace the step's ``roles`` provider on the step object; no subclass needed::

    default = step.roles

    def mine(context, state):
        roles = default(context, state)
        return roles.replace(grads=MySink(roles.grads))  # MySink wraps the default grad sink

    step.roles = mine

Cost: four small objects and a context per call.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from zfunc.core.microbatches import split_batch

PyTree = Any
SumAcross = Callable[[torch.Tensor, str], torch.Tensor]


@dataclass(frozen=True)
class RunContext:
    """What a call's roles read from the run that drives them (module docstring).

    ``spec``: the state's placement (a ``ShardSpec``; an ``OffloadSpec`` for an offloaded step),
    the layout of this rank's pieces. ``grad_divisor``: what the grads delivered to the grad sink
    are divided by to be the step's mean grads: ranks x microbatches x loss scale (the reducers
    deliver sums of the scaled loss's grads), 1.0 where the reducer divides them itself (stage 0).
    ``sum_across(t, label) -> t``: ``t`` summed over the data-parallel ranks, in place, one
    all-reduce named ``label``; None at stage 0, whose grads are whole and equal on every rank and
    whose loss is summed with the last grad bucket. ``finite(loss, norm, step, loss_scale) ->
    bool``: the step's finite check (``Step.finite``; raises after ``max_skips`` skips in a row).
    """

    spec: Any
    grad_divisor: float
    sum_across: SumAcross | None
    finite: Callable[[torch.Tensor, torch.Tensor | None, int, Any], bool]


class Role:
    """Base of the roles: ``finish()`` after the call, learning nothing by default."""

    def finish(self) -> dict[str, Any]:
        """Called once after the call (also when it failed): ends the role's work in flight and
        returns what it learned for the next call (``step.learn`` keeps it)."""
        return {}


@dataclass(frozen=True)
class Roles:
    """The roles of one call (module docstring), made by the step's ``roles(context, state)``."""

    params: Any
    grads: Any
    update: Any
    schedule: Any

    def replace(self, **roles: Any) -> Roles:
        """These roles with some replaced (``params=``, ``grads=``, ``update=``, ``schedule=``)."""
        unknown = sorted(set(roles) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"Roles.replace: unknown role {unknown[0]!r}; expected params, grads, update or schedule")
        return replace(self, **roles)

    def finish(self) -> dict[str, Any]:
        """Each role's ``finish``, in order (params source, grad sink, update), every one called even
        if one raises; what they learned, merged."""
        learned: dict[str, Any] = {}
        try:
            learned.update(self.params.finish() or {})
        finally:
            try:
                learned.update(self.grads.finish() or {})
            finally:
                learned.update(self.update.finish() or {})
        return learned


class Accumulation(Role):
    """Gradient accumulation: the batch split along dim 0 into ``count`` equal microbatches, each
    run forward then backward before the next (``train_step(accum=)``); grads sum over them."""

    def __init__(self, count: int):
        self.count = count
        self._ops = [op for i in range(count) for op in (("F", i), ("B", i))]

    def split(self, batch: PyTree) -> list[PyTree]:
        """``count`` microbatches of ``batch`` (every tensor's leading dim must divide)."""
        return [batch] if self.count == 1 else split_batch(batch, self.count)

    def ops(self, stages: int = 1, stage: int = 0) -> list[tuple[str, int]]:
        """``[("F", 0), ("B", 0), ("F", 1), ...]``: one stage, each backward after its forward."""
        if stages != 1:
            raise ValueError(f"stages: accumulation runs on one stage, got {stages}")
        return self._ops
