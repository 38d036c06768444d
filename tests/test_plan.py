"""plan: predicted bytes equal the engine's own accounting; the ZeRO paper's figure; the CLI."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from tests.models import Block, Tiny, batches, local
from zfunc import plan as zp
from zfunc.plan import calibrate, cost

STAGES = (0, 1, 2, 3)
# (optimizer, params) placements; params offload needs stage 3 on more than one rank
PLACES = [(None, None), ("cpu", None), ("nvme", None), ("cpu", "cpu"), ("nvme", "nvme")]
# (precision, accum) per stage: bf16 changes the compute copies, accum stage 1's whole grads
RUNS = {0: ("fp32", 1), 1: ("bf16", 2), 2: ("bf16", 1), 3: ("fp32", 1)}


def configs():
    for stage in STAGES:
        for where, params in PLACES:
            if params is not None and stage != 3:
                continue
            yield stage, where, params, *RUNS[stage]


def memory_worker(rank, world, path, todo):
    """``step.memory(state)`` after one step of each config (or why the engine refused it)."""
    mesh = zf.Mesh(dp=world)
    out = []
    for stage, where, params, precision, accum in todo:
        torch.manual_seed(0)
        apply, p = zf.functionalize(Tiny())

        def loss_fn(p, batch):
            x, y = batch
            return F.cross_entropy(apply(p, x).flatten(0, 1).float(), y.flatten())

        tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(1e-2))
        step = zf.train_step(loss_fn, tx, precision, accum)
        try:
            step = zf.shard(step, mesh, stage, units=zf.units.by_class(Block) if stage == 3 else None)
            if where:
                step = zf.offload(step, where, params, path=os.path.join(path, f"{stage}-{where}-{params}"))
        except ValueError as e:
            out.append(f"refused: {e}")
            continue
        state = step.init(p)
        state, _ = step(state, local(batches(world, 1, b=2 * accum)[0], rank, world))
        mem = step.memory(state)
        out.append({k: dict(v) if k == "comm" else v for k, v in mem.items()})
        del state, step
    return out


@pytest.fixture(scope="module")
def leaves():
    return zp.from_module(Tiny()).leaves


@pytest.fixture(scope="module")
def units():
    """Tiny's stage-3 units: ``(shapes of its params, modules that read them)``."""
    model = Tiny()
    sizes = dict(model.named_parameters())
    return [([tuple(sizes[n].shape) for n in u.params], u.users) for u in zf.units.by_class(Block)(model)]


def forward_gathers(units, world, precision):
    """Bytes stage 3 gathers in a forward: each unit once per module that reads it (a tied head
    gathers the embedding's unit again)."""
    e = 4 if precision == "fp32" else 2
    return sum(e * world * zp.local_numel(shapes, world, 0) * len(users) for shapes, users in units)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 4])
def test_predicted_model_states_equal_the_engines_accounting(tmp_path, world, leaves, units):
    todo = list(configs())
    results = zf.dist.spawn(memory_worker, world, world, str(tmp_path), todo, timeout_s=300)
    checked = 0
    for k, (stage, where, params, precision, accum) in enumerate(todo):
        for rank in range(world):
            got = results[rank][k]
            what = f"stage {stage}, optimizer {where}, params {params}, {world} ranks, rank {rank}"
            if isinstance(got, str):
                if stage == 0 and where and "zf.offload cannot wrap zf.shard" in got:
                    continue  # zf.offload refuses a stage-0 (replicated) step
                raise AssertionError(f"{what}: {got}")
            checked += 1
            if where:
                want = zp.offload_bytes(leaves, world, rank, optimizer=where, params=params, precision=precision)
                assert {p: got[p] for p in want} == want, what
                continue
            want = zp.engine_bytes(leaves, world, rank, stage, precision=precision, accum=accum)
            keys = ("params", "optimizer") if stage == 0 else want  # stage 0's step-time keys: its own
            assert {key: got[key] for key in keys} == {key: want[key] for key in keys}, what
            if stage == 3:
                numels = [sum(math.prod(x) for x in shapes) for shapes, _ in units]
                assert 0 < got["whole_params"] <= zp.working_bound(numels, precision), what
            if stage in (1, 2):
                assert got["comm"] == zp.engine_comm(leaves, world, stage, precision=precision, accum=accum), what
            if stage == 3:
                comm = zp.engine_comm(leaves, world, stage, precision=precision, accum=accum)
                assert got["comm"]["reduce_scatter"] == comm["reduce_scatter"], what
                fwd = forward_gathers(units, world, precision)  # backward re-gathers at most as much again
                assert fwd <= got["comm"]["all_gather"] <= 2 * fwd, what
    assert checked


@pytest.mark.multiprocess
def test_stage_0_on_2_ranks_is_accounted(tmp_path, leaves):
    results = zf.dist.spawn(memory_worker, 2, 2, str(tmp_path), [(0, None, None, "fp32", 1)], timeout_s=120)
    want = zp.engine_bytes(leaves, 2, 0, 0)
    got = results[0][0]
    assert isinstance(got, dict), got  # a refusal of stage 0 on 2 ranks is a failure
    assert (got["params"], got["optimizer"]) == (want["params"], want["optimizer"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage_0_counts_its_compute_copy_of_the_params_below_fp32(tmp_path, leaves, precision):
    got = memory_worker(0, 1, str(tmp_path), [(0, None, None, precision, 1)])[0]
    want = zp.engine_bytes(leaves, 1, 0, 0, precision=precision)
    assert {key: got[key] for key in want} == want  # fp32 computes on the masters: no copy
    assert want["whole_params"] == (0 if precision == "fp32" else 2 * sum(math.prod(s) for s in leaves))


# ---------------------------------------------------------------------- ZeRO paper, Figure 1
def test_the_zero_papers_figure_1_per_device_memory():
    """7.5B params, 64 GPUs, K = 12: 120 GB, 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p)."""
    got = [zp.zero_paper(7.5e9, 64, stage)["total"] / 1e9 for stage in STAGES]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def test_zfuncs_own_layout_differs_from_the_paper_by_the_fp32_grad_slice():
    """zfunc keeps an fp32 grad slice (4 Psi/N where the paper counts fp16 grads: +4 at stage 1, whose
    whole fp16 grads the paper counts too, +2 at stage 2) and gathers stage 3 from the fp32 masters
    (no fp16 param shard: -2, which the fp32 grad slice's +2 cancels), besides the step's buffers:
    stage 2's bucket of whole grads and stage 3's gathered units and their grads."""
    model = zp.from_params(7.5e9)
    c = zp.cluster("A100-80GB", 64)
    for stage, extra in ((1, 4), (2, 2), (3, 0)):
        p = zp.plan(model, c, zp.from_flags(zero=stage, accum=1))
        states = p.params_bytes + p.grads_bytes + p.optimizer_bytes
        gpu = p.memory["gpu"]
        buffers = {1: 0, 2: gpu["whole_grads"], 3: gpu["compute_params"] + gpu["whole_grads"]}[stage]
        paper = zp.zero_paper(7.5e9, 64, stage)["total"]
        assert states - buffers == pytest.approx(paper + extra * 7.5e9 / 64, rel=1e-6), stage


# ---------------------------------------------------------------------- model, strategy, time
def test_flops_match_megatrons_formula_with_recomputation():
    """The Azure 2T run's FLOPs formula: 96 B s l h^2 (1 + s/6h + V/16lh)."""
    m = zp.from_shape(160, 32768, 128, vocab=51200)
    B, s, l, h, V = 8, 1024, 160, 32768, 51200
    assert m.train_flops_per_token(s, remat=True) * B * s == pytest.approx(
        96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h)), rel=1e-9)


def test_a_standard_shape_keeps_the_parameter_count():
    m = zp.from_params(7e9)
    assert m.total_params == 7_000_000_000
    assert abs(m.layers * m.layer_params() + m.embedding_params() - 7e9) / 7e9 < 0.05
    assert m.hidden % m.heads == 0


def test_a_module_on_the_meta_device_gives_exact_leaves():
    from recipes.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64))
    spec = zp.from_module(model)
    assert spec.total_params == sum(p.numel() for p in model.parameters())
    assert (spec.layers, spec.hidden, spec.heads, spec.vocab) == (2, 64, 2, 256)
    assert spec.layers * spec.layer_params() + spec.embedding_params() == spec.total_params


def test_an_hf_config_builds_on_the_meta_device():
    pytest.importorskip("transformers")
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    spec = zp.from_hf_config(json.dumps(cfg))
    assert spec.kind == "llama" and spec.kv == 2
    assert spec.total_params == spec.layers * spec.layer_params() + spec.embedding_params()


def test_more_ranks_less_memory_and_stage_order():
    m, c = zp.from_params(13e9), zp.cluster("A100-80GB", 64)
    states = [zp.plan(m, c, zp.from_flags(zero=z)).gpu_bytes for z in STAGES]
    assert states[0] > states[1] > states[2] > states[3]
    small = zp.plan(m, zp.cluster("A100-80GB", 8), zp.from_flags(zero=3)).gpu_bytes
    assert small > states[3]


def test_offload_moves_state_off_the_gpu_and_costs_time():
    m, c = zp.from_params(13e9), zp.cluster("V100-32GB", 1)
    on = zp.plan(m, c, zp.from_flags(zero=2, precision="fp16"))
    off = zp.plan(m, c, zp.from_flags(zero=2, precision="fp16", offload_optimizer="cpu"))
    assert off.memory["cpu"]["optimizer"] == on.memory["gpu"]["optimizer"]
    assert off.gpu_bytes < on.gpu_bytes
    assert off.time["update"] > on.time["update"]
    nvme = zp.plan(m, c, zp.from_flags(zero=2, precision="fp16", offload_optimizer="nvme"))
    # masters with the optimizer, each file beside its spare; the grads held for the clip in scratch files
    held = nvme.memory["nvme"]["held_grads"]
    assert held == 2 * m.total_params  # fp16 grads, one process
    assert nvme.nvme_bytes_per_node == 2 * (off.memory["cpu"]["optimizer"] + off.memory["cpu"]["masters"]) + held


@pytest.mark.parametrize("kw, match", [
    (dict(pp=2, schedule="zb"), r"schedule: expected one of .*got 'zb'"),
    (dict(zero=1, offload_params="cpu"), "offload_params: offloading params needs ZeRO stage 3"),
    (dict(tp=3), "tp, pp, sp_size: tp \\* pp \\* sp_size = 3 does not divide"),
    (dict(sp_size=2, sp_kind="ring", seq=1026), "seq: 1026 tokens do not split over sp_size=2 ranks"),
    (dict(zero=5), r"zero: expected one of \[0, 1, 2, 3\], got 5"),
    (dict(sp=True), "sp: sequence parallelism"),
    (dict(micro_batch=0), "micro_batch: expected an int >= 1, got 0"),
    (dict(precision="bf16"), "precision: V100-32GB has no bf16"),
])
def test_bad_strategies_name_the_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        zp.plan(zp.from_params(1e9), zp.cluster("V100-32GB", 8), zp.from_flags(**{"precision": "fp16", **kw}))


def test_tensor_parallelism_is_modelled_and_said_to_be_unimplemented():
    p = zp.plan(zp.from_params(70e9), zp.cluster("H100-80GB", 64), zp.from_flags(tp=8, sp=True, zero=1))
    assert any("does not run it yet" in n for n in p.notes)
    assert p.time["tp_comm"] > 0 and p.comm["all_gather"] > 0


@pytest.mark.parametrize("kind", ["ulysses", "ring"])
def test_sequence_parallelism_splits_activations_and_keeps_zero_over_dp_x_sp(kind):
    """sp_size=2 on the same GPUs: each rank computes half of every sequence (half the activations and
    the compute), ZeRO still splits over all 8 ranks (dp x sp), and attention's exchanges cost bytes (and
    Ulysses' all-to-alls time; ring's transfers run behind the attention on a GPU)."""
    m, c = zp.from_params(7e9, kind="llama"), zp.cluster("H100-80GB", 8)
    plain = zp.plan(m, c, zp.from_flags(zero=3, seq=8192))
    sp = zp.plan(m, c, zp.from_flags(zero=3, seq=8192, sp_size=2, sp_kind=kind))
    assert sp.plan.dp == 4 and "sp_size=2 " + kind in zp.describe(sp.plan)
    assert sp.memory["gpu"]["activations"] == pytest.approx(plain.memory["gpu"]["activations"] / 2)
    assert sp.memory["gpu"]["masters"] == plain.memory["gpu"]["masters"]
    assert sp.time["compute"] < 0.6 * plain.time["compute"]
    assert sp.time["sp_comm"] > 0 if kind == "ulysses" else sp.time["sp_comm"] == 0  # ring's hide behind compute
    assert (sp.comm["all_to_all"] if kind == "ulysses" else sp.comm["send"]) > 0
    assert sp.tokens_per_step == plain.tokens_per_step / 2  # dp=4: each sequence is computed by 2 ranks


def test_search_returns_fitting_plans_fastest_first():
    found = zp.search(zp.from_params(7e9), zp.cluster("A100-80GB", 8), zp.from_flags(seq=2048), top=3)
    assert found and all(p.fits for p in found)
    rates = [p.tokens_per_step / p.step_time for p in found]
    assert rates == sorted(rates, reverse=True)


def test_json_has_the_fields_the_issue_names(capsys):
    from zfunc.plan.__main__ import main

    assert main(["--params", "7e9", "--gpus", "8", "--zero", "3", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    for key in ("params_gb", "grads_gb", "optimizer_gb", "model_states_gb", "comm_gb_per_step", "step_time_s",
                "tflops_per_gpu", "fits"):
        assert key in j, key
    assert math.isclose(j["model_states_gb"], j["params_gb"] + j["grads_gb"] + j["optimizer_gb"])


@pytest.mark.parametrize("argv, match", [
    (["--params", "7e9", "--gpu", "B300"], "--gpu: expected one of H100-80GB.*got 'B300'"),
    (["--params", "7e9", "--schedule", "zb", "--pp", "2"], r"--schedule: expected one of .*got 'zb'"),
    (["--params", "7e9", "--flavor", "7B"], "give exactly one model"),
])
def test_the_cli_names_a_bad_flag(capsys, argv, match):
    from zfunc.plan.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.multiprocess
def test_the_module_runs_as_a_command():
    out = subprocess.run([sys.executable, "-m", "zfunc.plan", "--params", "1e9", "--gpus", "2", "--search", "--top",
                          "1"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("1. dp=")


# ---------------------------------------------------------------------- time on a calibrated CPU
def fake_calibration() -> dict:
    """A calibration file's content with round numbers (what ``calibrate.measure`` writes)."""
    rate = lambda x: {"1": x, "all": 2 * x}  # noqa: E731
    per_rank = {"matmul_flops": 100e9, "copy_bw": 40e9, "attention_flops": 40e9, "activation_rate": 2e9,
                "first_touch_bw": 2e9}
    return {"version": calibrate.VERSION, "date": "2026-11-24", "host": "test", "threads": 2, "ram_bytes": 16e9,
            "load_average": [0.0, 0.0, 0.0], **{k: rate(v) for k, v in per_rank.items()},
            "cpu_adam_params_per_s": rate(1e9), "per_rank_of_2": per_rank,
            "collectives": {k: [300e-6, 2e9] for k in ("all_gather", "reduce_scatter", "all_reduce", "send")},
            "disk": {"read_bw": 1.5e9, "write_bw": 4e9}}


def test_cpu_timer_and_share_see_load_not_sleep():
    """A rate timed in CPU time ignores time the thread did not run; the share counts it."""
    import time

    assert calibrate._cpu_seconds(lambda: time.sleep(0.02), repeats=2) < 0.01
    assert 0 < calibrate.cpu_share() <= 1
    assert calibrate.cpu_share(then=lambda: time.sleep(0.2)) < 0.5  # a wait after the probe counts


def test_share_scales_the_cpu_and_loopback_not_the_disk():
    cal = fake_calibration()
    whole, half = calibrate.cluster_from(cal, 2), calibrate.cluster_from(cal, 2, share=0.5)
    assert half.device.flops("fp32") == whole.device.flops("fp32") / 2 == 50e9
    assert half.device.first_touch_bw == whole.device.first_touch_bw / 2
    assert half.collectives["all_gather"] == (600e-6, 1e9)
    assert (half.node.nvme_read_bw, half.node.nvme_write_bw) == (whole.node.nvme_read_bw, whole.node.nvme_write_bw)
    with pytest.raises(ValueError, match="share"):
        calibrate.cluster_from(cal, 2, share=1.5)


@pytest.mark.parametrize("clip", [True, False])
def test_offloaded_update_on_a_cpu_device(clip):
    """A CPU device: first writes of fresh memory (4 B/param at first-touch speed), CPU-Adam (the
    clip's factor in its own pass: no pass of its own), then the disk, one after the other."""
    n = 16_000_000
    model = zp.from_params(n)
    s = zp.from_flags(zero=1, offload_optimizer="nvme", micro_batch=1, seq=1, precision="fp32", clip=clip)
    cluster = calibrate.cluster_from(fake_calibration(), 1)  # one process: the "all" rates
    update = zp.plan(model, cluster, s).time["update"]
    host = model.total_params * (1 / 2e9 + 4 / 4e9)
    disk = model.total_params * 8 * (1 / 1.5e9 + 1 / 4e9)
    assert update == pytest.approx(host + disk)
    gpu = zp.cluster("A100-80GB", 8)  # a GPU node: the disk runs beside CPU-Adam, no page faults
    resolved = zp.plan(model, gpu, s).plan
    parts = cost.offload_update_parts(model, resolved, gpu)
    assert cost.update_time(model, resolved, gpu) == pytest.approx(max(parts["host"], parts["disk"]))


def test_stage3_on_a_cpu_pays_a_latency_per_unit():
    """Stage 3 runs a gather (forward), a re-gather and a reduce-scatter per unit; nothing hides them."""
    model = zp.from_shape(4, 192, 4, vocab=256)
    cluster = calibrate.cluster_from(fake_calibration(), 2)
    s = zp.from_flags(zero=3, micro_batch=8, seq=128, precision="fp32")
    t = zp.plan(model, cluster, s).time["dp_comm"]
    P = model.total_params
    one = lambda units: 300e-6 + units / 2 / 2e9  # noqa: E731  (2 ranks: half the Comm bytes on the wire)
    expected = 2 * one(4 * P) + one(4 * P) + 4 * 3 * 300e-6 + one(24)
    assert t == pytest.approx(expected, rel=1e-3)


def test_a_loaded_pipeline_runs_its_fill_and_drain_at_the_share_of_one_rank():
    from zfunc.plan.validate import loaded_pipeline

    whole = {"compute": 5.0, "pp_shared": 0.5, "update": 0.5, "step": 6.0}  # m=4, p=2: 5 slots of 1 s
    same = loaded_pipeline(whole, 4, 2, 0.5, 0.5)
    assert same["step"] == pytest.approx(12.0)  # one share: everything twice as long
    parts = loaded_pipeline(whole, 4, 2, 0.5, 1.0)
    assert parts["compute (steady)"] == pytest.approx(3 / 0.5)
    assert parts["compute (fill and drain)"] == pytest.approx(2.0)
    assert parts["step"] == pytest.approx(6 + 2 + 2)


def test_validation_takes_the_benchmarks_measurements_and_predicts_each_row():
    """zfunc.plan.validate turns measurements (what benchmarks/plan_validate.py's ranks return) into
    rows: each predicted step is the estimate at the ranks' rates, divided by their share of a core."""
    from zfunc.plan import validate

    cal, model = fake_calibration(), zp.from_shape(4, 192, 4, vocab=256, max_seq=128)
    rates = cal["per_rank_of_2"]
    names = list(validate.TRAINERS)
    shard = [({k: [0.1, 0.3] for k in names}, rates, {k: [0.5, 0.5] for k in names}, {k: [0.1, 0.1] for k in names})
             for _ in range(2)]
    rows = validate.shard_rows(cal, shard, model, batch=8, seq=128)
    cluster = calibrate.cluster_from(cal, 2, rates=rates)
    for row, stage in zip(rows, validate.TRAINERS.values()):
        whole = zp.plan(model, cluster, zp.from_flags(zero=stage, micro_batch=8, seq=128, precision="fp32"))
        assert (row.measured, row.share) == (pytest.approx(0.2), 0.5)
        assert row.predicted == pytest.approx(whole.step_time / 0.5)
    keys = [(s, 2) for s in validate.SCHEDULES]
    pipe = [({k: [0.2] for k in keys}, rates, {k: [1.0] for k in keys}, {k: [0.1] for k in keys},
             {k: [1.0] for k in keys}) for _ in range(2)]
    rows = validate.pipeline_rows(cal, pipe, model, (2,), batch=16, seq=128)
    assert [r.config for r in rows] == ["gpipe, 2 stages, m=2, 16x128", "1f1b, 2 stages, m=2, 16x128"]
    assert "of 6 within" in validate.table(validate.shard_rows(cal, shard, model, 8, 128) + rows)


def test_validation_tp_rows_put_a_tp_runs_bytes_beside_the_plans():
    """zfunc.plan.validate.tp_rows: a tp run's ``step.memory`` (model states per rank, the tp group's bytes per
    step; the larger rank's) beside the plan's tp rows; the table counts those within +-25%."""
    from zfunc.plan import validate

    cal, model = fake_calibration(), zp.from_shape(4, 192, 4, vocab=256, max_seq=128)
    flags = zp.from_flags(tp=2, zero=0, micro_batch=8, seq=128, precision="fp32", clip=True)
    planned = zp.plan(model, calibrate.cluster_from(cal, 2), flags)
    states, moved = planned.memory["gpu"]["masters"] + planned.memory["gpu"]["optimizer"], planned.comm["all_reduce"]
    halves = {"all_reduce": moved / 2, "all_gather": moved / 2}
    exact = {"params": states / 3, "opt_state": 2 * states / 3, "comm": halves}
    rows = validate.tp_rows(cal, [exact, exact], model, batch=8, seq=128)
    assert [r.measured / r.predicted for r in rows] == pytest.approx([1.0, 1.0])
    assert "2 of 2 within" in validate.bytes_table(rows)
    more = {"params": states / 3, "opt_state": states, "comm": {"all_reduce": 1.5 * moved}}
    rows = validate.tp_rows(cal, [exact, more], model, batch=8, seq=128)
    assert [r.measured / r.predicted for r in rows] == pytest.approx([4 / 3, 1.5])
    assert "0 of 2 within" in validate.bytes_table(rows)


def test_the_library_imports_neither_recipes_nor_benchmarks():
    import ast
    from pathlib import Path

    root = Path(zf.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in ("recipes", "benchmarks")]
    assert not found, found


def test_a_flavor_comes_from_the_recipe_that_registered_it(monkeypatch):
    """``from_flavor`` knows only registered recipes (the library imports none): unknown -> a ValueError
    naming the recipe and those registered; registered -> its model's exact leaves, built on meta."""
    from zfunc.plan import model as model_mod

    monkeypatch.setattr(model_mod, "_FLAVORS", {})
    with pytest.raises(ValueError, match=r"--recipe: no flavors registered for recipe 'gpt' \(registered: none\)"):
        zp.from_flavor("debug", "gpt")
    built = []

    def build(name):
        model = Tiny()
        built.append((name, next(model.parameters()).device.type))
        return model, {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 32}

    zp.register_flavors("gpt", build)
    spec = zp.from_flavor("tiny", "gpt")
    assert built == [("tiny", "meta")] and spec.params == sum(p.numel() for p in Tiny().parameters())
    with pytest.raises(ValueError, match=r"build: expected a callable"):
        zp.register_flavors("gpt", None)


def test_recipes_plan_registers_the_recipes_flavors(monkeypatch, capsys):
    from recipes import llama, plan as recipes_plan
    from zfunc.plan import model as model_mod

    monkeypatch.setattr(model_mod, "_FLAVORS", {})
    assert recipes_plan.main(["--flavor", "debug", "--recipe", "llama", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "llama debug" and out["params"] == sum(
        p.numel() for p in llama.Llama(llama.flavor("debug")).parameters())


def test_papers_predicts_every_published_row_within_30_percent():
    """``--papers``: each published claim (capacity, TFLOP/s, tokens/s, scaling) predicted within 30%, with the
    GEMM efficiencies taken from sources other than the rows (``zfunc.plan.hardware``)."""
    from zfunc.plan import papers

    rows = {make.__name__: make() for make in papers.HEADLINES}
    assert {"torchtitan_8b", "torchtitan_405b", "infinity_1t_one_gpu"} <= rows.keys()
    for name, row in rows.items():
        assert row.ratio is not None and 0.7 <= row.ratio <= 1.3, (name, row.ratio, row.predicted)
    assert "| Llama 3.1 8B, 8 H100, FSDP (torchtitan) |" in papers.table()
