"""Offload's update role (``LeafUpdate``) for one call of an offloaded step.

``OffloadedStep.roles`` gives each call's run (``zfunc.sharding.run.StepRun``, the one run class) the sharded
step's roles with three replaced: params come from the stores (``zfunc.offloading.pieces.StoredPieces``: a
leaf's compute copy, else its master read ahead from RAM or its swap file), grads go to a sink
(``zfunc.offloading.grads``: ``UpdateOnArrival`` updates each leaf as its grad arrives, with overlap;
``HeldSlices`` holds them in host RAM, ``SpilledGrads`` in swap files), and the update runs leaf by
leaf from the stores (``LeafUpdate``, ``_update_leaf``), writing back as it goes
(``zfunc.offloading.call_stores``: at most ``2 * chunk_bytes`` of writes in flight, a failed call's
files put back). The schedule stays the sharded step's accumulation.
``ComputeCopies`` (``zfunc.offloading.copies``) keeps the compute-dtype copy of each master that the
update wrote in its own pass (with ``params=None``: the params the device keeps). The roles read the
run through the call's ``RunContext`` and the step's configuration through what
``OffloadedStep.roles`` gave them. Everything here lives for one call, except ``ComputeCopies`` and
the read and update orders, which the roles return from their ``finish`` for the step to keep
(``OffloadedStep.learn``; ``docs/design.md``, "Run objects"). The law, the cost and the rules for
non-finite steps are ``zfunc.offloading.step``'s.
"""
from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import torch

from zfunc import optim
from zfunc.core import placement, precision as mp, tree
from zfunc.core.roles import Role, RunContext
from zfunc.sharding.layout import leaf_names
from zfunc.core.state import FIELDS, TrainState
from zfunc.core.step import NonFiniteError, Step
from zfunc.core.totals import sum_over_ranks, without_missing_grads
from zfunc.offloading.grads import leaf_norm
from zfunc.offloading.merge import NO_MERGE, merge_states, split_state
from zfunc.offloading.call_stores import _Stores
from zfunc.offloading.store import All, OnDisk, ReadAhead, done

PyTree = Any


class LeafUpdate(_Stores, Role):
    """Update of an offloaded step: leaf by leaf from the stores (each leaf's master and state read
    ahead, updated by the optimizer's CPU kernel, written back, at most ``2 * chunk_bytes`` of
    writes in flight); the grads held until now, or (``UpdateOnArrival``) consumed as they came.
    ``step``: the offloaded step, whose configuration (optimizer, precision, stores, the norm it
    needs, its metrics) it reads."""

    def __init__(self, context: RunContext, state: TrainState, step: Step):  # the OffloadedStep
        _Stores.__init__(self, step, state.placement.device)
        self.context, self.step, self._state_spec = context, step, context.spec
        self.optimizer, self.compute_dtype = step.optimizer, step.compute_dtype
        self.compute_copies = step.compute_copies
        self._state_in_use, self._fields = state, tuple(getattr(state, f) for f in FIELDS)
        self._masters, self._param_names = tree.leaves(state.params), leaf_names(state.params)
        self._opt_states = list(state.opt_state)
        self._sq_norm = torch.zeros((), dtype=torch.float64)  # overlap: the grads' sum of squares so far
        # tensor-parallel slices (``Rows.slicing``): their squares are summed over the slices' group too
        rule, spec = placement.of(context.spec), context.spec
        self._sliced = [rule.rows(spec, i, leaf.shape).slicing is not None for i, leaf in enumerate(spec.leaves)]
        self._sq_sliced = torch.zeros((), dtype=torch.float64)  # overlap: the sliced leaves' part of ``_sq_norm``
        self._wants_norm = step.needs_norm()  # train_step(grad_norm=), clipping or fp16; else no norm at all
        self._new: dict[int, tuple[Any, Any]] = {}
        self._skip_updates = False
        self.held_grad_bytes = 0  # the grads held until now for the update (RAM, or their swap files)
        self.spilled = None  # the SpilledGrads sink whose files hold the grads (optimizer on NVMe), if any
        self._grads: list = []  # the grads being applied
        self._grads_ahead: ReadAhead | None = None  # reads of the grads held in files, ahead of their leaves
        self._early: tuple | None = None  # (order, reads) started during backward (``read_ahead``)
        self._device_copies = step.where_params is None  # the device keeps compute-dtype params (ComputeCopies)
        self._device = state.placement.device
        self.update_s = 0.0  # seconds in the leaf updates, held or overlapped with backward, writes included

    def finish(self) -> dict[str, Any]:
        self.writes.drain()
        return {"update_s": self.update_s, "held_grad_bytes": self.held_grad_bytes}

    def undo(self, state: TrainState) -> str:
        """``_Stores.undo``, the compute copies of masters in files dropped first (their files go back)."""
        self.compute_copies.forget([m for m in self._masters if isinstance(m, OnDisk)])
        return _Stores.undo(self, state)

    def _leaf_bytes(self, i: int) -> int:
        return 4 * math.prod(self._state_spec.leaves[i].local_shape(self._state_spec.rank))

    # ------------------------------------------------------------------ the update
    def apply(self, state: TrainState, grads: PyTree, loss: torch.Tensor, aux: Any, produced: torch.Tensor | None):
        """The held grads (or, with overlap, None: the leaves are updated) arrive unscaled (sums
        over ranks and microbatches of the scaled loss's grads; at one rank autograd's own, in the
        compute dtype): the kernel multiplies them by ``1 / grad_divisor`` in its pass. One sum over
        the ranks (``sum_over_ranks``) totals the squared grad norm (none where no norm is needed),
        the loss and the grads-produced flags first."""
        params, opt_state, step, rng, loss_scale, _ = self._fields  # the state may be consumed by now
        scale = 1.0 / self.context.grad_divisor
        sum_across = self.context.sum_across
        if grads is not None:
            g_leaves = tree.leaves(grads)
            self.held_grad_bytes = sum(g.nbytes if isinstance(g, OnDisk) else g.numel() * g.element_size()
                                       for g in g_leaves)
        if not self._wants_norm:  # nothing reads it: only the loss is checked, as in the plain step
            norm, loss, produced = sum_over_ranks(sum_across, None, loss, produced)
        elif grads is not None:  # held until now: the norm first (fp32 from bf16/fp16), then every leaf
            raw = self._held_norm(g_leaves)
            raw, loss, produced = sum_over_ranks(sum_across, raw * raw, loss, produced)
            norm = raw * scale
        else:
            norm, loss, produced = sum_over_ranks(sum_across, self._overlapped_squares().float(), loss, produced)
            if not self._skip_updates and not bool(torch.isfinite(norm)):
                raise NonFiniteError(
                    f"step: non-finite grads (grad norm {norm.item()}) at state.step={step} behind a finite loss, "
                    "with offload's overlap: the leaves were updated during backward, before the norm was "
                    "known, so the state passed in is consumed. Restart from a checkpoint; with "
                    "offload(..., overlap=False) such a step is skipped instead")
        finite = self.context.finite(loss, norm, step, loss_scale)  # may raise: nothing written yet
        lr = optim.learning_rate(self.optimizer, self._opt_states[0])
        state._consumed = True
        if grads is not None and finite:
            if produced is not None:
                g_leaves = without_missing_grads(g_leaves, produced)
            # a clip in the optimizer reads the global norm of the grads as given (unscaled): ``raw``
            self._update_leaves(list(range(len(g_leaves))), g_leaves, scale, None if norm is None else raw)
        for store in (self._param_store, self._opt_store):  # groups not every leaf of which was updated
            for name, nbytes, write in store.flush():
                self.writes.track(write, nbytes, name)
        self.writes.wait(None)
        loss_scale = mp.next_loss_scale(loss_scale, finite)
        metrics = self.step.metrics(loss, norm, lr, finite, step, loss_scale, aux)
        masters = [self._new.get(i, (m, None))[0] for i, m in enumerate(self._masters)]
        states = tuple(self._new.get(i, (None, s))[1] for i, s in enumerate(self._opt_states))
        new_params = tree.unflatten(tree.structure(params), masters)
        return TrainState(new_params, states, step + 1, rng, loss_scale, state.placement), metrics

    def add_squares(self, i: int, squares: torch.Tensor) -> None:
        """With overlap: leaf ``i``'s grad's sum of squares, counted toward the norm."""
        if self._sliced[i]:
            self._sq_sliced += squares
        else:
            self._sq_norm += squares

    def _overlapped_squares(self) -> torch.Tensor:
        """With overlap: this rank's squared norm, its sliced leaves' summed over their slices' group."""
        if not any(self._sliced):
            return self._sq_norm
        return self._sq_norm + placement.of(self.context.spec).sum_over_slices(self.context.spec, self._sq_sliced)

    def _held_norm(self, grads: list) -> torch.Tensor:
        """This rank's norm of the held grads (``optim.global_norm``; spilled: from their files' norms),
        its sliced leaves' squares summed over their slices' group (one all-reduce)."""
        if not any(self._sliced):
            return self.spilled.norm() if self.spilled is not None else optim.global_norm(grads)
        norms = self.spilled.norms if self.spilled is not None else [leaf_norm(g) for g in grads]
        squares = [torch.zeros((), dtype=torch.float64) if n is None else n.to("cpu").double() ** 2 for n in norms]
        sliced = sum((s for s, cut in zip(squares, self._sliced) if cut), torch.zeros((), dtype=torch.float64))
        whole = sum((s for s, cut in zip(squares, self._sliced) if not cut), torch.zeros((), dtype=torch.float64))
        spec = self.context.spec
        return (whole + placement.of(spec).sum_over_slices(spec, sliced)).sqrt().float()

    def _update_leaves(self, order: list[int], grads: list[torch.Tensor], scale: float,
                       norm: torch.Tensor | None) -> None:
        """Update the leaves in ``order``; ``norm``: the global norm of all ``grads`` as given (for a clip)."""
        start = time.perf_counter()
        self._grads = grads
        reader = self._leaf_reader(order)
        self._grads_ahead = self._grad_reader(order, grads)
        for batch in self._batches(order):
            self._update_batch(batch, grads, reader, scale, norm)
        self.writes.wait(None)
        self.update_s += time.perf_counter() - start

    def _batches(self, order: list[int]) -> list[list[int]]:
        """``order`` cut into runs of leaves of one group (``leaf_groups``): what one optimizer call updates."""
        group_of = self.step.group_of(self._state_spec)
        batches: list[list[int]] = []
        for i in order:
            if batches and group_of[batches[-1][-1]] == group_of[i]:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def read_ahead(self) -> None:
        """Start the update's reads of masters and states now, along leaf order (the held update's),
        while backward still runs: they do not depend on the grads, so the update finds them read.
        Once per call; nothing where nothing is on disk."""
        if self._early is None:
            order = list(range(len(self._masters)))
            self._early = (order, self._leaf_reader(order))
            if self._early[1] is not None:
                self._early[1].start()

    def _leaf_reader(self, order: list[int]) -> ReadAhead | None:
        """Reads of the leaves' masters and states ahead of their updates, along ``order`` (3/4 of
        ``chunk_bytes`` in flight; the grads held in files have the rest, ``_grad_reader``); None
        where nothing is on disk (all in RAM: nothing to wait for, ~0.1 ms a leaf saved)."""
        if self._opt_store.engine is None and self._param_store.engine is None:
            return None
        if self._early is not None and self._early[0] == order and self._early[1] is not None:
            early, self._early = self._early[1], (None, None)  # started during backward: used once
            return early
        return ReadAhead(self._fetch_leaf, self._update_bytes, order, self.chunk_bytes * 3 // 4)

    def _grad_reader(self, order: list[int], grads: list) -> ReadAhead | None:
        """Reads of the grads held in swap files (``SpilledGrads``) ahead of their leaves' updates."""
        if not any(isinstance(g, OnDisk) for g in grads):
            return None
        return ReadAhead(lambda i: self._opt_store.fetch(grads[i]) if isinstance(grads[i], OnDisk) else done(grads[i]),
                         lambda i: grads[i].nbytes if isinstance(grads[i], OnDisk) else 0, order,
                         self.chunk_bytes // 4).start()

    def _fetch_leaf(self, i: int) -> All:
        """Pending ``[master, *state tensors]`` of leaf ``i``, all reads started."""
        parts = [self._param_store.fetch(self._masters[i])]
        parts += [self._opt_store.fetch(t) for t in tree.leaves(self._opt_states[i]) if _is_stored(t)]
        return All(parts)

    def _update_bytes(self, i: int) -> int:
        return self._leaf_bytes(i) * (1 + sum(_is_stored(t) for t in tree.leaves(self._opt_states[i])))

    def _update_leaf(self, i: int, grad: torch.Tensor | None, reader: ReadAhead | None, squares: list | None = None,
                     grad_scale: float = 1.0, norm: torch.Tensor | None = None) -> None:
        """Read leaf ``i``'s master and state, apply the optimizer on the CPU, write them back.
        ``grad`` None: no grad; the optimizer leaves the param alone but advances its count, as
        the plain step's does for all params together. ``squares`` and ``grad_scale``: as in
        ``optim.apply`` (the kernel unscales the grad, in whatever dtype it came, in its pass and
        appends the unscaled grad's sum of squares where it computes it). ``norm``: the global norm
        of all the grads, of which ``grad`` is one, as given (``optim.apply(norm=)``: for a clip)."""
        leaf = self._take_leaf(i, grad, reader)
        new_p, new_state = self._apply([leaf], squares, grad_scale, norm)[0]
        self._put_leaf(leaf, new_p, new_state)

    def _update_batch(self, batch: list[int], grads: list, reader: ReadAhead | None, grad_scale: float,
                      norm: torch.Tensor | None) -> None:
        """Update the leaves ``batch`` (a group's, ``leaf_groups``) with one call of the optimizer
        on them all where their states merge (``merge_states``: one kernel pass over the group, no
        per-leaf call cost), else leaf by leaf; each read, and written back, as ``_update_leaf``."""
        leaves = [self._take_leaf(i, grads[i], reader) for i in batch]
        for leaf, (new_p, new_state) in zip(leaves, self._apply(leaves, None, grad_scale, norm)):
            self._put_leaf(leaf, new_p, new_state)

    def _take_leaf(self, i: int, grad: torch.Tensor | None, reader: ReadAhead | None) -> _Leaf:
        """Leaf ``i``'s master, optimizer state and grad in hand on the CPU (read from the stores)."""
        self._state_in_use._consumed = True  # its files or tensors change from here on
        if reader is None:  # all in RAM: the state's own tensors, nothing to read or write back
            master, state, state_leaves, s_spec = self._masters[i], self._opt_states[i], None, None
        else:
            state_leaves, s_spec = tree.flatten(self._opt_states[i])
            master, *tensors = reader.get(i)
            it = iter(tensors)
            state = tree.unflatten(s_spec, [next(it).to("cpu") if _is_stored(t) else t for t in state_leaves])
        if isinstance(grad, OnDisk):  # held in its group's swap file (SpilledGrads), read ahead
            grad = self._grads_ahead.get(i)
        p_cpu = master if master.device.type == "cpu" else master.to("cpu")
        if grad is not None and grad.device.type != "cpu":
            grad = grad.to("cpu")
        # A master kept in RAM gets its compute copy in the update's own pass (ComputeCopies); so does
        # every master with params=None, whose compute-dtype copy is what the device keeps
        in_ram = isinstance(self._masters[i], torch.Tensor) and self._masters[i].device.type == "cpu"
        on_gpu = self._device_copies and self._device.type != "cpu"
        out = None
        if (in_ram or self._device_copies) and self.compute_dtype is not torch.float32:
            out = (torch.empty(p_cpu.shape, dtype=self.compute_dtype, pin_memory=True) if on_gpu else
                   self.compute_copies.buffer(self._masters[i], self.compute_dtype, self._param_store.pin))
        return _Leaf(i, self._param_names[i], master, p_cpu, state, state_leaves, s_spec, grad, out, in_ram, on_gpu)

    def _apply(self, leaves: list[_Leaf], squares: list | None, grad_scale: float,
               norm: torch.Tensor | None) -> list[tuple[torch.Tensor, Any]]:
        """The optimizer's kernel on ``leaves``: ``(new master, new state)`` of each. Several leaves
        whose states merge go in one call (the kernel's law is elementwise: the same values)."""
        merged = merge_states([leaf.state for leaf in leaves], [leaf.name for leaf in leaves]) if len(leaves) > 1 \
            else NO_MERGE
        if merged is NO_MERGE:
            return [self._apply_one(leaf, squares, grad_scale, norm) for leaf in leaves]
        grads = {leaf.name: leaf.grad for leaf in leaves}
        known = None if norm is None else optim.known_norm(grads, norm)
        outs = {leaf.name: leaf.out for leaf in leaves}
        new_p, new_state = optim.apply(self.optimizer, grads, merged, {leaf.name: leaf.p_cpu for leaf in leaves},
                                       out=None if all(o is None for o in outs.values()) else outs,
                                       grad_scale=grad_scale, norm=known)
        return [(new_p[leaf.name], split_state(new_state, leaf.state, leaf.name)) for leaf in leaves]

    def _apply_one(self, leaf: _Leaf, squares: list | None, grad_scale: float,
                   norm: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        grads = {leaf.name: leaf.grad}
        known = None if norm is None else optim.known_norm(grads, norm)
        new_p, new_state = optim.apply(self.optimizer, grads, leaf.state, {leaf.name: leaf.p_cpu},
                                       out=None if leaf.out is None else {leaf.name: leaf.out}, squares=squares,
                                       grad_scale=grad_scale, norm=known)
        return new_p[leaf.name], new_state

    def _put_leaf(self, leaf: _Leaf, new_p: torch.Tensor, new_state: Any) -> None:
        """Leaf ``leaf.i``'s new master and state where they are kept (written back to files), its
        compute copy noted."""
        i, master = leaf.i, leaf.master
        if master.device.type != "cpu":
            master.copy_(new_p)
            new_p = master
        handle, write = self._param_store.store_back(self._masters[i], new_p)
        self.writes.track(write, _file_bytes(handle), getattr(handle, "name", None))
        # fp32 on a GPU: the device's copy is the master itself, refreshed from the host's new value each update
        copy = leaf.out if leaf.out is not None else (
            new_p if self._device_copies and (leaf.on_gpu or not leaf.in_ram) else None)
        if copy is not None and leaf.on_gpu:  # the device's compute-dtype params, updated from the host's pass
            kept = self.compute_copies.last(handle)
            if kept is None or kept.dtype != copy.dtype:
                kept = torch.empty_like(copy, device=self._device)
            copy = kept.copy_(copy, non_blocking=True)
        if copy is not None:
            self.compute_copies.written(handle, copy)
        if leaf.state_leaves is None:  # in RAM: the new state is kept as it is
            self._new[i] = (handle, new_state)
            return
        new_leaves = []
        for old, new in zip(leaf.state_leaves, tree.leaves(new_state)):
            if _is_stored(old):
                kept, write = self._opt_store.store_back(old, new)
                self.writes.track(write, _file_bytes(kept), getattr(kept, "name", None))
                new_leaves.append(kept)
            else:
                new_leaves.append(new)
        self._new[i] = (handle, tree.unflatten(leaf.s_spec, new_leaves))


class _Leaf(NamedTuple):
    """One leaf in hand for its update (``LeafUpdate._take_leaf``)."""

    i: int
    name: str
    master: torch.Tensor
    p_cpu: torch.Tensor
    state: Any
    state_leaves: list | None  # the stored state's leaves (handles), None when all in RAM
    s_spec: Any
    grad: torch.Tensor | None
    out: torch.Tensor | None
    in_ram: bool
    on_gpu: bool


def _file_bytes(x: Any) -> int:
    """Bytes a write of ``x``'s file moves (its group's, packed)."""
    return x.file_bytes if isinstance(x, OnDisk) else 0


def _is_stored(t: Any) -> bool:
    return isinstance(t, (torch.Tensor, OnDisk))
