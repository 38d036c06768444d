"""offload: optimizer state and params in CPU RAM or on NVMe, updated by CPU-Adam as grads arrive.

``zf.offload(step, optimizer="cpu"|"nvme", params=None|"cpu"|"nvme", path=...)`` returns a step
that trains exactly like ``step`` (a plain step, or ``zf.shard(step, mesh, stage)``) while keeping,
between steps, the optimizer state (``optimizer=``) and the fp32 master params (``params=``) in
CPU RAM (pinned when there is a GPU) or in swap files under ``path`` (``zfunc.swap``), each process
in its own folder (``path/rank00003/`` for global rank 3, ``path`` itself alone), locked while used.

**Law.** For the same optimizer and kernel (``backend="auto"`` runs zfunc's CPU-Adam on the
offloaded leaves and on a plain step's state on the CPU; a plain step on a GPU runs torch's kernel,
which agrees with it to about an ulp per step) the offloaded step gives the same params, optimizer state, loss and grad norm as ``step``, up to
the rounding of the global norm, which is summed leaf by leaf. Never a stale or delayed update.
Module buffers (BatchNorm statistics, ``zfunc.module``) are not offloaded: they stay in
``state.buffers`` where the forward computes, updated and averaged over ranks as ``zf.shard`` says.

**How a step runs** (one param *leaf* is the unit of storage; each leaf has its own optimizer
state, ``optimizer.init({name: piece})``, so a leaf can be updated alone):
- forward/backward: exactly ``shard``'s machinery, over a one-process mesh for a plain step.
  With ``params`` offloaded, units are fetched just in time (stage 3's gatherer) from the store,
  reads running ahead in the order recorded on the first step; else params are gathered whole.
- update: each leaf's master and state are read (``chunk_bytes`` of reads kept in flight ahead),
  updated by the optimizer's fused kernel on the CPU, and written back asynchronously: disk reads,
  CPU work and disk writes of consecutive leaves overlap (a 3-deep pipeline).
- overlap with backward: when the optimizer does not need the global grad norm (its
  ``needs_global_norm`` declaration is False: no ``clip_by_global_norm``), there is no fp16 overflow check and ``accum == 1``, a unit is updated as
  soon as its reduced grads exist, during the rest of backward. Otherwise all grad slices (fp32,
  4 B/param/N) are held until backward ends and the norm is known. The grad norm, where wanted
  (``train_step(grad_norm=True)``, clipping, fp16), is then summed from the squares CPU-Adam
  computes in its own pass over each grad (``optim.apply(squares=)``): the grads are read once.
  With ``train_step(grad_norm=False)`` and nothing else needing it, no norm is computed at all,
  held or overlapped, and only the loss is checked (the plain step's rule).

**Non-finite steps** (``zfunc.step``'s rules): without overlap the update waits for the grad norm,
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

**Cost** per rank, Psi params over N ranks (fp32 masters, Adam): RAM between steps holds nothing of
what is offloaded to "nvme"; ``optimizer="cpu"`` holds 8 Psi/N of moments in host RAM, ``params``
4 Psi/N of masters. Disk traffic per step with both on NVMe: reads 4 Psi/N per forward/backward
fetch of params + 12 Psi/N for the update; writes 12 Psi/N; disk space up to 24 Psi/N (the swap
engine keeps a spare of each file). The compute-side memory is that of the sharded step (stage 3:
a few units) plus ``chunk_bytes`` of reads and twice that of writes in flight.

``init(params, materialize=...)`` starts from meta-device params one leaf at a time, so a model
larger than RAM can start; ``zf.checkpoint.load(path, step)`` places a checkpoint the same way, one
leaf at a time (``restore``); ``zf.checkpoint.save`` / ``full_params`` read an offloaded state back
(``in_ram``).

bf16/fp16: a master kept in RAM (``params=None`` computing on the CPU, or ``params="cpu"``) gets
its compute-dtype copy written by the update in the same pass (``optim.apply(out=)``; zfunc's
CPU-Adam writes it while it updates), kept between steps (``ComputeCopies``, 2 B/param) and
gathered by the next forward instead of the master: no cast pass, and half the bytes gathered
(across PCIe with a GPU, for ``params="cpu"``). Masters on NVMe, or on the GPU, are cast at the
gather as before.

Not yet: grads cross PCIe as fp32 on CUDA, and masters kept on the GPU (``params=None``) cross
it as fp32 both ways for the update.

Over 400 lines for a reason: the step, its run object (``OffloadRun``) and the leaf-by-leaf update
are one mechanism; ``_Stores``/``OffloadRun``/``_Updating`` can move to a module of their own.
"""
from __future__ import annotations

import math
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any

import torch

from zfunc import compose, optim, precision as mp, tree
from zfunc.dist import Mesh
from zfunc.ops import hostmem
from zfunc.shard import FlatGroup, GradSlices, ShardedStep, ShardSpec, _leaf_names, local_piece
from zfunc.shard_run import ShardRun
from zfunc.step import _FIELDS, NonFiniteError, Step, TrainState, Transformed, require_train_state
from zfunc.store import All, OnDisk, ReadAhead, Store

PyTree = Any
PLACES = ("cpu", "nvme")


@dataclass(frozen=True)
class OffloadSpec(ShardSpec):
    """A ``ShardSpec`` (a plain step's offload is sharded over one rank) plus where the state lives."""

    optimizer: str = "cpu"
    params: str | None = None
    path: str | None = None
    device: torch.device = torch.device("cpu")  # where forward and backward compute

    def __str__(self) -> str:
        return (f"stage {self.stage} over {self.world} ranks, optimizer on {self.optimizer}, params on "
                f"{self.params or 'the compute device'}")


def _shard_fields(spec: ShardSpec) -> tuple:
    return tuple(getattr(spec, f.name) for f in fields(ShardSpec))


class _Pieces:
    """The param pieces, as ``shard``'s gatherers index them: a leaf's compute copy where the
    last update wrote one (``copies[i]``), else its master, read from the store on access."""

    def __init__(self, masters: list, reader: ReadAhead, copies: list):
        self.masters, self.reader, self.copies = masters, reader, copies

    def __len__(self) -> int:
        return len(self.masters)

    def __getitem__(self, i: int) -> torch.Tensor:
        copy = self.copies[i]
        return self.reader.get(i) if copy is None else copy


class ComputeCopies:
    """Each RAM master's compute-dtype copy (bf16/fp16), written by the update in the kernel's own
    pass, so that the next forward gathers it instead of casting the master (a second pass over
    it, 6 B/param). A copy is used only for the very master tensor it was written from, unchanged
    since (same object, same version counter); it is dropped when that tensor dies. Keyed by
    tensor, not held by a step's run: one step object may drive several states. Cost: 2 B/param
    of host RAM (pinned with a GPU) for every offloaded master in RAM trained in bf16/fp16."""

    def __init__(self):
        self._by_id: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def of(self, master: Any) -> torch.Tensor | None:
        """The copy written from ``master`` as it is now, or None."""
        entry = self._by_id.get(id(master))
        if entry is None or entry[0]() is not master or entry[1] != master._version:
            return None
        return entry[2]

    def buffer(self, master: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """Where ``master``'s next copy goes: its old copy's storage, or a new tensor."""
        entry = self._by_id.get(id(master))
        if entry is not None and entry[0]() is master and entry[2].dtype == dtype:
            return entry[2]
        return torch.empty(master.shape, dtype=dtype, pin_memory=pin)

    def written(self, master: torch.Tensor, copy: torch.Tensor) -> None:
        """``copy`` now equals ``master`` cast (the version counter read after the write)."""
        key, by_id = id(master), self._by_id
        by_id[key] = (weakref.ref(master, lambda _: by_id.pop(key, None)), master._version, copy)


class _Stores:
    """Where one call (an ``init`` or a step) puts leaves: the optimizer's and the params' stores,
    and the writes in flight (at most ``2 * chunk_bytes``)."""

    def __init__(self, step: OffloadedStep, device: torch.device):
        pin = device.type == "cuda"
        self.chunk_bytes = step.chunk_bytes
        self._writes: deque = deque()
        self._opt_store = Store(step.engine if step.where_optimizer == "nvme" else None, pin, self._track)
        self._param_store = Store(step.engine if step.where_params == "nvme" else None, pin, self._track)

    def _track(self, write: Future | None, nbytes: int) -> None:
        if write is None:
            return
        self._writes.append((write, nbytes))
        self._wait_writes(2 * self.chunk_bytes)

    def _wait_writes(self, budget: int | None) -> None:
        """Wait for the oldest writes until at most ``budget`` bytes are in flight (all: None)."""
        writes = self._writes
        while writes and (budget is None or sum(n for _, n in writes) > budget):
            writes.popleft()[0].result()


class OffloadedStep(Transformed):
    """The step ``offload`` returns (see the module docstring). It wraps a ``ShardedStep``
    (``sharded``: the sharded step it was given, or, for a plain step, one over a one-process mesh)
    and replaces three of its roles in its run (``OffloadRun``): params come from the stores, grads
    go to an updating or holding sink, the update runs leaf by leaf from the stores."""

    def __init__(self, base: Step, sharded: ShardedStep, optimizer: str, params: str | None, path: str | None,
                 chunk_bytes: int, overlap: bool | None):
        super().__init__(sharded, "offload")
        self.layers = (*base.layers, "offload")  # what the user built: a plain step's shard is internal
        self.sharded = sharded
        self.peak_gathered_bytes = self.peak_whole_grad_bytes = 0  # what the last call measured
        self.where_optimizer, self.where_params, self.path = optimizer, params, path
        self.chunk_bytes = chunk_bytes
        self.overlap = _overlap_allowed(base, overlap)
        self.engine = None
        self._fetch_order: list[int] = []  # params' read order in the last step (forward/backward)
        self.compute_copies = ComputeCopies()
        self._update_order: list[int] = []  # leaves' update order in the last step
        self.update_s = 0.0  # the last step's held update (not overlapped with backward), writes included

    # ------------------------------------------------------------------ init
    def init(self, params: PyTree, materialize: Callable[[str, torch.Tensor], torch.Tensor] | None = None
             ) -> TrainState:
        """This rank's fp32 pieces of ``params`` and their optimizer state, placed where the step
        keeps them (written to swap files for "nvme"), one leaf at a time.

        ``materialize(name, like)``: for params built on the meta device (``with
        torch.device("meta"): model = GPT(cfg)``), returns leaf ``name``'s whole initial value
        (shaped like ``like``); only one leaf is ever materialized at once, so a model larger than
        RAM can start. Compute then happens on CUDA when available, else on the CPU.
        """
        device, leaves, treespec, spec = self._layout(params)
        if device.type == "meta":
            if materialize is None:
                raise ValueError("params: on the meta device; pass materialize(name, like) -> tensor to init")
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        names = _leaf_names(params)

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
        _, _, treespec, spec = self._layout(params)
        pieces = [torch.empty(leaf.local_shape(spec.rank), device="meta") for leaf in spec.leaves]
        states = tuple(self.optimizer.init({name: p}) for name, p in zip(_leaf_names(params), pieces))
        meta = torch.device("meta")
        off = OffloadSpec(*_shard_fields(spec), self.where_optimizer, self.where_params, self.path, meta)
        return TrainState(tree.unflatten(treespec, pieces), states, 0, self.seed, mp.init_loss_scale(self.precision),
                          off)

    def restore(self, params: PyTree, leaf: Callable[[int], tuple[torch.Tensor, Any]],
                device: str | torch.device = "cpu") -> TrainState:
        """A state placed as ``init`` places it (in RAM, or written to this rank's swap files),
        whose leaf ``i`` (``params``' leaf order) holds the fp32 CPU piece and optimizer state
        ``leaf(i)`` returns, shaped as in ``init_meta(params)``; compute happens on ``device``.
        ``leaf`` is called one leaf at a time, each placed before the next is asked for, so only
        one leaf's values need be in RAM at once. Step, RNG and loss scale are the initial ones:
        what ``zf.checkpoint.load`` fills in next."""
        _, _, treespec, spec = self._layout(params)
        self.initialized_with = tree.map(lambda x: x.to("meta"), params)
        return self._place(treespec, spec, leaf, torch.device(device))

    def _place(self, treespec: Any, spec: ShardSpec, leaf: Callable[[int], tuple[torch.Tensor, Any]],
               device: torch.device) -> TrainState:
        """Each leaf's piece and optimizer state from ``leaf(i)``, put where the step keeps them."""
        self._swap(spec)
        stores = _Stores(self, device)
        masters, states = [], []
        for i in range(len(spec.leaves)):
            piece, state = leaf(i)
            s_leaves, s_spec = tree.flatten(state)
            states.append(tree.unflatten(s_spec, [stores._opt_store.put(f"p{i}.s{j}", t) if _is_stored(t) else t
                                                  for j, t in enumerate(s_leaves)]))
            masters.append(piece.to(device) if self.where_params is None
                           else stores._param_store.put(f"p{i}.master", piece))
            del piece, state, s_leaves
        stores._wait_writes(None)
        path = self.path if self.engine is None else str(self.engine.path)  # this rank's files
        off = OffloadSpec(*_shard_fields(spec), self.where_optimizer, self.where_params, path, device)
        return TrainState(tree.unflatten(treespec, masters), tuple(states), 0, self.seed,
                          mp.init_loss_scale(self.precision), off)

    def _swap(self, spec: ShardSpec) -> None:
        """The swap engine, on this process's own folder of ``path`` (``rank_dir``), which it locks."""
        if self.engine is None and "nvme" in (self.where_optimizer, self.where_params):
            from zfunc.swap import SwapEngine, rank_dir

            # the files init writes, fp32 like the local pieces: a master (params on nvme) and, as
            # for Adam, two moments (optimizer on nvme) per leaf; the engine adds their spares
            per_leaf = (self.where_params == "nvme") + 2 * (self.where_optimizer == "nvme")
            files = [4 * math.prod(leaf.local_shape(spec.rank)) for leaf in spec.leaves for _ in range(per_leaf)]
            # 4 I/O threads: enough to keep the disk busy under a CPU update, and every thread costs
            # RAM (an allocator arena, a staging buffer): at 8 the 403M-param GPT of
            # benchmarks/capacity.py no longer fit in 1 GiB
            self.engine = SwapEngine(rank_dir(self.path), files=files, threads=4)

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
        """Bytes of the state by place: "device" (masters kept where compute happens), "cpu" (host
        RAM), "nvme" (swap files); the peak of whole params in the last step and its communication."""
        self._check_state(state)
        where = {"device": 0, "cpu": 0, "nvme": 0}
        ram = "device" if self.where_params is None else "cpu"
        for leaves, in_ram in ((tree.leaves(state.params), ram), (tree.leaves(state.opt_state), "cpu")):
            for x in leaves:
                if isinstance(x, OnDisk):
                    where["nvme"] += x.nbytes
                elif isinstance(x, torch.Tensor):
                    where[in_ram] += x.numel() * x.element_size()
        return {**where, "whole_params": self.peak_gathered_bytes, "comm": self.mesh.comm_bytes()}

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        self._check_state(state)
        run = OffloadRun(self, state)  # all per-call state lives there
        try:
            return run.execute(state, batch)
        finally:
            self.peak_gathered_bytes, self.peak_whole_grad_bytes = run.peak_gathered_bytes, run.peak_whole_grad_bytes
            self.update_s = run.update_s


class OffloadRun(_Stores, ShardRun):
    """One call of an ``OffloadedStep``: a ``ShardRun`` whose params come from the stores (read
    ahead in the order the last step read them), whose grads go to an updating sink (overlap) or
    are held, and whose update runs leaf by leaf from the stores, writing back as it goes."""

    def __init__(self, step: OffloadedStep, state: TrainState):
        ShardRun.__init__(self, step, state)
        _Stores.__init__(self, step, state.placement.device)
        self._state_in_use, self._fields = state, tuple(getattr(state, f) for f in _FIELDS)
        self._masters, self._param_names = tree.leaves(state.params), _leaf_names(state.params)
        self._opt_states = list(state.opt_state)
        self._reader = ReadAhead(lambda i: self._param_store.fetch(self._masters[i]), self._leaf_bytes,
                                 step._fetch_order, self.chunk_bytes)
        self._sq_norm = torch.zeros((), dtype=torch.float64)  # overlap: the grads' sum of squares so far
        self._wants_norm = self._needs_norm()  # train_step(grad_norm=), clipping or fp16; else no norm at all
        self._new: dict[int, tuple[Any, Any]] = {}
        self._skip_updates = False
        self._update_seen: list[int] | None = None  # leaves in the order an overlapped update met them
        self.update_s = 0.0  # seconds in the held (not overlapped) update, writes included

    def execute(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        try:
            return super().execute(state, batch)
        finally:
            self.step._fetch_order = self._reader.seen  # learned: the next step reads ahead in this order
            if self._update_seen is not None:
                self.step._update_order = self._update_seen
            self._wait_writes(None)

    def _leaf_bytes(self, i: int) -> int:
        return 4 * math.prod(self._state_spec.leaves[i].local_shape(self._state_spec.rank))

    def _device(self, pieces) -> torch.device:
        return self._state_spec.device

    def _pieces(self, params) -> tuple[Any, Any]:
        masters, treespec = tree.flatten(params)
        copies = [self.compute_copies.of(m) for m in masters]
        if self.where_params is None:
            return [m if c is None else c for m, c in zip(masters, copies)], treespec
        return _Pieces(masters, self._reader, copies), treespec

    def _grad_sink(self, pieces):
        self._skip_updates = False
        if self.overlap:
            return _Updating(self)
        spec = self._state_spec
        return GradSlices(lambda i: torch.zeros(spec.leaves[i].local_shape(spec.rank), dtype=torch.float32,
                                                device=spec.device), len(spec.leaves), self._grad_divisor())

    # ------------------------------------------------------------------ the update
    def _before_backward(self, loss: torch.Tensor) -> None:
        """With overlap, updates start during backward: a non-finite loss (summed over the ranks,
        so all decide alike) turns them off for this step, which ``_update`` then skips."""
        if not self.overlap:
            return
        total = loss.detach().float().reshape(1).clone()
        if self.mesh.dp > 1:
            self.mesh.comm.all_reduce(total, label="loss all-reduce before an overlapped backward")
        self._skip_updates = not bool(torch.isfinite(total))

    def _update(self, state: TrainState, grads: PyTree, loss: torch.Tensor, aux: Any):
        params, opt_state, step, rng, loss_scale, _ = self._fields  # the state may be consumed by now
        if grads is not None:
            g_leaves = tree.leaves(grads)
        if not self._wants_norm:  # nothing reads it: only the loss is checked, as in the plain step
            self._sum_over_ranks(torch.zeros(()))  # the step's one sync still sums the loss and grads-produced flags
            norm = None
        elif grads is not None:  # held until now: the norm first, then every leaf
            norm = optim.global_norm(g_leaves)  # inside summing_across: over all ranks
        else:
            norm = self._sum_over_ranks(self._sq_norm.float()).sqrt()
            if not self._skip_updates and not bool(torch.isfinite(norm)):
                raise NonFiniteError(
                    f"step: non-finite grads (grad norm {norm.item()}) at state.step={step} behind a finite loss, "
                    "with offload's overlap: the leaves were updated during backward, before the norm was "
                    "known, so the state passed in is consumed. Restart from a checkpoint; with "
                    "offload(..., overlap=False) such a step is skipped instead")
        finite = self._finite(loss, norm, step, loss_scale)  # may raise: nothing written yet
        lr = optim.learning_rate(self.optimizer, self._opt_states[0])
        state._consumed = True
        if grads is not None and finite:
            g_leaves = self._without_missing_grads(g_leaves)
            if norm is None:
                self._update_leaves(list(range(len(g_leaves))), g_leaves)
            else:
                total_sq = (norm.double() ** 2).float()
                with optim.summing_across(lambda local_sq: total_sq):
                    self._update_leaves(list(range(len(g_leaves))), g_leaves)
        self._wait_writes(None)
        loss_scale = mp.next_loss_scale(loss_scale, finite)
        metrics = self._metrics(loss, norm, lr, finite, step, loss_scale, aux)
        masters = [self._new.get(i, (m, None))[0] for i, m in enumerate(self._masters)]
        states = tuple(self._new.get(i, (None, s))[1] for i, s in enumerate(self._opt_states))
        new_params = tree.unflatten(tree.structure(params), masters)
        return TrainState(new_params, states, step + 1, rng, loss_scale, state.placement), metrics

    def _update_leaves(self, order: list[int], grads: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        reader = ReadAhead(self._fetch_leaf, self._update_bytes, order, self.chunk_bytes)
        for i in order:
            self._update_leaf(i, grads[i], reader)
        self._wait_writes(None)
        self.update_s += time.perf_counter() - start

    def _fetch_leaf(self, i: int) -> All:
        """Pending ``[master, *state tensors]`` of leaf ``i``, all reads started."""
        parts = [self._param_store.fetch(self._masters[i])]
        parts += [self._opt_store.fetch(t) for t in tree.leaves(self._opt_states[i]) if _is_stored(t)]
        return All(parts)

    def _update_bytes(self, i: int) -> int:
        return self._leaf_bytes(i) * (1 + sum(_is_stored(t) for t in tree.leaves(self._opt_states[i])))

    def _update_leaf(self, i: int, grad: torch.Tensor | None, reader: ReadAhead, squares: list | None = None) -> None:
        """Read leaf ``i``'s master and state, apply the optimizer on the CPU, write them back.
        ``grad`` None: no grad; the optimizer leaves the param alone but advances its count, as
        the plain step's does for all params together. ``squares``: as in ``optim.apply`` (the
        kernel appends the grad's sum of squares where it computes it in its pass)."""
        self._state_in_use._consumed = True  # its files or tensors change from here on
        master, *tensors = reader.get(i)
        name = self._param_names[i]  # the key its optimizer state was made with
        on_device = master.device
        state_leaves, s_spec = tree.flatten(self._opt_states[i])
        it = iter(tensors)
        state = tree.unflatten(s_spec, [next(it).to("cpu") if _is_stored(t) else t for t in state_leaves])
        p_cpu = master.to("cpu")
        grad = None if grad is None else grad.to("cpu", torch.float32)
        # A master kept in RAM gets its compute copy in the update's own pass (ComputeCopies)
        in_ram = isinstance(self._masters[i], torch.Tensor) and self._masters[i].device.type == "cpu"
        out = None
        if in_ram and self.compute_dtype is not torch.float32:
            out = self.compute_copies.buffer(self._masters[i], self.compute_dtype, self._param_store.pin)
        new_p, new_state = optim.apply(self.optimizer, {name: grad}, state, {name: p_cpu},
                                       out=None if out is None else {name: out}, squares=squares)
        new_p = new_p[name]
        if on_device.type != "cpu":
            master.copy_(new_p)
            new_p = master
        handle, write = self._param_store.store_back(self._masters[i], new_p)
        self._track(write, self._leaf_bytes(i))
        if out is not None:
            self.compute_copies.written(handle, out)
        new_leaves = []
        for old, new in zip(state_leaves, tree.leaves(new_state)):
            if _is_stored(old):
                kept, write = self._opt_store.store_back(old, new)
                self._track(write, new.numel() * new.element_size())
                new_leaves.append(kept)
            else:
                new_leaves.append(new)
        self._new[i] = (handle, tree.unflatten(s_spec, new_leaves))

def _is_stored(t: Any) -> bool:
    return isinstance(t, (torch.Tensor, OnDisk))


class _Updating:
    """A grad sink that updates each unit's leaves as soon as their reduced grads arrive."""

    early = True

    def __init__(self, step: OffloadRun):
        self.step = step
        order = step._update_order
        self.reader = ReadAhead(step._fetch_leaf, step._update_bytes, order, step.chunk_bytes)
        self.seen: list[int] = []
        self.produced: set[int] = set()  # leaves backward produced a grad for, as far as read
        self.read = 0  # how much of the reducer's ``arrived`` list is in ``produced``

    def deliver(self, unit: FlatGroup, slices: list[torch.Tensor]) -> None:
        """Update each leaf of ``unit`` with its reduced grad slice; where the norm is wanted,
        add the slice's sum of squares, which the optimizer's kernel computes in its own pass
        (``optim.apply(squares=)``), so the grads are read once."""
        step = self.step
        divisor, wants = step._grad_divisor(), step._wants_norm
        for i, g in zip(unit.indices, slices):
            if divisor != 1.0:
                g = g / divisor
            self.seen.append(i)
            produced = not step._skip_updates and self._produced(i)
            squares = [] if wants and produced else None
            if not step._skip_updates:  # else a non-finite loss: the step will be skipped
                step._update_leaf(i, g if produced else None, self.reader, squares)
            if wants:  # the kernel's sum, or (another kernel; a leaf with no grad: zeros) the slice's norm
                step._sq_norm += squares[0] if squares else torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2

    def _produced(self, i: int) -> bool:
        """Whether leaf ``i`` has a grad. Alone, exact: a unit is delivered once its grads are all
        in, or backward has ended. Over N > 1 ranks, other ranks' grads are unknown: True."""
        if self.step.mesh.dp > 1:
            return True
        arrived = self.step._arrived  # grows as backward runs (accum is 1 with overlap: one list)
        self.produced.update(arrived[self.read :])
        self.read = len(arrived)
        return i in self.produced

    def result(self):
        self.step._update_seen = self.seen  # the run's step learns it at the end of the call
        return None


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


def in_ram(state: TrainState) -> TrainState:
    """``state`` with every leaf kept in a swap file read back into (new) CPU tensors; the state
    itself is not consumed. What ``zf.checkpoint.save`` and ``full_params`` read an offloaded
    state through (so they need RAM for this rank's whole state)."""
    spec = state.placement
    if not isinstance(spec, OffloadSpec) or spec.path is None:
        return state
    from zfunc.swap import SwapEngine

    with SwapEngine(spec.path, lock=False) as engine:  # a reader beside the step's engine, between steps
        store = Store(engine)
        futures = tree.map(store.fetch, (state.params, state.opt_state))  # RAM leaves come back as they are
        params, opt_state = tree.map(lambda f: f.result(), futures)
    return state.replace(params=params, opt_state=opt_state)


def offload(step: Step, optimizer: str = "cpu", params: str | None = None, *, path: str | None = None,
            chunk_bytes: int = 64 << 20, overlap: bool | None = None, units=None, prefetch: int = 1) -> OffloadedStep:
    """``step`` with its optimizer state (and optionally its fp32 master params) kept in CPU RAM or
    on NVMe between steps, and updated there by the optimizer's CPU kernel, leaf by leaf.

    Args:
      step: a plain ``Step`` from ``train_step`` or a sharded one from ``zf.shard`` (stage 1-3;
        offloading ``params`` needs stage 3 or a plain step).
      optimizer: "cpu" (host RAM, pinned with a GPU) or "nvme" (swap files under ``path``).
      params: ``None`` (masters stay where compute happens), "cpu" or "nvme": masters offloaded
        too, and each unit of params fetched just before use (stage 3's gatherer; ``units`` and
        ``prefetch`` as in ``zf.shard`` for a plain step).
      path: directory of the swap files, for "nvme" (checked for room and writability by ``init``).
        Each process keeps its files in its own folder, ``path/rank00003/`` for global rank 3
        (``path`` itself for a process alone), and locks it while its step lives: ranks given one
        path never share a file, and a second run on a path in use is refused (``SwapInUseError``).
      chunk_bytes: bytes of reads kept in flight ahead of the update and of param fetches; writes
        in flight are bounded by twice this.
      overlap: update units during backward (default: whenever the optimizer allows it; see the
        module docstring); True insists (error if not possible), False never. With overlap only a
        non-finite loss skips a step; non-finite grads behind a finite one raise ``NonFiniteError``
        with the state consumed (module docstring): False makes them skip the step too.
    Law and cost: the module docstring. Needs ``donate=True`` (the default): the state is updated
    where it lives, in RAM or in its files.
    """
    compose.check("offload", step)
    if optimizer not in PLACES:
        raise ValueError(f"optimizer: expected one of {PLACES}, got {optimizer!r}")
    if params not in (None, *PLACES):
        raise ValueError(f"params: expected None, 'cpu' or 'nvme', got {params!r}")
    if "nvme" in (optimizer, params) and not path:
        raise ValueError("path: 'nvme' offload needs a directory for its swap files, got none")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 4096:
        raise ValueError(f"chunk_bytes: expected an int >= 4096, got {chunk_bytes!r}")
    if not step.donate:
        raise ValueError("step: offload updates the state where it lives (RAM or files), so it needs a donating "
                         "step; build it with train_step(..., donate=True)")
    if compose.applied(step, "shard"):
        if params is not None and step.stage != 3:
            raise ValueError(f"params: offloading params needs stage 3 (units fetched just in time), the step is "
                             f"stage {step.stage}")
        if units is not None:
            raise ValueError("units: a sharded step brings its own units; pass them to zf.shard")
        sharded = step
    else:  # a plain step is sharded over one process: its machinery fetches units and delivers grads
        from zfunc import units as units_mod

        sharded = ShardedStep(step, Mesh.alone(), 3 if params is not None else 2, units or units_mod.auto(),
                              prefetch, 25 << 18, verify=False)
    return OffloadedStep(step, sharded, optimizer, params, path, chunk_bytes, overlap)
