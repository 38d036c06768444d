"""shard: ZeRO stages 0 (replicated data parallel, DDP), 1, 2 and 3 as a transformation of the step.

``zf.shard(step, mesh, stage, units=None)`` returns a step whose state is partitioned across the
``mesh.dp`` data-parallel ranks. Each rank feeds it its own batch; together they train exactly as
the plain step trains on the concatenated batch.

**Law.** For a loss that is a mean over equal-sized per-rank batches, N ranks running the sharded
step on batches ``b_0..b_{N-1}`` produce the same params, optimizer state, loss and grad norm as
the plain step on ``cat(b_0..b_{N-1})`` (up to the reordering of sums in the collectives).

**Module buffers** (BatchNorm's running statistics; ``zfunc.model.functional``): each rank's forward
normalizes with its own batch's statistics and updates the buffers from them, as DDP does without
SyncBatchNorm -- for such a model the law above holds against N replicas each on its own batch,
grads averaged, not against the plain step on the concatenated batch. After backward, every
floating buffer a forward wrote is replaced by its mean over the ranks, so all ranks hold the same
buffers (a momentum update thus uses the mean of the ranks' batch statistics). Integer buffers
(``num_batches_tracked``) stay each rank's count: equal, as the ranks run the same forwards. Cost:
one all-reduce of the written floating buffers per step, in fp64 (16 bytes per element as
``dist.Comm`` counts bytes); none for a model without such buffers.

**Layout (stages 1-3 alike).** Every parameter is split along dim 0 in ``torch.chunk`` style:
``chunk = ceil(rows / N)`` rows per rank, the last ranks holding fewer or none (0-d params count as
one row). ``state.params`` holds this rank's pieces (fp32 masters) and ``state.opt_state`` the
optimizer's state for them, so each rank keeps 1/N of params and optimizer state between steps,
whatever the stage, and a checkpoint's layout does not depend on the stage. Collectives work on
flat buffers (``FlatGroup``: a *bucket* of leaves at stages 0-2, a *unit* at stage 3), each rank's
segment zero-padded to ``chunk`` rows per param; the padding is never seen by the optimizer or
the norm. Plain tensors, not ``DTensor``: pieces are handed to the same fused optimizer kernels
as unsharded params (a DTensor would dispatch every optimizer op
through its sharding propagation), and uneven ``torch.chunk`` sharding is easy to describe to
``torch.distributed.checkpoint`` from ``ShardSpec`` when checkpointing needs it. Stage 0 keeps
every param and its optimizer state whole on every rank: its ``ShardSpec`` describes the layout of
one rank alone (``chunk = rows``; ``ShardSpec.split == (1, 0)``), which is a plain state's, so its
checkpoint is written once, by rank 0, and reshards to and from the other stages.

**Stages** (what differs is when params are whole and how grads travel):
- 0: params are whole on every rank (the masters themselves at fp32); each grad is summed, as
  backward produces it, into an fp32 bucket, and each bucket all-reduced as soon as it is complete,
  overlapping the rest of backward (``GradAllReducer``; buckets ordered as at stages 1/2, the
  first one small as DDP's, see ``ShardedStep._bucket_sizes``). With accumulation the
  microbatches before the last only sum (DDP's ``no_sync``). Every rank then runs
  the optimizer on the whole params: the all-reduce gives every rank the same bits, so the
  replicas stay identical, and the grad norm needs no collective (the loss rides in the last
  grad bucket: no collective of its own).
- 1: all params are all-gathered (in the compute dtype) at the start of the step; whole grads are
  held for the step: reduce-scattered bucket by bucket as backward produces them (accum=1), or
  summed over microbatches and reduce-scattered once (accum>1).
- 2: as 1, but each bucket's grads are freed once reduce-scattered (every microbatch): a rank
  never holds more than the buckets still in flight of whole grads beyond its own slice.
  Buckets go out in a fixed order, so the ranks' collectives always match: from the second step
  on, the order in which the first step's backward produced the grads on rank 0.
- 3: params stay sharded; each unit is gathered just before its forward, freed after it,
  gathered again when its backward needs it (``prefetch.Gatherer``) and its grads reduce-scattered.

**Cost** per rank, Psi = params, fp32 masters and Adam: between steps ``(4 + 8) Psi / N`` bytes
(masters + moments) at stages 1-3, ``(4 + 8) Psi`` at stage 0. Within the step: stage 0 holds
the fp32 grad buckets (4 Psi) and, below fp32, the compute copy of the params (2 Psi); stages 1/2
hold whole compute params (2 or 4 Psi); stage 1 whole fp32 grads (4 Psi); stage 2 at most one unit
of whole grads; stage 3 at most ``(1 + prefetch)`` units of whole params. Communication per step,
as ``dist.Comm`` counts bytes (DDP = 2 Psi): stage 0 all-reduces Psi fp32 grads = 2 Psi, as DDP; stages 1/2
all-gather Psi + reduce-scatter Psi = 2 Psi (in units of the elements' bytes: params gathered in the
compute dtype; grads reduce-scattered as backward makes them on gloo, bf16 ones widened to fp32 before
any sum (``Comm.reduce_dtype``), in fp32 on NCCL); stage 3 gathers twice: 3 Psi. Stage 1
reduce-scatters its grads rather than all-reducing them: a reduce-scatter gives each rank the slice it
updates for half the bytes.
One small all-reduce per step sums the squared grad norm, the loss and, per param, whether the
rank produced a grad for it: ``4 (2 + leaves)`` bytes.

**Non-finite steps and params without grads** (``zfunc.core.step``'s rules, on every rank alike): the
skip is decided on the summed loss and grad norm, which that all-reduce already made equal on
every rank; no other sync. A param is left alone by the optimizer only if no rank's backward
produced a grad for it (DDP's rule), which the same all-reduce tells every rank.
"""
from __future__ import annotations

from typing import Any

import torch

from zfunc.core import compose, placement, precision as mp, tree
from zfunc.dist import Mesh
from zfunc.dist.hierarchy import blocks, per_node
from zfunc.dist.quantized import QuantizedComm
from zfunc.model.materialize import Materializer, leaf as materialize_leaf
from zfunc.ops.cpu import hostmem
from zfunc.sharding.hpz import secondary_bytes
from zfunc.sharding.layout import FlatGroup, LeafShard, ShardSpec, leaf_names, local_piece
from zfunc.sharding.reduce import Buckets
from zfunc.core.roles import Roles, RunContext
from zfunc.sharding.run import LocalPieces, PlainUpdate, ReducedSlices, StepRun
from zfunc.core.step import Step, check_single_device
from zfunc.core.transformed import Transformed
from zfunc.core.state import TrainState, require_train_state
from zfunc.model.units import Selector

PyTree = Any
FIRST_BUCKET_ELEMS = 1 << 18  # stage 0's first bucket: 1 MiB of fp32, DDP's first_bucket_bytes_cap


class ShardedStep(Transformed):
    """The step ``shard`` returns: same call and ``init`` as ``Step``, state split over the mesh.
    Wraps the plain step it is given (``inner``) and owns the layout and the roles of each call
    (``roles``: params source, grad sink, update, schedule), which a ``StepRun`` drives; the loss,
    optimizer, precision and accumulation are ``inner``'s. What the calls learn it keeps
    (``learn``)."""

    def __init__(self, base: Step, mesh: Mesh, stage: int, units, prefetch: int, bucket_elems: int, verify: bool,
                 fit_buckets: bool = False, quantize_weights: bool = False, grad_bits: int | None = None,
                 hpz: int | None = None):
        super().__init__(base, "shard")
        self.mesh, self.stage, self.units_selector = mesh, stage, units
        # ZeRO++ (``zfunc.dist.quantized``): stage 3's param gathers in int8, grad reduce-scatters in grad_bits
        self.gather_comm = QuantizedComm(mesh.comm, True, None) if quantize_weights else mesh.comm
        self.reduce_comm = (QuantizedComm(mesh.reduce_comm, False, grad_bits, _nodes(mesh)) if grad_bits
                            else mesh.reduce_comm)
        # hpZ (``zfunc.sharding.hpz``): stage 3's re-gathers inside groups of ``hpz`` ranks
        self.hpz, self.hpz_group = hpz, blocks(mesh.comm, hpz, "hpz").inner if hpz else None
        self.prefetch, self.bucket_elems, self.verify = prefetch, bucket_elems, verify
        self.order: list[int] = []  # stage 3: units' run order, recorded on the first step
        self._flat_groups: list[FlatGroup] | None = None  # stages 0-2: the buckets; 3: the units
        # Stages 1/2: the order the first step's backward produced the grads in, until the
        # buckets are rebuilt in it (``StepRun._order_buckets``); then None.
        self._grad_order: list[int] | None = None
        self._buckets_ordered = False
        self._bucket_buffers: Buckets | None = None  # stage 0's fp32 buckets, kept from step to step
        self._gather_groups: list[FlatGroup] | None = None  # stages 1/2: the param gathers' groups
        self.fit_buckets = fit_buckets  # stages 0-2 without bucket_mb: buckets sized to the model
        self._buffer_names: list[str] = []  # the module buffers averaged in the last step
        # what the last call measured (``memory``)
        self.peak_gathered_bytes = 0  # most whole-param bytes held at once in the last step
        self.peak_whole_grad_bytes = 0  # most whole-grad bytes held at once in the last step

    # ------------------------------------------------------------------ init and checks
    def init(self, params: PyTree, materialize: Materializer | None = None) -> TrainState:
        """This rank's fp32 pieces of ``params`` (which must be equal on every rank) and their
        optimizer state; ``placement`` records the split.

        ``materialize``: for params on the meta device (``with torch.device("meta"): model =
        GPT(cfg)``), what makes their values (``zfunc.model.materialize``), asked leaf by leaf for this
        rank's rows only: ``materialize(name, like, rows=slice(start, stop))`` (``zf.materialize``'s
        ``normal``, ``constant``, ``by_name``...), or a plain ``materialize(name, like)`` making
        the whole leaf, which is then sliced. No rank ever holds the whole model: beyond the state,
        peak memory is one rank's rows of one leaf, made then copied into the state (a whole leaf
        for a plain callable). With a materializer whose values depend only on (seed, name, row),
        as ``zfunc.model.materialize``'s do, the state is the same whatever the world size, one process
        included. The pieces go to CUDA when there is a GPU and the mesh can reduce CUDA tensors
        (NCCL, or one process alone), else to the CPU. Ignored for params not on the meta device;
        meta params without it give a meta state, a template of shapes only (``zf.checkpoint.load``
        builds one to read a checkpoint into).
        """
        device, leaves, treespec, spec = self._layout(params)
        if device.type == "meta" and materialize is not None:
            device = self._materialize_device()
            materialize = placement.of(spec).materializer(spec, materialize)  # tp slices: cut from the whole leaves
        self.initialized_with = tree.map(lambda x: x.to("meta"), params)  # what zf.checkpoint.load checks
        pieces = []
        for x, leaf, name in zip(leaves, spec.leaves, leaf_names(params)):  # one leaf's rows at a time
            if x.device.type == "meta" and materialize is not None:
                start = min(spec.split[1] * leaf.chunk, leaf.rows)  # the rows local_piece takes
                rows = materialize_leaf(materialize, name, x, slice(start, start + leaf.local_rows(spec.split[1])))
                pieces.append(hostmem.copy_to(rows.reshape(leaf.local_shape(spec.split[1])), device, torch.float32))
                del rows
            else:
                pieces.append(hostmem.copy_to(local_piece(x.detach(), leaf, spec.split[1]), device, torch.float32))
        master = tree.unflatten(treespec, pieces)
        return TrainState(master, self.optimizer.init(master), 0, self.seed, mp.init_loss_scale(self.precision), spec)

    def _materialize_device(self) -> torch.device:
        """Where materialized pieces go (``init``): gloo moves CPU tensors only, so it keeps them
        there even on a machine with a GPU (asked first: CUDA is not probed on a gloo mesh)."""
        on_gloo = not self.mesh.comm.alone and self.mesh.comm._on_gloo()
        return torch.device("cuda" if not on_gloo and torch.cuda.is_available() else "cpu")

    def _layout(self, params: PyTree) -> tuple[torch.device, list[torch.Tensor], Any, ShardSpec]:
        """``(device, leaves, treespec, spec)`` of ``params``, checked (floating tensors, the same
        on every rank unless on the meta device)."""
        device = check_single_device(params)
        leaves, treespec = tree.flatten(params)
        for x in leaves:
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise TypeError(f"params: shard needs floating-point tensor leaves, got {type(x).__name__}"
                                f"{' ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}")
        if self.verify and device.type != "meta" and self.mesh.dp > 1:  # every rank must start alike
            checksum = torch.stack([x.detach().double().sum().cpu() for x in leaves]).sum()
            self.mesh.comm.agree((int(checksum.view(torch.int64)),), lambda op: f"params checksum {op[0]}",
                                 "init: params differ across ranks (seed the model the same way on every rank)")
        world = 1 if self.stage == 0 else self.mesh.dp  # stage 0: every rank holds every row
        spec = ShardSpec(self.stage, self.mesh.dp, self.mesh.rank,
                         tuple(LeafShard(tuple(x.shape), -(-(x.shape[0] if x.dim() else 1) // world)) for x in leaves),
                         self.inner.placement_of(params))  # e.g. a tensor-parallel step: each param its slice
        return device, leaves, treespec, spec

    def _check_state(self, state: Any) -> None:
        require_train_state(state)
        if state.placement is None:
            raise ValueError("state: this state is not sharded (it came from a plain step's init); "
                             "build it with this sharded step's init(params)")
        spec = state.placement
        expected = (self.stage, self.mesh.dp, self.mesh.rank)
        if type(spec) is not ShardSpec or (spec.stage, spec.world, spec.rank) != expected:
            raise ValueError(f"state: sharded as {state.placement}, but this step is stage {self.stage} over "
                             f"{self.mesh.dp} ranks (rank {self.mesh.rank}); reshard it through a checkpoint")

    @property
    def sharded(self) -> ShardedStep:
        """The step that holds the layout's learned state (unit and bucket orders): this one."""
        return self

    # ------------------------------------------------------------------ the step
    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        self._check_state(state)
        run = StepRun(self, state)  # all per-call state lives there, and in its roles
        try:
            return run.execute(state, batch)
        finally:
            self.learn(run.finish())

    def learn(self, learned: dict[str, Any]) -> None:
        """Keep what a call learned (``StepRun.finish``): the one place this step's learned state is
        written. ``groups``: the buckets (stages 0-2) or the units bound to the leaves (stage 3);
        ``unit_order``: the order stage 3's units ran in (the first step records it, prefetch and
        the reduce order follow it); ``grad_order``: the order the first step's backward produced
        the grads in (stages 0-2), until the next call rebuilds the buckets in it
        (``buckets_ordered``); ``bucket_buffers``: stage 0's kept fp32 buckets; ``gather_groups``: the
        groups stages 1/2 gather params in, where not the buckets; ``buffer_names``:
        the module buffers the call averaged; ``peak_gathered_bytes`` and ``peak_whole_grad_bytes``:
        what it measured (``memory``). A field the call did not learn stays as it was."""
        self._flat_groups = learned.get("groups", self._flat_groups)
        self.order = learned.get("unit_order", self.order)
        self._grad_order = learned.get("grad_order", self._grad_order)
        self._buckets_ordered = learned.get("buckets_ordered", self._buckets_ordered)
        self._bucket_buffers = learned.get("bucket_buffers", self._bucket_buffers)
        self._gather_groups = learned.get("gather_groups", self._gather_groups)
        self._buffer_names = learned.get("buffer_names", self._buffer_names)
        self.peak_gathered_bytes = learned.get("peak_gathered_bytes", self.peak_gathered_bytes)
        self.peak_whole_grad_bytes = learned.get("peak_whole_grad_bytes", self.peak_whole_grad_bytes)

    def local_norm(self, grads: PyTree) -> torch.Tensor | None:
        """The norm of this rank's grad pieces as the step it wraps takes it (a tensor-parallel
        step sums its sliced grads over the tp group); ``PlainUpdate`` sums its square over dp."""
        return self.inner.local_norm(grads)

    def roles(self, context: RunContext, state: TrainState) -> Roles:
        """The roles of one call (``zfunc.core.roles``), reading the run through ``context``: params
        are this rank's own pieces, reduced grads are summed into fp32 slices, the update is the
        plain step's rule on them, and the schedule is the inner step's accumulation."""
        return Roles(LocalPieces(), ReducedSlices(context), PlainUpdate(context, self), self.schedule)

    def memory(self, state: TrainState) -> dict[str, Any]:
        """Accounted bytes on this rank, and the last step's communication.

        ``params`` (fp32 master pieces) and ``optimizer`` are held between steps; ``grad_shard``
        (fp32, this rank's slice; stage 0: the whole grads' buckets, which it keeps from step to
        step as DDP does), ``whole_params`` (stage 0:
        the compute-dtype copy, none at fp32; stage 1/2: every param in the compute dtype;
        stage 3: the peak of gathered units) and ``whole_grads`` (the peak of whole grads held in
        the compute dtype) exist during a step. ``comm`` is the last step's bytes per collective
        (``dist.Comm``). Against the ZeRO paper's bf16 formulas (docs/design.md, section 7), with Psi params
        and N ranks: stage 0 = ``2 Psi + 16 Psi`` (+ the grad autograd just produced, until it is summed
        into its bucket): the paper's 16 Psi with the grads held in fp32 rather than bf16 (as DDP holds them
        for fp32 params under autocast); stage 1 = ``2 Psi + 2 Psi + 16 Psi/N``,
        stage 2 = ``2 Psi + 16 Psi/N`` (+ a bucket of whole grads), stage 3 = ``16 Psi/N`` (+ the gathered
        units): the paper's plus ``4 Psi/N`` (stages 1/2) for the fp32 grad slice the optimizer reads, which
        DeepSpeed holds too, and minus the bf16 param shard at stage 3 (units are gathered straight from the
        fp32 masters). With ``hpz``, ``secondary_params`` is hpZ's secondary copy (``zfunc.sharding.hpz``):
        ``(padded params) / hpz`` in the compute dtype, held during a step (0 before the first step binds units).
        """
        self._check_state(state)
        secondary = {} if not self.hpz else {"secondary_params": secondary_bytes(
            self._flat_groups or [], self.mesh.dp, self.hpz, self.compute_dtype)}
        return {**secondary,
            "params": tree.nbytes(state.params),
            "optimizer": tree.nbytes(state.opt_state),
            "grad_shard": tree.nbytes(state.params),
            "whole_params": self.peak_gathered_bytes,
            "whole_grads": self.peak_whole_grad_bytes,
            "comm": self.mesh.comm_bytes(),
        }

    def _bucket_sizes(self, spec: ShardSpec, fit: bool = True) -> tuple[int, int | None]:
        """``(elements per bucket, elements in the first)`` (None: as the others), counted in a rank's
        segment (stages 1/2: its rows of each leaf). Stage 0 caps its first bucket at 1 MiB, as DDP
        does, so that the first all-reduce starts early in backward; with ``fit_buckets`` (no
        ``bucket_mb`` given) its others hold a quarter of the grads, within [1, 25] MiB: DDP's fixed
        25 MiB leaves a small model one bucket after the first, whose all-reduce then waits for the end
        of backward (``benchmarks/shard.py`` compares stage 0 with DDP). Stages 1/2 with
        ``fit_buckets`` cut a rank's segment in halves, within [1, 25] MiB: with 25 MiB a small model
        is one bucket, its reduce-scatter wholly after backward; in halves the first overlaps the
        second half of backward, for one more collective (~0.6 ms of CPU on gloo here; a quarter, three
        more, cost more CPU than their overlap saved on a 2-core BERT step). ``fit=False`` (a step that
        offloads the sharded one, whose buckets feed its updates): stages 1/2 keep ``bucket_mb``'s size."""
        size = self.bucket_elems
        if self.stage == 0:
            if self.fit_buckets:
                size = min(size, max(FIRST_BUCKET_ELEMS, sum(leaf.rows * leaf.rowsize for leaf in spec.leaves) // 4))
            return size, min(size, FIRST_BUCKET_ELEMS)
        if self.fit_buckets and fit:
            size = min(size, max(FIRST_BUCKET_ELEMS, -(-sum(leaf.chunk * leaf.rowsize for leaf in spec.leaves) // 2)))
        return size, None


def shard(step: Step, mesh: Mesh, stage: int, units: Selector | None = None, *, prefetch: int = 1,
          bucket_mb: float | None = None, verify: bool = True, quantize_weights: bool = False,
          quantize_grads: bool | int = False, hpz: int | None = None) -> ShardedStep:
    """ZeRO stage ``stage`` (0, 1, 2 or 3) of ``step`` over ``mesh``'s data-parallel ranks; stage 0 is
    replicated data parallel (DDP): every rank holds everything, grads are all-reduced.

    Args:
      step: a plain ``Step`` from ``train_step``.
      mesh: ``zf.Mesh(dp=world_size)``; every rank calls ``shard`` and the step collectively. A mesh
        with a sequence-parallel axis (``sp > 1``) shards over its ``dp x sp`` ranks, ``mesh.dp_sp``: they
        hold the same params and each computes grads from its own tokens (``zf.Mesh``'s docstring).
      units: stage 3's gather units, a selector from ``zf.units`` (default ``zf.units.auto()``).
      prefetch: stage 3: how many units ahead to all-gather while one computes (0 turns it off).
      bucket_mb: stages 0-2: size of the flat buffers the grad collectives move (fp32 MiB, a rank's
        segment). Default: at stage 0 a quarter of the grads, within [1, 25] MiB, after a first bucket
        of 1 MiB; at stages 1/2 half of a rank's, within [1, 25] MiB, the params gathered in groups
        of 25 MiB (``ShardedStep._bucket_sizes`` says why).
      verify: before each stage-3 gather (whose order follows the model's control flow), check all
        ranks gather the same unit, so diverging control flow is reported by unit and step instead
        of aborting gloo or hanging NCCL. Ranks on one host (the shared-memory channel) compare
        their units within the gather's own barrier, at no extra round trip; elsewhere it is one
        all-gather of a few bytes on the comm thread before each gather (benchmarks/shard.py's zf-3
        and zf-3* rows show the cost). Reduce-scatters need no check: they run in a fixed order on a
        process group of their own.
      quantize_weights: ZeRO++'s qwZ, stage 3: params all-gathered as block-quantized int8 (a scale
        per 256 values; ``zfunc.dist.quantized``): ~3.9x fewer bytes than fp32, every rank computing
        with the same dequantized values (within half a quantization step of the masters).
      quantize_grads: ZeRO++'s qgZ, stages 1-3: grads reduce-scattered as an all-to-all of int4
        (True or 4) or int8 (8) blocks, dequantized and summed in fp32: ~7.8x / 3.9x fewer bytes.
        The step then equals the unquantized one only up to the quantization error (no exact law).
        Over dp ranks on several nodes (``zf.Mesh(ranks_per_node=)``), in two levels: inside each node,
        then across nodes with 1/ranks-per-node of the bytes (``zfunc.dist.quantized``).
      hpz: ZeRO++'s hpZ, stage 3: each rank keeps a secondary copy of 1/hpz of every gathered unit
        (in the compute dtype) within groups of ``hpz`` consecutive dp ranks, so backward's re-gathers
        stay inside the group (``zfunc.sharding.hpz``: law, bytes, memory). ``hpz`` divides ``mesh.dp``;
        None or 1: off (DeepSpeed's ``zero_hpz_partition_size``).
    Law, layout and cost: see the module docstring. The loss must be a mean over the rank's batch;
    under stage 3 the model's params must reach it only through ``zf.functionalize``'s ``apply``.
    """
    compose.check("shard", step, stage=stage)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a zf.Mesh, got {type(mesh).__name__}")
    mesh = mesh.dp_sp
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage: expected 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch: expected an int >= 0, got {prefetch!r}")
    if units is not None and stage != 3:
        raise ValueError(f"units: only stage 3 gathers by unit; stage {stage} uses bucket_mb")
    from zfunc.model import units as units_mod

    bucket_elems = max(1, int((25.0 if bucket_mb is None else bucket_mb) * 2**18))
    grad_bits = _grad_bits(quantize_grads, quantize_weights, stage)
    hpz = _hpz(hpz, stage, mesh.dp)
    return ShardedStep(step, mesh, stage, units or units_mod.auto(), prefetch, bucket_elems, verify,
                       fit_buckets=stage < 3 and bucket_mb is None, quantize_weights=quantize_weights,
                       grad_bits=grad_bits, hpz=hpz)


def _nodes(mesh: Mesh):
    """The mesh's dp ranks as nodes (``zfunc.dist.hierarchy.blocks``) for ZeRO++'s two-level grad
    reduce-scatter, where they span several nodes of several ranks (``Mesh.ranks_per_node``); else None."""
    size = per_node(mesh.reduce_comm, mesh.ranks_per_node)
    return None if size in (1, mesh.reduce_comm.world) else blocks(mesh.reduce_comm, size, "nodes")


def _hpz(hpz: int | None, stage: int, dp: int) -> int | None:
    """hpZ's group size, checked (None: off, as 1 is)."""
    if hpz is None or hpz == 1 and not isinstance(hpz, bool):
        return None
    if not isinstance(hpz, int) or isinstance(hpz, bool) or hpz < 1 or dp % hpz:
        raise ValueError(f"hpz: expected None or an int >= 1 dividing the {dp} data-parallel ranks, got {hpz!r}")
    if stage != 3:
        raise ValueError(f"hpz: ZeRO++'s secondary param copy serves stage 3's re-gathers in backward; expected "
                         f"stage 3, got stage {stage}")
    return hpz


def _grad_bits(quantize_grads: bool | int, quantize_weights: bool, stage: int) -> int | None:
    """The bits of ZeRO++'s grad reduce-scatter (None: fp32), checking both ZeRO++ arguments."""
    if not isinstance(quantize_weights, bool):
        raise ValueError(f"quantize_weights: expected a bool, got {quantize_weights!r}")
    if quantize_weights and stage != 3:
        raise ValueError(f"quantize_weights: ZeRO++'s int8 param all-gather is stage 3's (stages 1/2 gather "
                         f"no params in the step); expected stage 3, got stage {stage}")
    if quantize_grads is False:
        return None
    bits = 4 if quantize_grads is True else quantize_grads
    if bits not in (4, 8) or isinstance(quantize_grads, float):
        raise ValueError(f"quantize_grads: expected False, True (int4, as DeepSpeed's qgZ), 4 or 8, got "
                         f"{quantize_grads!r}")
    if stage == 0:
        raise ValueError("quantize_grads: ZeRO++ quantizes the grad reduce-scatter of stages 1-3; stage 0 "
                         "all-reduces (a 1-bit optimizer compresses it: zf.optim.onebit_adam); got stage 0")
    return bits
