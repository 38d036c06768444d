"""``OffloadedStep``, the step ``zf.offload`` returns (law and cost: ``zfunc.offloading.step``): where it
places a state (``init``, ``init_meta``, ``restore``, a group of leaves at a time), its swap engine and the
room it holds, the roles of one call (``StoredPieces``, ``UpdateOnArrival`` or held grads, ``LeafUpdate``),
what a call learns, and ``memory``; ``with_outcome``, a failed swap's error told what became of the state."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from zfunc.core import placement, precision as mp, tree
from zfunc.dist import Mesh
from zfunc.offloading import accounting
from zfunc.offloading.grads import HeldSlices, SpilledGrads
from zfunc.offloading.copies import ComputeCopies
from zfunc.offloading.grads import UpdateOnArrival
from zfunc.offloading.call_stores import _Stores
from zfunc.offloading.pieces import StoredPieces
from zfunc.offloading.run import LeafUpdate, _is_stored
from zfunc.ops.cpu import hostmem
from zfunc.core.roles import Roles, RunContext
from zfunc.sharding.step import ShardedStep
from zfunc.sharding.layout import ShardSpec, leaf_names, local_piece
from zfunc.sharding.run import StepRun
from zfunc.core.step import Step
from zfunc.core.transformed import Transformed
from zfunc.core.state import TrainState, require_train_state
from zfunc.offloading.placement import OffloadSpec
from zfunc.offloading.store import OnDisk, leaf_groups, packed_bytes

PyTree = Any


def _shard_fields(spec: ShardSpec) -> tuple:
    return tuple(getattr(spec, f.name) for f in fields(ShardSpec))


class OffloadedStep(Transformed):
    """The step ``offload`` returns (see the module docstring). It wraps a ``ShardedStep``
    (``sharded``: the sharded step it was given, or, for a plain step, one over a one-process mesh)
    and replaces three of its roles (``roles``): params come from the stores, grads go to an
    updating or holding sink, the update runs leaf by leaf from the stores. Its layout (``mesh``,
    ``stage``) is the sharded step's; what the calls learn it keeps (``learn``)."""

    def __init__(self, base: Step, sharded: ShardedStep, optimizer: str, params: str | None, path: str | None,
                 chunk_bytes: int, overlap: bool | None, group_bytes: int | None = None):
        super().__init__(sharded, "offload")
        self.layers = (*base.layers, "offload")  # what the user built: a plain step's shard is internal
        self.sharded = sharded
        self.peak_gathered_bytes = self.peak_whole_grad_bytes = 0  # what the last call measured
        self.where_optimizer, self.where_params, self.path = optimizer, params, path
        self.where_masters = params or optimizer  # the fp32 masters live with the optimizer state unless placed
        self.held_grad_bytes = 0  # grads the last call held for the norm (RAM or swap files)
        self.peak_spilled_ram_bytes = 0  # most grad bytes in RAM at once on their way to swap files (last call)
        self.chunk_bytes = chunk_bytes
        self.group_bytes = chunk_bytes // 4 if group_bytes is None else group_bytes  # leaf_groups' cap
        self._group_of = None  # (layout, each leaf's group), ``group_of``
        self.overlap = _overlap_allowed(base, overlap)
        self.engine = None
        self._made: list[Path] = []  # the folders the engine created for its files (``release``)
        self._fetch_order: list[int] = []  # params' read order in the last step (forward/backward)
        self.compute_copies = ComputeCopies()
        self._update_order: list[int] = []  # leaves' update order in the last step
        self.update_s = 0.0  # the last step's leaf updates (held, or overlapped with backward), writes included

    @property
    def mesh(self) -> Mesh:
        """The sharded step's mesh (``Mesh.alone()`` for an offloaded plain step)."""
        return self.sharded.mesh

    @property
    def stage(self) -> int:
        """The sharded step's ZeRO stage (for an offloaded plain step: 3 with params offloaded, else 2)."""
        return self.sharded.stage

    # ------------------------------------------------------------------ init
    def init(self, params: PyTree, materialize: Callable[[str, torch.Tensor], torch.Tensor] | None = None
             ) -> TrainState:
        """This rank's fp32 pieces of ``params`` and their optimizer state, placed where the step
        keeps them (written to swap files for "nvme"), one group of leaves at a time.

        ``materialize(name, like)``: for params built on the meta device (``with
        torch.device("meta"): model = GPT(cfg)``), returns leaf ``name``'s whole initial value
        (shaped like ``like``); only one leaf is ever materialized at once, so a model larger than
        RAM can start. Compute then happens on CUDA when available, else on the CPU.
        """
        device, leaves, treespec, spec = self.sharded._layout(params)
        if device.type == "meta":
            if materialize is None:
                raise ValueError("params: on the meta device; pass materialize(name, like) -> tensor to init")
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            materialize = placement.of(spec).materializer(spec, materialize)  # tp slices: cut from the whole leaves
        names = leaf_names(params)

        def fresh(i: int) -> tuple[torch.Tensor, Any]:
            x, leaf, name = leaves[i], spec.leaves[i], names[i]
            whole = materialize(name, x) if x.device.type == "meta" else x.detach()
            if tuple(whole.shape) != leaf.shape:
                raise ValueError(f"materialize: returned shape {tuple(whole.shape)} for {name}, expected {leaf.shape}")
            piece = hostmem.copy_to(local_piece(whole, leaf, spec.rank), "cpu", torch.float32)
            return piece, self.optimizer.init({name: piece})

        self.initialized_with = tree.map(lambda x: x.to("meta"), params)  # what zf.checkpoint.load checks
        return self._place(treespec, spec, fresh, device)

    def init_meta(self, params: PyTree) -> TrainState:
        """The state ``init(params)`` would return, on the meta device, touching no RAM or file:
        this rank's fp32 pieces and each leaf's optimizer state, with the ``OffloadSpec``."""
        _, _, treespec, spec = self.sharded._layout(params)
        pieces = [torch.empty(leaf.local_shape(spec.rank), device="meta") for leaf in spec.leaves]
        states = tuple(self.optimizer.init({name: p}) for name, p in zip(leaf_names(params), pieces))
        meta = torch.device("meta")
        off = OffloadSpec(*_shard_fields(spec), self.where_optimizer, self.where_params, self.path, meta)
        return TrainState(tree.unflatten(treespec, pieces), states, 0, self.seed, mp.init_loss_scale(self.precision),
                          off)

    def restore(self, params: PyTree, leaf: Callable[[int], tuple[torch.Tensor, Any]],
                device: str | torch.device = "cpu") -> TrainState:
        """A state placed as ``init`` places it (in RAM, or written to this rank's swap files),
        whose leaf ``i`` (``params``' leaf order) holds the fp32 CPU piece and optimizer state
        ``leaf(i)`` returns, shaped as in ``init_meta(params)``; compute happens on ``device``.
        ``leaf`` is called one leaf at a time, each group of leaves (``leaf_groups``) placed
        before the next group's first is asked for, so only one group's values need be in RAM at
        once. Step, RNG and loss scale are the initial ones:
        what ``zf.checkpoint.load`` fills in next."""
        _, _, treespec, spec = self.sharded._layout(params)
        self.initialized_with = tree.map(lambda x: x.to("meta"), params)
        return self._place(treespec, spec, leaf, torch.device(device))

    def _place(self, treespec: Any, spec: ShardSpec, leaf: Callable[[int], tuple[torch.Tensor, Any]],
               device: torch.device) -> TrainState:
        """Each leaf's piece and optimizer state from ``leaf(i)``, put where the step keeps them: a
        group of consecutive leaves (``leaf_groups``) at a time, its masters in one swap file and
        its optimizer states in another (``Store.pack``), so at most a group is in RAM at once."""
        self._swap(spec)
        stores = _Stores(self, device)
        masters, states = [], []
        for k, group in enumerate(leaf_groups(spec, self.group_bytes)):
            pieces, flat, copies = [], [], []
            for i in group:
                piece, state = leaf(i)
                flat.append(tree.flatten(state))
                # the device keeps the compute-dtype params (ComputeCopies), unless the RAM master is them
                copy = (piece.to(device, self.compute_dtype, copy=True) if self.where_params is None and (
                    self.where_masters == "nvme" or self.compute_dtype != torch.float32 or device.type != "cpu")
                        else None)
                # params on "cpu" in bf16/fp16: the host keeps the compute copy, as an update writes it
                if self.where_params == "cpu" and self.compute_dtype != torch.float32:
                    copy = piece.to(self.compute_dtype)
                    copy = copy.pin_memory() if device.type == "cuda" else copy
                pieces.append(piece)
                copies.append(copy)
                del piece, state
            stored = iter(stores._opt_store.pack(f"group{k}.states", [t for s_leaves, _ in flat for t in s_leaves
                                                                       if _is_stored(t)]))
            states += [tree.unflatten(s_spec, [next(stored) if _is_stored(t) else t for t in s_leaves])
                       for s_leaves, s_spec in flat]
            for handle, copy in zip(stores._param_store.pack(f"group{k}.masters", pieces), copies):
                masters.append(handle)
                if copy is not None:
                    self.compute_copies.written(handle, copy)
            del pieces, flat, copies
        stores.writes.wait(None)
        self.reserve_room(masters, states)  # the room of the first step's writes, held from now on
        path = self.path if self.engine is None else str(self.engine.path)  # this rank's files
        off = OffloadSpec(*_shard_fields(spec), self.where_optimizer, self.where_params, path, device)
        return TrainState(tree.unflatten(treespec, masters), tuple(states), 0, self.seed,
                          mp.init_loss_scale(self.precision), off)

    def group_of(self, spec: ShardSpec) -> list[int]:
        """Each leaf's group (``leaf_groups`` at ``group_bytes``): kept per layout, it is asked each step."""
        key = (spec.rank, spec.world, len(spec.leaves))
        if self._group_of is None or self._group_of[0] != key:
            groups = leaf_groups(spec, self.group_bytes)
            self._group_of = (key, [k for k, group in enumerate(groups) for _ in group])
        return self._group_of[1]

    def _swap(self, spec: ShardSpec) -> None:
        """The swap engine, on this process's own folder of ``path`` (``rank_dir``), which it locks."""
        if self.engine is None and "nvme" in (self.where_optimizer, self.where_masters):
            from zfunc.offloading.swap.engine import SwapEngine
            from zfunc.offloading.swap.directory import rank_dir

            # the files init writes, fp32 like the local pieces: per group of leaves (``leaf_groups``) the
            # masters (params on nvme) and, as for Adam, two moments per leaf (optimizer on nvme); the engine
            # adds their spares
            files = []
            for group in leaf_groups(spec, self.group_bytes):
                sizes = [4 * math.prod(spec.leaves[i].local_shape(spec.rank)) for i in group]
                files += [packed_bytes(sizes)] * (self.where_masters == "nvme")
                files += [packed_bytes([n for n in sizes for _ in range(2)])] * (self.where_optimizer == "nvme")
            # and the grads held for the norm (SpilledGrads): scratch files the first step writes, in place
            held = self.spilled_grad_bytes(spec)
            # 4 I/O threads: enough to keep the disk busy under a CPU update, and every thread costs
            # RAM (an allocator arena, a staging buffer), which benchmarks/capacity.py's 1 GiB budget counts
            folder = rank_dir(self.path)
            # the folders the engine is about to create (deepest first): ``release`` removes these alone
            self._made = [d for d in (folder, *folder.parents) if not d.exists()]
            self.engine = SwapEngine(folder, files=files, need_bytes=int(held), threads=4)

    def spilled_grad_bytes(self, spec: ShardSpec) -> int:
        """Bytes of the grads a step of layout ``spec`` holds for the norm in swap files (``SpilledGrads``;
        0: none held, or held in RAM, as they fit in ``chunk_bytes``: ``accounting.held_grads``)."""
        local = sum(math.prod(leaf.local_shape(spec.rank)) for leaf in spec.leaves)
        return int(accounting.held_grads(local, precision=self.precision, optimizer=self.where_optimizer,
                                         world=spec.world, accum=self.accum, held=not self.overlap,
                                         ram_bytes=self.chunk_bytes).get("nvme", 0))

    def reserve_room(self, params: PyTree, opt_state: PyTree) -> None:
        """Allocate the room of the next write of each swap file of the state (``SwapEngine.reserve``,
        a stat per file once held): ``SwapPathError`` naming the folder, its free and the needed
        bytes if it is not there."""
        if self.engine is not None:
            self.engine.reserve({x.name: x.file_bytes for x in tree.leaves((params, opt_state))
                                 if isinstance(x, OnDisk)})

    def _check_state(self, state: Any) -> None:
        require_train_state(state)
        spec = state.placement
        if not isinstance(spec, OffloadSpec):
            raise ValueError(f"state: this state is not offloaded ({spec or 'a plain state'}); build it with "
                             "this offloaded step's init(params)")
        mine = (self.stage, self.mesh.dp, self.mesh.rank, self.where_optimizer, self.where_params)
        if (spec.stage, spec.world, spec.rank, spec.optimizer, spec.params) != mine:
            raise ValueError(f"state: {spec}, but this step is stage {self.stage} over {self.mesh.dp} ranks "
                             f"(rank {self.mesh.rank}) with optimizer on {self.where_optimizer}, params on "
                             f"{self.where_params or 'the compute device'}")

    def memory(self, state: TrainState) -> dict[str, Any]:
        """Bytes by place ("device": where compute happens, "cpu": host RAM, "nvme": swap files, logical
        bytes) as ``zfunc.offloading.accounting``'s table says: ``device``, ``cpu``, ``nvme``, the
        totals kept between steps; ``kinds``, those by place and kind (``masters``, ``optimizer``,
        ``compute_params``); ``step``, what the last call held during the step by place and kind
        (``whole_params``: its peak of gathered params; ``whole_grads``: its peak of whole grads on the
        compute device before they leave it; ``held_grads``: the grads held for the norm;
        ``spilled_in_flight``: the most grad bytes in RAM on their way to swap files); and the
        last call's communication (``comm``)."""
        self._check_state(state)
        kinds: dict[str, dict[str, int]] = {p: {} for p in accounting.PLACES}
        for kind, leaves, place in (("masters", tree.leaves(state.params), self.where_masters),
                                    ("optimizer", tree.leaves(state.opt_state), self.where_optimizer)):
            for x in leaves:
                if isinstance(x, OnDisk):
                    kinds["nvme"][kind] = kinds["nvme"].get(kind, 0) + x.nbytes
                elif isinstance(x, torch.Tensor):
                    kinds[place][kind] = kinds[place].get(kind, 0) + x.numel() * x.element_size()
        masters = tree.leaves(state.params)
        copies = self.compute_copies.held(masters)
        if self.where_params is None:  # an fp32 RAM master on a CPU device is itself the compute param
            copies += sum(m.numel() * m.element_size() for m in masters
                          if isinstance(m, torch.Tensor) and self.compute_copies.of(m) is None)
        if copies:
            kinds["device" if self.where_params is None else "cpu"]["compute_params"] = copies
        # in swap files (SpilledGrads) where the optimizer is on NVMe and they exceeded chunk_bytes, else in RAM
        spilled = self.where_optimizer == "nvme" and self.held_grad_bytes > self.chunk_bytes
        held = {"nvme" if spilled else "cpu": self.held_grad_bytes} if self.held_grad_bytes else {}
        step = {"device": {"whole_params": self.peak_gathered_bytes, "whole_grads": self.peak_whole_grad_bytes},
                "cpu": {"held_grads": held.get("cpu", 0), "spilled_in_flight": self.peak_spilled_ram_bytes},
                "nvme": {"held_grads": held.get("nvme", 0)}}
        return {**accounting.totals(kinds), "kinds": kinds, "step": step, "whole_params": self.peak_gathered_bytes,
                "comm": self.mesh.comm_bytes()}

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        self._check_state(state)
        self.reserve_room(state.params, state.opt_state)  # no room: fails here, the state untouched
        run = StepRun(self, state)  # all per-call state lives there, and in its roles
        try:
            return run.execute(state, batch)
        except OSError as e:  # a swap read or write failed: the files go back to their versions before the step
            raise with_outcome(e, run.roles.update.undo(state)) from e
        finally:
            self.learn(run.finish())

    def learn(self, learned: dict[str, Any]) -> None:
        """Keep what a call learned (``StepRun.finish``): the one place this step's learned state is
        written. ``fetch_order``: the order the call read params in (the next reads ahead along
        it); ``update_order``: the order an overlapped update met the leaves in (likewise);
        ``update_s``: its seconds in leaf updates; ``peak_gathered_bytes`` and
        ``peak_whole_grad_bytes``: what it measured (``memory``); the rest is the sharded step's
        (``ShardedStep.learn``). A field the call did not learn stays as it was."""
        self._fetch_order = learned.get("fetch_order", self._fetch_order)
        self._update_order = learned.get("update_order", self._update_order)
        self.update_s = learned.get("update_s", self.update_s)
        self.peak_gathered_bytes = learned.get("peak_gathered_bytes", self.peak_gathered_bytes)
        self.peak_whole_grad_bytes = learned.get("peak_whole_grad_bytes", self.peak_whole_grad_bytes)
        self.peak_spilled_ram_bytes = learned.get("peak_spilled_ram_bytes", 0)
        self.held_grad_bytes = learned.get("held_grad_bytes", 0)
        self.sharded.learn(learned)

    def roles(self, context: RunContext, state: TrainState) -> Roles:
        """The roles of one call (``zfunc.core.roles``): the sharded step's, with the three offload owns
        replaced: params from the stores (``StoredPieces``), grads updated on arrival (overlap:
        ``UpdateOnArrival``) or held (``HeldSlices`` in RAM, ``SpilledGrads`` in swap files where the optimizer is
        on NVMe and they exceed ``chunk_bytes``), the update leaf by leaf (``LeafUpdate``)."""
        update = LeafUpdate(context, state, self)
        if self.overlap:
            grads = UpdateOnArrival(context, update, self._update_order)
        elif self.spilled_grad_bytes(context.spec):  # held for the norm in swap files beside the moments
            grads = update.spilled = SpilledGrads(context, self.engine, 2 * self.chunk_bytes,
                                                  leaf_groups(context.spec, self.group_bytes), update.read_ahead)
        else:
            grads = HeldSlices(context, update.read_ahead)
        params = StoredPieces(context, update, self.compute_copies, self.where_params, self._fetch_order)
        return self.sharded.roles(context, state).replace(params=params, grads=grads, update=update)


def _overlap_allowed(step: Step, overlap: bool | None) -> bool:
    """Whether units may be updated during backward: the update must not depend on grads not yet
    reduced (a global-norm clip, an fp16 overflow check) nor on later microbatches."""
    reasons = []
    if step.accum > 1:
        reasons.append(f"accum={step.accum} sums grads over microbatches first")
    if step.precision == "fp16":
        reasons.append("fp16 checks every grad for overflow first")
    if step.optimizer.needs_global_norm:
        reasons.append("the optimizer reads the global grad norm (clip_by_global_norm)")
    if overlap and reasons:
        raise ValueError(f"overlap: updates cannot start during backward: {'; '.join(reasons)}")
    return not reasons if overlap is None else overlap


def with_outcome(e: OSError, outcome: str) -> OSError:
    """``e`` with ``outcome`` (what became of the state) added to its message, same type and errno."""
    from zfunc.offloading.swap.file_format import SwapError

    if not isinstance(e, SwapError):
        e.add_note(outcome)
        return e
    told = type(e)(f"{e}; {outcome}")
    told.errno = e.errno
    return told
