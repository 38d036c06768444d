"""Pipeline schedules as data: every built-in one is deadlock-free with the peak of live
microbatches its docstring states, its simulated bubble as theory says; a user's schedule is
read, checked and refused where it would deadlock or miss a grad, before anything runs."""
import re

import pytest

import zfunc as zf
from tests.models import PipeTiny, adamw, token_loss
from zfunc.pipelining import BUILT_IN, Op, Schedule, build, check, from_csv
from zfunc.pipelining.schedules import peak_live


def cases():
    """(name, p, m, v) for p in 2..8, m in p..4p: every built-in schedule, interleaved with v = 2."""
    return [(name, p, m, 2 if name == "interleaved-1f1b" else 1)
            for name in BUILT_IN for p in range(2, 9) for m in range(p, 4 * p + 1)]


def test_every_built_in_schedule_is_deadlock_free_and_peaks_as_its_docstring_says():
    for name, p, m, v in cases():
        timeline = check(build(name, p, m, v))  # raises on a deadlock or a grad computed other than once
        assert timeline.peak_live == tuple(peak_live(name, p, m, r, v) for r in range(p)), (name, p, m, v)


@pytest.mark.parametrize("p", range(2, 9))
def test_simulated_bubbles_follow_theory_and_zero_bubble_is_below_1f1b_at_m_equal_p(p):
    for m in (p, 2 * p, 4 * p):
        theory = (p - 1) / (m + p - 1)  # unit costs: F = 1, B = 2
        for name in ("gpipe", "1f1b"):
            assert check(build(name, p, m)).bubble[0] == pytest.approx(theory), (name, p, m)
        interleaved = check(build("interleaved-1f1b", p, m, 2))
        assert max(interleaved.bubble) == pytest.approx((p - 1) / (2 * m + p - 1)), (p, m)
    one_f_one_b, zero_bubble = check(build("1f1b", p, p)), check(build("zero-bubble", p, p))
    assert max(zero_bubble.bubble) < min(one_f_one_b.bubble) and zero_bubble.makespan < one_f_one_b.makespan
    for m in (2 * p, 4 * p):  # ZB-V: about half ZB-H1's bubble once every rank's V is full
        assert max(check(build("zbv", p, m)).bubble) < 0.6 * max(check(build("zero-bubble", p, m)).bubble), (p, m)


def test_costs_per_kind_and_stage_give_the_bubble_of_those_op_times():
    """GPipe on 2 ranks, 1 microbatch: F0 (1), F1 (2), B1 (4), B0 (2) in a row: makespan 9."""
    timeline = check(build("gpipe", 2, 1), {("F", 1): 2.0, ("B", 1): 4.0})
    assert timeline.makespan == 9.0
    assert timeline.bubble == pytest.approx((6 / 9, 3 / 9))


def test_zbv_places_two_stages_per_rank_in_a_v():
    plan = build("zbv", 4, 8)
    assert plan.ranks == (0, 1, 2, 3, 3, 2, 1, 0) and plan.virtual == 2
    assert plan == build("zbv", 4, 8, 2)  # its two virtual stages are implied
    with pytest.raises(ValueError, match="virtual_stages: expected 1 with schedule 'zbv'"):
        build("zbv", 4, 8, 3)


def test_a_schedule_round_trips_through_csv_as_torchtitan_writes_it():
    for name, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zbv", 1)):
        plan = build(name, 3, 6, v)
        again = from_csv(plan.to_csv(), name)
        assert again == plan, name
    assert build("1f1b", 2, 2).to_csv() == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    assert from_csv("0F0,,0B0\n1F0, 1B0\n").ops == ((Op("F", 0, 0), Op("B", 0, 0)), (Op("F", 0, 1), Op("B", 0, 1)))


@pytest.mark.parametrize("text, error", [
    ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "deadlock: rank 0 at 0B0 waits for 1B0; rank 1 at 1F1 waits for 0F1"),
    ("0F0,0B0\n1F0\n", "rank 1 never runs the forward and backward"),
    ("0F0,0B0,0B0\n1F0,1B0\n", "rank 0 runs 0B0 twice"),
    ("0B0,0F0\n1F0,1B0\n", "rank 0 runs 0B0 before 0F0"),
    ("0F0,0W0,0I0\n1F0,1B0\n", "rank 0 runs 0W0 before 0I0"),
    ("0F0,0I0,0B0,0W0\n1F0,1B0\n", "runs both a whole backward and an input-grad op"),
    ("0F0,0B0,1F0\n1F0,1B0\n", "stage 1 has ops on ranks 0 and 1"),
    ("0F0,0B0,2F0,2B0\n1F0,1B0\n", "every rank must run the same number of virtual stages"),
    ("0F0,0X0\n", "line 1, cell '0X0': expected <stage><F|B|I|W><microbatch>"),
])
def test_a_wrong_user_schedule_is_refused_before_it_runs(text, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        check(from_csv(text))


def test_zf_pipeline_checks_a_schedule_before_it_makes_the_step():
    model = PipeTiny()
    apply, params = zf.functionalize(model)
    step = zf.train_step(token_loss(apply), adamw(True))
    by_block = zf.units.by_class(type(model.blocks[0]))
    deadlock = from_csv("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    with pytest.raises(ValueError, match="schedule: deadlock"):
        zf.pipeline(step, stages=2, microbatches=2, schedule=deadlock, model=model, units=by_block)
    with pytest.raises(ValueError, match=r"schedule: 'custom' is for 2 ranks and 2 microbatches; the pipeline has 2 "
                                         r"stages and 4"):
        zf.pipeline(step, stages=2, microbatches=4, schedule=Schedule.from_rows(build("1f1b", 2, 2).ops),
                    model=model, units=by_block)
    with pytest.raises(ValueError, match="virtual_stages: expected 1 with schedule '1f1b'"):
        zf.pipeline(step, stages=1, microbatches=2, virtual_stages=2, model=model, units=by_block)
    with pytest.raises(ValueError, match="stages: 4 stages need at least 4 pipeline units, the model has 3"):
        zf.pipeline(step, stages=2, microbatches=2, schedule="interleaved-1f1b", virtual_stages=2,
                    model=PipeTiny(n=3), units=by_block)
    one = zf.pipeline(step, stages=1, microbatches=2, schedule="interleaved-1f1b", virtual_stages=2, model=model,
                      units=by_block)
    assert isinstance(one.schedule.plan(1), Schedule) and one.schedule.plan(1).ranks == (0, 0)


def test_zf_plan_predicts_each_schedules_bubble_and_live_microbatches():
    """zf.plan's pipeline term: GPipe and 1F1B as before, the others by their simulated bubble;
    GPipe holds more activations than 1F1B, zero-bubble as many on the busiest stage."""
    import dataclasses

    from zfunc import plan as zp
    from zfunc.plan.core import schedule_bubble

    assert schedule_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert schedule_bubble("interleaved-1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    model, cluster = zp.from_params(1e9), zp.cluster("H100-80GB", 4)
    base = zp.from_flags(dp=1, pp=4, zero=1, accum=8)
    compute = {}
    for name, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zbv", 1)):
        how = dataclasses.replace(base, pipeline_schedule=name, virtual_stages=v)
        compute[name] = zp.plan(model, cluster, how).time["compute"]
    assert compute["interleaved-1f1b"] < compute["1f1b"], compute
    assert compute["zbv"] < compute["zero-bubble"] < compute["1f1b"], compute
    live = {name: zp.plan(model, cluster, dataclasses.replace(base, pipeline_schedule=name, virtual_stages=v))
            .memory["gpu"]["activations"] for name, v in (("1f1b", 1), ("zero-bubble", 1), ("gpipe", 1), ("zbv", 1))}
    assert live["zbv"] == live["zero-bubble"] == live["1f1b"] < live["gpipe"], live  # ZB-V: 2p halves of a stage


def test_costs_per_op_override_those_per_stage_and_kind():
    """GPipe on 2 ranks, 2 microbatches; F of microbatch 1 on stage 0 costs 3: rank 1 waits for it."""
    timeline = check(build("gpipe", 2, 2), {("F", 1, 0): 3.0, ("F", 0): 1.0})
    assert [(str(op), start, end) for op, start, end in timeline.spans[1][:2]] == [("1F0", 1.0, 2.0), ("1F1", 4.0, 5.0)]


def simulated_timings(timeline, shift=(0.0, 0.0)):
    """What each rank's step.timings would read if the run went as ``timeline`` says (rank r's
    schedule starting at shift[r])."""
    out = []
    for r, row in enumerate(timeline.spans):
        t0 = shift[r] if r < len(shift) else 0.0
        ops = [(op.kind, op.microbatch, start - t0, end - t0, op.stage, end - start) for op, start, end in row]
        out.append({"t0": t0, "step_s": row[-1][2] - t0, "compute_s": sum(o[5] for o in ops), "ops": ops})
    return out


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 2, 4, 1), ("zbv", 2, 4, 1), ("zbv", 4, 8, 1),
                                        ("interleaved-1f1b", 2, 4, 2)])
def test_a_run_that_runs_as_simulated_measures_the_simulated_bubble(name, p, m, v):
    """zf.pipelining.measured: the bubble over the pipeline's makespan of a run whose ops start and
    last as check's simulation says (uneven op times, ranks' clocks started apart) is the simulation's."""
    plan = build(name, p, m, v)
    costs = {(op.kind, op.microbatch, op.stage): 1.0 + 0.1 * ((3 * op.microbatch + op.stage) % 5) + (op.kind != "F")
             for row in plan.ops for op in row}
    timeline = check(plan, costs)
    timings = simulated_timings(timeline, shift=(0.0, 0.5))  # rank 1 starts later: its first op waits anyway
    assert zf.pipelining.measured.bubble(timings) == pytest.approx(timeline.bubble)
    assert zf.pipelining.measured.implied(plan, timings).bubble == pytest.approx(timeline.bubble)
    assert zf.pipelining.measured.makespan(timings) == pytest.approx(timeline.makespan)
    if name == "1f1b":  # the last stage ends first: its own span's idle fraction is below the theory's
        own = 1 - timings[1]["compute_s"] / timings[1]["step_s"]
        assert own < timeline.bubble[1] - 0.05
