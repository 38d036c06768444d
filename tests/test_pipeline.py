"""pipeline: p stages on p gloo ranks train exactly as the plain step on the whole batch."""
import pytest
import torch

import zfunc as zf
from tests.models import PIPE_VOCAB as VOCAB, PipeTiny as Tiny, pipe_batches as batches  # this file's model and data
from tests.models import (Block, NormSpy, NormStack, NormUnit, adamw, assert_same_training, assert_trained_like,
                          bn_batches, bn_step, norm_step, token_loss, torch_train, train_on, tree_equal, with_faults)
from recipes import gpt
from zfunc.checkpoint import full_params
from zfunc.pipelining import Schedule, build, check, from_csv
from zfunc.pipelining.buffers import RecvBuffers
from zfunc.pipelining.schedules import peak_live


def make(pipe=None, mesh=None, shard=False, model="tiny", clip=True, grad_norm=True, **model_kw):
    """``(step, state)``: the plain step, or pipelined with ``pipe = (schedule, microbatches, split[,
    virtual stages])``; model "tiny8" is the tiny one with 8 blocks, "gpt4" the GPT with 4, "gpt4-named"
    that GPT untied with its embeddings, blocks, final norm and head as named units (the cut of
    benchmarks/pipeline.py and torch's stages: nothing shared)."""
    torch.manual_seed(0)
    if model == "tiny8":
        model, model_kw = "tiny", {**model_kw, "n": 8}
    units = None
    if model in ("gpt", "gpt4", "gpt4-named"):  # the recipe's GPT, unchanged: tied wte/lm_head, positions, final norm
        layers = 2 if model == "gpt" else 4
        model_name, model = model, gpt.GPT(gpt.GPTConfig(vocab_size=VOCAB, block_size=5, n_layer=layers, n_head=2,
                                                         n_embd=8))
        block = gpt.Block
        if model_name == "gpt4-named":  # lm_head untied; every param in a named unit: none shared, none lent
            model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
            units = ["wte", "wpe", *(f"blocks.{b}" for b in range(layers)), "ln_f", "lm_head"]
    else:
        model, block = Tiny(**model_kw), Block
    apply, params = zf.functionalize(model)
    step = zf.train_step(token_loss(apply), adamw(clip), grad_norm=grad_norm)
    if pipe is not None:
        schedule, m, split, v = (*pipe, 1)[:4]
        step = zf.shard(step, mesh, stage=1) if shard else step
        step = zf.pipeline(step, stages=mesh.pp, microbatches=m, schedule=schedule, model=model,
                           units=units or zf.units.by_class(block), split=split, mesh=None if shard else mesh,
                           virtual_stages=v)
    return step, step.init(params)


def check_equal(results, ref, what):
    """Every rank's losses and norms are the plain step's; each param is held by one rank and equal."""
    ref_state, ref_losses, ref_norms = ref
    holder = {}
    for rank, got in enumerate(results):
        params = got[2]
        for name in params:
            assert name not in holder, f"{what}: {name} is held by ranks {holder.get(name)} and {rank}"
            holder[name] = rank
        assert_same_training(got, (ref_losses, ref_norms, ref_state.params), what, names=params)
    assert set(holder) == set(ref_state.params), what


# A user's schedule (torchtitan's CSV): the last stage splits its backwards, its weight grads out of order.
CUSTOM = from_csv("0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n1F0,1I0,1F1,1I1,1W0,1F2,1I2,1W1,1F3,1I3,1W3,1W2\n")
# (model, schedule, microbatches, split[, virtual stages]): even and uneven splits, m < p, m = p, m > p; every
# schedule, interleaved with v = 2 (2 ranks: 4 virtual stages; 4 ranks: 8, of the 8-block model).
CONFIGS = {2: [("tiny", "gpipe", 4, None), ("tiny", "1f1b", 4, None), ("tiny", "1f1b", 2, (1, 3)),
               ("tiny", "gpipe", 1, (3, 1)), ("gpt", "1f1b", 4, None), ("tiny", "interleaved-1f1b", 4, None, 2),
               ("tiny", "interleaved-1f1b", 2, (1, 1, 1, 1), 2), ("tiny", "zero-bubble", 4, None),
               ("gpt", "zero-bubble", 2, None), ("tiny", CUSTOM, 4, None), ("tiny", "zbv", 4, None),
               ("gpt4", "zbv", 2, None),  # ZB-V: rank 0 holds the first and last stage, the tied wte/lm_head
               ("gpt4-named", "zbv", 4, (3, 1, 1, 3)), ("gpt4-named", "interleaved-1f1b", 4, (3, 1, 1, 3), 2)],
           4: [("tiny", "gpipe", 4, None), ("tiny", "1f1b", 8, None), ("tiny", "1f1b", 2, None),
               ("tiny8", "interleaved-1f1b", 4, None, 2), ("tiny", "zero-bubble", 4, None), ("tiny8", "zbv", 8, None)]}


def law_worker(rank, world, configs):
    mesh = zf.Mesh(pp=world)
    out = []
    for model, *pipe in configs:
        step, state = make(pipe, mesh, model=model)
        data = batches()
        state, losses, norms = train_on(step, state, data[:2])
        pooled = step.recv_buffers.nbytes()  # the receive buffers of a step with known shapes, kept
        state, more, norms_more = train_on(step, state, data[2:])
        out.append((losses + more, norms + norms_more, dict(state.params), step.peak_live_microbatches,
                    mesh.comm_bytes(), step.timings["bubble"], (pooled, step.recv_buffers.nbytes())))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_pipelined_step_equals_plain_step(world):
    results = zf.dist.spawn(law_worker, world, world, CONFIGS[world])
    refs = {model: train_on(*make(model=model), batches()) for model in {c[0] for c in CONFIGS[world]}}
    for k, (model, schedule, m, split, *v) in enumerate(CONFIGS[world]):
        v = v[0] if v else 1
        what = f"{model}, {schedule}, m={m}, split={split}, v={v}, p={world}"
        check_equal([r[k][:3] for r in results], refs[model], what)
        name = schedule.name if isinstance(schedule, Schedule) else schedule
        for stage, r in enumerate(results):
            live, nbytes, bubble, (pooled, kept) = r[k][3:]
            assert kept == pooled and (pooled > 0) == (nbytes["recv"] > 0), (what, stage, pooled, kept)  # reused
            # the schedule's peak of live microbatches (per virtual stage), as its docstring states
            expected = check(CUSTOM).peak_live[stage] if name == "custom" else peak_live(name, world, m, stage, v)
            assert live == expected, (what, stage, live)
            assert 0.0 <= bubble < 1.0, (what, stage, bubble)
            if model == "tiny":
                ranks = build(name, world, m, v).ranks if name != "custom" else None
                assert (nbytes["send"], nbytes["recv"]) == p2p_bytes(stage, world, v, ranks), (what, stage, nbytes)


def test_a_receive_buffer_is_reused_only_once_nothing_refers_to_its_memory():
    pool, cpu = RecvBuffers(), torch.device("cpu")
    a = pool.take((2, 3), torch.float32, cpu).requires_grad_()
    loss = (a * a).sum()  # autograd saved a
    b = pool.take((2, 3), torch.float32, cpu)
    row = b[0]
    del b
    c = pool.take((2, 3), torch.float32, cpu)  # b's memory is still seen through its row
    assert len({a.data_ptr(), row.data_ptr(), c.data_ptr()}) == 3
    del a, c
    d = pool.take((2, 3), torch.float32, cpu)  # c's: nothing refers to it
    assert d.data_ptr() not in (row.data_ptr(),) and len(pool.pools[torch.Size((2, 3)), torch.float32, cpu]) == 3
    loss.backward()
    del loss, row, d
    assert {pool.take((2, 3), torch.float32, cpu).data_ptr() for _ in range(2)} <= \
        {b.data_ptr() for b in pool.pools[torch.Size((2, 3)), torch.float32, cpu]}
    assert pool.take((3,), torch.int64, cpu).dtype == torch.int64 and pool.nbytes() == 3 * 6 * 4 + 3 * 8


def p2p_bytes(stage, p, v=1, ranks=None, header=13 * 8, acts=8 * 5 * 6 * 4, shared=(VOCAB * 6 + 6 + 6) * 4):
    """The docstring's cost: m activations (the whole batch's, fp32) forward and their grads back
    across each boundary between virtual stages on two ranks (stage k on ``ranks[k]``, by default
    rank k % p), a shape header per such boundary and step, and the shared params (emb = head, ln_f)
    lent from stage 0's rank to the last stage's, when they differ, their fp32 grads returned."""
    ranks = ranks or [k % p for k in range(p * v)]
    send = recv = 0
    for b in range(len(ranks) - 1):
        src, dst = ranks[b], ranks[b + 1]
        if src != dst:
            send += (header + acts if stage == src else 0) + (acts if stage == dst else 0)
            recv += (header + acts if stage == dst else 0) + (acts if stage == src else 0)
    ends = shared if stage in (ranks[0], ranks[-1]) and ranks[0] != ranks[-1] else 0
    return send + ends, recv + ends


def dp_pp_worker(rank, world):
    mesh = zf.Mesh(dp=2, pp=2)
    step, state = make(("1f1b", 2, None), mesh, shard=True)
    local = [tuple(t[mesh.rank * 4 : (mesh.rank + 1) * 4] for t in batch) for batch in batches()]
    state, losses, norms = train_on(step, state, local)
    stage_state = zf.TrainState(state.params, state.opt_state, placement=state.placement.inner)
    return losses, norms, full_params(stage_state, mesh), (mesh.rank, mesh.pp_rank)


@pytest.mark.multiprocess
def test_dp2_x_pp2_with_shard_stage_1_equals_plain_step():
    results = zf.dist.spawn(dp_pp_worker, 4, 4)
    assert [r[3] for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]  # rank = pp_rank * dp + dp_rank
    ref = train_on(*make(), batches())
    for dp_rank in (0, 1):  # each replica's two stages hold the whole model between them
        check_equal([results[dp_rank][:3], results[2 + dp_rank][:3]], ref, f"dp rank {dp_rank}")


def no_norm_worker(rank, world):
    """Per layout (the plain step or stage 1 under the pipeline) and ``grad_norm``: this stage's
    params after the steps, the metrics' grad norms, ``global_norm`` calls and all-reduce labels."""
    mesh = zf.Mesh(pp=world)
    out = {}
    for shard in (False, True):
        for grad_norm in (True, False):
            step, state = make(("1f1b", 2, None), mesh, shard=shard, clip=False, grad_norm=grad_norm)
            norms = []
            with NormSpy(mesh) as spy:
                for batch in batches(n=2):
                    state, m = step(state, batch)
                    norms.append(m["grad_norm"])
            out[shard, grad_norm] = (dict(state.params), norms, spy.norms, spy.labels)
    return out


@pytest.mark.multiprocess
def test_grad_norm_false_computes_no_norm_and_sums_none_yet_trains_alike():
    """``train_step(grad_norm=False)`` without clipping, pipelined (over the plain step and over
    stage 1): no norm computed, no all-reduce for it, the metrics' grad norm None, the same params."""
    for rank, out in enumerate(zf.dist.spawn(no_norm_worker, 2, 2)):
        for shard in (False, True):
            params, norms, calls, labels = out[shard, False]
            ref, ref_norms, ref_calls, ref_labels = out[shard, True]
            what = f"shard {shard}, rank {rank}"
            assert (calls, norms) == (0, [None, None]) and ref_calls == 2, (what, calls, norms, ref_calls)
            assert all(n is not None for n in ref_norms), what
            assert not any("grad-norm" in label for label in labels), (what, labels)
            assert any("grad-norm" in label for label in ref_labels), (what, ref_labels)
            for name in ref:
                torch.testing.assert_close(params[name], ref[name], rtol=0, atol=0, msg=f"{what}: {name}")


def nonfinite_worker(rank, world):
    """The last stage's loss gets a fault at the second of three steps: per fault, each step's
    ``skipped``, whether the skip returned this stage's params and optimizer state unchanged,
    and the params after."""
    out = {}
    for fault in ("nan_loss", "inf_grads"):
        step, state = make(("1f1b", 2, None), zf.Mesh(pp=world))
        with_faults(step)
        flags = []
        for k, batch in enumerate(batches()):
            before = zf.tree.clone((state.params, state.opt_state))
            state, m = step(state, (*batch, fault if k == 1 else None))
            flags.append(m["skipped"])
            if k == 1:
                unchanged = tree_equal((state.params, state.opt_state), before)
        out[fault] = (flags, unchanged, dict(state.params))
    return out


@pytest.mark.multiprocess
def test_a_non_finite_step_is_skipped_on_every_stage():
    results = zf.dist.spawn(nonfinite_worker, 2, 2)
    ref_step, ref = make()
    for batch in batches()[::2]:  # the plain step without the bad batch
        ref, _ = ref_step(ref, batch)
    for fault in ("nan_loss", "inf_grads"):
        for rank, out in enumerate(results):
            flags, unchanged, params = out[fault]
            assert flags == [False, True, False] and unchanged, (fault, rank)
            for name, value in params.items():
                torch.testing.assert_close(value, ref.params[name], rtol=1e-5, atol=1e-5)


def refusing_worker(rank, world, model_kw, own_batch):
    step, state = make(("gpipe", 2, None), zf.Mesh(pp=world), **model_kw)
    if own_batch == "later":  # a first step alike: the second one's header is checked as it arrives, not waited for
        state, _ = step(state, batches(n=2)[0])
    step(state, batches(n=2)[rank if own_batch else 0])


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_kw, own_batch, error", [
    ({"between": True}, False, "unit 'blocks.2' \\(first of stage 1\\) must get the output of unit 'blocks.1'"),
    ({"reuse": True}, False, "stage 1's forward used param 'blocks.0.ln.weight', which stage 0 holds"),
    ({}, True, "stages 0 and 1 were given different batches at step 0"),
    ({}, "later", "stages 0 and 1 were given different batches at step 1"),
])
def test_what_a_pipeline_cannot_split_is_refused(model_kw, own_batch, error):
    with pytest.raises(RuntimeError, match=f"rank 1 of 2 failed:(.|\n)*{error}"):
        zf.dist.spawn(refusing_worker, 2, 2, model_kw, own_batch, timeout_s=30)


def shapes_worker(rank, world, data):
    step, state = make(("1f1b", 2, None), zf.Mesh(pp=world))
    state, losses, norms = train_on(step, state, data)
    return losses, norms, dict(state.params)


@pytest.mark.multiprocess
def test_a_new_batch_shape_gets_its_header_waited_for_and_trains_as_the_plain_step():
    """Stage shapes are kept from the last step with the batch's shapes; a batch of other shapes
    (a shorter sequence, then back) gets its header waited for again."""
    data = [tuple(t[:, :n] for t in batch) for batch, n in zip(batches(n=5), (5, 5, 3, 5, 5))]
    results = zf.dist.spawn(shapes_worker, 2, 2, data)
    check_equal(results, train_on(*make(), data), "1f1b, sequences of 5, 5, 3, 5, 5 tokens")


# ------------------------------------------------------------------------------------ one process


@pytest.mark.parametrize("p, m", [(4, 6), (4, 2), (2, 1)])
def test_schedules_run_every_microbatch_once_and_bound_the_live_ones(p, m):
    from zfunc.pipelining.stage import schedule_ops

    assert schedule_ops("1f1b", 2, 0, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    for schedule in ("gpipe", "1f1b"):
        for stage in range(p):
            ops = schedule_ops(schedule, p, stage, m)
            assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            live = [sum(1 if kind == "F" else -1 for kind, _ in ops[: k + 1]) for k in range(len(ops))]
            assert min(live) >= 0 and max(live) == (m if schedule == "gpipe" else min(p - stage, m))


def test_one_stage_equals_plain_step_with_accumulation():
    step, state = make(("1f1b", 4, None), zf.Mesh())
    state, losses, norms = train_on(step, state, batches())
    check_equal([(losses, norms, dict(state.params))], train_on(*make(), batches()), "one stage")
    assert step.peak_live_microbatches == 1 and step.timings["wait_s"] == 0 < step.timings["compute_s"]
    assert [op[:2] for op in step.timings["ops"]] == [(kind, i) for i in range(4) for kind in "FB"]
    ends = [0.0] + [op[3] for op in step.timings["ops"]]  # an op is busy from the previous one's end
    assert all(0 < busy <= end - before for (_, _, _, end, _, busy), before in zip(step.timings["ops"], ends))
    assert sum(op[5] for op in step.timings["ops"]) == pytest.approx(step.timings["compute_s"])
    assert zf.pipelining.measured.bubble([step.timings]) == pytest.approx((step.timings["bubble"],))  # one rank


def test_a_pipelined_state_saves_loads_and_gathers_its_params(tmp_path):
    """What each stage holds (tests/test_checkpoint.py reshards p stages x d ranks): here one stage."""
    step, state = make(("1f1b", 2, None), zf.Mesh())
    state, _, _ = train_on(step, state, batches())
    whole = zf.checkpoint.full_params(state)
    assert list(whole) == sorted(state.params) and all(torch.equal(whole[n], state.params[n]) for n in whole)
    directory = zf.checkpoint.save(state, tmp_path / "000003")
    loaded = zf.checkpoint.load(directory, step)
    assert loaded.placement == state.placement and loaded.step == 3
    for a, b in zip(zf.tree.leaves(loaded), zf.tree.leaves(state)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    plain_step, _ = make()
    assert all(torch.equal(zf.checkpoint.load(directory, plain_step).params[n], whole[n]) for n in whole)


def test_bad_input():
    mesh = zf.Mesh()
    plain_step, plain_state = make()
    step, state = make(("1f1b", 2, None), mesh)
    torch.manual_seed(0)
    model = Tiny(n=3)
    by_block = zf.units.by_class(Block)
    with pytest.raises(ValueError, match=r"stages: 4 stages need at least 4 pipeline units, the model has 3"):
        zf.pipeline(plain_step, stages=4, microbatches=2, model=model, units=by_block)
    with pytest.raises(ValueError, match=r"batch: microbatches=3 must divide .* shape \(8, 5\)"):
        step3, state3 = make(("gpipe", 3, None), mesh)
        step3(state3, batches()[0])
    with pytest.raises(ValueError, match=r"split: expected 1 ints >= 1 .* 3 pipeline units, got \[2\]"):
        zf.pipeline(plain_step, stages=1, microbatches=2, model=model, units=by_block, split=(2,))
    with pytest.raises(ValueError, match="schedule: expected one of"):
        zf.pipeline(plain_step, stages=1, microbatches=2, schedule="zb", model=model, units=by_block)
    with pytest.raises(ValueError, match="stages: 2 stages, but the mesh has pp=1"):
        zf.pipeline(plain_step, stages=2, microbatches=2, model=model, units=by_block, mesh=mesh)
    with pytest.raises(ValueError, match="this state is sharded \\(pipeline stage 0 of 1\\)"):
        plain_step(state, batches()[0])
    with pytest.raises(ValueError, match="this state is not pipelined"):
        step(plain_state, batches()[0])
    with pytest.raises(ValueError, match=r"zf.shard\(zf.pipeline\(step\)\) is refused: .* must be applied last"):
        zf.shard(step, mesh, stage=1)
    with pytest.raises(ValueError, match="pipeline composes with ZeRO stage 1, 2 or 3 over the dp axis, got stage 0"):
        zf.pipeline(zf.shard(plain_step, mesh, stage=0), stages=1, microbatches=2, model=model, units=by_block)
    shuffled, shuffled_state = make(("gpipe", 2, None), mesh, order=[1, 0, 2, 3])
    with pytest.raises(ValueError, match="units must run once each, in module order; unit 'blocks.1' ran"):
        shuffled(shuffled_state, batches()[0])


# ------------------------------------------------------------------------------------ module buffers


def norm_worker(rank, world, schedule, model_kw):

    step, state = norm_step(zf.Mesh(pp=world), schedule, **model_kw)
    try:
        for batch in bn_batches():
            state, _ = step(state, batch)
    except ValueError as e:
        return str(e), state.consumed
    return dict(state.params), state.buffers


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_carries_its_units_batchnorm_statistics(schedule):
    """The pipelined step updates each unit's statistics once per microbatch, as the plain step
    with accum=m: each stage holds its own units' buffers, equal to the plain step's."""

    results = zf.dist.spawn(norm_worker, 2, 2, schedule, {})
    step, ref = norm_step()
    for batch in bn_batches():
        ref, _ = step(ref, batch)
    assert set(results[0][1]) == {f"blocks.0.bn.{n}" for n in ("running_mean", "running_var", "num_batches_tracked")}
    assert set(results[0][1]) | set(results[1][1]) == set(ref.buffers) and len(ref.buffers) == 6
    for params, buffers in results:
        for name, p in params.items():
            torch.testing.assert_close(p, ref.params[name], rtol=1e-6, atol=1e-6, msg=name)
        for name, b in buffers.items():
            torch.testing.assert_close(b, ref.buffers[name], rtol=1e-6, atol=1e-6, msg=name)
    assert results[1][1]["blocks.1.bn.num_batches_tracked"].item() == 6  # 3 steps of 2 microbatches


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["stem", "head"])
def test_a_buffer_written_outside_the_units_is_refused_on_every_stage(where):
    results = zf.dist.spawn(norm_worker, 2, 2, "1f1b", {where: True}, timeout_s=60)
    for message, consumed in results:
        assert "wrote module buffers outside the pipeline units" in message and not consumed
    assert f"'{where}.running_mean'" in results[1][0]  # the last stage runs both the stem and the head


def norm_dp_pp_worker(rank, world):

    mesh = zf.Mesh(dp=2, pp=2)
    torch.manual_seed(0)
    model = NormStack()
    step = zf.pipeline(zf.shard(bn_step(model)[1], mesh, stage=1), stages=2, microbatches=2, model=model,
                       units=zf.units.by_class(NormUnit))
    state = step.init(zf.functionalize(model)[1])
    for batch in bn_batches():
        state, _ = step(state, tuple(t[mesh.rank * 4 : (mesh.rank + 1) * 4] for t in batch))
    stage_state = zf.TrainState(state.params, state.opt_state, placement=state.placement.inner)
    return full_params(stage_state, mesh), state.buffers


@pytest.mark.multiprocess
def test_dp2_x_pp2_averages_each_stage_statistics_over_its_dp_ranks():

    results = zf.dist.spawn(norm_dp_pp_worker, 4, 4)
    torch.manual_seed(0)
    ref = torch_train(NormStack(), bn_batches(), accum=2, ranks=2)
    for params, buffers in results:
        assert buffers and all(n.startswith("blocks.") for n in buffers)
        # grads summed over 2 ranks x 2 microbatches in another order than the reference: rounding
        # that momentum carries over the steps, up to 2e-6 with the pure SGD update and 6e-6 with
        # the CPU kernel the placement picks (one rounding, as torch's) on params ~0.1-1
        assert_trained_like(params, buffers, ref, rtol=1e-5, atol=1e-5, names=set(params) | set(buffers))
