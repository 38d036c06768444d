"""placement: how each transformation's placement of a state is saved, loaded and made whole.

A ``TrainState``'s ``placement`` is ``None`` for a plain state, else the spec of the transformation
that placed its params and optimizer state (``zf.shard``'s ``ShardSpec``, ``zf.offload``'s
``OffloadSpec``, ``zf.pipeline``'s ``PipelineSpec``). Beside its spec's definition each
transformation registers a ``Placement`` for the spec's type (``register(ShardSpec,
ShardPlacement())``); ``zf.checkpoint`` and ``full_params`` ask ``of(spec)`` and never check a
spec's type, so a new transformation brings its placement without editing them.

What a placement answers, for a state it placed (``Placement``'s methods; the base class is the
plain placement: one process, every leaf whole and in memory, and each method says what it does):

- ``processes(spec)``: this process's ``(world, rank)`` among those that save the state;
- ``describe(spec)``: the layout the manifest records;
- ``rows(spec, index, shape)``: which rows of param leaf ``index`` this process holds, as the
  checkpoint stores them (a split is along dim 0, ``torch.chunk`` style, of the whole leaf or of
  the slice of it this process holds: ``Rows.slicing``);
- ``model(spec)``: the whole model's params, when the state holds only some of them;
- ``logical_paths(state, paths)`` and ``in_memory(state)``: how its leaves read as the plain
  state's;
- ``whole(state, mesh)``: every param whole on every process (``full_params``);
- ``materializer(spec, fn)``: a materializer of the whole model's leaves made to give the ones it
  holds (a tensor-parallel state's slices), for a transformation that splits them further;
- ``sum_over_slices(spec, value)``: a sum over its sliced leaves (grad squares) summed over the
  processes holding the other slices;
- ``restore(step, leaves, params, device)``: how a checkpoint's leaves are put in place, where
  filling the step's template leaf by leaf is not how the step keeps them.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist

from zfunc.core import tree
from zfunc.core.slicing import Slicing
from zfunc.core.state import TrainState
from zfunc.dist.comm import all_arrive

PyTree = Any
FULL_PARAMS = "zf.checkpoint.full_params"  # the call every process of a split state makes (``arrive``)


class Rows(NamedTuple):
    """The rows of one param leaf a process holds: the leaf's whole ``shape``, the ``chunk`` of
    rows per process of its split, and ``held``, the ``(start, stop)`` rows of this process.
    ``slicing`` (a ``zfunc.core.slicing.Slicing``): the leaf is first cut along one dim into
    ``slicing.tp`` slices (tensor parallelism) and this process holds rows of slice ``index``
    (``chunk`` and ``held`` count that slice's rows, ``slicing.piece_shape(shape)``); None: rows
    of the whole leaf."""

    shape: tuple[int, ...]
    chunk: int
    held: tuple[int, int]
    slicing: Slicing | None = None
    index: int = 0


def whole_rows(shape: tuple[int, ...]) -> Rows:
    """The rows of a leaf of ``shape`` that one process holds whole (a 0-d leaf counts as one row)."""
    n = shape[0] if len(shape) else 1
    return Rows(tuple(shape), n, (0, n))


class Placement:
    """The plain placement (``None``): one process holds every leaf whole, in memory. A
    transformation subclasses it and overrides what its placement changes."""

    def processes(self, spec: Any) -> tuple[int, int]:
        """``(world, rank)`` of this process among those that save the state (rank names its file)."""
        return 1, 0

    def describe(self, spec: Any) -> dict:
        """The layout, for the manifest: ``world`` (processes), ``pipeline`` (stages, None: not
        pipelined), ``stage`` (ZeRO stage, None: not sharded)."""
        return {"world": self.processes(spec)[0], "pipeline": None, "stage": None}

    def rows(self, spec: Any, index: int, shape: tuple[int, ...]) -> Rows:
        """Param leaf ``index`` (leaf order of ``state.params``), whose piece here has ``shape``:
        its whole shape, chunk and the rows this process holds. Plain: the piece is the whole leaf."""
        return whole_rows(shape)

    def model(self, spec: Any) -> dict[str, tuple[int, ...]] | None:
        """The whole model's params (name -> whole shape) when this state holds only some of them
        (the others are elsewhere, not missing); None when it holds them all."""
        return None

    def logical_paths(self, state: TrainState, paths: list[str]) -> list[str]:
        """Each of the state's leaf paths (``TrainState`` tree paths, "/"-joined) as the plain
        state names it; leaves given the same path are copies of one logical leaf."""
        return paths

    def in_memory(self, state: TrainState) -> TrainState:
        """``state`` with every leaf a tensor or value in memory (what a save reads)."""
        return state

    def whole(self, state: TrainState, mesh: Any = None) -> PyTree:
        """Every param whole (fp32 copies) on every process; a collective where processes hold
        different rows, which every process calls (``arrive`` first). Plain: a copy."""
        return tree.clone(state.params)

    def materializer(self, spec: Any, fn: Any) -> Any:
        """``fn`` (a ``zf.materialize`` materializer of the whole model's leaves) made to give the
        leaves this placement holds (a tensor-parallel state's: its slices), for a transformation that
        splits them further and materializes its own rows of them (``zf.shard``). Plain: ``fn``."""
        return fn

    def sum_over_slices(self, spec: Any, value: torch.Tensor) -> torch.Tensor:
        """``value``, a sum over this process's sliced param leaves (``Rows.slicing``: their grads'
        squares), summed over the processes holding the other slices of them (a tensor-parallel
        state's tp group: one all-reduce): what a grad norm counts once per slice. Plain: ``value``."""
        return value

    def restore(self, step: Any, leaves: TrainState, params: PyTree, device: str | torch.device
                ) -> TrainState | None:
        """The state of ``step`` for model ``params`` (meta) holding the checkpoint's values, where
        ``leaves`` is the step's template with each leaf a function reading it; None (here) lets
        the checkpoint read each leaf into the template's tensors."""
        return None


_REGISTRY: dict[type, Placement] = {}
PLAIN = Placement()


def register(spec_type: type, placement: Placement) -> None:
    """Make ``placement`` answer for states whose ``placement`` is a ``spec_type`` (or a subclass
    without a placement of its own). Called once, beside the spec's definition."""
    if not isinstance(spec_type, type):
        raise TypeError(f"spec_type: expected a class, got {spec_type!r}")
    if not isinstance(placement, Placement):
        raise TypeError(f"placement: expected a zfunc.core.placement.Placement, got {type(placement).__name__}")
    _REGISTRY[spec_type] = placement


def of(spec: Any) -> Placement:
    """The placement of a state whose ``placement`` is ``spec`` (None: the plain one)."""
    if spec is None:
        return PLAIN
    for cls in type(spec).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    known = ", ".join(sorted(c.__name__ for c in _REGISTRY))
    raise TypeError(f"state: its placement {spec!r} ({type(spec).__name__}) has no registered Placement "
                    f"(expected None or one of: {known}; see zfunc.core.placement.register)")


def arrive(world: int, group: Any = None) -> None:
    """Before ``whole``'s collectives: every process of the ``world``-process state calls
    ``full_params`` (``zf.dist.all_arrive``: a ``CollectiveError`` naming the missing ones)."""
    if world > 1:
        all_arrive(FULL_PARAMS, "state", group)


def full_params(state: TrainState, mesh: Any = None) -> PyTree:
    """Every param whole (fp32 copies), on every process, from a state of any placement: a
    collective where its processes hold different rows (sharded, pipelined), which every process
    of the state calls (checked first, see ``zf.dist.all_arrive``); ``mesh``: the one the state
    was split over (default: one over the ranks of the default process group). Plain: a copy."""
    if not isinstance(state, TrainState):
        raise TypeError(f"state: expected a TrainState, got {type(state).__name__}")
    return of(state.placement).whole(state, mesh)


def gather_rows(state: TrainState) -> dict[str, torch.Tensor]:
    """Every param whole (fp32), keyed by tree path ("/"-joined) in sorted order, on every process
    of the default process group, from a state whose processes hold rows of different params
    (``Placement.rows``, e.g. pipeline stages). A tensor-parallel slice's rows (``Rows.slicing``)
    fill that slice, and the slices make the whole leaf (``Slicing.whole``). Costs an all-gather of
    the processes' pieces, each padded to the largest (fp32), and one of their descriptions."""
    spec, rule = state.placement, of(state.placement)
    world, _ = rule.processes(spec)
    paths, pieces_, _ = optree.tree_flatten_with_path(state.params, namespace=tree.NAMESPACE)
    held = []  # (key, whole shape, rows held) per param leaf
    for i, (path, x) in enumerate(zip(paths, pieces_)):
        rows = rule.rows(spec, i, tuple(x.shape))
        held.append(("/".join(map(str, path)), rows.shape, rows.held, rows.slicing, rows.index))
    flat_pieces = [x.detach().float().reshape(-1) for x in pieces_]
    device = flat_pieces[0].device if flat_pieces else torch.device("cpu")
    flat = torch.cat(flat_pieces) if flat_pieces else torch.zeros(0, device=device)
    if world > 1 and dist.get_world_size() != world:
        raise ValueError(f"state: it is one of {world} ranks, but the process group has {dist.get_world_size()}")
    everyone = [(held, flat.numel())]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, (held, flat.numel()))
    size = max(n for _, n in everyone)
    padded = torch.cat([flat, flat.new_zeros(size - flat.numel())])
    gathered = [padded] if world == 1 else [torch.empty_like(padded) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, padded)
    out: dict[tuple[str, int], torch.Tensor] = {}  # (key, slice index) -> the slice (whole leaf: index 0)
    slicings: dict[str, Slicing] = {}
    for (described, _), buffer in zip(everyone, gathered):
        offset = 0
        for key, shape, (a, b), slicing, index in described:
            if slicing is not None:
                slicings[key], shape = slicing, slicing.piece_shape(shape)
            tail = tuple(shape[1:])
            n = (b - a) * int(torch.Size(tail).numel())
            if (key, index) not in out:
                out[key, index] = torch.empty(shape, dtype=torch.float32, device=device)
            out[key, index].reshape(-1, *tail)[a:b] = buffer[offset : offset + n].view(b - a, *tail)
            offset += n
    keys = sorted({key for key, _ in out})
    return {k: slicings[k].whole([out[k, r] for r in range(slicings[k].tp)]) if k in slicings else out[k, 0]
            for k in keys}
