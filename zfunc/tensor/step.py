"""``zf.tensor_parallel.step(step, model)``: the training step over a tensor-parallel model.

A plain step on each rank already trains a ``zf.tensor_parallel`` model as one process trains the
whole one (``zfunc.tensor.transform``): each rank's grads are its slices of the whole grads and the
replicated params' whole grads. What it cannot know is which of its params are slices, so its grad
norm (``metrics["grad_norm"]``, clipping, fp16's overflow check) would be this rank's alone. This
step wraps it and takes the global norm over the tp group:

    norm^2 = sum over tp ranks of (sum of the squares of this rank's sliced grads)
             + sum of the squares of the replicated grads (the same on every rank: counted once)

Law: losses, grad norms and params equal the plain step's on the whole model (fp32, to rounding),
with clipping too. Cost: one all-reduce of one fp32 scalar over the tp group per step (8 bytes as
``Comm`` counts it), beside the model's own collectives.

The state is placed (``TensorParallelSpec``): ``zf.checkpoint.full_params`` gathers every sliced
param whole (one all-gather per sliced param over the tp group); ``zf.checkpoint.save`` writes each
rank's slices as pieces of the whole params, their slicing in the manifest, so the checkpoint loads
into any tp size, ZeRO layout or one process (``TensorParallelPlacement``).

Over dp: ``zf.shard(zf.tensor_parallel.step(step, model), zf.Mesh(dp=d, tp=t), stage)`` shards each
tp rank's slices over its dp group (dp groups exclude tp peers); the sharded step asks this one for
its pieces' norm, and sums its square over dp. That state is placed by ``zf.shard`` (a ``ShardSpec``
over this step's ``TensorParallelSpec``, ``within``): ``full_params`` gives whole params (gathered
over dp, then over tp), and a checkpoint holds the whole params and optimizer state, as above.

Under a pipeline: ``zf.pipeline(step, ...)`` of this step, or of ``zf.shard`` of it, over ``zf.Mesh(dp=d,
pp=p, tp=t)`` (3D): each stage's tp ranks hold their slices of the stage's params, the pipeline asks this
step for the norm of its pieces and sums its square over dp and pp; ``full_params`` and checkpoints put
the slices together (``zfunc.core.placement.gather_rows``). Not with ``sequence_parallel``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import nn

from zfunc import optim
from zfunc.core import compose, placement, tree
from zfunc.core.state import TrainState, require_train_state
from zfunc.core.step import Step
from zfunc.core.transformed import Transformed
from zfunc.tensor.layout import Layout, layout_of


@dataclass(frozen=True, eq=False)
class TensorParallelSpec:
    """A tensor-parallel state: this rank's slices (``layout``) over the tp ``comm``; ``names``: the
    params' names in leaf order (what ``rows`` looks each leaf's slicing up by)."""

    layout: Layout
    comm: Any
    names: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"TensorParallelSpec(tp={self.layout.tp}, rank={self.layout.rank})"


class TensorParallelPlacement(placement.Placement):
    """Made whole by gathering each sliced param over the tp group; saved as pieces of the whole
    params: tp rank r's process (``r`` of ``tp``, as ``zf.Mesh`` numbers its tp group) writes slice
    ``r`` of each sliced param (``Rows.slicing``, recorded in the manifest, so the checkpoint reads
    into any layout: another tp, one process, ZeRO over dp) and the replicated params once."""

    def processes(self, spec: TensorParallelSpec) -> tuple[int, int]:
        return spec.layout.tp, spec.layout.rank

    def describe(self, spec: TensorParallelSpec) -> dict:
        return {"world": spec.layout.tp, "pipeline": None, "stage": None, "tp": spec.layout.tp}

    def rows(self, spec: TensorParallelSpec, index: int, shape: tuple[int, ...]) -> placement.Rows:
        name = spec.names[index]
        slicing = spec.layout.slicings.get(name)
        if slicing is None:
            return placement.whole_rows(shape)
        return placement.Rows(spec.layout.whole_shape(name, shape), shape[0], (0, shape[0]), slicing, spec.layout.rank)

    def materializer(self, spec: TensorParallelSpec, fn: Any) -> Any:
        return spec.layout.materializer(fn)

    def sum_over_slices(self, spec: TensorParallelSpec, value: torch.Tensor) -> torch.Tensor:
        total = value.detach().clone()
        spec.comm.all_reduce(total, label="tensor parallel: a grad norm's sliced part")
        return total

    def whole(self, state: TrainState, mesh: Any = None) -> Any:
        spec = state.placement
        placement.arrive(spec.layout.tp, getattr(spec.comm, "group", None))
        return tree.clone(spec.layout.gather(state.params, spec.comm))


placement.register(TensorParallelSpec, TensorParallelPlacement())
def _wrapped_by(outer: str):
    """Shard, offload and the pipeline may wrap a tensor-parallel step (shard and the pipeline ask it for
    its pieces' norm, ``local_norm``; offload sums its sliced leaves' squares over tp,
    ``Placement.sum_over_slices``), but not a sequence-parallel one: their own backward does not sum the
    replicated grads over tp."""
    def verdict(step: Any, options: dict) -> Any:
        if isinstance(step, TensorParallelStep) and step.spec.layout.sequence_parallel:
            return (f"step: zf.{outer} of a sequence-parallel zf.tensor_parallel.step is refused: the wrapping "
                    "step's backward does not sum the replicated params' grads over tp (not yet); the order that "
                    f"works: zf.tensor_parallel(model, mesh, sequence_parallel=False) under zf.{outer}")
        return None

    return verdict


def _sp_without_tp(p: Any) -> str | None:
    if p.sp and p.tp == 1:
        return "sp: sequence parallelism splits along the tensor-parallel group; it needs tp > 1, got sp=True with tp=1"
    return None


def _tp_not_yet(p: Any) -> str | None:
    if p.tp == 1:
        return None
    if p.sp and p.pp > 1:
        return (f"sp: sequence parallelism under a pipeline is not supported yet; expected pp=1 with sp=True, "
                f"got pp={p.pp}")
    if p.sp and (p.dp > 1 or p.zero_stage > 0):
        return (f"sp: sequence parallelism under zf.shard is not supported yet; expected dp=1 and zero_stage=0 with "
                f"sp=True, got dp={p.dp}, zero_stage={p.zero_stage}")
    return None


compose.unregister("tp")  # the estimator's placeholder rows ("tp is modelled, not run"): replaced by these
compose.register("tensor_parallel", wraps={"train_step": None}, wrapped_by={
    "shard": _wrapped_by("shard"),
    "offload": _wrapped_by("offload"),
    "pipeline": _wrapped_by("pipeline"),
}, rules=[compose.Rule("sequence without tensor parallelism", compose.INCONSISTENT, _sp_without_tp, "tensor_parallel"),
          compose.Rule("tensor parallelism with what it does not yet run", compose.UNSUPPORTED, _tp_not_yet,
                       "tensor_parallel")])


def sum_replicated_grads(grads: dict[str, torch.Tensor | None], layout: Layout, comm: Any) -> None:
    """Sequence-parallel: each rank's grads of the replicated params are its tokens' share; sum them
    over the tp group in place (one all-reduce of them all, flattened)."""
    shares = [g for n, g in grads.items() if g is not None and n not in layout.slicings]
    if not shares or layout.tp == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in shares])
    comm.all_reduce(flat, label="tensor parallel: the sequence-parallel grads of the replicated params")
    offset = 0
    for g in shares:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def squared_norm(grads: dict[str, torch.Tensor | None], layout: Layout, comm: Any) -> torch.Tensor:
    """The global squared norm of a tp rank's grads (see the module docstring): one all-reduce."""
    sliced = [g for n, g in grads.items() if g is not None and n in layout.slicings]
    whole = [g for n, g in grads.items() if g is not None and n not in layout.slicings]
    mine = optim.global_norm(sliced) ** 2
    comm.all_reduce(mine, label="tensor parallel: the grad norm's sliced part")
    return mine + optim.global_norm(whole) ** 2


class TensorParallelStep(Transformed):
    """A plain step over a tensor-parallel model: the grad norm taken over the tp group."""

    def __init__(self, inner: Step, layout: Layout, comm: Any):
        super().__init__(inner, "tensor_parallel")
        self.spec = TensorParallelSpec(layout, comm)

    def init(self, params: Any, materialize: Any = None) -> TrainState:
        """The plain step's state of this rank's pieces, placed; ``materialize`` makes the whole
        model's leaves (``zf.materialize``), each cut to this rank's piece (``Layout.materializer``)."""
        if materialize is not None:
            materialize = self.spec.layout.materializer(materialize)
        s = self.inner.init(params, materialize)
        self.initialized_with = self.inner.initialized_with  # the pieces' shapes: what zf.checkpoint.load fills
        return TrainState(s.params, s.opt_state, s.step, s.rng, s.loss_scale, self.placement_of(params),
                          buffers=s.buffers)

    def placement_of(self, params: Any) -> TensorParallelSpec:
        """This step's spec, with the names of ``params``' leaves (in leaf order)."""
        paths = optree.tree_flatten_with_path(params, namespace=tree.NAMESPACE)[0]
        return dataclasses.replace(self.spec, names=tuple(".".join(map(str, p)) for p in paths))

    def _check_state(self, state: Any) -> None:
        require_train_state(state)
        if not isinstance(state.placement, TensorParallelSpec):
            raise ValueError(f"state: expected a state from this tensor-parallel step's init, got one placed "
                             f"{state.placement}")

    def _loss_and_grads(self, params, batch, step, rng, loss_scale):
        """The plain step's loss and grads; sequence-parallel, the replicated params' grads summed over tp."""
        loss, aux, grads = super()._loss_and_grads(params, batch, step, rng, loss_scale)
        if self.spec.layout.sequence_parallel:
            sum_replicated_grads(grads, self.spec.layout, self.spec.comm)
        return loss, aux, grads

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        self.spec.comm.bytes.clear()  # memory()'s "comm": this call's tp bytes
        return super().__call__(state, batch)

    def memory(self, state: TrainState) -> dict[str, Any]:
        """This rank's bytes: ``params`` and ``opt_state`` (its slices and the replicated params), and
        ``comm``: the bytes per call type its tp group moved in the last step (``zfunc.tensor.cost``'s
        formulas)."""
        return {"params": tree.nbytes(state.params), "opt_state": tree.nbytes(state.opt_state),
                "comm": dict(self.spec.comm.bytes)}

    def local_norm(self, grads: Any) -> torch.Tensor | None:
        """The grads' global norm over the tp group (see the module docstring), None where the step
        needs none; the plain step's update takes it for its metric and clipping."""
        return squared_norm(grads, self.spec.layout, self.spec.comm).sqrt() if self.needs_norm() else None


def tensor_parallel_step(step: Step, model: nn.Module) -> TensorParallelStep:
    """``step`` (from ``zf.train_step``) over ``model``, made tensor-parallel by ``zf.tensor_parallel``
    (see the module docstring)."""
    compose.check("tensor_parallel", step)
    layout = layout_of(model)
    if layout is None:
        raise ValueError(f"model: expected a model made tensor-parallel by zf.tensor_parallel(model, mesh), got a "
                         f"{type(model).__name__} it did not slice")
    return TensorParallelStep(step, layout, layout.comm)
