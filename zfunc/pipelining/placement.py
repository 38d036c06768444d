"""The placement of a pipelined state: ``PipelineSpec``, and how a checkpoint saves it and
``full_params`` makes it whole.

A stage holds only the params it owns (the shared ones on stage 0; no stand-ins) and their
optimizer state, split over its dp ranks as a sharded state when ``inner`` is set, and its own
units' buffers; counts and the other unsplit optimizer leaves are on every stage. Its process is
global rank ``stage * dp + dp rank`` (``zf.Mesh``), which names its checkpoint file; with tensor
parallelism (``within``, or ``inner.within``: the params are tp slices) ``(stage * dp + dp rank) * tp +
tp rank``, and ``whole`` puts each param's slices together after gathering its rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from zfunc.core import placement
from zfunc.core.state import TrainState
from zfunc.sharding.layout import ShardSpec

PyTree = Any


@dataclass(frozen=True)
class PipelineSpec:
    """Static metadata of a pipelined state: the stage, the names and whole shapes of all params
    (leaf order), the names this stage holds, and ``inner``, their dp split (``ShardSpec``).

    A stage's state holds only what it owns, no stand-ins: ``params`` the fp32 masters of
    ``owned`` (the shared params on stage 0), split over the dp ranks when ``inner`` is set, and
    ``opt_state`` the optimizer's state for them, the counts and other unsplit leaves on every
    stage; ``buffers`` those of its own units. Process ``stage * dp + dp rank`` (``zf.Mesh``)."""

    stages: int
    stage: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    owned: tuple[str, ...]
    inner: ShardSpec | None = None
    whole_shapes: tuple[tuple[int, ...], ...] | None = None  # of ``names``, where ``shapes`` are tp slices
    within: Any = None  # unsharded: the wrapped step's spec (``TensorParallelSpec``: the params are its slices)

    @property
    def split(self) -> Any:
        """The spec that places this stage's params: ``inner`` (sharded), else ``within``."""
        return self.inner if self.inner is not None else self.within

    def __str__(self) -> str:
        return f"pipeline stage {self.stage} of {self.stages}" + (f", {self.inner}" if self.inner else "")


class PipelinePlacement(placement.Placement):
    """A stage's share of the model, its rows as its dp split (``inner``) places them (module docstring)."""

    def processes(self, spec: PipelineSpec) -> tuple[int, int]:
        dp, rank = placement.of(spec.split).processes(spec.split)  # dp x tp ranks: tp innermost
        return spec.stages * dp, spec.stage * dp + rank

    def describe(self, spec: PipelineSpec) -> dict:
        inner = placement.of(spec.split).describe(spec.split)  # with tensor parallelism, its "tp"
        return {**inner, "world": self.processes(spec)[0], "pipeline": spec.stages, "stage": inner["stage"]}

    def rows(self, spec: PipelineSpec, index: int, shape: tuple[int, ...]) -> placement.Rows:
        return placement.of(spec.split).rows(spec.split, index, shape)

    def logical_paths(self, state: TrainState, paths: list[str]) -> list[str]:
        """As the stage's unsharded step names them (``within``: an offloaded step's state per leaf)."""
        within = _stage_spec(state.placement)
        return paths if within is None else placement.of(within).logical_paths(state, paths)

    def in_memory(self, state: TrainState) -> TrainState:
        """As the stage's unsharded step reads it (``within``: an offloaded step's swap files read back)."""
        spec, within = state.placement, _stage_spec(state.placement)
        if within is None:
            return state
        return as_placed(placement.of(within).in_memory(as_placed(state, within)), spec)

    def restore(self, step: Any, leaves: TrainState, params: Any, device: Any) -> TrainState | None:
        """An unsharded stage's state as its step's placement restores it (``within``: an offloaded
        step places each leaf itself), else None (the checkpoint fills the template)."""
        spec, within = leaves.placement, _stage_spec(leaves.placement)
        if within is None:
            return None
        owned = {name: params[name] for name in spec.owned}
        state = placement.of(within).restore(step.inner, as_placed(leaves, within), owned, device)
        if state is None:
            return None
        return as_placed(state, replace(spec, **{"inner" if spec.inner is not None else "within": state.placement}))

    def model(self, spec: PipelineSpec) -> dict[str, tuple[int, ...]]:
        return {name: tuple(shape) for name, shape in zip(spec.names, spec.whole_shapes or spec.shapes)}

    def whole(self, state: TrainState, mesh: Any = None) -> PyTree:
        """Each stage's params, from its dp ranks, on every rank: over the default process group
        (``placement.gather_rows``), whatever ``mesh``; tensor-parallel slices gathered with the rest
        and put together by their slicing (``Rows.slicing``)."""
        placement.arrive(self.processes(state.placement)[0])
        return placement.gather_rows(self.in_memory(state))  # an offloaded stage's masters read back first


def _stage_spec(spec: PipelineSpec) -> Any:
    """The spec whose placement reads, names and restores the stage's state: ``inner`` (a dp split,
    offloaded or not) or ``within`` (tensor-parallel or offloaded), else None."""
    return spec.split


def as_placed(state: TrainState, spec: Any) -> TrainState:
    """``state``'s values under placement ``spec``."""
    return TrainState(state.params, state.opt_state, state.step, state.rng, state.loss_scale, spec,
                      buffers=state.buffers)


placement.register(PipelineSpec, PipelinePlacement())
