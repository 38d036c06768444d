"""pipeline: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, zero-bubble, ZB-V) as a transformation of the step.

``zf.pipeline(step, stages=p, microbatches=m, schedule="1f1b", model=model, units=zf.units.by_class(Block))``
splits the model's consecutive *pipeline units* into ``p`` stages, one per rank of the mesh's pp
axis; every rank of a pipeline calls the step with the same batch, which is cut into ``m``
microbatches; activations travel forward and their grads backward point to point (``dist.P2P``).
Loss and metrics come back on every rank.

**Schedules** are data (``zfunc.pipelining.schedules``): per rank, its ops in order (forward,
backward, or the backward split into input grad "I" and weight grads "W") on *virtual* stages;
with ``virtual_stages=v`` ("interleaved-1f1b") the units are cut into ``p v`` stages, stage ``k``
on rank ``k % p``, so a rank runs ``v`` separate slices of the model. Built-in ones by name, or a
user's ``Schedule`` (``from_csv``); ``zfunc.pipelining.check`` proves each deadlock-free and
computes its peak of live microbatches and its bubble before the step is made. "zero-bubble"
splits each backward with ``zfunc.pipelining.split_backward``: the input grad first, sent on at
once, the weight grads later from the kept graph, each grad computed once.

**How a stage runs the unchanged model.** The step runs the user's opaque ``loss_fn(params,
batch)``; while ``zf.functionalize``'s ``apply`` runs the module it enters the stage's
``running`` (registered with ``zfunc.model.functional.run_by``), which, for that one call, makes other
stages' units the identity (their ``forward`` replaced), swaps the first local unit's input for
the activation received from the previous stage (a forward pre-hook) and, on all but the last
stage, stops the forward after the last local unit by raising a private ``BaseException``
carrying its output. Code outside the units (embeddings, final
norm, head, loss) runs wherever it is reached; its params (and those tied to them: GPT's
``wte``/``lm_head``) are *shared*: owned by stage 0 and lent to the last stage each step. Params a
stage neither owns nor borrows are zero-memory stand-ins (``zeros(()).expand(shape)``); that code
on stages > 0 computes with them and its result is dropped at the first local unit.

**Law.** For a loss that is a mean over the batch, the pipelined step on a batch equals the plain
step on it (params, optimizer state, loss, grad norm), up to the order of float sums, whatever
the schedule, split or ``p``: the microbatch grads are averaged as ``train_step(accum=m)`` does.
Checked at run time, with an error instead of a wrong result: units run once each, in module
order; a stage's first unit gets the previous unit's output unchanged (no code between units);
stand-ins receive no grad. Dropout draws different masks than the plain step (test with 0).
A step whose loss or grads are inf/nan is skipped on every rank alike, as the plain step skips it:
the decision reads the loss and the grad norm, which are summed over all ranks anyway. Not yet: a
param no microbatch produced a grad for gets a zero grad (the optimizer moves it by weight decay),
where the plain step leaves it alone.

**Module buffers** (BatchNorm statistics, ``zfunc.model.functional``): each stage carries, in its state, the
buffers of its own units, updated by its forwards microbatch after microbatch (as
``train_step(accum=m)`` does) and, when the step is sharded, averaged over the dp ranks as
``zf.shard`` does. A forward that writes a buffer outside the pipeline units (a BatchNorm in the
stem or the head, in training mode) is refused on every stage at the end of the schedule, before
the update: that code runs on several stages, on stand-in params before the first unit, so no
stage's copy would be right.

**Cost** (per rank; ``Psi_s`` = params of stage s, ``Psi_sh`` = shared ones, ``A`` = bytes of one
microbatch's activation at a stage boundary). Between steps: ``(4 + opt) Psi_s`` bytes (fp32
masters + optimizer state, 8 for Adam; stage 0 also ``(4 + opt) Psi_sh``), and on the step object
(not the state) the receive buffers it reuses call after call (``zfunc.pipelining.buffers``: about
its peak of live microbatches' received activations per incoming boundary, an activation grad or
two, and on the last stage the lent ``Psi_sh``; what a step allocated anyway). During a step: the
fp32 grad sums (``4 Psi_s``), a compute-dtype copy of the params unless fp32, the activations of
as many microbatches as the schedule's docstring states (``p - s`` on stage s with 1F1B, all
``m`` with GPipe, ``p`` with zero-bubble, which holds a microbatch's graph from its forward to its
weight grads; per virtual stage with interleaving: ``step.peak_live_microbatches``), and on
the last stage the lent params and their grads. Communication per step: each boundary between
two virtual stages on two ranks carries ``m A`` forward (activations), ``m A`` back (their grads)
and a 104-byte header (shape, step, a digest of the batch to check the stages got the same one),
which the receiving stage waits for before posting its first activation's receive only on a step
whose batch shapes differ from the last step's; otherwise it knows the shapes, posts both at once
and checks the header before it reads that activation (a stage's output shape must follow from
the batch's shapes and structure: a change under the same ones is refused on both stages);
``Psi_sh`` in the compute dtype goes from stage 0 to the last stage and ``4 Psi_sh`` of fp32
grads back (what all-reducing a replica's grads would cost); one all-reduce over the pipeline of
three scalars (loss, grad norm, a count of stray buffers). ``mesh.comm_bytes()`` counts it
("send", "recv"). Compute: the pre-unit code (embeddings) also runs, discarded, on stages > 0
(each virtual stage's forward, interleaved). Idle time: the bubble ``(p - 1) / (m + p - 1)`` of
p equal stages with GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` interleaved, less with zero-bubble
(``step.schedule.timeline(p).bubble`` in theory, ``step.timings["bubble"]`` measured).

**Composition** (3D, as DeepSpeed): ``zf.pipeline(zf.shard(step, Mesh(dp=d, pp=p), stage=1), ...)``
shards each stage's params and optimizer state over its dp group: whole stage params are
all-gathered at the start of the step, whole grads summed over microbatches and reduce-scattered
at the end (stage 1 costs: ``2 Psi_s`` per rank per step). Stages 2 and 3 (``stage=2``, ``3``)
reduce-scatter each op's grads as the op ends into fp32 slices (no whole grads outlive an op;
``m`` reduce-scatters of ``Psi_s`` per step, per virtual stage's op); stage 3 gathers the stage's
params once per step and keeps them for its microbatches (a per-unit gather per microbatch, as
``zf.shard`` stage 3 does alone, would gather each unit ``2 m`` times; the schedule interleaves
microbatches, so the whole stage stays gathered), so between steps a rank holds ``1/d`` of its
stage's params. Stage 0 (``stage=0``) composes only with an optimizer that communicates itself (the 1-bit
optimizers, ``zfunc.optim.onebit``, given ``comm=mesh.comm``: each stage's dp ranks): during their
warm-up each stage all-reduces its whole fp32 grads over its dp ranks (``2 Psi_s``), after it each
rank keeps its own and the optimizer all-reduces the momentum compressed over the stage's dp ranks;
each param tensor being compressed on its own, this equals the same optimizer unpipelined
(tests/test_onebit_pipeline.py; 1-bit LAMB's one message of all momenta is cut by stage instead).
``shard(pipeline(...))`` is rejected: the pipeline must be the outermost
transformation (docs/design.md, section 3: it changes what a state and a loss are for whatever
would wrap it). Units under ``zf.remat`` recompute in backward (a unit's call inside its own call
counts once, ``zfunc.pipelining.hooks``); with "zero-bubble" a remat'ed unit recomputes in the
input-grad op and again in the weight-grad op. ``zf.pipeline(zf.offload(step, "cpu" | "nvme"), ...)``
keeps each stage's fp32 masters and optimizer state in CPU RAM or swap files (one rank per stage;
over ``zf.offload(zf.shard(step, Mesh(dp=d, pp=p), stage), ...)``, stage 1-3, each dp rank's
slices of them, gathered and reduce-scattered as above): the schedule runs on the compute copies
the last update wrote (or the masters cast), and once it ends the offloaded step's leaf-by-leaf update
(``zfunc.offloading.run.LeafUpdate``) applies the stage's mean grads, the norm summed over the
stages (and dp ranks); checkpoints are the offloaded step's (``within``, or ``inner`` when sharded), so
they load into any layout. With the params offloaded too (``offload(step, opt, params="cpu" | "nvme")``;
over a sharded step, stage 3) the masters live in CPU RAM or swap files between steps and the stage
reads all of them (its dp rank's slices) at the step's start, the whole stage's compute-dtype params
held for the schedule as above: its peak is a stage's params, not a unit's.
The schedule, ``step.schedule``, is a ``PipelineSchedule`` (``zfunc.pipelining.stage``) with
accumulation's interface, ``split(batch)`` and ``ops(stages, stage)``, which the one microbatch
loop (``zfunc.core.microbatches``) runs; the pipeline leaves ``Roles`` (``zfunc.core.roles``).

**Why this shape.** Shared params have one owner rather than a copy on both end stages
(DeepSpeed's tied layers): the optimizer state exists once, the grad norm counts each param once,
and nobody needs to know whether a param outside the units is used before or after them (that
would need a trace); sending the lent params costs what all-reducing a replica's grads would.
Stage ownership must be known at ``init`` (the state holds only the stage's params), before the
model ever runs, so ``pipeline`` takes the ``model``. Pipeline units are the selector's units
except those made only of one module's own params (``by_class``'s leftovers: embeddings, norms,
heads); if every unit is such a module (a stack of Linears), all are pipeline units.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zfunc.core import compose, placement, precision as mp, tree
from zfunc.core.microbatches import step_seed
from zfunc.core.roles import RunContext
from zfunc.dist import Mesh
from zfunc.model.functional import BufferScope, carrying
from zfunc.pipelining.buffers import RecvBuffers
from zfunc.pipelining.layout import Layout, make_layout
from zfunc.pipelining.placement import PipelineSpec, as_placed
from zfunc.pipelining.schedules import BUILT_IN, Schedule
from zfunc.pipelining.header import digest
from zfunc.pipelining.stage import PipelineSchedule, _Run
from zfunc.pipelining.dp_grads import OpGradSlices, reduce_scatter
from zfunc.sharding.reduce import average_buffers, average_order
from zfunc.sharding.layout import ShardSpec, bucket_groups, gather_whole
from zfunc.core.step import Step
from zfunc.core.transformed import Transformed
from zfunc.core.state import TrainState, require_train_state
from zfunc.model.materialize import Materializer
from zfunc.model.units import Selector
from zfunc.offloading.run import LeafUpdate
from zfunc.offloading.store import Store
from zfunc.offloading.offloaded import with_outcome

PyTree = Any
SCHEDULES = BUILT_IN
__all__ = ["Layout", "PipelineSpec", "PipelineStep", "make_layout", "pipeline"]


# ----------------------------------------------------------------------------- the step


class PipelineStep(Transformed):
    """The step ``pipeline`` returns: same call and ``init`` as ``Step``; this rank runs one stage.

    Metrics are the same on every rank, except ``aux`` (``has_aux``): the loss function's aux per
    microbatch on the last stage, which alone computes the loss; ``None`` elsewhere. ``schedule``
    is the microbatch loop's schedule (``PipelineSchedule``; ``str()`` gives its name, ``plan(p)`` the
    checked ``Schedule``, ``timeline(p)`` its simulated run with its theoretical bubble per rank).
    After each call, ``peak_live_microbatches`` is the most microbatches (per virtual stage) whose
    activations this rank held at once, and ``timings`` has the schedule's wall time ``step_s``, the
    time spent blocked on peers ``wait_s``, forward + backward compute ``compute_s``, this rank's
    measured ``bubble`` (``1 - compute_s / step_s``) and ``ops``: each op's ``(kind, microbatch,
    start_s, end_s, stage, busy_s)`` from the schedule's start, ``busy_s`` the time from the
    previous op's end (or the schedule's start) to its own, less its waits on peers, and ``t0``,
    the schedule's start (``time.perf_counter()``: ranks on one host share its clock). ``step_s``
    runs from the schedule's start (the batch's split) to its last send done; ``compute_s`` sums
    the ops' ``busy_s``, which include the runtime's work for each op (posting its receives and
    sends, the stage's hooks, summing its grads, reaping the sends before it). So the measured
    bubble counts what a rank does not work: the waits on peers (the schedule's dependencies and
    the transfers' latency) and the time after its last op (the shared params' grads, the last sends);
    ``zfunc.pipelining.measured`` puts every rank's timings of a step together: each rank's idle
    fraction of the pipeline's makespan (the theory's definition) and the bubble the schedule itself
    implies for those op times (``check`` with each op's ``busy_s``).
    """

    def __init__(self, base: Step, model: nn.Module, layout: Layout, microbatches: int, schedule: PipelineSchedule,
                 mesh: Mesh):
        super().__init__(base, "pipeline")  # the loss, optimizer, precision: base's (accum is 1)
        self.base = base if compose.applied(base, "shard") else None  # sharded over dp: its init places the state
        self.offloaded = compose.applied(base, "offload")  # the stage's state in CPU RAM, updated leaf by leaf
        self.sharded = base.sharded if self.offloaded and self.base is not None else self.base  # a ShardedStep
        self.model, self.layout, self.mesh = model, layout, mesh
        self.stages, self.stage, self.microbatches = mesh.pp, mesh.pp_rank, microbatches
        self.schedule = schedule  # the microbatch loop's schedule, checked
        self.ranks = schedule.plan(mesh.pp).ranks  # virtual stage -> rank
        self.peak_live_microbatches, self.timings = 0, {}
        self._bucket_cache: list | None = None
        self.recv_buffers = RecvBuffers()  # zfunc.pipelining.buffers: kept across calls, never in the state
        self.boundary_shapes: tuple | None = None  # (batch signature, stage -> input, output shape): the last step's

    def init(self, params: PyTree, materialize: Materializer | None = None) -> TrainState:
        """This stage's fp32 params (split over the dp ranks if the step is sharded) and their
        optimizer state; ``placement`` is a ``PipelineSpec``. ``materialize``: for params on the
        meta device, what makes the values of the params this stage owns, as the inner step's
        ``init`` asks for them (``zfunc.model.materialize``); no stage makes another's."""
        if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
            raise TypeError("params: expected the dict[str, Tensor] of zf.functionalize(model), got "
                            f"{type(params).__name__}")
        unknown = sorted(params.keys() - self.layout.owner.keys())
        if unknown:
            raise ValueError(f"params: {unknown[:5]} are not parameters of the model given to zf.pipeline")
        names = tuple(sorted(params))  # optree's leaf order for a dict
        owned = {n: params[n] for n in names if self.ranks[self.layout.owner[n]] == self.stage}
        if self.base is not None:
            inner = self.base.init(owned, materialize)
        elif self.offloaded and materialize is None and any(p.is_meta for p in owned.values()):
            inner = self.inner.init_meta(owned)  # zf.checkpoint.load's template: no RAM touched
        elif compose.applied(self.inner, "tensor_parallel") or self.offloaded:  # its pieces, through its init
            inner = self.inner.init(owned, materialize)
        else:
            inner = Step.init(self, owned, materialize)
        self.initialized_with = tree.map(lambda x: x.to("meta"), params)  # the whole model: zf.checkpoint.load
        shapes = tuple(tuple(params[n].shape) for n in names)
        sharded = self.base is not None
        spec = PipelineSpec(self.stages, self.stage, names, shapes, tuple(sorted(owned)),
                            inner.placement if sharded else None, self._whole_shapes(params, shapes),
                            None if sharded else inner.placement)
        return TrainState(inner.params, inner.opt_state, 0, self.seed, inner.loss_scale, spec)

    def _whole_shapes(self, params: dict[str, Any], shapes: tuple) -> tuple | None:
        """The whole model's params' shapes where the sharded step's inner step holds pieces of them
        (a tensor-parallel step: its slices; ``Step.placement_of``), else None (``shapes`` are whole)."""
        within = (self.sharded.inner if self.sharded is not None else self.inner).placement_of(params)
        if within is None:
            return None
        rule = placement.of(within)
        return tuple(tuple(rule.rows(within, i, shape).shape) for i, shape in enumerate(shapes))

    def local_norm(self, grads: PyTree) -> torch.Tensor | None:
        """The norm of this stage's grads as the step it wraps takes it (a tensor-parallel step, alone
        or under ``zf.shard``, sums its sliced grads' squares over the tp group); summed over dp and pp
        by the call."""
        return self.inner.local_norm(grads)

    def own_buffers(self, buffers: dict[str, Any]) -> dict[str, Any]:
        """The module buffers of this stage's own units among ``buffers``: what its state carries."""
        bounds = [self.layout.bounds[k] for k, rank in enumerate(self.ranks) if rank == self.stage]
        mine = [unit for first, last in bounds for unit in self.layout.units[first : last + 1]]
        return {n: b for n, b in buffers.items() if self._in_units(n, mine)}

    def _check_state(self, state: Any) -> None:
        require_train_state(state)
        spec = state.placement
        if not isinstance(spec, PipelineSpec):
            raise ValueError(f"state: this state is not pipelined ({spec or 'a plain state'}); build it with this "
                             "pipelined step's init(params)")
        dp = (spec.inner.world, spec.inner.rank) if spec.inner else None
        mine = (self.mesh.dp, self.mesh.rank) if self.base else None
        if (spec.stages, spec.stage, dp) != (self.stages, self.stage, mine):
            raise ValueError(f"state: it is {spec}, but this step runs pipeline stage {self.stage} of {self.stages}"
                             + (f" sharded over {self.mesh.dp} ranks" if self.base else ""))

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        self._check_state(state)
        params, step, rng, loss_scale = state.params, state.step, state.rng, state.loss_scale
        # zf.shard stage 0 with an optimizer that communicates itself (1-bit): this rank's own grads
        self._local_grads = _talks_itself(self.base, state)
        with carrying(state.buffers) as carried:
            loss, aux, grads = self._loss_and_grads(state.placement, params, batch, step, rng, loss_scale, carried)
        local = None if self.offloaded else self.local_norm(grads)  # this stage's (and dp rank's) share
        device = next((g.device for g in tree.leaves(grads)), torch.device("cpu"))
        loss, norm = self._totals(loss, local, state.placement, step, device, self._stray_buffers(carried))
        buffers = self._stage_buffers(carried, state.placement, step)
        if self.offloaded:
            new_state, metrics = self._offloaded_update(state, grads, loss, aux)
            return new_state.replace(buffers=buffers), metrics
        new_state, metrics = self.update(state, grads, loss, aux, norm)
        return new_state.replace(buffers=buffers), metrics

    def _offloaded_update(self, state: TrainState, grads: PyTree, loss: torch.Tensor, aux: Any):
        """The offloaded step's update (``zfunc.offloading.run.LeafUpdate``) of this stage's state (or
        its dp rank's slices of it) with its mean grads: the grad norm's squares summed over the
        stages (and dp ranks) with the loss, which every rank holds whole already, so each adds its
        ``1 / (p d)`` (exact for powers of two)."""
        offloaded, spec = self.inner, state.placement
        offloaded.reserve_room(state.params, state.opt_state)  # no room for the swap files' writes: fails here
        within = as_placed(state, spec.split)
        context = RunContext(spec.split, 1.0, self._sum_across, offloaded.finite)
        update = LeafUpdate(context, within, offloaded)
        ranks = self.stages * (spec.inner.world if spec.inner is not None else 1)
        try:
            new, metrics = update.apply(within, grads, loss / ranks, aux, None)
        except OSError as e:  # a swap read or write failed: the files go back to their versions before the step
            raise with_outcome(e, update.undo(within)) from e
        finally:
            offloaded.learn(update.finish())
        state._consumed = True
        return as_placed(new, state.placement), metrics

    def _in_units(self, name: str, units: Sequence[str]) -> bool:
        return any(name.startswith(f"{u}.") for u in units)

    def _stray_buffers(self, carried: BufferScope) -> list[str]:
        """Buffers the forward wrote outside every pipeline unit (module docstring: refused)."""
        return [n for n in carried.written if not self._in_units(n, self.layout.units)]

    def _stage_buffers(self, carried: BufferScope, spec: PipelineSpec, step: int) -> dict[str, torch.Tensor]:
        """The buffers of this stage's own units, those written averaged over the dp ranks."""
        own = self.own_buffers(carried.buffers)
        if spec.inner is None:
            return own
        names = [n for n in average_order(carried) if n in own]
        return average_buffers(own, names, self.mesh.comm, spec.inner.world, f"buffer all-reduce at step {step}")

    def _sum_across(self, t: torch.Tensor, label: str) -> torch.Tensor:
        """``t`` summed over every rank of the step, in place: over the dp ranks (when sharded),
        then over the pipeline's stages. Stage 0's grads are whole on every dp rank (all-reduced, or a
        1-bit optimizer's own): their norm is summed over the stages only."""
        if self.base is not None and self.base.stage > 0:
            self.mesh.comm.all_reduce(t, label=f"{label} over the dp ranks")
        self.mesh.pp_comm.all_reduce(t, label=f"{label} over the pipeline")
        return t

    def _loss_and_grads(self, spec: PipelineSpec, params, batch, step, rng, loss_scale, carried: BufferScope):
        """This rank's mean microbatch loss (None but on the last stage; ``_totals`` makes it every
        rank's) and its fp32 grads, averaged over microbatches (and dp)."""
        pieces, treespec = tree.flatten(params)
        if self.offloaded:
            pieces = self._stored_pieces(pieces)
        scale = mp.scale_of(loss_scale)
        self.mesh.clear_comm_bytes()
        whole = self._whole_params(pieces, spec, step)
        divisor = self.microbatches * (scale or 1.0)
        sliced = None
        if spec.inner is not None and spec.inner.stage >= 2:  # each op's grads reduce-scattered as it ends
            sliced = OpGradSlices(pieces, whole, spec.inner, self._buckets(spec.inner), self.mesh.reduce_comm, step,
                                 divisor * spec.inner.world)
        run = _Run(self, spec, whole, step, scale, digest(batch), sliced)
        loss, aux = run.execute(batch, step_seed(rng, step), params)
        self.peak_live_microbatches = run.peak_live
        self.timings = {"step_s": run.step_s, "wait_s": run.wait_s, "compute_s": run.compute_s,
                        "bubble": 1.0 - run.compute_s / run.step_s if run.step_s > 0 else 0.0, "ops": run.trace,
                        "t0": run.t0}
        grads = [torch.zeros(w.shape, device=w.device) if g is None else g for g, w in zip(run.acc, whole)]
        if sliced is not None:
            grads = sliced.result()
        elif spec.inner is not None and spec.inner.stage == 0:
            grads = _replicated(grads, self.mesh.reduce_comm, step, divisor, spec.inner.world, self._local_grads)
        elif spec.inner is not None:
            grads = reduce_scatter(grads, pieces, spec.inner, self._buckets(spec.inner), self.mesh.reduce_comm, step,
                                    divisor * spec.inner.world)
        else:
            torch._foreach_mul_(grads, 1.0 / divisor)
        return loss, aux, tree.unflatten(treespec, grads)

    def _stored_pieces(self, masters: list[Any]) -> list[torch.Tensor]:
        """An offloaded stage's params (or its dp rank's slices) in the compute dtype: the compute
        copies the last update wrote, else the masters, read from their swap files where they live
        there (params offloaded), all of the stage's at once: every microbatch's ops use them."""
        offloaded = self.inner
        store = Store(offloaded.engine if offloaded.where_masters == "nvme" else None)
        copies = [offloaded.compute_copies.of(m) for m in masters]
        reads = [store.fetch(m) if c is None else None for m, c in zip(masters, copies)]
        return [c if c is not None else r.result().to(self.compute_dtype) for c, r in zip(copies, reads)]

    def _whole_params(self, pieces: list[torch.Tensor], spec: PipelineSpec, step: int) -> list[torch.Tensor]:
        """This stage's params whole, in the compute dtype (all-gathered over dp when sharded)."""
        if spec.inner is None or spec.inner.stage == 0:
            return [p.to(self.compute_dtype) for p in pieces]
        return gather_whole(pieces, spec.inner, self._buckets(spec.inner), self.mesh.comm, self.compute_dtype,
                            pieces[0].device, f"step {step}")

    def _buckets(self, inner: ShardSpec) -> list:
        if self._bucket_cache is None:
            self._bucket_cache = bucket_groups(inner.leaves, self.sharded.bucket_elems)
        return self._bucket_cache

    def _totals(self, loss: torch.Tensor | None, local_norm: torch.Tensor | None, spec: PipelineSpec, step: int,
                device: torch.device, stray: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(loss, norm)`` of the whole step on every rank, in one all-reduce over the pipeline
        (and one over the dp ranks, when sharded): the last stage's mean loss (None elsewhere, which
        adds 0; over dp, the mean), the grad norm from each rank's ``local_norm`` (None: not
        computed), and the count of ``stray`` buffers: if any stage has some, every stage raises,
        before the update (a post-unit module runs on the last stage only)."""
        device = device if loss is None else loss.device
        parts = [torch.zeros((), device=device) if loss is None else loss.float(),
                 torch.tensor(float(len(stray)), device=device)]
        if local_norm is not None:
            parts.append((local_norm * local_norm).to(device, torch.float32))
        flat = torch.stack(parts)
        what = "loss and grad-norm" if local_norm is not None else "loss"
        if spec.inner is not None:
            self.mesh.comm.all_reduce(flat, label=f"{what} all-reduce over the dp ranks at step {step}")
        self.mesh.pp_comm.all_reduce(flat, label=f"{what} all-reduce over the pipeline at step {step}")
        if flat[1].item():
            where = f"here: {stray[:5]}" if stray else "on another stage"
            raise ValueError(f"pipeline: the forward wrote module buffers outside the pipeline units ({where}); a "
                             "pipelined state carries only the buffers of each stage's own units (BatchNorm inside "
                             "a unit is fine): move that module into a unit, or put it in eval mode")
        loss = flat[0] / spec.inner.world if spec.inner is not None else flat[0]
        return loss, (flat[2].sqrt() if local_norm is not None else None)


# ----------------------------------------------------------------------------- construction


def pipeline(step: Step, stages: int, microbatches: int, schedule: str | Schedule = "1f1b", *, model: nn.Module,
             units: Selector | Sequence[str], split: Sequence[int] | None = None,
             mesh: Mesh | None = None, virtual_stages: int = 1) -> PipelineStep:
    """Pipeline ``step`` over ``stages`` ranks with ``microbatches`` microbatches per batch.

    Args:
      step: a plain ``Step`` from ``train_step`` (accum=1), or ``zf.shard(step, mesh, stage=1)``
        over a ``Mesh(dp=d, pp=stages)`` to shard each stage over its dp ranks; either may be a
        ``zf.tensor_parallel.step`` over a model sliced over the mesh's tp group (3D: ``Mesh(dp=d,
        pp=stages, tp=t)``; each stage's tp ranks run its units on their slices, the grad norm
        counts each slice once; not sequence-parallel).
      stages: pipeline stages, one per rank of the mesh's pp axis.
      microbatches: the batch's leading dim is split into this many equal parts.
      schedule: a built-in schedule's name (``zfunc.pipelining.schedules``): "1f1b" (at most
        ``stages - s`` live microbatches on stage s), "gpipe" (all ``m``), "interleaved-1f1b"
        (``virtual_stages`` per rank), "zero-bubble" (ZB-H1: backward split into input and weight
        grads), "zbv" (ZB-V: two stages per rank in a V, the units cut into ``2 stages``); or a
        ``zfunc.pipelining.Schedule`` of one's own (``from_csv``). Either is checked
        (``zfunc.pipelining.check``: every grad once, no deadlock) before the step is made.
      model: the module the loss runs through ``zf.functionalize``'s ``apply``, used unchanged.
      units: the pipeline units: a ``zf.units`` selector (e.g. ``by_class(Block)``; see the module
        docstring for which of its units count) or module names; consecutive ones form a stage.
      split: units per virtual stage (e.g. ``(1, 3)``); default even, earlier stages taking the remainder.
      mesh: default ``Mesh(pp=stages)``; a sharded step brings its own.
      virtual_stages: virtual stages per rank with "interleaved-1f1b" (the units cut into
        ``stages * virtual_stages`` stages, stage ``k`` on rank ``k % stages``); 1 otherwise.
    Every rank of a pipeline calls the step with the same batch. Law and cost: module docstring.
    """
    compose.check("pipeline", step, mesh=mesh)
    for name, value in (("stages", stages), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if not isinstance(schedule, Schedule) and schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES} or a zfunc.pipelining.Schedule, got {schedule!r}")
    if isinstance(schedule, Schedule) and virtual_stages != 1:
        raise ValueError(f"virtual_stages: a Schedule places its own virtual stages ({schedule.virtual} per rank); "
                         f"leave virtual_stages at 1, got {virtual_stages}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected the torch.nn.Module the loss runs, got {type(model).__name__}")
    plan = PipelineSchedule(schedule, microbatches, virtual_stages)
    plan.timeline(stages)  # built and checked: refuses a wrong or deadlocking schedule before anything runs
    layout = make_layout(model, units, len(plan.plan(stages).ranks), split)
    mesh = _pick_mesh(step, stages, mesh)
    return PipelineStep(step, model, layout, microbatches, plan, mesh)


def _talks_itself(sharded: Step | None, state: TrainState) -> bool:
    """Stage 0 under an optimizer that communicates itself this step (``GradientTransformation.local_grads``:
    the 1-bit optimizers after their warm-up): the grads stay this rank's own."""
    local = getattr(sharded.optimizer, "local_grads", None) if sharded is not None and sharded.stage == 0 else None
    return bool(local is not None and local(state.opt_state))


def _replicated(grads: list[torch.Tensor], comm, step: int, divisor: float, world: int,
                local: bool) -> list[torch.Tensor]:
    """ZeRO stage 0 over a stage's dp ranks: the microbatch sums ``grads`` all-reduced (one flat fp32
    buffer) and divided by ``divisor * world``: their mean over the ranks; ``local`` (a 1-bit optimizer
    communicating itself): this rank's own, divided by ``divisor``."""
    if local or not grads:
        torch._foreach_mul_(grads, 1.0 / divisor)
        return grads
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    comm.all_reduce(flat, label=f"grad all-reduce of the stage at step {step}")
    flat.div_(divisor * world)
    return [piece.view_as(g) for piece, g in zip(flat.split([g.numel() for g in grads]), grads)]


def _pick_mesh(step: Step, stages: int, mesh: Mesh | None) -> Mesh:
    if compose.applied(step, "shard"):
        mesh = step.mesh
    mesh = Mesh(pp=stages) if mesh is None else mesh
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a zf.Mesh, got {type(mesh).__name__}")
    if mesh.pp != stages:
        raise ValueError(f"stages: {stages} stages, but the mesh has pp={mesh.pp} (build it as zf.Mesh(pp={stages}))")
    return mesh
