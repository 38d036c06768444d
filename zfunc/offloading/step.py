"""offload: optimizer state and params in CPU RAM or on NVMe, updated by CPU-Adam as grads arrive.

``zf.offload(step, optimizer="cpu"|"nvme", params=None|"cpu"|"nvme", path=...)`` returns a step
that trains exactly like ``step`` (a plain step, or ``zf.shard(step, mesh, stage)``) while keeping,
between steps, the optimizer state (``optimizer=``) and the fp32 master params in CPU RAM (pinned
when there is a GPU) or in swap files under ``path`` (``zfunc.offloading.swap.engine``), each process
in its own folder (``path/rank00003/`` for global rank 3, ``path`` itself alone), locked while used;
``zf.offloading.release(step, state)`` removes the files, and the folders made for them, once done.

**Placement.** The fp32 masters always live with the optimizer state (``optimizer=``), or where
``params=`` puts them. The compute device holds compute-dtype params only: with ``params=None`` the
whole of this rank's params in the compute dtype (``ComputeCopies``, written by each update in the
kernel's own pass and copied to the device; stages 1/2 gather them whole), with ``params`` offloaded
the live units (stage 3's gatherer fetching from the store). Bytes by place and kind, and their
formulas: ``zfunc.offloading.accounting`` (``memory``).

**Law.** For the same optimizer and kernel (``backend="auto"`` runs zfunc's CPU-Adam on the
offloaded leaves and on a plain step's state on the CPU; a plain step on a GPU runs torch's kernel,
which agrees with it to about an ulp per step) the offloaded step gives the same params, optimizer
state, loss and grad norm as ``step``, up to the rounding of the global norm, which is summed leaf by
leaf. Never a stale or delayed update.
Module buffers (BatchNorm statistics, ``zfunc.model.functional``) are not offloaded: they stay in
``state.buffers`` where the forward computes, updated and averaged over ranks as ``zf.shard`` says.

**How a step runs** (one param *leaf* is the unit of update; each leaf has its own optimizer
state, ``optimizer.init({name: piece})``, so a leaf can be updated alone; on NVMe a *group* of
consecutive leaves, up to ``group_bytes`` of masters, is the unit of storage: its masters in one
swap file, its optimizer states in another, ``zfunc.offloading.store``'s packed files):
- forward/backward: exactly ``shard``'s machinery, over a one-process mesh for a plain step.
  With ``params`` offloaded, units are fetched just in time (stage 3's gatherer) from the store,
  reads running ahead in the order recorded on the first step; else params are gathered whole.
- update: each leaf's master and state are read (``chunk_bytes`` of reads kept in flight ahead;
  on NVMe a group's files are read whole by its first leaf, the next groups' read ahead),
  updated by the optimizer's fused kernel on the CPU in the read buffer, and written back
  asynchronously (a group's files once its last leaf is updated: write-behind): disk reads, CPU
  work and disk writes of consecutive groups overlap (a 3-deep pipeline). A swap file costs
  ~0.3 ms per transfer whatever its size, so a group's two large transfers replace 2-4 per leaf.
  Without overlap the reads of masters and states start as backward starts (they need no grad).
  A group's leaves whose optimizer states merge (per-param dicts, equal counts:
  ``zfunc.offloading.run.merge_states``) go through the kernel in one call (in RAM too): one
  call per group, not per leaf; the kernel is elementwise, so the values are the same.
- overlap with backward: when the optimizer does not need the global grad norm (its
  ``needs_global_norm`` declaration is False: no ``clip_by_global_norm``), there is no fp16
  overflow check and ``accum == 1``, a unit is updated as soon as its reduced grads exist, during
  the rest of backward. Otherwise all grad slices (fp32, 4 B/param/N; alone, autograd's own grads
  in the compute dtype) are held until backward ends and the norm is known, off the device as
  backward produces them (``zfunc.offloading.grads``): in host RAM with the optimizer there, in swap
  files beside the moments with the optimizer on NVMe (each leaf's norm taken on the way, so the
  global norm needs no read-back), so neither the device nor RAM holds a whole-model grad then.
- grads reach CPU-Adam unscaled: it multiplies them by 1/(loss scale x ranks x microbatches), and by
  a ``clip_by_global_norm`` factor in front of it, in its own pass (``optim.apply(grad_scale=)``).
  Alone (one rank) nothing is reduced, so the grads are autograd's own, in the compute dtype
  (bf16/fp16, read as such by the kernel): no fp32 copy is packed per step (fresh pages, which
  fault on a CPU device) and no separate unscale or clip pass runs. Over ranks the reduce-scatter
  stays fp32 (the sums need it). The grad norm, where wanted
  (``train_step(grad_norm=True)``, clipping, fp16), is then summed from the squares CPU-Adam
  computes in its own pass over each grad (``optim.apply(squares=)``): the grads are read once.
  With ``train_step(grad_norm=False)`` and nothing else needing it, no norm is computed at all,
  held or overlapped, and only the loss is checked (the plain step's rule).

**Non-finite steps** (``zfunc.core.step``'s rules): without overlap the update waits for the grad norm,
so a step whose loss or grads are inf/nan writes nothing: the state comes back unchanged and
``metrics["skipped"]`` is True, as in the plain step. With overlap, updates start before the norm
exists, and an update cannot be taken back, so **only a non-finite loss is caught**: it is checked
(summed over the ranks: one more scalar all-reduce per step when N > 1) between forward and
backward, and then no leaf is updated and the step is skipped. Non-finite grads behind a finite
loss reach the leaves; the step then raises ``NonFiniteError`` (the state is consumed: restart
from a checkpoint) rather than return nan params. Pass ``overlap=False`` to have such steps
skipped too. A param no rank produced a grad for is left alone by the optimizer, except with
overlap on N > 1 ranks, where it is updated with a zero grad (no rank can know before its update
that the others produced none: weight decay applies to it).

**A full or failing swap disk.** ``init`` (and ``zf.checkpoint.load``) allocates beside each swap
file the room of its next version (its spare, ``zfunc.offloading.swap.engine``), and each step first makes sure of it
(``SwapEngine.reserve``: two stats per file; where room is missing, ``SwapPathError`` naming the
folder, its free bytes and the bytes needed, raised before the state is touched). On a file system
that overwrites in place (ext4, xfs) a step on a full disk then allocates nothing and trains on. A
swap read or write that fails anyway (an I/O error, a short write; no room on a copy-on-write file
system) fails the step with the engine's ``SwapError`` (no room: ``SwapPathError``, ``errno``
ENOSPC or EDQUOT) once every file the step rewrote is back to its version before it
(``SwapEngine.restore``). With ``optimizer="nvme"`` and the masters with it (``params`` None or
"nvme") the state passed in is then whole and not consumed: save it, or call the step again once
there is room. Other placements update their RAM leaves in place, so the state stays consumed and
the error says so: restart from a checkpoint. The held grads' files (``zfunc.offloading.grads``) are
scratch, overwritten in place: ``init`` checks their room too (no spare), and after the first step they
need no more. Over several ranks only the
failing rank raises (the others may wait in a collective): restart them all from a checkpoint.
``zf.checkpoint.save`` and ``full_params`` read the swap files without writing in their folder
(``in_ram``), so a full swap disk does not stop a save elsewhere.

**Cost** per rank, Psi params over N ranks (fp32 masters, Adam; ``zfunc.offloading.accounting``):
RAM between steps holds nothing of what is offloaded to "nvme"; ``optimizer="cpu"`` holds 12 Psi/N
of masters and moments in host RAM. Disk traffic per step with all on NVMe: reads 4 Psi/N per
forward/backward fetch of params + 12 Psi/N for the update; writes 12 Psi/N; with held grads,
e Psi (alone) or 4 Psi/N more written and read; disk space up to 24 Psi/N (the swap engine keeps a
spare of each file), twice the held grads' on top. The device holds the compute-dtype params
(``params=None``: e Psi/N, plus stages 1/2's whole gather) or a few units, and a bounded number of
grad buckets; the host ``chunk_bytes`` of reads and twice that of writes in flight.

``init(params, materialize=...)`` starts from meta-device params one group of leaves at a time,
so a model larger than RAM can start; ``zf.checkpoint.load(path, step)`` places a checkpoint the
same way, one group at a time (``restore``); ``zf.checkpoint.save`` / ``full_params`` read an offloaded state back
(``in_ram``).

bf16/fp16: a master kept in RAM gets its compute-dtype copy written by the update in the same pass
(``optim.apply(out=)``; zfunc's CPU-Adam writes it while it updates), kept between steps
(``ComputeCopies``, 2 B/param; with ``params=None`` on a GPU, copied to the device's copy) and
gathered by the next forward instead of the master: no cast pass, and half the bytes gathered.
With ``params=None`` a master on NVMe keeps its copy too (at fp32 the updated master itself); with
``params="nvme"`` masters are cast at the gather.

Over ranks, grads cross PCIe as fp32 on CUDA (alone, in the compute dtype); the updated params
cross it once, in the compute dtype.

The step (``init``, ``restore``, ``memory``) is here; its placement (``OffloadSpec``, ``in_ram``, how a
checkpoint saves and restores it) is in ``zfunc.offloading.placement``; the roles of one call
(``StoredPieces``, ``HeldSlices``, ``UpdateOnArrival``, ``LeafUpdate``: params from the stores,
grads held or updated on arrival, the leaf-by-leaf update), its stores and ``ComputeCopies`` are
in ``zfunc.offloading.run`` (importable from here too); the run that drives them is shard's
(``zfunc.sharding.run.StepRun``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from zfunc.core import compose, placement, precision as mp, tree
from zfunc.dist import Mesh
from zfunc.offloading import accounting
from zfunc.offloading.grads import HeldSlices, SpilledGrads, grad_file
from zfunc.offloading.copies import ComputeCopies
from zfunc.offloading.grads import UpdateOnArrival
from zfunc.offloading.run import LeafUpdate, StoredPieces, _is_stored, _Stores
from zfunc.ops.cpu import hostmem
from zfunc.core.roles import Roles, RunContext
from zfunc.sharding.step import ShardedStep
from zfunc.sharding.layout import ShardSpec, leaf_names, local_piece
from zfunc.sharding.run import StepRun
from zfunc.core.step import Step
from zfunc.core.transformed import Transformed
from zfunc.core.state import TrainState, require_train_state
from zfunc.offloading.placement import OffloadSpec, in_ram
from zfunc.offloading.store import OnDisk, leaf_groups, packed_bytes

__all__ = ["OffloadSpec", "OffloadedStep", "in_ram", "offload", "release"]

PyTree = Any
PLACES = ("cpu", "nvme")


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
        stores._wait_writes(None)
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
            local = sum(math.prod(leaf.local_shape(spec.rank)) for leaf in spec.leaves)
            held = accounting.held_grads(local, precision=self.precision, optimizer=self.where_optimizer,
                                         world=spec.world, accum=self.accum, held=not self.overlap).get("nvme", 0)
            # 4 I/O threads: enough to keep the disk busy under a CPU update, and every thread costs
            # RAM (an allocator arena, a staging buffer), which benchmarks/capacity.py's 1 GiB budget counts
            folder = rank_dir(self.path)
            # the folders the engine is about to create (deepest first): ``release`` removes these alone
            self._made = [d for d in (folder, *folder.parents) if not d.exists()]
            self.engine = SwapEngine(folder, files=files, need_bytes=int(held), threads=4)

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
        held = {self.where_optimizer: self.held_grad_bytes} if self.held_grad_bytes else {}
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
        ``UpdateOnArrival``) or held (``HeldSlices``), the update leaf by leaf (``LeafUpdate``)."""
        update = LeafUpdate(context, state, self)
        if self.overlap:
            grads = UpdateOnArrival(context, update, self._update_order)
        elif self.where_optimizer == "nvme":  # held for the norm in swap files beside the moments
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


def release(step: Step, state: TrainState) -> int:
    """Remove the swap files of ``state``, the state ``step`` last returned (or placed: ``init``,
    ``zf.checkpoint.load``), their spares with them, then close the step's swap engine (its folder's
    lock goes with it) and remove the folders it created for them, if nothing else is in them.
    ``state`` is consumed: its leaves were those files (``ConsumedStateError`` if read). Returns the
    bytes the files held; 0, touching nothing, for a step with no swap engine (not offloaded,
    offloaded to "cpu", or released already). A pipeline over an offloaded step releases its stage's.
    Files and folders zfunc did not write stay. The
    step may ``init`` again afterwards, on a new engine. Cost: waits for the I/O issued on the
    files, then an unlink per file and spare."""
    from zfunc.offloading.swap.directory import spare_path

    within = getattr(getattr(state, "placement", None), "within", None)
    if isinstance(getattr(step, "inner", None), OffloadedStep) and isinstance(within, OffloadSpec):
        stage = TrainState(state.params, state.opt_state, state.step, state.rng, state.loss_scale, within)
        state._consumed = True  # a pipeline stage's offloaded state (``PipelineSpec.within``): its files go
        step, state = step.inner, stage
    if not isinstance(step, OffloadedStep) or step.engine is None:
        return 0
    step._check_state(state)
    engine = step.engine
    names = list(dict.fromkeys(x.name for x in tree.leaves((state.params, state.opt_state)) if isinstance(x, OnDisk)))
    names += [grad_file(i) for i in range(len(tree.leaves(state.params))) if engine.file(grad_file(i)).exists()]
    state._consumed = True  # before anything goes: a background save of it finishes first
    freed = 0
    for name in names:  # under the engine's lock: no other engine writes here meanwhile
        file = engine.file(name)
        freed += sum(f.stat().st_size for f in (file, spare_path(file)) if f.exists())
        engine.remove(name)  # waits for the operations issued on it
    engine.close()
    step.engine = None
    for folder in step._made:
        try:
            folder.rmdir()  # only empty: what else is there (another rank's folder) keeps it
        except OSError:
            break
    step._made = []
    return freed


def offload(step: Step, optimizer: str = "cpu", params: str | None = None, *, path: str | None = None,
            chunk_bytes: int = 64 << 20, overlap: bool | None = None, units=None, prefetch: int = 1,
            group_bytes: int | None = None) -> OffloadedStep:
    """``step`` with its optimizer state and its fp32 master params kept in CPU RAM or
    on NVMe between steps, and updated there by the optimizer's CPU kernel, leaf by leaf.

    Args:
      step: a plain ``Step`` from ``train_step`` or a sharded one from ``zf.shard`` (stage 1-3;
        offloading ``params`` needs stage 3 or a plain step).
      optimizer: "cpu" (host RAM, pinned with a GPU) or "nvme" (swap files under ``path``).
      params: ``None`` (masters with the optimizer state; the device keeps the params whole in the
        compute dtype), "cpu" or "nvme": masters there, and each unit of params fetched just
        before use (stage 3's gatherer; ``units`` and ``prefetch`` as in ``zf.shard`` for a plain step).
      path: directory of the swap files, for "nvme" (checked for room and writability by ``init``).
        Each process keeps its files in its own folder, ``path/rank00003/`` for global rank 3
        (``path`` itself for a process alone), and locks it while its step lives: ranks given one
        path never share a file, and a second run on a path in use is refused (``SwapInUseError``).
      chunk_bytes: bytes of reads kept in flight ahead of the update and of param fetches (plus
        the group a read reaches into); writes in flight are bounded by twice this.
      group_bytes: on NVMe, the fp32 master bytes of a group of consecutive leaves kept in one
        pair of swap files (masters, optimizer state), as DeepSpeed's ``sub_group_size``; a larger
        leaf is a group alone. Default ``chunk_bytes // 4``: a group's master and Adam moments fit
        the reads in flight. RAM holds a group's files while its leaves are in use.
      overlap: update units during backward (default: whenever the optimizer allows it; see the
        module docstring); True insists (error if not possible), False never. With overlap only a
        non-finite loss skips a step; non-finite grads behind a finite one raise ``NonFiniteError``
        with the state consumed (module docstring): False makes them skip the step too.
    Law and cost: the module docstring. Needs ``donate=True`` (the default): the state is updated
    where it lives, in RAM or in its files.
    """
    compose.check("offload", step, params=params, units=units)
    if optimizer not in PLACES:
        raise ValueError(f"optimizer: expected one of {PLACES}, got {optimizer!r}")
    if params not in (None, *PLACES):
        raise ValueError(f"params: expected None, 'cpu' or 'nvme', got {params!r}")
    if "nvme" in (optimizer, params) and not path:
        raise ValueError("path: 'nvme' offload needs a directory for its swap files, got none")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 4096:
        raise ValueError(f"chunk_bytes: expected an int >= 4096, got {chunk_bytes!r}")
    if group_bytes is not None and (not isinstance(group_bytes, int) or group_bytes < 1):
        raise ValueError(f"group_bytes: expected None or an int >= 1, got {group_bytes!r}")
    if not step.donate:
        raise ValueError("step: offload updates the state where it lives (RAM or files), so it needs a donating "
                         "step; build it with train_step(..., donate=True)")
    if compose.applied(step, "shard"):
        sharded = step
    else:  # a plain step is sharded over one process: its machinery fetches units and delivers grads
        from zfunc.model import units as units_mod

        sharded = ShardedStep(step, Mesh.alone(), 3 if params is not None else 2, units or units_mod.auto(),
                              prefetch, 25 << 18, verify=False)
    return OffloadedStep(step, sharded, optimizer, params, path, chunk_bytes, overlap, group_bytes)
