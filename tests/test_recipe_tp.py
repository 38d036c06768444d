"""--tp on the recipes: ``torchrun --nproc_per_node 4 -m recipes.llama --tp 2 --zero 1`` and ``-m recipes.gpt --tp 2
--pp 2 --tile-lm-head 2`` train as one process does (OUT/metrics.jsonl: losses and val losses within 1e-5, fp32),
the first's checkpoint resumes in one process, a --dry-run plans rank 0's bytes in one process as the run has them,
and --tp flags that cannot work are named before anything is built."""
import json
import re

import pytest

import zfunc as zf
from recipes import gpt, layout, llama
from recipes.cli import parse_args, with_precision
from recipes.layout import FlagError
from tests.recipe_runs import TINY, assert_same_losses, metrics, refused_before_built
from tests.test_loop import flags, run_cli


@pytest.mark.multiprocess
def test_llama_tp2_zero1_on_4_ranks_trains_as_1_process_and_resumes_in_one(tmp_path, text_file):
    argv = flags("llama", "--data", str(text_file), "--steps", "4", "--eval-every", "2", "--log-every", "1",
                 "--ckpt-every", "2")
    llama.main(argv + ["--out", str(tmp_path / "one")])
    want = metrics(tmp_path / "one")
    four = tmp_path / "four"
    done = run_cli("llama", four, argv + ["--tp", "2", "--zero", "1"], procs=4)
    assert "layout: 4 processes, dp=2 pp=1 tp=2, ZeRO 1" in done.stdout
    # a dry run in one process, planning the same 4 ranks, says rank 0's bytes as the run did
    planned = dry_run_lines(llama.main, argv + ["--tp", "2", "--zero", "1", "--world-size", "4"], tmp_path / "dry")
    assert plan_line(planned) == plan_line(done.stdout.splitlines()), (planned, done.stdout)
    assert_same_losses(metrics(four), want, "llama --tp 2 --zero 1 on 4 processes")
    manifest = zf.checkpoint.read_manifest(four / "ckpt" / "000002")
    assert (manifest["world"], manifest["tp"], manifest["stage"]) == (4, 2, 1)
    # as if the run had died after step 2's checkpoint: resumed by one process, it logs the same losses
    (four / "ckpt" / "000004").rename(tmp_path / "moved")
    (four / "ckpt" / "latest").write_text("000002")
    llama.main(argv + ["--out", str(four), "--resume"])
    assert_same_losses(metrics(four), want, "dp2 x tp2 resumed in one process")


@pytest.mark.multiprocess
def test_gpt_tp2_with_megatron_sequence_parallelism_on_2_ranks_trains_as_1_process(tmp_path, text_file):
    """--tp 2 --tp-sequence-parallel: the norms and residuals between the tp regions on half the tokens each."""
    argv = flags("gpt", "--data", str(text_file), "--steps", "3", "--eval-every", "3", "--log-every", "1")
    gpt.main(argv + ["--out", str(tmp_path / "one")])
    done = run_cli("gpt", tmp_path / "two", argv + ["--tp", "2", "--tp-sequence-parallel"], procs=2)
    assert "tp=2 (sequence parallel)" in done.stdout
    assert_same_losses(metrics(tmp_path / "two"), metrics(tmp_path / "one"), "gpt --tp 2 --tp-sequence-parallel")


@pytest.mark.multiprocess
def test_gpt_tp2_x_pp2_with_a_tiled_head_on_4_ranks_trains_as_1_process(tmp_path, text_file):
    """``torchrun --nproc_per_node 4 -m recipes.gpt --tp 2 --pp 2 --tile-lm-head 2``: each stage's layers sliced
    over its tp pair, the tied head and embedding in 2 vocab tiles each sliced, equal to one plain process (the
    loss falls); the one-process dry run of the same flags says rank 0's bytes as the run did; its checkpoint
    resumes in one process."""
    argv = flags("gpt", "--data", str(text_file), "--steps", "4", "--eval-every", "2", "--log-every", "1",
                 "--ckpt-every", "2", "--n-layer", "2")
    gpt.main(argv + ["--out", str(tmp_path / "one")])
    want = metrics(tmp_path / "one")
    tiled = ["--tile-lm-head", "2"]
    layout_flags = tiled + ["--tp", "2", "--pp", "2", "--microbatches", "2"]
    four = tmp_path / "four"
    done = run_cli("gpt", four, argv + layout_flags, procs=4)
    assert "layout: 4 processes, dp=1 pp=2 (1f1b schedule) tp=2, ZeRO 0" in done.stdout
    rows = metrics(four)
    assert_same_losses(rows, want, "gpt --tp 2 --pp 2 --tile-lm-head 2 on 4 processes")
    assert rows[-1]["loss"] < rows[0]["loss"]
    planned = dry_run_lines(gpt.main, argv + layout_flags, tmp_path / "dry")
    assert plan_line(planned) == plan_line(done.stdout.splitlines()), (planned, done.stdout)
    # its step-2 checkpoint (each tile's slices of each stage) resumed by one process: the same losses
    (four / "ckpt" / "000004").rename(tmp_path / "moved")
    (four / "ckpt" / "latest").write_text("000002")
    gpt.main(argv + tiled + ["--out", str(four), "--resume"])
    assert_same_losses(metrics(four), want, "pp2 x tp2 with a tiled head, resumed in one process")


def dry_run_lines(main, argv: list[str], out) -> list[str]:
    """What ``main(argv + --dry-run)`` prints in this process (which joins no process group)."""
    import contextlib
    import io

    import torch.distributed as dist

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        main(argv + ["--dry-run", "--out", str(out)])
    assert not (dist.is_available() and dist.is_initialized())
    return said.getvalue().splitlines()


def plan_line(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("plan (zfunc.plan"))


DRY_RUNS = [  # (flags, the processes planned)
    (["--tp", "2"], 2),
    (["--tp", "2", "--zero", "3"], 2),
    (["--pp", "2", "--tp", "2", "--n-layer", "2"], 4),
    (["--pp", "2", "--tp", "2", "--n-layer", "2", "--zero", "1", "--world-size", "8"], 8),
]


@pytest.mark.parametrize("more, world", DRY_RUNS, ids=[" ".join(f) for f, _ in DRY_RUNS])
def test_a_tp_dry_run_plans_its_ranks_in_one_process(tmp_path, text_file, more, world):
    """``python -m recipes.gpt --tp 2 --dry-run``: no torchrun; rank 0 of the fewest processes the layout needs
    (or --world-size), its params sliced on the meta device over a planned mesh (``zf.Mesh.planned``)."""
    import torch

    from recipes import engine, report

    argv = TINY + ["--precision", "fp32", "--data", str(text_file)] + more
    lines = dry_run_lines(gpt.main, argv, tmp_path)
    said = "\n".join(lines)
    assert f"layout: {world} processes (planned in one process: a dry run)" in said, said
    assert f"rank 0 of {world}" in plan_line(lines) and "verdict: fits this machine" in said, said
    assert f"{world} processes here" in said, said  # the verdict counts them all on this machine
    plan, args = layout.resolve(with_precision(parse_args(gpt.RECIPE, argv)), world, gpt.UNITS, notices=False)
    with torch.device("meta"):
        whole, model = gpt.RECIPE.build(args, 256).module, gpt.RECIPE.build(args, 256).module
    params = engine.functional(model, plan, engine.make_mesh(plan, planned=True))[1]
    assert params["wte.weight"].shape[0] == whole.wte.weight.shape[0] // 2  # rank 0's half of the (tied) vocab
    gb = report.plan_bytes(params, plan, model)["device"] / 1e9
    assert f"device {gb:.3g} GB" in plan_line(lines), (gb, plan_line(lines))


def measured_and_planned(rank, root):
    """Per ZeRO stage (0, 3): this rank's model-state bytes (``step.memory``) after a step of the recipe's GPT at
    --tp 2 on 2 gloo ranks, and zfunc.plan's for rank 0's slices as a one-process dry run makes them (over
    ``zf.Mesh.planned``: the engine's keys, and the plan line's total)."""
    import torch

    from recipes import checkpoints, engine, report
    from zfunc import plan as zp

    out = {}
    for zero in (0, 3):
        argv = TINY + ["--precision", "fp32", "--tp", "2", "--zero", str(zero), "--out", root]
        plan, args = layout.resolve(with_precision(parse_args(gpt.RECIPE, argv)), 2, gpt.UNITS, notices=False)
        with torch.device("meta"):
            built, dry = gpt.RECIPE.build(args, 256), gpt.RECIPE.build(args, 256).module
        apply, params = engine.functional(built.module, plan, engine.make_mesh(plan))
        step, _ = engine.build_step(engine.loss_fn(gpt.RECIPE.task, apply, built.module), built.module, args, plan)
        state, _ = checkpoints.first_state(args, step, built, params, plan, torch.device("cpu"))
        x = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
        state, _ = step(state, (x, x.roll(-1, 1)))
        planned = engine.functional(dry, plan, engine.make_mesh(plan, planned=True))[1]
        want = zp.engine_bytes([tuple(p.shape) for p in planned.values()], plan.dp, 0, zero)
        out[zero] = (step.memory(state), want, report.plan_bytes(planned, plan, dry)["device"])
    return out


@pytest.mark.multiprocess
def test_a_tp_dry_runs_bytes_per_rank_are_what_a_2_rank_run_holds(tmp_path):
    for measured in zf.dist.spawn(measured_and_planned, 2, str(tmp_path), timeout_s=300):
        held, want, line = measured[0]  # the tp step's own keys at ZeRO 0
        assert (held["params"], held["opt_state"]) == (want["params"], want["optimizer"])
        assert line == sum(want.values())
        held, want, line = measured[3]
        assert {key: held[key] for key in want} == want and line == sum(want.values())


def test_a_planned_mesh_runs_no_collective():
    import torch

    mesh = zf.Mesh.planned(dp=2, pp=2, tp=2, rank=5)
    assert (mesh.pp_rank, mesh.rank, mesh.tp_rank) == (1, 0, 1)
    with pytest.raises(zf.dist.CollectiveError, match="this mesh is planned"):
        mesh.tp_comm.all_reduce(torch.zeros(2), label="a test")
    with pytest.raises(zf.dist.CollectiveError, match="this mesh is planned"):
        mesh.p2p.send(torch.zeros(2), 0, label="a test")
    with pytest.raises(ValueError, match=re.escape("rank: expected an int in [0, 8)")):
        zf.Mesh.planned(dp=2, pp=2, tp=2, rank=8)


TP_FLAGS = [  # (flags, world size, the message naming the flags)
    (["--tp", "3"], 4, "--tp: 3 ranks per replica (tp) do not divide the 4 processes"),
    (["--tp", "2", "--sp", "2"], 2, "--sp, --tp: 4 ranks per replica (sp * tp) do not divide the 2 processes"),
    (["--tp", "0"], 1, "--tp: expected an int >= 1, got 0"),
    (["--world-size", "2"], 1, "--world-size: plans a --dry-run in one process; got --world-size 2 without --dry-run"),
    (["--world-size", "2", "--dry-run"], 4, "--world-size: 2, but torchrun started 4 processes"),
    (["--tp-sequence-parallel"], 1, "--tp-sequence-parallel (plan sp): sequence parallelism splits along the "
                                    "tensor-parallel group; it needs tp > 1"),
]


@pytest.mark.parametrize("flags, world, message", TP_FLAGS, ids=[" ".join(f) for f, *_ in TP_FLAGS])
def test_tp_flags_that_cannot_work_are_named_before_anything_is_built(tmp_path, monkeypatch, flags, world, message):
    refused_before_built(tmp_path, monkeypatch, flags, world, message)


def test_a_deepspeed_configs_autotp_size_must_be_the_tp_flag(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "tensor_parallel": {"autotp_size": 2}}))
    args = parse_args(gpt.RECIPE, TINY + ["--deepspeed", str(config), "--out", str(tmp_path / "out")])
    with pytest.raises(FlagError, match=re.escape("tensor_parallel.autotp_size is 2 but --tp is 1; give --tp 2")):
        layout.resolve(with_precision(args), 1, gpt.UNITS, notices=False)
