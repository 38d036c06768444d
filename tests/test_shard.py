"""shard: N ranks on loopback gloo train exactly as one process on the concatenated batch."""
import os
import signal

import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from tests.models import (Block, NormSpy, Tiny, assert_same_training, batches, hf_model, local, make, token_loss,
                          train_on, tree_equal, with_faults)
from zfunc.sharding.layout import FlatGroup, LeafShard, ShardSpec, local_piece
from zfunc.sharding.reduce import GradAllReducer, GradReducer
from zfunc.checkpoint import full_params


CONFIGS = [(stage, accum, clip) for stage in (0, 1, 2, 3) for accum, clip in ((1, True), (2, False))]


def law_worker(rank, world, configs, precision="fp32"):
    mesh = zf.Mesh(dp=world)
    out = []
    for stage, accum, clip in configs:
        # about a bucket per leaf, reordered after step 1
        step, state = make(stage, mesh, accum, clip, bucket_mb=1e-4, precision=precision)
        state, losses, norms = train_on(step, state, batches(world), rank, world)
        out.append((losses, norms, full_params(state, mesh)))
    return out


def reference(world, accum, clip, precision="fp32"):
    step, state = make(accum=accum, clip=clip, precision=precision)
    state, losses, norms = train_on(step, state, batches(world))
    return losses, norms, state.params


# Collectives reorder sums: 1e-5 relative. Adam turns rounding in near-zero grads into +-lr steps;
# over 5 steps at lr 1e-2 a few such flips move a param by at most 2 * lr * 5 = 0.1 -- far above
# anything seen (1e-7), so the bound stays 1e-5 absolute, i.e. no sign flip was observed.
@pytest.mark.multiprocess
@pytest.mark.parametrize("world, configs", [(1, [c for c in CONFIGS if c[0] == 0]), (2, CONFIGS),
                                            (4, [c for c in CONFIGS if c[1] == 1 or c[0] == 0])])
def test_sharded_step_equals_plain_step(world, configs):
    results = zf.dist.spawn(law_worker, world, world, configs)
    for k, (stage, accum, clip) in enumerate(configs):
        ref_losses, ref_norms, ref_params = reference(world, accum, clip)
        for rank in range(world):
            assert_same_training(results[rank][k], (ref_losses, ref_norms, ref_params),
                                 f"stage {stage}, accum {accum}, clip {clip}, rank {rank}")
            for name, p in results[rank][k][2].items():  # stage 0's replicas hold the same bits
                assert torch.equal(p, results[0][k][2][name]), (stage, accum, rank, name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_bf16_steps_equal_the_plain_step_with_the_ranks_as_microbatches(world):
    """bf16 grads depend on how the batch is split (the mean's 1/batch is applied in bf16), so
    the plain reference takes each rank's batch as a microbatch: accum = world * accum. Each
    microbatch's bf16 grads are then the same bits, if computed by the same kernels: the reference
    runs on as many threads as a rank (bf16 matmuls round differently with another thread count).
    Stages 1-3 reduce-scatter the bf16 grads as they are, widened to fp32 before any sum. The sums
    in fp32 differ in order only: 1e-5 as in fp32 (stage 0 bit-exact here on 2 and 4 ranks)."""
    configs = [(0, 1, True), (0, 2, False), (1, 1, True), (1, 2, False), (2, 2, True), (3, 1, True)]
    results = zf.dist.spawn(law_worker, world, world, configs, "bf16")
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # a rank's, see zf.dist.spawn
    try:
        refs = [reference(world, world * accum, clip, "bf16") for _, accum, clip in configs]
    finally:
        torch.set_num_threads(threads)
    for k, ((stage, accum, clip), ref) in enumerate(zip(configs, refs)):
        for rank in range(world):
            assert_same_training(results[rank][k], ref, f"bf16, stage {stage}, accum {accum}, clip {clip}, rank {rank}")


def launch_worker(rank, world):
    """Per step, how many grads backward had produced when each reduce-scatter was launched."""
    mesh = zf.Mesh(dp=world)
    step, state = make(2, mesh, clip=False, bucket_mb=1e-6)  # a bucket per leaf
    launches = []
    reduce = GradReducer._reduce

    def spy(self, u, grads):
        launches[-1].append(len(self.arrived))
        reduce(self, u, grads)

    GradReducer._reduce = spy  # in this spawned process only
    for batch in batches(world, n=3):
        launches.append([])
        state, _ = step(state, local(batch, rank, world))
    return launches, len(step._flat_groups)


@pytest.mark.multiprocess
def test_reduce_scatters_overlap_backward_once_buckets_follow_the_grads():
    """Leaf order is sorted names: Tiny's embedding (tied to the head), whose grad backward produces
    last, falls in the first buckets of the reversed leaf order, so on the first step every
    reduce-scatter waits for the end of backward; from the second on, buckets follow the grads."""
    for (first, *later), n in zf.dist.spawn(launch_worker, 2, 2):
        assert n == 15  # a bucket per leaf: 3 blocks of 4, the embedding, ln_f's 2
        # step 1, reversed leaf order: ln_f.weight, ln_f.bias, then the embedding holds the rest back
        assert first == [1, 2] + [n] * (n - 2)
        for launched in later:  # each bucket goes out as soon as its grad is there
            assert launched == list(range(1, n + 1))


def all_reduce_launch_worker(rank, world, accum):
    """Stage 0: per step, how many grads backward had produced when each all-reduce was launched,
    and the step's accounting."""
    mesh = zf.Mesh(dp=world)
    step, state = make(0, mesh, accum, clip=False, bucket_mb=1e-6)  # a bucket per leaf
    launches = []
    reduce = GradAllReducer._reduce

    def spy(self, u, grads):
        launches[-1].append(len(self.arrived))
        reduce(self, u, grads)

    GradAllReducer._reduce = spy  # in this spawned process only
    for batch in batches(world, n=3):
        launches.append([])
        state, _ = step(state, local(batch, rank, world))
    return launches, len(step._flat_groups), step.memory(state)


@pytest.mark.multiprocess
@pytest.mark.parametrize("accum", [1, 2])
def test_stage_0_all_reduces_overlap_the_last_backward(accum):
    """As the reduce-scatters of stages 1/2 (test above): on the first step the buckets follow the
    reversed leaf order and wait for the embedding's grad; from the second on, each bucket's
    all-reduce goes out as soon as its grad is there. With accumulation, nothing is launched
    during the first microbatch (DDP's no_sync): its n grads are summed in place first."""
    for (first, *later), n, memory in zf.dist.spawn(all_reduce_launch_worker, 2, 2, accum):
        assert n == 15
        before = n * (accum - 1)  # grads of the microbatches before the last
        assert first == [before + 1, before + 2] + [before + n] * (n - 2)
        for launched in later:
            assert launched == list(range(before + 1, before + n + 1))
        # fp32: the masters themselves are differentiated (no copy), grads live in the fp32 buckets
        assert memory["whole_params"] == 0 and memory["grad_shard"] == memory["params"]


def test_bucket_sizes_follow_ddp_and_the_model():
    """Stage 0: a 1 MiB first bucket (DDP's); by default the others hold a quarter of the grads,
    within [1, 25] MiB; an explicit bucket_mb is taken as given. Stages 1/2: by default half of a
    rank's segment, within [1, 25] MiB, unless bucket_mb is given or a step offloading them runs them."""
    step, _ = make()
    mib = 1 << 18  # fp32 elements

    def spec(elements, stage=0, world=1):
        return ShardSpec(stage, world, 0, (LeafShard((elements // 1024, 1024), elements // 1024 // world),))

    default = zf.shard(step, zf.Mesh(), 0)
    assert default._bucket_sizes(spec(4 * mib)) == (mib, mib)  # a small model: 1 MiB buckets
    assert default._bucket_sizes(spec(32 * mib)) == (8 * mib, mib)
    assert default._bucket_sizes(spec(1024 * mib)) == (25 * mib, mib)  # a big one: DDP's 25 MiB
    assert default._bucket_sizes(spec(1024 * mib), fit=False) == (25 * mib, mib)  # stage 0 fits whoever runs it
    assert zf.shard(step, zf.Mesh(), 0, bucket_mb=2)._bucket_sizes(spec(1024 * mib)) == (2 * mib, mib)
    assert zf.shard(step, zf.Mesh(), 0, bucket_mb=0.5)._bucket_sizes(spec(mib)) == (mib // 2, mib // 2)
    stage2 = zf.shard(step, zf.Mesh(), 2)
    assert stage2._bucket_sizes(spec(64 * mib, 2, 2)) == (16 * mib, None)  # half of a rank's 32 MiB
    assert stage2._bucket_sizes(spec(mib, 2, 2)) == (mib, None)  # at least 1 MiB
    assert stage2._bucket_sizes(spec(1024 * mib, 2, 2)) == (25 * mib, None)
    assert stage2._bucket_sizes(spec(64 * mib, 2, 2), fit=False) == (25 * mib, None)
    assert zf.shard(step, zf.Mesh(), 1, bucket_mb=25)._bucket_sizes(spec(64 * mib, 1, 2)) == (25 * mib, None)


def default_buckets_worker(rank, world, configs):
    """Stages 1/2 with their default (fitted) buckets on a Tiny wide enough for two: the law's
    records, the number of grad buckets and of param gathers."""
    mesh = zf.Mesh(dp=world)
    out = []
    for stage, accum, clip in configs:
        step, state = make(stage, mesh, accum, clip, model_kw={"d": 600}, bucket_mb=None)
        state, losses, norms = train_on(step, state, batches(world), rank, world)
        out.append(((losses, norms, full_params(state, mesh)), len(step._flat_groups), len(step._gather_groups)))
    return out


@pytest.mark.multiprocess
def test_default_buckets_reduce_during_backward_and_gather_at_once():
    """By default stages 1/2 cut a rank's grads into two buckets (halves of its segment, at least 1 MiB:
    Tiny's 1.1M params over 2 ranks), so the first reduce-scatter overlaps the rest of backward, and
    gather the params in one 25 MiB group; the law holds as with any buckets."""
    configs = [(1, 1, True), (2, 1, True), (1, 2, False)]
    for rank, result in enumerate(zf.dist.spawn(default_buckets_worker, 2, 2, configs)):
        for (stage, accum, clip), (got, buckets, gathers) in zip(configs, result):
            step, state = make(accum=accum, clip=clip, model_kw={"d": 600})
            state, losses, norms = train_on(step, state, batches(2))
            assert_same_training(got, (losses, norms, state.params), f"stage {stage}, accum {accum}, rank {rank}")
            assert (buckets, gathers) == (2, 1), (stage, accum)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_packing_writes_every_element_padding_as_zeros(world):
    """Collective buffers come from torch.empty: what they held must not reach the collectives."""
    shapes = [(5, 3), (7,), (), (2, 2)]
    wholes = [torch.randn(shape) for shape in shapes]
    leaves = tuple(LeafShard(shape, -(-(shape[0] if shape else 1) // world)) for shape in shapes)
    unit = FlatGroup("u", list(range(len(leaves))), leaves)
    grads = [*wholes[:-1], None]  # the last param got no grad: reduced as zeros
    full = torch.full((world, unit.segment), float("nan"))
    unit.pack_full(grads, leaves, world, full)
    for rank in range(world):
        pieces = [local_piece(w, leaf, rank) for w, leaf in zip(wholes, leaves)]
        out, seg = unit.gather_buffer(pieces, torch.float32, "cpu", world, rank)
        assert seg.data_ptr() == out[rank * unit.segment :].data_ptr() and seg.numel() == unit.segment
        for g, piece, sent, packed in zip(grads, pieces, unit.local_views(full[rank], leaves, rank),
                                          unit.local_views(seg, leaves, rank)):
            assert torch.equal(sent, piece if g is not None else torch.zeros_like(piece))
            assert torch.equal(packed, piece)
        padding = torch.ones(unit.segment, dtype=torch.bool)
        for off, piece in zip(unit.offsets, pieces):
            padding[off : off + piece.numel()] = False
        assert not full[rank][padding].any() and not seg[padding].any()


def accounting_worker(rank, world, precision):
    """``step.memory`` after a step, for each stage, on a model with even row counts (no padding)."""
    mesh = zf.Mesh(dp=world)
    out = {}
    for stage in (0, 1, 2, 3):
        step, state = make(stage, mesh, clip=False, model_kw=dict(d=8, n=3, tie=False), vocab=16)
        step = zf.shard(zf.train_step(step.loss_fn, step.optimizer, precision), mesh, stage,
                        units=step.units_selector if stage == 3 else None, bucket_mb=1e-4)
        state = step.init(full_params(state, mesh))
        state, _ = step(state, local(batches(world, 1, vocab=16)[0], rank, world))
        unit_elems = [u.segment * world for u in step._flat_groups]
        out[stage] = dict(step.memory(state), largest_unit=max(unit_elems), units=len(unit_elems))
    for depth in (0, 2):  # stage 3's prefetch depth bounds the whole params held at once
        step = zf.shard(zf.train_step(step.loss_fn, step.optimizer, precision), mesh, 3,
                        units=step.units_selector, prefetch=depth)
        state = step.init(full_params(state, mesh))
        for _ in range(2):  # the first step records the unit order, the second prefetches by it
            state, _ = step(state, local(batches(world, 1, vocab=16)[0], rank, world))
        out[f"3-prefetch-{depth}"] = step.memory(state)["whole_params"]
    step, state = make(2, mesh)  # with clip_by_global_norm: the reported norm is the one it clips by
    state, _ = step(state, local(batches(world, 1)[0], rank, world))
    out["clipped"] = step.memory(state)["comm"]
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_memory_and_comm_accounting(world):
    torch.manual_seed(0)
    psi = sum(p.numel() for p in Tiny(vocab=16, d=8, n=3, tie=False).parameters())  # rows divide by 2 and 4
    for rank, r in enumerate(zf.dist.spawn(accounting_worker, world, world, "bf16")):
        for stage in (1, 2, 3):
            m = r[stage]
            # between steps, at every stage: fp32 masters (4) + Adam moments (8) per param, split N ways
            split = (4 * psi // world, 8 * psi // world, 4 * psi // world)
            assert (m["params"], m["optimizer"], m["grad_shard"]) == split
        # stage 0: everything whole: masters, moments, fp32 grad buckets, the bf16 copy = 18 Psi (the
        # ZeRO paper's 2 + 2 + 12 = 16 with fp32 grads), plus a bf16 grad until it is summed in
        m = r[0]
        assert (m["params"], m["optimizer"], m["grad_shard"], m["whole_params"]) == (4 * psi, 8 * psi, 4 * psi, 2 * psi)
        assert 0 < m["whole_grads"] <= 2 * 16 * 8  # the largest leaf (embedding, head), bf16
        # comm: all-reduces of the fp32 grads (2 Psi, counted as DDP's) and the loss in their last bucket
        assert m["comm"] == {"all_reduce": 2 * 4 * psi + 2 * 4}, m["comm"]
        # stage 1/2: every param whole in bf16; stage 1 every grad whole (bf16, accum 1), stage 2 less
        assert r[1]["whole_params"] == r[2]["whole_params"] == 2 * psi
        assert r[1]["whole_grads"] == 2 * psi and r[1]["units"] > 2
        assert 0 < r[2]["whole_grads"] < 2 * psi
        # stage 3: at most (1 + prefetch) units whole at once, params and grads alike
        assert 0 < r[3]["whole_params"] <= 2 * 2 * r[3]["largest_unit"]
        assert 0 < r[3]["whole_grads"] <= 2 * r[3]["largest_unit"]
        for depth in (0, 2):
            assert 0 < r[f"3-prefetch-{depth}"] <= (1 + depth) * 2 * r[3]["largest_unit"]
        assert r["3-prefetch-0"] < r["3-prefetch-2"]  # prefetching holds more, as it should
        # comm per step: stages 1/2 gather Psi and reduce-scatter Psi, both bf16 (the grads as backward
        # makes them, summed in fp32 on arrival): fewer bytes than DDP's fp32 all-reduce
        for stage in (1, 2):
            comm = r[stage]["comm"]
            assert (comm["all_gather"], comm["reduce_scatter"]) == (2 * psi, 2 * psi), (stage, comm)
        # stage 3 gathers in forward and again where a unit's backward reads its params (not the
        # embedding's): between 1.5 and 2 Psi of gathers, so at most 3 Psi in all (1.5x stages 1/2)
        comm3 = r[3]["comm"]
        assert 1.5 * 2 * psi <= comm3["all_gather"] <= 2 * 2 * psi
        assert comm3["reduce_scatter"] == 2 * psi
        # one small all-reduce: the grad norm, the loss and, per param, whether the rank produced a
        # grad for it (4 bytes each, counted in and out)
        leaves = len(zf.functionalize(Tiny())[1])
        assert r["clipped"]["all_reduce"] == 2 * (4 + 4 + 4 * leaves)


# ------------------------------------------------------------------------------------ non-finite steps, unused params


def nonfinite_worker(rank, world):
    """Per (stage, fault) on rank 0 only: was the step skipped on this rank, are params and
    optimizer state unchanged, the skip count, did the next step train; and the max_skips errors."""
    mesh = zf.Mesh(dp=world)
    out = {}
    data = [local(b, rank, world) for b in batches(world, 3)]
    for stage in (1, 2, 3):
        for fault in ("nan_loss", "inf_grads"):
            step, state = make(stage, mesh)
            with_faults(step)
            state, _ = step(state, data[0])
            before = (full_params(state, mesh), zf.tree.clone(state.opt_state))
            state, m = step(state, (*data[1], fault if rank == 0 else None))
            unchanged = tree_equal((full_params(state, mesh), state.opt_state), before)
            skips = state.loss_scale.skips
            state, m_next = step(state, data[2])
            out[(stage, fault)] = (m["skipped"], unchanged, skips, m_next["skipped"])
        step.max_skips = 0
        try:
            step(state, (*data[0], "nan_loss" if rank == 1 else None))
        except zf.NonFiniteError as e:
            out[(stage, "error")] = str(e)
    return out


@pytest.mark.multiprocess
def test_a_non_finite_loss_or_grads_on_one_rank_skip_the_step_on_every_rank():
    for rank, out in enumerate(zf.dist.spawn(nonfinite_worker, 2, 2)):
        for stage in (1, 2, 3):
            for fault in ("nan_loss", "inf_grads"):
                assert out[(stage, fault)] == (True, True, 1, False), (rank, stage, fault)
            error = out[(stage, "error")]
            assert "1 non-finite step in a row, the last at state.step=3: non-finite loss (nan)" in error, (rank, stage)


def unused_worker(rank, world):
    mesh = zf.Mesh(dp=world)
    out = {}
    data = [local(b, rank, world) for b in batches(world, 2)]
    for stage, who in ((1, "everyone"), (2, "everyone"), (3, "everyone"), (1, "rank 0"), (2, "rank 0")):
        step, state = make(stage, mesh, clip=False)
        for batch in data:  # block 1 is skipped by every rank, or by rank 0 only
            state, _ = step(state, (*batch, 1 if who == "everyone" or rank == 0 else None))
        out[(stage, who)] = full_params(state, mesh)
    return out


@pytest.mark.multiprocess
def test_a_param_is_left_alone_only_if_no_rank_produced_a_grad_for_it():
    init = make()[1].params
    step, ref = make(clip=False)
    for batch in batches(2, 2):
        ref, _ = step(ref, (*batch, 1))
    assert torch.equal(ref.params["blocks.1.fc.weight"], init["blocks.1.fc.weight"])  # no weight decay either
    for rank, out in enumerate(zf.dist.spawn(unused_worker, 2, 2)):
        for stage in (1, 2, 3):  # unused everywhere: the plain step's training, block 1 untouched
            got = out[(stage, "everyone")]
            for name in ref.params:
                torch.testing.assert_close(got[name], ref.params[name], rtol=1e-5, atol=1e-5, msg=f"{stage} {name}")
        for stage in (1, 2):  # used by rank 1: updated (stage 3 requires the same units on every rank)
            got = out[(stage, "rank 0")]
            for name in ("blocks.1.fc.weight", "blocks.1.fc.bias", "blocks.1.ln.weight"):
                assert not torch.equal(got[name], init[name]), (rank, stage, name)


# ------------------------------------------------------------------------------------ bad input


def bad_input_worker(rank, world):
    mesh = zf.Mesh(dp=world)
    errors = {}
    try:
        zf.Mesh(dp=world + 1)
    except ValueError as e:
        errors["mesh"] = str(e)
    plain_step, plain_state = make()
    sharded_step, sharded_state = make(2, mesh)
    stage3_step, _ = make(3, mesh)
    replicated_step, replicated_state = make(0, mesh)
    batch = local(batches(world, 1)[0], rank, world)
    for name, fn in {
        "sharded_into_plain": lambda: plain_step(sharded_state, batch),
        "plain_into_sharded": lambda: sharded_step(plain_state, batch),
        "other_stage": lambda: stage3_step(sharded_state, batch),
        "replicated_into_stage_2": lambda: sharded_step(replicated_state, batch),
        "plain_into_replicated": lambda: replicated_step(plain_state, batch),
    }.items():
        try:
            fn()
        except ValueError as e:
            errors[name] = str(e)
    torch.manual_seed(0)
    apply, params = zf.functionalize(Tiny())
    step = zf.shard(zf.train_step(token_loss(apply),
                                  zf.optim.sgd(0.1)), mesh, 3, units=zf.units.by_names(["blocks.0", "blocks.1"]))
    try:
        step(step.init(params), batch)
    except ValueError as e:
        errors["units"] = str(e)
    try:
        sharded_step.init({"w": torch.full((3,), float(rank))})
    except zf.dist.CollectiveError as e:
        errors["params_differ"] = str(e)
    return errors


@pytest.mark.multiprocess
def test_bad_input_is_reported_clearly():
    errors = zf.dist.spawn(bad_input_worker, 2, 2)[0]
    assert "dp: the mesh has 3 ranks but the process group has world size 2" in errors["mesh"]
    assert "this state is sharded (stage 2 over 2 ranks)" in errors["sharded_into_plain"]
    assert "not sharded" in errors["plain_into_sharded"]
    assert "sharded as stage 2 over 2 ranks, but this step is stage 3" in errors["other_stage"]
    assert "sharded as stage 0 over 2 ranks, but this step is stage 2" in errors["replicated_into_stage_2"]
    assert "not sharded" in errors["plain_into_replicated"]
    assert "units: parameters" in errors["units"] and "emb.weight" in errors["units"]
    assert "params differ across ranks" in errors["params_differ"]


def test_shard_argument_checks():
    mesh = zf.Mesh()  # a single process: a mesh of one
    step, _ = make()
    with pytest.raises(ValueError, match="stage: expected 0, 1, 2 or 3"):
        zf.shard(step, mesh, 4)
    with pytest.raises(ValueError, match="offloading a stage-0"):
        zf.offload(zf.shard(step, mesh, 0))
    with pytest.raises(TypeError, match="mesh: expected a zf.Mesh"):
        zf.shard(step, "dp=2", 1)
    with pytest.raises(ValueError, match="units: only stage 3"):
        zf.shard(step, mesh, 2, units=zf.units.by_class(Block))
    with pytest.raises(ValueError, match="prefetch"):
        zf.shard(step, mesh, 3, prefetch=-1)
    with pytest.raises(ValueError, match=r"zf.shard\(zf.shard\(step\)\) is refused: .* sharded already"):
        zf.shard(zf.shard(step, mesh, 1), mesh, 1)
    with pytest.raises(ValueError, match="dp: the mesh has 2 ranks"):
        zf.Mesh(dp=2)


@pytest.mark.parametrize("stage", [0, 3])
def test_single_process_mesh_equals_plain(stage):
    ref = reference(1, 1, True)
    step, state = make(stage, zf.Mesh())
    for batch in batches(1):
        state, m = step(state, batch)
    for name in ref[2]:
        torch.testing.assert_close(state.params[name], ref[2][name], rtol=1e-5, atol=1e-6)


def no_norm_worker(rank, world):
    """Per stage and ``grad_norm``: the whole params after 2 steps, the metrics' grad norms, the
    number of ``global_norm`` calls and the labels of the all-reduces."""
    mesh = zf.Mesh(dp=world)
    data = [(*local(b, rank, world), 1 if k == 0 else None) for k, b in enumerate(batches(world, n=2))]
    out = {}
    for stage in (0, 1, 2, 3):
        for grad_norm in (True, False):
            step, state = make(stage, mesh, clip=False, grad_norm=grad_norm)
            losses, norms = [], []
            with NormSpy(mesh) as spy:
                for batch in data:  # the first skips block 1 on every rank: its params are left alone
                    state, m = step(state, batch)
                    losses.append(m["loss"].item())
                    norms.append(m["grad_norm"])
            out[stage, grad_norm] = (full_params(state, mesh), losses, norms, spy.norms, spy.labels)
    return out


@pytest.mark.multiprocess
def test_grad_norm_false_computes_no_norm_and_sums_none_yet_trains_alike():
    """``train_step(grad_norm=False)`` without clipping: no norm computed at any stage, no
    all-reduce for it (stages 1-3 sum the loss and grads-produced flags alone), the metrics'
    grad norm None, and the same params as with the norm (a param no rank produced a grad for
    left alone: the flags that say so are summed without the norm)."""
    for rank, out in enumerate(zf.dist.spawn(no_norm_worker, 2, 2)):
        for stage in (0, 1, 2, 3):
            (params, losses, norms, calls, labels), (ref, ref_losses, _, ref_calls, ref_labels) = \
                out[stage, False], out[stage, True]
            what = f"stage {stage}, rank {rank}"
            assert calls == 0 and ref_calls == 2, (what, calls, ref_calls)
            assert norms == [None] * 2 and all(n is not None for n in out[stage, True][2]), what
            assert not any("grad-norm" in label for label in labels), (what, labels)
            assert stage == 0 or any("grad-norm" in label for label in ref_labels), (what, ref_labels)
            assert losses == ref_losses, what
            for name in ref:
                torch.testing.assert_close(params[name], ref[name], rtol=0, atol=0, msg=f"{what}: {name}")


def divergence_worker(rank, world):
    mesh = zf.Mesh(dp=world)
    step, state = make(3, mesh)
    x, y = local(batches(world, 1)[0], rank, world)
    state, _ = step(state, (x, y))
    try:  # rank 1 skips block 0 through data-dependent control flow; blocks are the same size
        step(state, (x, y, 0 if rank == 1 else None))
    except zf.dist.CollectiveError as e:
        return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_diverging_ranks_are_detected_and_named():
    messages = zf.dist.spawn(divergence_worker, 2, 2, timeout_s=60)
    for msg in messages:
        assert "ranks diverged" in msg and "blocks.0" in msg and "step 1" in msg, msg


def dying_worker(rank, world):
    mesh = zf.Mesh(dp=world)
    step, state = make(3, mesh)
    batch = local(batches(world, 1)[0], rank, world)
    state, _ = step(state, batch)
    loss_fn = step.loss_fn

    def dies_mid_step(params, b):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return loss_fn(params, b)

    step.loss_fn = dies_mid_step
    step(state, batch)
    return "no error"


@pytest.mark.multiprocess
def test_a_rank_dying_mid_step_fails_the_others_with_a_clear_error():
    # Whether spawn sees rank 1's death or rank 0's failure first, rank 0's error is in the report:
    # it fails at once (gloo: connection reset), naming the collective, unit and step.
    with pytest.raises(RuntimeError, match="rank [01] of 2 (died|failed)") as info:
        zf.dist.spawn(dying_worker, 2, 2, timeout_s=60)
    report = str(info.value)
    assert "CollectiveError" in report and "gather of unit 'emb' at step 1" in report, report


def hf_run(kind, mesh=None, rank=0, world=1):
    model, block = hf_model(kind)
    apply, params = zf.functionalize(model)

    def loss_fn(p, ids):
        logits = apply(p, ids) if kind == "recipe-gpt" else apply(p, input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    if mesh is not None:
        step = zf.shard(step, mesh, 3, units=zf.units.by_class(block))
    state = step.init(params)
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 61, (2 * world, 12), generator=g)
        state, m = step(state, ids[rank * 2:(rank + 1) * 2] if mesh is not None else ids)
        losses.append(m["loss"].item())
    return losses, getattr(step, "peak_gathered_bytes", 0)


def hf_worker(rank, world):
    mesh = zf.Mesh(dp=world)
    return {kind: hf_run(kind, mesh, rank, world) for kind in ("recipe-gpt", "gpt2", "llama")}


@pytest.mark.multiprocess
def test_our_gpt_and_hugging_face_models_train_unchanged_under_stage_3():
    pytest.importorskip("transformers")
    results = zf.dist.spawn(hf_worker, 2, 2, timeout_s=180)
    for kind in ("recipe-gpt", "gpt2", "llama"):
        ref, _ = hf_run(kind, world=2)
        for rank in range(2):
            losses, peak = results[rank][kind]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6, msg=kind)
            assert peak > 0


def batchnorm_worker(rank, world, configs):
    from tests.models import BNNet, bn_batches, bn_step

    mesh = zf.Mesh(dp=world)
    out = []
    for stage, accum in configs:
        torch.manual_seed(0)
        model = BNNet()
        _, step = bn_step(model, accum)
        step = zf.shard(step, mesh, stage)
        state = step.init(zf.functionalize(model)[1])
        for batch in bn_batches():
            state, _ = step(state, local(batch, rank, world))
        out.append((full_params(state, mesh), state.buffers))
    return out


@pytest.mark.multiprocess
def test_batchnorm_statistics_are_averaged_over_ranks():
    """The module docstring's law for buffers: every rank normalizes with its own batch (DDP), the
    written floating buffers are averaged over the ranks after each step: torch's loop on 2
    replicas whose buffers are averaged after each step gives the same params and statistics, and
    the ranks hold identical buffers."""
    from tests.models import BNNet, assert_trained_like, bn_batches, torch_train

    configs = [(0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (2, 2)]
    results = zf.dist.spawn(batchnorm_worker, 2, 2, configs)
    for k, (stage, accum) in enumerate(configs):
        torch.manual_seed(0)
        ref = torch_train(BNNet(), bn_batches(), accum, ranks=2)
        for rank in range(2):
            params, buffers = results[rank][k]
            assert_trained_like(params, buffers, ref, rtol=1e-5, atol=1e-6)
            for name, b in buffers.items():
                assert torch.equal(b, results[0][k][1][name]), (stage, accum, rank, name)
        assert results[0][k][1]["bn.num_batches_tracked"].item() == 3 * accum
