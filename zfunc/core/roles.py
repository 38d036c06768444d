"""Roles: the four jobs a sharded or offloaded step's call is made of, each a plain object.

A transformation *provides* the roles it owns and leaves the others to the step it wraps
(``ShardedStep.roles``, ``OffloadedStep.roles``); one run class (``zfunc.sharding.run.StepRun``)
drives them for one call. The roles are made for each call, with its run, and dropped after it:
per-call state lives in them and in the run, never on the step (docs/design.md, sections 3-4).

Each role is a small object with one job; what the run asks of it:

- **params source** (``params``): where the compute reads params. ``pieces(params) ->
  (pieces, treespec)``: this rank's param pieces, indexable in leaf order (the gather of the
  run's stage then makes them whole, by bucket or per unit); ``device(pieces)``: where the step
  computes. ``zfunc.sharding.run.LocalPieces`` (the state's own tensors), ``zfunc.offloading.run.StoredPieces``
  (compute copies, else masters read ahead from RAM or swap files).
- **grad sink** (``grads``): where reduced grads go. ``open(pieces)``: this call's sink, whose
  ``deliver(group, slices)`` the reducer calls with each group's reduced fp32 slices, ``early``
  asks for delivery as soon as a group is complete, ``result()`` gives the grads (a list in leaf
  order, or None where they were consumed); ``before_backward(loss)`` sees each microbatch's
  loss between its forward and backward. ``zfunc.sharding.run.ReducedSlices`` (fp32 slices like the
  pieces), ``zfunc.offloading.run.HeldSlices`` (fp32 CPU slices), ``zfunc.offloading.run.UpdateOnArrival``
  (updates each leaf as its grad arrives).
- **update** (``update``): ``apply(state, grads, loss, aux) -> (state, metrics)``.
  ``zfunc.sharding.run.PlainUpdate`` (the plain step's rule on this rank's pieces),
  ``zfunc.offloading.run.LeafUpdate`` (leaf by leaf from the stores, writes in flight).
- **schedule** (``schedule``): how a batch becomes microbatches: ``count``, ``split(batch)`` and
  ``ops(stages, stage)``, the order of forwards ``("F", i)`` and backwards ``("B", i)`` on one
  stage. ``Accumulation`` here; the pipeline's ``zfunc.pipelining.stage.PipelineSchedule`` (GPipe,
  1F1B). Accumulation is 1F1B on one stage: each microbatch's backward follows its forward, and
  ``StepRun`` runs the two together; the pipeline's own run drives its schedule (docs/design.md,
  section 3: why the pipeline stays the outermost transformation).

Every role has ``finish()`` (``Role``); the run calls those of the params source, the grad sink
and the update once after the call, also when it failed: what they learned for the next call is
written back to the step there (offload's read and update orders), and writes in flight end.

To swap a role, replace the step's ``roles`` provider on the step object; no subclass needed::

    default = step.roles

    def mine(run, state):
        roles = default(run, state)
        return roles.replace(grads=MySink(roles.grads))  # MySink wraps the default grad sink

    step.roles = mine

Cost: four small objects per call (offload's roles also open its stores, as its run did before).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from zfunc.core.step import split_batch

PyTree = Any


class Role:
    """Base of the roles: ``finish()`` after the call, nothing by default."""

    def finish(self) -> None:
        """Called once after the call (also when it failed)."""


@dataclass(frozen=True)
class Roles:
    """The roles of one call (module docstring), made by the step's ``roles(run, state)``."""

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

    def finish(self) -> None:
        """Each role's ``finish``, in order: params source, grad sink, update."""
        self.params.finish()
        self.grads.finish()
        self.update.finish()


class Accumulation(Role):
    """Gradient accumulation: the batch split along dim 0 into ``count`` equal microbatches, each
    run forward then backward before the next (``train_step(accum=)``); grads sum over them."""

    def __init__(self, count: int):
        self.count = count

    def split(self, batch: PyTree) -> list[PyTree]:
        """``count`` microbatches of ``batch`` (every tensor's leading dim must divide)."""
        return split_batch(batch, self.count)

    def ops(self, stages: int = 1, stage: int = 0) -> list[tuple[str, int]]:
        """``[("F", 0), ("B", 0), ("F", 1), ...]``: one stage, each backward after its forward."""
        if stages != 1:
            raise ValueError(f"stages: accumulation runs on one stage, got {stages}")
        return [op for i in range(self.count) for op in (("F", i), ("B", i))]
