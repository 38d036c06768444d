"""offload's accounting: step.memory() by place and kind equals zfunc.offloading.accounting's formulas,
and grads held for the norm leave the compute side as backward produces them."""
import weakref

import pytest
import torch

import zfunc as zf
from tests.models import Tiny, batches, make_offloaded as make, train_on
from zfunc.offloading import accounting
from zfunc.offloading.grads import SpilledGrads


SPILLS = dict(d=64, n=2)  # a Tiny whose grads (~20 KB in bf16) exceed the smallest chunk_bytes (4096): spilled


def numel() -> int:
    return sum(p.numel() for p in Tiny().parameters())


@pytest.mark.parametrize("where, params", [("cpu", None), ("nvme", None), ("cpu", "cpu"), ("nvme", "nvme")])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("clip", [False, True])
def test_memory_by_place_and_kind_equals_the_formulas(tmp_path, where, params, precision, clip):
    step, state = make(clip, precision, 1, where, params, tmp_path)
    state, _, _ = train_on(step, state, batches(1, 1))
    got, mine = step.memory(state), numel()
    want = accounting.resting(mine, precision=precision, optimizer=where, params=params)
    assert got["kinds"] == {place: {k: v for k, v in kinds.items() if v} for place, kinds in want.items()}
    assert {p: got[p] for p in accounting.PLACES} == accounting.totals(want)
    e = accounting.elem(precision)
    # the device: the compute-dtype params whole (stage 2, params=None) or the live units (stage 3), never masters
    assert got["kinds"]["device"] == ({"compute_params": e * mine} if params is None else {})
    if params is None:
        assert got["step"]["device"]["whole_params"] == e * mine
    else:
        assert 0 < got["step"]["device"]["whole_params"] < e * mine
    held = accounting.held_grads(mine, precision=precision, optimizer=where, world=1, accum=1,
                                 held=not step.overlap, ram_bytes=step.chunk_bytes)
    assert {p: got["step"][p]["held_grads"] for p in ("cpu", "nvme")} == {p: held.get(p, 0) for p in ("cpu", "nvme")}
    assert step.overlap == (not clip and precision != "fp16")


@pytest.mark.parametrize("clip, precision, accum", [(True, "fp16", 1), (True, "fp32", 2), (False, "bf16", 1)])
def test_init_checks_the_room_of_the_held_grads_swap_files(tmp_path, monkeypatch, clip, precision, accum):
    """``init`` asks the swap folder for the room of the held grads' scratch files (no spare: they are
    overwritten in place) on top of the moments' and masters' files and spares: what ``memory()`` then
    reports as held on NVMe; none when the step updates on arrival."""
    import zfunc.offloading.swap.engine as engine

    asked = []
    check = engine.check_path
    monkeypatch.setattr(engine, "check_path", lambda path, need_bytes=0, files=(): asked.append(need_bytes)
                        or check(path, need_bytes, files))
    step, state = make(clip, precision, accum, "nvme", None, tmp_path, tiny=SPILLS, chunk_bytes=4096)
    state, _, _ = train_on(step, state, batches(accum, 1))
    assert asked == [step.memory(state)["step"]["nvme"]["held_grads"]]
    assert (asked[0] > 0) == clip


class LiveGrads:
    """Counts the grad bytes alive in RAM at each grad delivery: every grad the sink has been handed
    is watched through a weak reference, and the largest total of those still alive is kept."""

    def __init__(self, monkeypatch):
        self.watched: list[tuple[weakref.ref, int]] = []
        self.peak = 0
        deliver = SpilledGrads.deliver

        def counting(sink, group, slices):
            for g in slices:
                if g is not None:
                    self.watched.append((weakref.ref(g), g.numel() * g.element_size()))
            deliver(sink, group, slices)
            alive = sum(n for ref, n in self.watched if ref() is not None)
            self.peak = max(self.peak, alive)

        monkeypatch.setattr(SpilledGrads, "deliver", counting)


def wide(where=None, params=None, path=None, **kw):
    """``(step, state)`` of an 8-block Tiny of width 64 (35k params, 16 KB per block's Linear) with a
    clip; offloaded with ``params=None``, a one-process ZeRO-2 step in 16 KB buckets."""
    import torch.nn.functional as F

    from tests.models import Block, adamw

    torch.manual_seed(0)
    apply, p = zf.functionalize(Tiny(d=64, n=8))
    loss_fn = lambda p, b: F.cross_entropy(apply(p, b[0]).flatten(0, 1).float(), b[1].flatten())  # noqa: E731
    step = zf.train_step(loss_fn, adamw(True, backend="numba"))
    if where and params is None:
        step = zf.shard(step, zf.Mesh.alone(), 2, bucket_mb=BUCKET / 2**20)
    if where:
        step = zf.offload(step, where, params, path=path, units=zf.units.by_class(Block) if params else None, **kw)
    return step, step.init(p), sum(x.numel() for x in p.values())


BUCKET = 4 * 64 * 64  # bytes: a block's Linear weight


@pytest.mark.parametrize("params", [None, "nvme"])
def test_grads_held_for_a_clip_go_to_swap_files_and_ram_holds_a_bounded_number(tmp_path, monkeypatch, params):
    """With the optimizer on NVMe and a clip, each grad is written beside its moments as backward
    produces it: the RAM holds the writes in flight (``2 * chunk_bytes``) and the group being
    delivered, never the whole model's grads; training equals the plain step."""
    live = LiveGrads(monkeypatch)
    chunk = 4096
    step, state, n = wide("nvme", params, tmp_path, chunk_bytes=chunk)
    ref_step, ref, _ = wide()
    got = train_on(step, state, batches(1, 3))
    want = train_on(ref_step, ref, batches(1, 3))
    assert got[1] == want[1] and got[2] == pytest.approx(want[2], rel=1e-6)
    whole, largest = 4 * n, 4 * 64 * 64  # a bucket or a unit: at most a block's Linear and a few small leaves
    bound = 2 * chunk + accounting.GRAD_BUCKETS * (largest + 4 * 3 * 64)
    assert live.peak <= bound < whole / 3, (live.peak, bound, whole)
    mem = step.memory(got[0])
    assert mem["step"]["nvme"]["held_grads"] == whole and mem["step"]["cpu"]["held_grads"] == 0
    assert 0 < mem["step"]["cpu"]["spilled_in_flight"] <= 2 * chunk + largest


def test_grads_held_in_ram_are_the_whole_grads_without_a_copy(tmp_path, monkeypatch):
    """With the optimizer in RAM on a CPU device the held grads are autograd's own (the host buffers
    are the grads): the update receives the very tensors backward produced, no copy."""
    from zfunc.offloading import grads as grads_mod

    seen = []
    to_host = grads_mod.HostGrads.to_host
    def watching(self, g):
        seen.append((g, to_host(self, g)))
        return seen[-1][1]

    monkeypatch.setattr(grads_mod.HostGrads, "to_host", watching)
    step, state, n = wide("cpu", None)
    state, _, _ = train_on(step, state, batches(1, 1))
    assert seen and all(a is b for a, b in seen)
    assert step.memory(state)["step"]["cpu"]["held_grads"] == 4 * n


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_spilled_grads_train_as_the_plain_step_in_low_precision_with_accumulation(tmp_path, precision):
    """Held grads in swap files, summed over two microbatches (read back, added, written again), give the
    plain step's training; fp16's overflow check reads the norm from the per-leaf partial norms."""
    step, state = make(True, precision, 2, "nvme", "nvme", tmp_path, tiny=SPILLS, chunk_bytes=4096)
    ref_step, ref = make(True, precision, 2, tiny=SPILLS)
    got = train_on(step, state, batches(1, 3))
    want = train_on(ref_step, ref, batches(1, 3))
    assert got[1] == want[1] and got[2] == pytest.approx(want[2], rel=1e-5)
    full = zf.checkpoint.full_params(got[0])
    for name, w in want[0].params.items():
        torch.testing.assert_close(full[name], w, rtol=1e-5, atol=1e-6)


HELD_ON_TWO = [(2, "cpu", None, "fp32"), (2, "nvme", None, "bf16"), (3, "cpu", "cpu", "bf16"),
               (3, "nvme", "nvme", "fp32")]


def held_on_two_worker(rank, world, path):
    mesh = zf.Mesh(dp=world)
    out = []
    for stage, where, params, precision in HELD_ON_TWO:
        step, state = make(True, precision, 1, where, params, f"{path}/{stage}-{where}-{rank}", mesh=mesh, stage=stage)
        state, _, _ = train_on(step, state, batches(1, 1), rank, world)
        mine = sum(m.numel() if isinstance(m, torch.Tensor) else m.nbytes // 4 for m in zf.tree.leaves(state.params))
        mem = step.memory(state)
        out.append((mine, {p: mem["step"][p]["held_grads"] for p in ("cpu", "nvme")}))
    return out


@pytest.mark.multiprocess
def test_grads_held_for_a_clip_on_two_ranks_are_each_ranks_fp32_slice(tmp_path):
    """Over 2 ranks with a clip, each rank holds its reduced fp32 grad slice for the norm, where the
    optimizer lives (4 B per param of its slice in any precision), as ``accounting.held_grads`` and
    the planner say."""
    results = zf.dist.spawn(held_on_two_worker, 2, 2, str(tmp_path))
    for (stage, where, params, precision), *ranks in zip(HELD_ON_TWO, *results):
        for rank, (mine, held) in enumerate(ranks):
            want = accounting.held_grads(mine, precision=precision, optimizer=where, world=2, accum=1, held=True,
                                         ram_bytes=64 << 20)  # the default chunk_bytes
            assert held == {p: want.get(p, 0) for p in ("cpu", "nvme")}, (stage, where, precision, rank, mine)
            assert 0 < mine < numel()  # a slice: the other rank holds the rest


@pytest.mark.parametrize("precision, accum", [("fp32", 1), ("bf16", 2)])
def test_held_grads_within_chunk_bytes_stay_in_ram_with_the_optimizer_on_nvme(tmp_path, precision, accum):
    """With the optimizer and masters on NVMe and a clip, grads that fit in ``chunk_bytes`` are held in
    RAM (no grad files written or read), as ``accounting.held_grads`` says, and train as the plain step
    (losses and norms bit for bit: the norm is taken as the plain step takes it) and as the same step
    spilling them (``chunk_bytes`` below their bytes; its norm summed from per-leaf norms) does."""
    step, state = make(True, precision, accum, "nvme", "nvme", tmp_path / "ram", tiny=SPILLS)
    spill_step, spill_state = make(True, precision, accum, "nvme", "nvme", tmp_path / "spill", tiny=SPILLS,
                                   chunk_bytes=4096)
    ref_step, ref = make(True, precision, accum, tiny=SPILLS)
    got = train_on(step, state, batches(accum, 3))
    spilled = train_on(spill_step, spill_state, batches(accum, 3))
    want = train_on(ref_step, ref, batches(accum, 3))
    assert not list((tmp_path / "ram").glob("*grads*")) and list((tmp_path / "spill").glob("*grads*"))
    mem = step.memory(got[0])
    assert mem["step"]["nvme"]["held_grads"] == 0 and mem["step"]["cpu"]["held_grads"] > 0
    assert spill_step.memory(spilled[0])["step"]["nvme"]["held_grads"] == mem["step"]["cpu"]["held_grads"]
    assert got[1:] == want[1:]
    assert spilled[1] == pytest.approx(want[1], rel=1e-6) and spilled[2] == pytest.approx(want[2], rel=1e-5)
    full, full_spilled = zf.checkpoint.full_params(got[0]), zf.checkpoint.full_params(spilled[0])
    for name, w in want[0].params.items():
        torch.testing.assert_close(full[name], w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(full_spilled[name], w, rtol=1e-5, atol=1e-6)
