"""One call of a sharded or offloaded step: everything that lives for one ``step(state, batch)``.

A ``StepRun`` is made by ``ShardedStep.__call__`` and ``OffloadedStep.__call__`` for each call. It
makes the call's ``RunContext`` (the state's placement, the grad divisor, the sum over the ranks,
the finite check) and asks the step for the call's roles (``step.roles(context, state)``,
``zfunc.core.roles``): where params come from, where grads go, how the update runs and the
microbatch schedule. It runs the schedule through the one microbatch loop
(``zfunc.core.microbatches.run_microbatches``) with ZeRO's machinery, which stays here: the gathers
(stages 1/2: whole by bucket; stage 3: per unit, ``prefetch.Gatherer``) and the grad reducers. It
holds the state's layout, the groups (buckets or units) and their orders as this call knows them,
the per-leaf "this rank produced a grad" flags and the peaks it measured. Shard's own roles are
here too: ``LocalPieces``, ``ReducedSlices``, ``PlainUpdate``; offload's are in
``zfunc.offloading.run``.

The step object keeps only its configuration and what it learned (stage 3's units and their run
order, stages 0-2's bucket order, stage 0's bucket buffers), so one step object can drive any
number of states (docs/design.md, "Run objects"). The run reads that learned state when it starts;
what the call learns it keeps, and ``finish`` hands it back, with its roles', for the step to
record in one place (``step.learn``).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from zfunc.core import precision as mp, tree
from zfunc.core.microbatches import run_microbatches, step_seed
from zfunc.core.roles import Role, RunContext
from zfunc.core.grads import split_loss
from zfunc.core.step import Step, TrainState
from zfunc.core.totals import sum_over_ranks
from zfunc.model.functional import BufferScope, carrying, run_by
from zfunc.sharding.layout import FlatGroup, ShardSpec, _placeholder, bucket_groups, gather_whole, leaf_names
from zfunc.sharding.hpz import SecondaryGatherer
from zfunc.sharding.prefetch import Gatherer
from zfunc.sharding.reduce import (Buckets, GradAllReducer, GradReducer, GradSlices, average_buffers,
                                   average_order)

PyTree = Any


def _summer(comm) -> Callable[[torch.Tensor, str], torch.Tensor]:
    """The context's ``sum_across``: ``t`` summed over the data-parallel ranks, in place, by ``comm``.
    A closure over the comm, not a bound method of the run: the run holds the context, which the
    roles hold, and a cycle through them keeps every buffer of the call alive until Python's cyclic
    GC runs."""
    def sum_across(t: torch.Tensor, label: str) -> torch.Tensor:
        comm.all_reduce(t, label=label)
        return t

    return sum_across


class StepRun:
    """One call of a ``ShardedStep`` or an ``OffloadedStep`` (``step``, the step called; its
    ``sharded`` holds the layout's configuration and learned state), driving the roles the step
    gives it (see the module docstring)."""

    def __init__(self, step: Step, state: TrainState):
        sharded = step.sharded  # the ShardedStep: the layout and its learned state
        self.step, self.sharded, self.mesh, self.stage = step, sharded, sharded.mesh, sharded.stage
        self.spec: ShardSpec = state.placement
        scale = state.loss_scale and state.loss_scale.scale
        # reduced grads are sums over the ranks and microbatches of the scaled loss's grads
        self.reduce_divisor = self.spec.world * step.accum * (scale or 1.0)
        self.groups: list[FlatGroup] | None = sharded._flat_groups  # buckets, or stage 3's units
        self.unit_order: list[int] = sharded.order or []  # stage 3: the units' run order ([]: record it)
        self.buckets_ordered = sharded._buckets_ordered
        self.gather_groups: list[FlatGroup] | None = sharded._gather_groups  # stages 1/2's param gathers
        self.learned: dict[str, Any] = {"unit_order": self.unit_order} if self.stage == 3 and not sharded.order else {}
        self.peak_gathered_bytes = 0  # most whole-param bytes held at once
        self.peak_whole_grad_bytes = 0  # most whole-grad bytes held at once
        self.produced: torch.Tensor | None = None  # per leaf, 1 where this rank's backward produced a grad
        self._live: dict[int, tuple] = {}  # microbatches between their forward and backward
        self.context = RunContext(self.spec, 1.0 if self.stage == 0 else self.reduce_divisor,
                                  None if self.stage == 0 else _summer(self.mesh.comm), step.finite)
        self.roles = step.roles(self.context, state)  # this call's params source, grad sink, update and schedule
        self._opt_state = state.opt_state if self.stage == 0 else None  # read before backward consumes it
        if self.roles.schedule.count != step.accum:
            raise ValueError(f"roles: the schedule runs {self.roles.schedule.count} microbatches, but the step "
                             f"accumulates {step.accum} (train_step(accum=)); a sharded step's schedule is its "
                             "accumulation")

    def execute(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        """The step on ``state`` (already checked by the step): the new state and the metrics.
        ``finish`` follows, also when this fails."""
        number = state.step  # read first: an overlapped update consumes the state during backward
        with carrying(state.buffers) as carried:
            loss, aux, grads = self._loss_and_grads(state, batch)
        buffers = self._average_buffers(carried, number)
        new_state, metrics = self.roles.update.apply(state, grads, loss, aux, self.produced)
        metrics["loss"] = metrics["loss"] / self.spec.world  # the total over the ranks: their mean
        return new_state.replace(buffers=buffers), metrics

    def finish(self) -> dict[str, Any]:
        """End the call: each role's ``finish`` (its work in flight ends) and what the call learned,
        the roles' and the run's, for ``step.learn``: ``groups``, ``unit_order``, ``grad_order``,
        ``buckets_ordered``, ``bucket_buffers``, ``gather_groups``, ``buffer_names`` where this call
        learned them, and the peaks it measured (``ShardedStep.learn`` says what each is)."""
        learned = self.roles.finish()
        learned.update(self.learned)
        learned.update(peak_gathered_bytes=self.peak_gathered_bytes, peak_whole_grad_bytes=self.peak_whole_grad_bytes)
        return learned

    # ------------------------------------------------------------------ forward and backward
    def _loss_and_grads(self, state: TrainState, batch: PyTree):
        """This rank's mean loss over its microbatches (stage 0: the sum over the ranks of theirs),
        and its fp32 grads (stages 1-3: its slice, stage 0: whole) averaged over the ranks."""
        params, step = state.params, state.step
        if self.stage == 3 and self.groups is None:  # unit binding maps param names to leaves
            self._names = leaf_names(params)
        self.pieces, self.treespec = self._pieces(params)
        self.device = self.roles.params.device(self.pieces)
        self.sink = self.roles.grads.open(self.pieces)
        self.scale, self.number = mp.scale_of(state.loss_scale), step
        if self.stage > 0:
            self.produced = torch.zeros(len(self.spec.leaves))
        if self.sharded._grad_order is not None:
            self._order_buckets(step)
        self.mesh.clear_comm_bytes()
        start, forward = ((self._start_replicated, self._forward_replicated) if self.stage == 0
                          else (self._start_sharded, self._forward_sharded))
        start()
        loss, aux = run_microbatches(self.roles.schedule, batch, self.step.compute_dtype, step_seed(state.rng, step),
                                     params, forward, self._backward)
        reducer, sink = self.reducer, self.sink
        # what the microbatches held (whole params, the compute copy, whole grads) goes before the update
        self.reducer = self.sink = self.whole = self.compute = self.pieces = None
        if self.stage > 0 and not self.eager:
            reducer.reduce_accumulated()
        if self.stage < 3 and not self.buckets_ordered:
            self.learned["grad_order"] = reducer.arrived  # learned once
        if self.stage == 0:  # summed over the ranks with the last bucket; execute averages it over them
            loss = reducer.loss / self.roles.schedule.count
        grads = sink.result()
        return loss, aux, grads and tree.unflatten(self.treespec, grads)

    def _start_replicated(self) -> None:
        """Stage 0: the whole params in the compute dtype (the fp32 masters themselves at fp32),
        and ``GradAllReducer``, which sums each microbatch's grads into the kept fp32 buckets and
        all-reduces them during the last microbatch's backward, then divides them."""
        pieces = self.pieces
        self.compute = [p.to(self.step.compute_dtype) for p in pieces]
        self.peak_gathered_bytes = sum(c.numel() * c.element_size() for c, p in zip(self.compute, pieces) if c is not p)
        buckets, kept = self._buckets(), self.sharded._bucket_buffers
        if kept is None or (kept.groups, kept.device) != (buckets, self.device):
            kept = Buckets(buckets, self.spec.leaves, self.device)  # a new order or place: new buffers, kept
            self.learned["bucket_buffers"] = kept
        # an optimizer that communicates itself this step (1-bit) takes this rank's own mean grads
        local = self.step.optimizer.local_grads is not None and self.step.optimizer.local_grads(self._opt_state)
        self.reducer = GradAllReducer(self.mesh.reduce_comm, ShardSpec(0, 1, 0, self.spec.leaves), kept,
                                      self.sink.deliver, self.number,
                                      self.reduce_divisor / self.spec.world if local else self.reduce_divisor, local)

    def _forward_replicated(self, i: int, micro: PyTree) -> tuple[torch.Tensor, Any]:
        self.reducer.eager = i == self.roles.schedule.count - 1  # DDP's no_sync before the last microbatch
        return self._forward(i, micro, [c.detach().requires_grad_() for c in self.compute], None, self.reducer)

    def _start_sharded(self) -> None:
        """Stages 1-3: stages 1/2 gather every param whole now; reducers are made per microbatch,
        except at stage 1 with accumulation, which sums whole grads and reduce-scatters once."""
        self.whole = (self._own_whole() or gather_whole(self.pieces, self.spec, self._gather_groups(),
                                                         self.mesh.comm, self.step.compute_dtype, self.device,
                                                         f"step {self.number}")
                      if self.stage < 3 else None)
        self.peak_gathered_bytes = tree.nbytes(self.whole) if self.whole else 0
        self.eager, self.reducer = self.stage > 1 or self.roles.schedule.count == 1, None

    def _own_whole(self) -> list[torch.Tensor] | None:
        """One rank whose pieces are already whole, in the compute dtype, where it computes (offload's
        compute copies; fp32 masters at fp32): those very tensors, no gathered copy. Else None."""
        if self.spec.world != 1 or not isinstance(self.pieces, list):  # not pieces read from a store on access
            return None
        dtype, pieces = self.step.compute_dtype, self.pieces
        if not all(isinstance(p, torch.Tensor) and p.dtype == dtype and p.device.type == self.device.type
                   for p in pieces):
            return None
        return [p.detach().view(leaf.shape) for p, leaf in zip(pieces, self.spec.leaves)]

    def _forward_sharded(self, i: int, micro: PyTree) -> tuple[torch.Tensor, Any]:
        leaves, gatherer, groups = self._microbatch_leaves()
        if self.reducer is None or self.eager:  # stage 1 with accum sums whole grads over microbatches
            sink = self.sink
            self.reducer = GradReducer(self.sharded.reduce_comm, self.spec, groups, sink.deliver, self.device,
                                       self.eager, self.number, lambda groups=groups: self._backward_order(groups()),
                                       on_group_done=gatherer.release if gatherer else None,
                                       keep_whole=self.stage == 1, deliver_early=sink.early, own_grads=sink.own)
        return self._forward(i, micro, leaves, gatherer, self.reducer)

    def _microbatch_leaves(self):
        """``(leaves, gatherer, groups)`` for one microbatch (``groups()``: what the reducer
        reduces by, the buckets or stage 3's units): stages 1/2 differentiate the gathered params;
        stage 3 hands out storage-less placeholders that its ``Gatherer`` fills per unit."""
        if self.stage < 3:
            return [w.detach().requires_grad_() for w in self.whole], None, self._buckets
        sharded, spec = self.sharded, self.spec
        leaves = [_placeholder(leaf.shape, self.step.compute_dtype, self.device) for leaf in spec.leaves]
        secondary = {} if sharded.hpz_group is None else {"group": sharded.hpz_group}  # hpZ
        gatherer = (SecondaryGatherer if secondary else Gatherer)(
            sharded.gather_comm, spec, self.pieces, leaves, self._units, self.unit_order, sharded.prefetch,
            self.number, sharded.verify, **secondary)
        return leaves, gatherer, lambda: gatherer.units

    def _forward(self, i: int, micro: PyTree, leaves: list, gatherer: Gatherer | None, reducer: GradReducer):
        """Microbatch ``i``'s forward; the reducer's hooks take each grad its backward produces."""
        handles = reducer.hook(leaves)
        with torch.enable_grad(), run_by(gatherer) if gatherer is not None else nullcontext():
            out = self.step.loss_fn(tree.unflatten(self.treespec, leaves), micro)
        loss, aux = split_loss(out, self.step.has_aux)
        reducer.forward_done(loss)
        if gatherer is not None and gatherer.units is None:
            raise ValueError("loss_fn: stage 3 needs the loss to run the model through the apply of "
                             "zf.functionalize (params reach the model only through it)")
        self.roles.grads.before_backward(loss)
        self._live[i] = (loss, leaves, gatherer, reducer, handles)
        return loss, aux

    def _backward(self, i: int) -> None:
        """Microbatch ``i``'s backward: its reducer reduces the grads as they are produced."""
        loss, leaves, gatherer, reducer, handles = self._live.pop(i)
        (loss * self.scale if self.scale is not None else loss).backward(inputs=leaves)
        for h in handles:
            h.remove()
        reducer.finish_microbatch()
        self.peak_whole_grad_bytes = max(self.peak_whole_grad_bytes, reducer.peak_bytes)
        if gatherer is not None:
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, gatherer.peak_bytes)
        if self.produced is not None:
            self.produced[torch.tensor(reducer.arrived, dtype=torch.long)] = 1.0

    # ------------------------------------------------------------------ groups and their orders
    def _pieces(self, params) -> tuple[Any, Any]:
        """``(pieces, treespec)``: this rank's param pieces, indexable in leaf order (the params source's)."""
        return self.roles.params.pieces(params)

    def _buckets(self) -> list[FlatGroup]:
        """Stages 0-2's buckets: the step's, else made now (and learned)."""
        if self.groups is None:
            size, first = self._bucket_sizes()
            self.groups = self.learned["groups"] = bucket_groups(self.spec.leaves, size, first_elems=first)
        return self.groups

    def _bucket_sizes(self) -> tuple[int, int | None]:
        """The grad buckets' sizes (``ShardedStep._bucket_sizes``): fitted to the model unless a step that
        offloads the sharded one runs it."""
        return self.sharded._bucket_sizes(self.spec, fit=self.step is self.sharded)

    def _gather_groups(self) -> list[FlatGroup]:
        """Stages 1/2: the groups the params are all-gathered in at the start of the step. Where the grad
        buckets are fitted smaller than ``bucket_mb`` (``_bucket_sizes``), groups of ``bucket_mb`` in leaf
        order (one collective for a model under 25 MiB a rank: a gather has no backward to overlap, and
        each collective costs its own round trip), made once and learned; else the grad buckets."""
        if self._bucket_sizes()[0] >= self.sharded.bucket_elems:
            return self._buckets()
        if self.gather_groups is None:
            self.gather_groups = self.learned["gather_groups"] = bucket_groups(self.spec.leaves,
                                                                               self.sharded.bucket_elems)
        return self.gather_groups

    def _units(self, module) -> list[FlatGroup]:
        """Stage 3's units: the step's, else bound now to the leaves of the model the loss runs."""
        if self.groups is None:
            self.groups = self.learned["groups"] = bind_units(self.sharded.units_selector, module, self.spec,
                                                              self._names)
        return self.groups

    def _backward_order(self, groups: list[FlatGroup]) -> list[int]:
        """The groups (buckets or units) in the order their grads complete: stage 3 reverses the
        recorded forward order of its units (those that did not run go last); stages 1/2's buckets
        are already in backward order."""
        if self.stage < 3:
            return list(range(len(groups)))
        ran = self.unit_order[::-1]
        return ran + [u for u in range(len(groups)) if u not in ran]

    def _order_buckets(self, step: int) -> None:
        """Stages 0-2, once, at the start of the second step: rebuild the buckets in the order the
        first step's backward produced the grads on rank 0 (leaves that got none last), as DDP
        rebuilds its buckets after its first iteration, so that each bucket is complete, and its
        reduce launched, as early as backward allows. Leaf order is the pytree's (sorted dict
        keys), not the model's: on the GPT it puts the embeddings, whose grads come last, in the
        first bucket of the reversed order, and as buckets are launched in order, no
        reduce-scatter overlapped backward at all. Every rank takes rank 0's order (one small
        all-gather, in no step's comm bytes), so their buckets match whatever their graphs did."""
        spec = self.spec
        arrived = list(dict.fromkeys(self.sharded._grad_order))
        seen = set(arrived)
        order = torch.tensor(arrived + [i for i in reversed(range(len(spec.leaves))) if i not in seen])
        everyone = torch.empty(spec.world * order.numel(), dtype=order.dtype)
        self.mesh.comm.all_gather(everyone, order, label=f"bucket order at step {step}")
        size, first = self._bucket_sizes()
        self.groups = bucket_groups(spec.leaves, size, everyone[: order.numel()].tolist(), first)
        self.buckets_ordered = True
        self.learned.update(groups=self.groups, grad_order=None, buckets_ordered=True)

    def _average_buffers(self, carried: BufferScope, step: int) -> dict[str, torch.Tensor]:
        """The step's module buffers, those a forward wrote averaged over the ranks (``zf.shard``'s
        docstring); the first time the set of written buffers changes, the ranks check they agree."""
        sharded = self.sharded
        names = average_order(carried)
        if names != sharded._buffer_names and sharded.verify and self.mesh.dp > 1:
            numel = sum(carried.buffers[n].numel() for n in names)
            self.mesh.comm.agree((len(names), numel), lambda op: f"buffer all-reduce of {op[0]} buffers, {op[1]} "
                                 "elements", f"step {step}: the ranks' forwards wrote different module buffers")
        self.learned["buffer_names"] = names
        return average_buffers(carried.buffers, names, self.mesh.comm, self.mesh.dp,
                               f"buffer all-reduce at step {step}")


def bind_units(selector, module, spec: ShardSpec, names: list[str]) -> list[FlatGroup]:
    """Stage 3's units: the groups ``selector(module)`` makes of the leaves (``names``: their param
    names, leaf order); ``ValueError`` naming the params no unit covers."""
    index = {name: i for i, name in enumerate(names)}
    flat = []
    for unit in selector(module):
        indices = [index[p] for p in unit.params if p in index]
        if indices:
            flat.append(FlatGroup(unit.name or "<root>", indices, spec.leaves, unit.users))
    covered = {i for fu in flat for i in fu.indices}
    missing = [names[i] for i in range(len(names)) if i not in covered]
    if missing:
        raise ValueError(f"units: params {missing[:5]} are in no unit of the model run by the loss")
    return flat


# ----------------------------------------------------------------------------- shard's roles


class LocalPieces(Role):
    """Params source: this rank's pieces are the state's own tensors, where the compute happens."""

    def pieces(self, params) -> tuple[Any, Any]:
        """``(pieces, treespec)``: this rank's param pieces, indexable in leaf order."""
        return tree.flatten(params)

    def device(self, pieces) -> torch.device:
        """Where the step computes: where the pieces live."""
        return pieces[0].device


class ReducedSlices(Role):
    """Grad sink: the reduced fp32 grad slices, summed into accumulators shaped like the pieces
    and divided by the context's ``grad_divisor`` at the end (``GradSlices``)."""

    def __init__(self, context: RunContext):
        self.context = context

    def open(self, pieces) -> GradSlices:
        """Where the reduced grad slices go: fp32 accumulators shaped like ``pieces``."""
        return GradSlices(lambda i: torch.zeros_like(pieces[i]), len(pieces), self.context.grad_divisor)

    def before_backward(self, loss: torch.Tensor) -> None:
        """Nothing to check before backward."""


class PlainUpdate(Role):
    """Update: the plain step's rule (``Step.update``) on this rank's pieces, after one sum over the
    ranks (``sum_over_ranks`` with the context's ``sum_across``) of the squared grad norm, the loss
    and the grads-produced flags; stage 0, whose grads are whole and equal on every rank and whose
    loss is a total already, takes its norm locally and sums nothing."""

    def __init__(self, context: RunContext, step: Step):
        self.context, self.step = context, step

    def apply(self, state: TrainState, grads: PyTree, loss: torch.Tensor, aux: Any, produced: torch.Tensor | None):
        """The new state and the metrics (their loss: the total over the ranks)."""
        norm = self.step.local_norm(grads)
        if self.context.sum_across is not None:
            norm, loss, produced = sum_over_ranks(self.context.sum_across, None if norm is None else norm * norm,
                                                  loss, produced)
        return self.step.update(state, grads, loss, aux, norm, produced=produced)
