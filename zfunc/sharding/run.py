"""One call of a sharded or offloaded step: everything that lives for one ``step(state, batch)``.

A ``StepRun`` is made by ``ShardedStep.__call__`` and ``OffloadedStep.__call__`` for each call. It
asks the step for this call's roles (``step.roles(run, state)``, ``zfunc.core.roles``): where params
come from, where grads go, how the update runs and the microbatch schedule; then it drives them
with ZeRO's machinery, which stays here: the gathers (stages 1/2: whole by bucket; stage 3: per
unit, ``prefetch.Gatherer``), the grad reducers and the step's one all-reduce (the loss, the grad
norm and per-leaf "produced a grad" flags). It holds the state's layout and loss scale, the
leaves whose grads arrived and the peaks it measured. Shard's own roles are here too:
``LocalPieces``, ``ReducedSlices``, ``PlainUpdate``; offload's are in ``zfunc.offloading.run``.

The step object keeps only its configuration and what it learned once (stage 3's units and their
run order, stages 0-2's bucket order, stage 0's bucket buffers), so one step object can drive any
number of states (docs/design.md, "Run objects"). Configuration and learned state are read from
the step by delegation; a run writes learned state only through ``self.sharded``, the
``ShardedStep`` (the step itself, or the one an offloaded step wraps), and its roles write theirs
in their ``finish``.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from zfunc import optim
from zfunc.core import precision as mp, tree
from zfunc.model.functional import carrying, run_by
from zfunc.sharding.prefetch import Gatherer
from zfunc.core.roles import Role
from zfunc.sharding.layout import ShardSpec, leaf_names, _placeholder
from zfunc.sharding.reduce import Buckets, GradAllReducer, GradReducer, GradSlices
from zfunc.core.step import Step, cuda_devices, step_seed, seeded, split_loss
from zfunc.core.state import TrainState

PyTree = Any


class StepRun:
    """One call of a ``ShardedStep`` or an ``OffloadedStep``, driving the roles the step gives it
    (see the module docstring)."""

    def __init__(self, step: Any, state: TrainState):
        self.step = step  # the step called: its configuration (and an offloaded step's roles)
        self.sharded = step.sharded  # the ShardedStep that learns the unit and bucket orders
        self._state_spec = state.placement
        self._loss_scale = state.loss_scale and state.loss_scale.scale
        # This call's loss and its 0/1 per leaf "this rank produced a grad", until an all-reduce sums them.
        self._to_sum: tuple[torch.Tensor, torch.Tensor] | None = None
        self._produced: torch.Tensor | None = None  # per leaf, ranks that produced a grad (once summed)
        self._arrived: list[int] = []  # the current microbatch's leaves whose grads backward produced
        self.peak_gathered_bytes = 0  # most whole-param bytes held at once
        self.peak_whole_grad_bytes = 0  # most whole-grad bytes held at once
        self.roles = step.roles(self, state)  # this call's params source, grad sink, update and schedule

    def __getattr__(self, name: str) -> Any:
        """The step's configuration and learned state (only called for what the run lacks)."""
        if name in ("step", "sharded", "roles"):
            raise AttributeError(name)
        return getattr(self.step, name)

    def execute(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        """The step on ``state`` (already checked by the step): the new state and the metrics.
        The roles finish after it, also when it fails (they write back what they learned)."""
        try:
            return self._execute(state, batch)
        finally:
            self.roles.finish()

    def _execute(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        params, step, rng, loss_scale = state.params, state.step, state.rng, state.loss_scale
        if self.stage == 3 and self._flat_groups is None:  # unit binding maps param names to leaves
            self.sharded._names = leaf_names(params)
        with carrying(state.buffers) as carried:
            loss, aux, grads = self._loss_and_grads(params, batch, step, rng, loss_scale)
        buffers = self.sharded._average_buffers(carried, step)
        if self.stage == 0:  # grads whole and equal on every rank: the norm is taken locally (the
            # loss was summed over the ranks with the last grad bucket)
            new_state, metrics = self.roles.update.apply(state, grads, loss, aux)
        else:
            # summed by the grad norm's all-reduce, the step's one sync; without a norm, alone (``_finite``)
            self._to_sum = (loss, self._produced)
            try:
                with optim.summing_across(self._sum_over_ranks):
                    new_state, metrics = self.roles.update.apply(state, grads, loss, aux)
            finally:
                self._produced, self._to_sum = None, None  # this step's only
        loss.div_(state.placement.world)  # metrics["loss"]: the mean over ranks
        return new_state.replace(buffers=buffers), metrics

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (global_norm's own temporary) summed over the ranks; the first call of a step
        also sums the step's loss and the per-leaf grads-produced flags, in the same all-reduce."""
        pending, self._to_sum = self._to_sum, None
        if pending is None:
            self.mesh.comm.all_reduce(t, label="grad-norm all-reduce")
            return t
        loss, produced = pending
        both = torch.cat([t.reshape(1), loss.reshape(1).to(t.device, t.dtype), produced.to(t.device, t.dtype)])
        self.mesh.comm.all_reduce(both, label="grad-norm, loss and grads-produced all-reduce")
        loss.copy_(both[1])
        produced.copy_(both[2:])
        return both[0]

    def _sum_loss_and_produced(self) -> None:
        """The step's loss and grads-produced flags summed over the ranks in one all-reduce: what
        ``_sum_over_ranks`` does with the norm's, for a step that computes no norm."""
        loss, produced = self._to_sum
        self._to_sum = None
        both = torch.cat([loss.reshape(1).float(), produced.to(loss.device, torch.float32)])
        self.mesh.comm.all_reduce(both, label="loss and grads-produced all-reduce")
        loss.copy_(both[0])
        produced.copy_(both[1:])

    def _finite(self, loss: torch.Tensor, norm: torch.Tensor | None, step: int, loss_scale) -> bool:
        """The step's finite check (``Step._finite``) on the loss summed over the ranks, so every
        rank decides alike: a step without a norm (``train_step(grad_norm=False)``, no clipping, not
        fp16) sums it here, with the grads-produced flags, in the step's one all-reduce."""
        if self._to_sum is not None:
            self._sum_loss_and_produced()
        return self.step._finite(loss, norm, step, loss_scale)

    def _without_missing_grads(self, grads: PyTree) -> PyTree:
        """``grads`` with ``None`` for the params no rank produced a grad for (their slices are
        zeros): the optimizer leaves those alone, as DDP does. Known once the norm is summed."""
        if self._produced is None or self._to_sum is not None:
            return grads
        leaves, treespec = tree.flatten(grads)
        return tree.unflatten(treespec, [g if n > 0 else None for g, n in zip(leaves, self._produced.tolist())])

    def _loss_and_grads(self, params, batch, step, rng, loss_scale):
        """This rank's mean loss over its microbatches, and its fp32 slice of the grads averaged over ranks."""
        if self.stage == 0:
            return self._replicated_loss_and_grads(params, batch, step, rng, loss_scale)
        pieces, treespec = self._pieces(params)
        spec = self._state_spec
        scale = mp.scale_of(loss_scale)
        device = self._device(pieces)
        sink = self._grad_sink(pieces)
        self._produced = torch.zeros(len(spec.leaves))  # 1 where this rank's backward produced a grad
        if self._grad_order is not None:
            self._order_buckets(spec, step)
        self.mesh.clear_comm_bytes()
        whole = self._gather_all(pieces, spec, f"step {step}", device) if self.stage < 3 else None
        self.peak_gathered_bytes, self.peak_whole_grad_bytes = (tree.nbytes(whole) if whole else 0), 0
        reducer, losses, auxes = None, [], []
        eager = self.stage > 1 or self.roles.schedule.count == 1
        with seeded(step_seed(rng, step), cuda_devices(params)):
            for micro in self.roles.schedule.split(mp.cast_floating(batch, self.compute_dtype)):
                leaves, gatherer, groups = self._microbatch_leaves(spec, pieces, whole, step, device)
                if reducer is None or eager:  # stage 1 with accum sums whole grads over microbatches
                    reducer = GradReducer(self.mesh.reduce_comm, spec, groups, sink.deliver, device, eager, step,
                                          lambda groups=groups: self._backward_order(groups()),
                                          on_group_done=gatherer.release if gatherer else None,
                                          keep_whole=self.stage == 1, deliver_early=sink.early,
                                          own_grads=sink.own)
                    self._arrived = reducer.arrived  # leaves with a grad so far (offload's overlapped updates)
                loss, aux = self._backward(tree.unflatten(treespec, leaves), micro, leaves, gatherer, reducer, scale)
                self._produced[torch.tensor(reducer.arrived, dtype=torch.long)] = 1.0
                losses.append(loss)
                auxes.append(aux)
        if not eager:
            reducer.reduce_accumulated()
        if self.stage < 3 and not self._buckets_ordered:
            self.sharded._grad_order = reducer.arrived  # learned once
        grads = sink.result()
        loss = torch.stack(losses).mean()  # this rank's; the caller averages it over the ranks
        return loss, (auxes[0] if self.roles.schedule.count == 1 else auxes), grads and tree.unflatten(treespec, grads)

    def _replicated_loss_and_grads(self, params, batch, step, rng, loss_scale):
        """Stage 0: the loss summed over the ranks (of each rank's mean over its microbatches), and the
        whole fp32 grads averaged over the ranks (the same on every rank): each microbatch differentiates
        the whole params (the fp32 masters themselves at fp32, a compute-dtype copy otherwise), and
        ``GradAllReducer`` sums the grads into its buckets, all-reducing them during the last microbatch's
        backward."""
        pieces, treespec = self._pieces(params)
        spec = self._state_spec
        sink = GradSlices(lambda i: torch.zeros_like(pieces[i]), len(pieces), 1.0)  # the reducer divides
        if self._grad_order is not None:
            self._order_buckets(spec, step)
        self.mesh.clear_comm_bytes()
        compute = [p.to(self.compute_dtype) for p in pieces]
        self.peak_gathered_bytes = sum(c.numel() * c.element_size() for c, p in zip(compute, pieces) if c is not p)
        self.peak_whole_grad_bytes = 0
        buckets, device = self._buckets(spec), self._device(pieces)
        kept = self._bucket_buffers
        if kept is None or (kept.groups, kept.device) != (buckets, device):
            self.sharded._bucket_buffers = Buckets(buckets, spec.leaves, device)  # new order or place: kept
        reducer = GradAllReducer(self.mesh.reduce_comm, ShardSpec(0, 1, 0, spec.leaves), self._bucket_buffers,
                                 sink.deliver, step, self._grad_divisor())
        auxes = []
        scale = mp.scale_of(loss_scale)
        with seeded(step_seed(rng, step), cuda_devices(params)):
            micros = self.roles.schedule.split(mp.cast_floating(batch, self.compute_dtype))
            for k, micro in enumerate(micros):
                reducer.eager = k == len(micros) - 1  # DDP's no_sync before the last microbatch
                leaves = [c.detach().requires_grad_() for c in compute]
                _, aux = self._backward(tree.unflatten(treespec, leaves), micro, leaves, None, reducer, scale)
                auxes.append(aux)
        if not self._buckets_ordered:
            self.sharded._grad_order = reducer.arrived  # learned once
        loss = reducer.loss / self.roles.schedule.count  # summed over the ranks; the caller divides by them
        return loss, (auxes[0] if self.roles.schedule.count == 1 else auxes), tree.unflatten(treespec, sink.result())

    def _pieces(self, params) -> tuple[Any, Any]:
        """``(pieces, treespec)``: this rank's param pieces, indexable in leaf order (the params source's)."""
        return self.roles.params.pieces(params)

    def _grad_sink(self, pieces):
        """This call's grad sink (the grad sink role's)."""
        return self.roles.grads.open(pieces)

    def _grad_divisor(self) -> float:
        """Reduced grads are sums over ranks and microbatches of scaled losses' grads."""
        return self._state_spec.world * self.roles.schedule.count * (self._loss_scale or 1.0)

    def _device(self, pieces) -> torch.device:
        """Where the step computes (the params source says)."""
        return self.roles.params.device(pieces)

    def _microbatch_leaves(self, spec: ShardSpec, pieces, whole, step: int, device: torch.device):
        """``(leaves, gatherer, groups)`` for one microbatch (``groups()``: what the reducer
        reduces by, the buckets or stage 3's units): stages 1/2 differentiate the gathered params;
        stage 3 hands out storage-less placeholders that its ``Gatherer`` fills per unit."""
        if self.stage < 3:
            return [w.detach().requires_grad_() for w in whole], None, lambda: self._buckets(spec)
        leaves = [_placeholder(leaf.shape, self.compute_dtype, device) for leaf in spec.leaves]
        gatherer = Gatherer(self.mesh.comm, spec, pieces, leaves,
                            lambda module: self.sharded._stage3_units(module, spec), self.order, self.prefetch,
                            step, self.verify)
        return leaves, gatherer, lambda: gatherer.units

    def _backward(self, params, micro, leaves, gatherer, reducer, scale):
        """Forward and backward of one microbatch; the reducer takes each grad as it is produced."""
        handles = reducer.hook(leaves)
        with torch.enable_grad(), run_by(gatherer) if gatherer is not None else nullcontext():
            out = self.loss_fn(params, micro)
        loss, aux = split_loss(out, self.has_aux)
        reducer.forward_done(loss)
        if gatherer is not None and gatherer.units is None:
            raise ValueError("loss_fn: stage 3 needs the loss to run the model through the apply of "
                             "zf.functionalize (params reach the model only through it)")
        self._before_backward(loss)
        (loss * scale if scale is not None else loss).backward(inputs=leaves)
        for h in handles:
            h.remove()
        reducer.finish_microbatch()
        self.peak_whole_grad_bytes = max(self.peak_whole_grad_bytes, reducer.peak_bytes)
        if gatherer is not None:
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, gatherer.peak_bytes)
        return loss.detach().float(), aux

    def _before_backward(self, loss: torch.Tensor) -> None:
        """Each microbatch's loss, between its forward and its backward (the grad sink sees it)."""
        self.roles.grads.before_backward(loss)


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
    and averaged at the end (``GradSlices``)."""

    def __init__(self, run: StepRun):
        self.run = run

    def open(self, pieces) -> GradSlices:
        """Where the reduced grad slices go: fp32 accumulators shaped like ``pieces``."""
        return GradSlices(lambda i: torch.zeros_like(pieces[i]), len(pieces), self.run._grad_divisor())

    def before_backward(self, loss: torch.Tensor) -> None:
        """Nothing to check before backward."""


class PlainUpdate(Role):
    """Update: the plain step's rule (``Step._update``) on this rank's pieces, with the run's
    finite check and grads-produced flags (summed over the ranks with the grad norm)."""

    def __init__(self, run: StepRun):
        self.run = run

    def apply(self, state: TrainState, grads: PyTree, loss: torch.Tensor, aux: Any):
        """The new state and the metrics."""
        return Step._update(self.run, state, grads, loss, aux)
