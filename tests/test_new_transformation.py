"""A step transformation added without editing zfunc: ``count_grads``, a grad sink that counts the bytes
it receives, with a placement of its own (docs/design.md, "Adding a transformation", walks through it).

Everything it needs is below: the step (a ``Transformed``), one rulebook row (``compose.register``) and
one placement registration (``placement.register``). With them it trains as the plain step, its state
saves to a checkpoint that loads into a plain step (and back into itself), ``zf.checkpoint.full_params``
makes it whole, and an order the row does not allow is refused up front.
"""
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import zfunc as zf
from tests.models import assert_same_training, batches, make, train_on
from zfunc.core import compose, placement
from zfunc.core.transformed import Transformed


# ------------------------------------------------------------------------------ the transformation
@dataclass(frozen=True)
class CountSpec:
    """A counting step's state: placed as the one-process sharded state it wraps (``inner``)."""

    inner: Any


def _inner(state: zf.TrainState) -> zf.TrainState:
    """The wrapped state: the same leaves, placed as the sharded step that updates them expects."""
    return zf.TrainState(state.params, state.opt_state, state.step, state.rng, state.loss_scale,
                         state.placement.inner, buffers=state.buffers)


def _outer(state: zf.TrainState) -> zf.TrainState:
    return zf.TrainState(state.params, state.opt_state, state.step, state.rng, state.loss_scale,
                         CountSpec(state.placement), buffers=state.buffers)


class CountPlacement(placement.Placement):
    """Saved, loaded and made whole as the state it wraps."""

    def processes(self, spec: CountSpec) -> tuple[int, int]:
        return placement.of(spec.inner).processes(spec.inner)

    def describe(self, spec: CountSpec) -> dict:
        return placement.of(spec.inner).describe(spec.inner)

    def rows(self, spec: CountSpec, index: int, shape: tuple[int, ...]) -> placement.Rows:
        return placement.of(spec.inner).rows(spec.inner, index, shape)

    def whole(self, state: zf.TrainState, mesh: Any = None) -> Any:
        return placement.full_params(_inner(state), mesh)


placement.register(CountSpec, CountPlacement())
compose.register("count_grads", wraps={"train_step": None}, wrapped_by={
    "shard": ("count_grads runs its step over one process itself and counts what reaches its grad sink",
              "zf.count_grads(step) alone, or zf.shard(step, mesh, stage) without it"),
})


class GradCounter:
    """Grad sink: the one it wraps, adding the bytes of every grad slice delivered to it to the
    call's count (``counts[-1]``, opened per call)."""

    def __init__(self, sink: Any, counts: list[int]):
        self.sink, self.counts = sink, counts

    def open(self, pieces: Any) -> Any:
        self.counts.append(0)
        return _Counting(self.sink.open(pieces), self.counts)

    def __getattr__(self, name: str) -> Any:  # before_backward, finish: the wrapped sink's
        return getattr(self.sink, name)


class _Counting:
    """One call's open sink: counts, then delivers to the wrapped one."""

    def __init__(self, opened: Any, counts: list[int]):
        self.opened, self.counts = opened, counts

    def deliver(self, group: Any, slices: list) -> None:
        self.counts[-1] += sum(s.numel() * s.element_size() for s in slices if s is not None)
        self.opened.deliver(group, slices)

    def __getattr__(self, name: str) -> Any:  # early, own, result
        return getattr(self.opened, name)


class CountingStep(Transformed):
    """``count_grads(step)``: ``step`` run over one process as ZeRO-2 (whose roles a transformation
    may swap), its grad sink a ``GradCounter``; ``counts`` holds each call's grad bytes received."""

    def __init__(self, step: zf.Step):
        super().__init__(step, "count_grads")
        self.counts: list[int] = []
        self.one_process = zf.shard(step, zf.Mesh.alone(), 2)
        default = self.one_process.roles

        def roles(*call: Any) -> Any:  # the documented swap of one role (zfunc.core.roles)
            made = default(*call)
            return made.replace(grads=GradCounter(made.grads, self.counts))

        self.one_process.roles = roles

    def init(self, params: Any, materialize: Any = None) -> zf.TrainState:
        return _outer(self.one_process.init(params, materialize))

    def __call__(self, state: zf.TrainState, batch: Any) -> tuple[zf.TrainState, dict]:
        if not isinstance(state.placement, CountSpec):
            raise ValueError(f"state: placed as {state.placement}, not by count_grads; build it with its init(params)")
        new, metrics = self.one_process(_inner(state), batch)
        return _outer(new), metrics


def count_grads(step: zf.Step) -> CountingStep:
    """``step``, counting the bytes of the grads its update receives (fp32: 4 per element)."""
    compose.check("count_grads", step)
    return CountingStep(step)


# ------------------------------------------------------------------------------ the proof
def test_count_grads_trains_as_the_plain_step_and_counts_every_grad_byte():
    step, start = make()
    counting = count_grads(step)
    state = counting.init(start.params)
    assert isinstance(state.placement, CountSpec)
    data = batches(1)
    state, losses, norms = train_on(counting, state, data)
    ref, ref_losses, ref_norms = train_on(step, start, data)
    assert_same_training((losses, norms, zf.checkpoint.full_params(state)), (ref_losses, ref_norms, ref.params),
                         "count_grads")
    assert counting.counts == [4 * sum(p.numel() for p in ref.params.values())] * len(data)


def test_count_grads_saves_a_checkpoint_that_loads_into_a_plain_step_and_back(tmp_path):
    step, start = make()
    counting = count_grads(step)
    data = batches(1)
    state = train_on(counting, counting.init(start.params), data[:3])[0]
    zf.checkpoint.save(state, tmp_path / "ckpt" / "000003")
    manifest = zf.checkpoint.read_manifest(tmp_path / "ckpt" / "000003")
    assert (manifest["world"], manifest["pipeline"], manifest["stage"]) == (1, None, 2)  # its placement says

    plain = zf.checkpoint.load(tmp_path / "ckpt" / "000003", step)
    assert plain.placement is None and plain.step == 3
    whole = zf.checkpoint.full_params(state)
    assert all(torch.equal(plain.params[n], whole[n]) for n in whole)
    resumed = zf.checkpoint.load(tmp_path / "ckpt" / "000003", counting)
    assert isinstance(resumed.placement, CountSpec)

    straight, losses, norms = train_on(step, train_on(step, start, data[:3])[0], data[3:])
    for name, (s, t) in {"plain": (step, plain), "count_grads": (counting, resumed)}.items():
        after, got_losses, got_norms = train_on(s, t, data[3:])
        assert_same_training((got_losses, got_norms, zf.checkpoint.full_params(after)),
                             (losses, norms, straight.params), f"loaded into {name}")


def test_count_grads_in_a_wrong_order_is_refused_naming_both_and_the_order_that_works():
    step, _ = make()
    mesh = zf.Mesh()
    with pytest.raises(ValueError, match=r"zf.shard\(zf.count_grads\(step\)\) is refused: zf.shard cannot wrap "
                                         r"zf.count_grads: count_grads runs its step over one process itself"):
        zf.shard(count_grads(step), mesh, 1)
    with pytest.raises(ValueError, match=r"zf.count_grads\(zf.shard\(step\)\) is refused: zf.count_grads cannot "
                                         r"wrap zf.shard: the rulebook has no row letting zf.count_grads wrap "
                                         r"zf.shard; the order that works: zf.count_grads\(step, ...\)"):
        count_grads(zf.shard(step, mesh, 1))
    with pytest.raises(ValueError, match=r"zf.offload cannot wrap zf.count_grads: the rulebook has no row "
                                         r"letting zf.offload"):
        zf.offload(count_grads(step))
    with pytest.raises(ValueError, match=r"zf.count_grads cannot wrap zf.count_grads"):
        count_grads(count_grads(step))
