"""recipes/gpt.py: the model, the data, a tiny training run through zfunc, and its flags checked."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zfunc as zf
from recipes import gpt, layout, plot, task
from recipes.cli import check_args, parse_args, with_precision
from recipes.data import get_batch, is_val, load_bytes
from recipes.data_cap import MAX_CORPUS_BYTES
from recipes.layout import FlagError
from tests.recipe_runs import (HF_ZERO2, HF_ZERO3, ROOT, TINY, assert_same_losses, exits_2, metrics,
                               refused_before_built)
from tests.test_plot import near, read_png


def test_tiny_run_trains_through_zfunc_and_saves_a_checkpoint(tmp_path, text_file):
    out = tmp_path / "out"
    result = gpt.main(TINY + ["--steps", "40", "--eval-every", "10", "--data", str(text_file),
                              "--out", str(out)])
    losses = [v for _, v in result["history"]]
    assert [s for s, _ in result["history"]] == [10, 20, 30, 40]
    assert losses[-1] < losses[0] < math.log(256)
    assert losses[-1] < 2.0  # a 45-byte repeated sentence is easy
    manifest = zf.checkpoint.read_manifest(result["checkpoint"])
    assert manifest["step"] == 40 and manifest["extra"]["val_loss"] == pytest.approx(result["val_loss"])
    assert manifest["extra"]["config"]["n_embd"] == 32
    exported = zf.checkpoint.export(result["checkpoint"], tmp_path / "model.safetensors")
    params = load_file(exported)
    assert "lm_head.weight" not in params  # tied to wte.weight: stored once
    model = gpt.GPT(gpt.GPTConfig(**manifest["extra"]["config"]))
    model.load_state_dict(params, strict=False)
    assert torch.equal(model.lm_head.weight, params["wte.weight"])
    assert len(result["sample"]) == 16


def test_resume_continues_exactly(tmp_path, text_file):
    flags = TINY + ["--steps", "6", "--eval-every", "0", "--ckpt-every", "3", "--data", str(text_file),
                    "--out", str(tmp_path)]
    straight = gpt.main(flags)["checkpoint"]
    ckpt = tmp_path / "ckpt"
    saved = load_file(zf.checkpoint.export(straight, tmp_path / "straight.safetensors"))
    (ckpt / "000006").rename(tmp_path / "moved")  # as if the run had died after step 3
    (ckpt / "latest").write_text("000003")
    result = gpt.main(flags + ["--resume"])
    resumed = result["checkpoint"]
    assert result["tokens_per_s"] > 0  # over the 3 steps this run trained
    again = load_file(zf.checkpoint.export(resumed, tmp_path / "resumed.safetensors"))
    assert all(torch.equal(again[k], saved[k]) for k in saved)


def test_resume_without_a_checkpoint_says_so(tmp_path, text_file, capsys):
    argv = TINY + ["--steps", "2", "--data", str(text_file), "--out", str(tmp_path), "--resume"]
    assert "--resume: no checkpoint under" in exits_2(capsys, gpt.main, argv)


def test_generate_returns_the_asked_number_of_tokens():
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = gpt.GPT(cfg).eval()
    prompt = list(b"a prompt longer than the block")
    out = task.generate(model, prompt, 20, cfg.block_size, generator=torch.Generator().manual_seed(0))
    assert len(out) == 20 and all(isinstance(i, int) and 0 <= i < 256 for i in out)
    again = task.generate(model, prompt, 20, cfg.block_size, generator=torch.Generator().manual_seed(0))
    assert again == out
    assert task.generate(model, [], 0, cfg.block_size) == []


def test_initial_values_are_gpt2s_init_and_any_rows_are_the_rows_of_the_whole():
    cfg = gpt.GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    for name, like in model.named_parameters():
        whole = model.initial_value(name, like, seed=3)
        assert whole.shape == like.shape and whole.dtype == like.dtype, name
        n = like.shape[0]
        for rows in (slice(0, n), slice(1, n - 1), slice(n - 1, n), slice(2, 2)):
            assert torch.equal(model.initial_value(name, like, 3, rows), whole[rows]), (name, rows)
        if name.startswith("ln") or ".ln" in name:
            assert torch.equal(whole, torch.ones_like(whole) if name.endswith("weight") else torch.zeros_like(whole))
        elif name.endswith("bias"):
            assert not whole.any(), name
        else:  # N(0, 0.02), the residual projections scaled by 1/sqrt(2 * n_layer)
            residual = name.endswith("proj.weight") or name.endswith("mlp.2.weight")
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02
            assert abs(whole.std().item() / std - 1) < 0.2 and abs(whole.mean().item()) < std / 3, name
    assert not torch.equal(model.initial_value("wte.weight", model.wte.weight, 3),
                           model.initial_value("wte.weight", model.wte.weight, 4))


def test_a_rank_draws_only_its_rows_of_a_large_leaf(monkeypatch):
    """ZeRO-3 from the meta device: rank r of 4 materializes its quarter of the embedding, never the whole
    (zf.materialize.normal draws blocks of rows: at most its rows plus two blocks)."""
    cfg = gpt.GPTConfig(vocab_size=4096, block_size=8, n_layer=1, n_head=2, n_embd=256)  # wte: 4 MiB, 4 blocks
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    drawn, randn = [], torch.randn
    monkeypatch.setattr(torch, "randn", lambda n, **kw: drawn.append(n) or randn(n, **kw))
    like, quarter = model.wte.weight, 4096 // 4
    mine = model.initial_value("wte.weight", like, 0, slice(quarter, 2 * quarter))
    assert mine.shape == (quarter, 256) and sum(drawn) <= quarter * 256 + 2 * zf.materialize.BLOCK_ELEMS < like.numel()
    assert torch.equal(mine, model.initial_value("wte.weight", like, 0)[quarter:2 * quarter])


def test_a_tiles_rows_are_the_rows_of_the_untiled_layer():
    cfg = gpt.GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    whole = model.initial_value("wte.weight", model.wte.weight, 5)  # lm_head's tied weight
    zf.tile(model, tiles=3, modules=["lm_head"])  # splits lm_head (and wte, tied) into tiles of rows
    tiles = [(name, p) for name, p in model.named_parameters() if ".tiles." in name]
    assert [name for name, _ in tiles] == [f"wte.tiles.{i}.weight" for i in range(3)]
    materialize = zf.tiling.materializer(model.materializer(5), model)  # what the recipe's loop asks
    got = torch.cat([materialize(name, p) for name, p in tiles])
    assert torch.equal(got, whole)
    name, p = tiles[1]
    assert torch.equal(materialize(name, p, slice(1, 3)), materialize(name, p)[1:3])


def test_default_corpus_loads_and_splits_deterministically():
    a, b = load_bytes(), load_bytes()
    assert a.n_files > 100 and "stdlib" in a.source
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    total = len(a.train) + len(a.val)
    assert total <= MAX_CORPUS_BYTES + a.n_files  # + the separators
    assert 0.03 < len(a.val) / total < 0.25
    assert b"def " in bytes(a.val[:100_000].tolist())
    assert 2.5 < task.unigram_entropy(a.val)["unigram_entropy"] < math.log(256)


def test_folder_is_split_by_file_and_single_file_by_position(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_bytes(f"file {i} ".encode() * 100)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01" * 500)  # binary: skipped
    corpus = load_bytes(tmp_path)
    assert corpus.n_files == 40
    val = bytes(corpus.val.tolist())
    val_names = {f"f{i:02d}.txt" for i in range(40) if is_val(f"f{i:02d}.txt")}
    for i in range(40):
        assert (f"file {i} ".encode() in val) == (f"f{i:02d}.txt" in val_names)
    single = load_bytes(tmp_path / "f00.txt")
    assert len(single.val) == len(b"file 0 ") * 100 // 10 and single.n_files == 1


def test_missing_or_empty_data_path_names_it(tmp_path, capsys):
    missing = tmp_path / "no_such_corpus"
    err = exits_2(capsys, gpt.main, ["--data", str(missing), "--steps", "1", "--out", str(tmp_path)])
    assert f"--data: path {str(missing)!r} does not exist" in err
    with pytest.raises(FileNotFoundError, match="no_such_corpus"):
        load_bytes(missing)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty_dir"):
        load_bytes(empty)


def test_get_batch_targets_are_inputs_shifted_by_one():
    data = torch.arange(100, dtype=torch.uint8)
    x, y = get_batch(data, 4, 10, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 10) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))
    with pytest.raises(ValueError, match="block_size=200"):
        get_batch(data, 4, 200)


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exc:
        gpt.main(["--help"])
    assert exc.value.code == 0
    assert "--n-layer" in capsys.readouterr().out


BAD_FLAGS = [  # (flags, the message naming the flag, the value and what was expected)
    (["--batch-size", "0"], "--batch-size: expected an int >= 1, got 0"),
    (["--steps", "0"], "--steps: expected an int >= 1, got 0"),
    (["--n-layer", "0"], "--n-layer: expected an int >= 1, got 0"),
    (["--block-size", "-3"], "--block-size: expected an int >= 1, got -3"),
    (["--accum", "0"], "--accum: expected an int >= 1, got 0"),
    (["--eval-batches", "0"], "--eval-batches: expected an int >= 1, got 0"),
    (["--keep-last", "0"], "--keep-last: expected an int >= 1, got 0"),
    (["--ckpt-every", "-1"], "--ckpt-every: expected an int >= 0, got -1"),
    (["--eval-every", "-5"], "--eval-every: expected an int >= 0, got -5"),
    (["--warmup", "-1"], "--warmup: expected an int >= 0, got -1"),
    (["--sample-len", "-1"], "--sample-len: expected an int >= 0, got -1"),
    (["--seed", "-1"], "--seed: expected an int in [0, 2**32), got -1"),
    (["--n-embd", "33"], "--n-embd: expected a multiple of --n-head 4, got 33"),
    (["--dropout", "1"], "--dropout: expected a number in [0, 1), got 1.0"),
    (["--lr", "nan"], "--lr: expected a finite number >= 0, got nan"),
    (["--end-lr=-1e-4"], "--end-lr: expected a finite number >= 0, got -0.0001"),
    (["--weight-decay", "inf"], "--weight-decay: expected a finite number >= 0, got inf"),
    (["--grad-clip", "0"], "--grad-clip: expected a number > 0, got 0.0"),
    (["--temperature", "0"], "--temperature: expected a finite number > 0, got 0.0"),
    (["--top-k", "0"], "--top-k: expected an int >= 1, got 0"),
    (["--device", "nodevice"], "--device: expected a torch device such as cpu or cuda:0, got 'nodevice'"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=[f[0] for f, _ in BAD_FLAGS])
def test_check_args_names_each_bad_flag(tmp_path, flags, message):
    args = parse_args(gpt.RECIPE, flags + ["--out", str(tmp_path / "out")])
    with pytest.raises(FlagError, match=re.escape(message)):
        check_args(gpt.RECIPE, args)
    assert not (tmp_path / "out").exists()  # values are checked before --out is created


def test_bad_flags_exit_2_all_named_before_anything_is_built(tmp_path, capsys):
    err = exits_2(capsys, gpt.main,
                  ["--batch-size", "0", "--ckpt-every", "-1", "--keep-last", "0", "--out", str(tmp_path)])
    assert "--batch-size: expected" in err and "--ckpt-every: expected" in err and "--keep-last: expected" in err


def test_an_unwritable_out_is_found_before_the_data_is_loaded(tmp_path, text_file, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    err = exits_2(capsys, gpt.main, TINY + ["--data", str(text_file), "--out", str(blocker / "run")])
    assert "--out: cannot write checkpoints under" in err and "a_file" in err
    assert check_args(gpt.RECIPE, parse_args(gpt.RECIPE, ["--out", str(tmp_path / "new" / "run")])) is None
    assert (tmp_path / "new" / "run" / "ckpt").is_dir() and not any((tmp_path / "new" / "run" / "ckpt").iterdir())


def test_a_block_size_the_data_cannot_fill_is_found_before_the_model(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_bytes(b"0123456789" * 20)  # val: the last 20 bytes
    err = exits_2(capsys, gpt.main, TINY + ["--data", str(small), "--out", str(tmp_path)])
    assert "--block-size: 32 needs more than 33 bytes, the val split" in err


def test_every_0_means_never_but_the_last_step_evaluates_and_saves(tmp_path, text_file):
    result = gpt.main(TINY + ["--steps", "3", "--eval-every", "0", "--ckpt-every", "0", "--data", str(text_file),
                              "--out", str(tmp_path)])
    assert [s for s, _ in result["history"]] == [3] and math.isfinite(result["val_loss"])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["000003", "latest"]


def snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_refuses_other_training_flags_naming_each(tmp_path, text_file, capsys):
    flags = TINY + ["--eval-every", "0", "--data", str(text_file), "--out", str(tmp_path)]
    gpt.main(flags + ["--steps", "2"])
    capsys.readouterr()
    before = snapshot(tmp_path)
    err = exits_2(capsys, gpt.main, flags + ["--steps", "4", "--resume", "--n-layer", "2", "--lr", "2e-2"])
    assert "--n-layer: 1 in the checkpoint, 2 given" in err and "--lr: 0.01 in the checkpoint, 0.02 given" in err
    assert "--steps:" not in err and "--eval-every" not in err
    err = exits_2(capsys, gpt.main, flags + ["--steps", "4", "--resume", "--data", str(tmp_path / "ckpt" / "latest")])
    assert f"--data: {str(text_file)!r} in the checkpoint" in err
    assert snapshot(tmp_path) == before
    # what may change on resume does: more steps, other eval, checkpoint and sample flags
    result = gpt.main(flags + ["--resume", "--steps", "3", "--eval-every", "1", "--eval-batches", "1",
                               "--keep-last", "1", "--sample-len", "3", "--top-k", "5"])
    assert result["history"] == [(3, result["val_loss"])] and len(result["sample"]) == 3


def test_resume_with_steps_not_beyond_the_checkpoint_changes_nothing(tmp_path, text_file, capsys):
    flags = TINY + ["--eval-every", "0", "--ckpt-every", "2", "--data", str(text_file), "--out", str(tmp_path)]
    gpt.main(flags + ["--steps", "4"])
    capsys.readouterr()
    before = snapshot(tmp_path)
    for steps in ("3", "4"):
        err = exits_2(capsys, gpt.main, flags + ["--steps", steps, "--resume"])
        assert f"--steps: {steps} is not beyond step 4 of the checkpoint" in err and "nothing to train" in err
    assert snapshot(tmp_path) == before
    assert zf.checkpoint.latest(tmp_path / "ckpt") == tmp_path / "ckpt" / "000004"


def test_resume_from_a_checkpoint_without_flags_still_checks_the_model(tmp_path, text_file, capsys):
    flags = TINY + ["--eval-every", "0", "--data", str(text_file), "--out", str(tmp_path)]
    gpt.main(flags + ["--steps", "2"])
    manifest_path = tmp_path / "ckpt" / "000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["extra"] = {}  # saved by another program: nothing to compare the flags with
    manifest_path.write_text(json.dumps(manifest))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        gpt.main(flags + ["--steps", "4", "--resume", "--n-layer", "2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--resume:" in err and "does not hold this model" in err and "blocks.1." in err


# ----------------------------------------------------------------------------- at scale: the layout flags
# The law of the command line: the same flags in any layout (ZeRO stage, offload, pipeline, remat,
# tiling, accumulation, number of processes) train as the single-process run: the same losses in
# OUT/metrics.jsonl (fp32, 1e-5 relative). Two-process runs go through torchrun, as a user's would.
LAW = TINY + ["--n-layer", "2", "--steps", "4", "--eval-every", "2", "--log-every", "1", "--precision", "fp32"]


def cli(out: Path, flags: list[str], procs: int = 1, torchrun: list[str] = ()) -> subprocess.CompletedProcess:
    """``python -m recipes.gpt`` (procs=1) or ``torchrun --standalone --nproc_per_node procs -m recipes.gpt``."""
    launcher = [sys.executable, "-m", "recipes.gpt"] if procs == 1 and not torchrun else [
        sys.executable, "-m", "torch.distributed.run", *(torchrun or ["--standalone"]), "--nproc_per_node", str(procs),
        "-m", "recipes.gpt"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([*launcher, *flags, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{' '.join(launcher + flags)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def law(tmp_path_factory, text_file):
    """The single-process run every layout must reproduce: its flags and OUT/metrics.jsonl."""
    out = tmp_path_factory.mktemp("law") / "plain"
    flags = LAW + ["--data", str(text_file)]
    gpt.main(flags + ["--out", str(out)])
    return flags, metrics(out), out


slow = pytest.mark.slow
ONE_PROCESS = [  # (layout flags, marks): every transformation in one process, in the recipe's own process
    (["--zero", "3", "--remat"], ()),
    (["--zero", "2", "--offload-optimizer", "nvme"], ()),
    (["--offload-optimizer", "cpu", "--offload-params", "cpu"], ()),
    (["--accum", "2", "--tile-lm-head", "2"], ()),
    (["--zero", "1"], slow),
    (["--zero", "3", "--offload-optimizer", "nvme", "--offload-params", "nvme", "--remat", "--remat-offload"], slow),
    (["--offload-optimizer", "nvme", "--offload-params", "nvme"], slow),
    (["--zero", "2", "--accum", "4"], slow),
]


def _ids(cases):
    return [" ".join(flags) for flags, _ in cases]


def _nvme(flags: list[str], tmp_path: Path) -> list[str]:
    return flags + ["--nvme-path", str(tmp_path / "swap")] if "nvme" in flags else flags


@pytest.mark.parametrize("layout", [pytest.param(f, marks=m) for f, m in ONE_PROCESS], ids=_ids(ONE_PROCESS))
def test_the_same_flags_in_another_layout_train_the_same_in_one_process(tmp_path, law, layout):
    flags, want, _ = law
    gpt.main(flags + _nvme(layout, tmp_path) + ["--out", str(tmp_path / "out")])
    assert_same_losses(metrics(tmp_path / "out"), want, " ".join(layout))


TWO_PROCESSES = [
    (["--zero", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu"], ()),
    (["--pp", "2", "--microbatches", "2"], ()),
    (["--zero", "0"], ()),
    (["--zero", "1"], slow),
    (["--zero", "2", "--offload-optimizer", "nvme", "--accum", "2"], slow),
    (["--zero", "3", "--remat", "--tile-lm-head", "2"], slow),
    (["--pp", "2", "--microbatches", "4", "--schedule", "gpipe", "--zero", "1"], slow),
    (["--pp", "2", "--microbatches", "2", "--zero", "3", "--remat"], ()),  # a stage's ZeRO-3 (dp 1), remat'ed units
    (["--pp", "2", "--microbatches", "2", "--offload-optimizer", "cpu"], ()),  # each stage's optimizer state offloaded
    (["--pp", "2", "--microbatches", "2", "--zero", "2", "--offload-optimizer", "cpu"], slow),  # ZeRO-2 slices
    (["--pp", "2", "--microbatches", "2", "--offload-optimizer", "cpu", "--offload-params", "cpu"], slow),
    (["--pp", "2", "--microbatches", "2", "--schedule", "zero-bubble"], slow),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [pytest.param(f, marks=m) for f, m in TWO_PROCESSES], ids=_ids(TWO_PROCESSES))
def test_the_same_flags_on_two_processes_under_torchrun_train_the_same(tmp_path, law, layout):
    flags, want, _ = law
    logs = tmp_path / "logs"
    done = cli(tmp_path / "out", flags + _nvme(layout, tmp_path), procs=2,
               torchrun=["--standalone", "--log-dir", str(logs), "--redirects", "3"])
    assert_same_losses(metrics(tmp_path / "out"), want, " ".join(layout))
    # each rank's output went to its own files: rank 0 tells the story, rank 1 prints nothing
    by_rank = {p.parent.name: p for p in logs.rglob("stdout.log")}
    assert "model:" in by_rank["0"].read_text() and "layout: 2 processes" in by_rank["0"].read_text()
    assert by_rank["1"].read_text() == "" and (by_rank["1"].parent / "stderr.log").read_text() == "", done.stderr


@pytest.mark.multiprocess
@slow  # its own one-process reference at 4 layers; tests/test_pipeline.py runs interleaved-1f1b by default
def test_an_interleaved_pipeline_under_torchrun_trains_as_one_process(tmp_path, text_file):
    """--pp 2 --schedule interleaved-1f1b --virtual-stages 2: 4 virtual stages of one block each, on 2 processes."""
    flags = LAW + ["--data", str(text_file), "--n-layer", "4"]
    gpt.main(flags + ["--out", str(tmp_path / "plain")])
    cli(tmp_path / "out", flags + ["--pp", "2", "--microbatches", "2", "--schedule", "interleaved-1f1b",
                                   "--virtual-stages", "2"], procs=2)
    assert_same_losses(metrics(tmp_path / "out"), metrics(tmp_path / "plain"), "interleaved-1f1b, v=2")


@pytest.mark.multiprocess
@slow
def test_two_machines_by_torchruns_c10d_rendezvous_train_the_same(tmp_path, law):
    """Two torchrun agents, one process each, meet at a c10d rendezvous on loopback (--nnodes 2)."""
    flags, want, _ = law
    port = zf.dist.free_port()
    rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "law"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc_per_node", "1", "-m", "recipes.gpt",
           *flags, "--zero", "2", "--out", str(tmp_path / "out")]
    agents = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = [a.communicate(timeout=600)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert sum("layout: 2 processes, dp=2" in o for o in outputs) == 1  # rank 0's machine alone tells it
    assert_same_losses(metrics(tmp_path / "out"), want, "two machines, --zero 2")


def test_metrics_jsonl_parses_and_loss_png_is_drawn(law):
    _, rows, out = law
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mb"} <= r.keys()
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and len(r["peak_mem_mb"]) == 1
        assert 0 <= r["cpu_cores"] <= os.cpu_count() * 1.05  # its CPU time over wall time, per log
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert read_png((out / "loss.png").read_bytes()).shape == (450, 720, 3)


def test_the_default_install_draws_loss_png_and_the_final_line_counts_busy_cores(tmp_path, text_file, capsys,
                                                                                  monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as a default install: importing it raises ImportError
    gpt.main(LAW + ["--data", str(text_file), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "loss.png" not in out  # drawn without a word
    assert re.search(rf"after 4 steps; [\d,]+ tokens/s on \d+\.\d\d of {torch.get_num_threads()} cores; elapsed", out)
    img = read_png((tmp_path / "loss.png").read_bytes())
    assert img.shape == (450, 720, 3) and near(img, plot.BLUE).sum() > 100 and near(img, plot.ORANGE).sum() > 50


def test_a_resumed_run_appends_to_the_log_from_its_checkpoint(tmp_path, law):
    flags, want, _ = law
    gpt.main(flags + ["--ckpt-every", "2", "--out", str(tmp_path)])
    (tmp_path / "ckpt" / "000004").rename(tmp_path / "moved")  # as if the run had died after step 2's save
    (tmp_path / "ckpt" / "latest").write_text("000002")
    gpt.main(flags + ["--resume", "--out", str(tmp_path)])
    assert_same_losses(metrics(tmp_path), want, "resumed")  # steps 1-4, each once


@pytest.mark.multiprocess
def test_resume_in_another_layout_and_number_of_processes(tmp_path, law):
    """ZeRO-2 on two processes, killed after step 2's checkpoint; resumed as one plain process."""
    flags, want, _ = law
    cli(tmp_path, flags + ["--zero", "2", "--ckpt-every", "2"], procs=2)
    (tmp_path / "ckpt" / "000004").rename(tmp_path / "moved")
    (tmp_path / "ckpt" / "latest").write_text("000002")
    result = gpt.main(flags + ["--resume", "--out", str(tmp_path)])
    assert_same_losses(metrics(tmp_path), want, "--zero 2 on 2 processes -> 1 process")
    mine = load_file(zf.checkpoint.export(result["checkpoint"], tmp_path / "resumed.safetensors"))
    theirs = load_file(zf.checkpoint.export(tmp_path / "moved", tmp_path / "straight.safetensors"))
    assert all(torch.allclose(mine[k], theirs[k], rtol=1e-5, atol=1e-6) for k in theirs)


def test_resume_into_an_offloaded_layout(tmp_path, law):
    flags, want, _ = law
    gpt.main(flags + ["--zero", "1", "--ckpt-every", "2", "--out", str(tmp_path)])
    (tmp_path / "ckpt" / "000004").rename(tmp_path / "moved")
    (tmp_path / "ckpt" / "latest").write_text("000002")
    gpt.main(flags + ["--resume", "--offload-optimizer", "cpu", "--out", str(tmp_path)])
    assert_same_losses(metrics(tmp_path), want, "--zero 1 -> --offload-optimizer cpu")


@pytest.mark.multiprocess
@slow
def test_resume_from_zero3_on_two_processes_to_a_pipeline_to_one_process(tmp_path, law):
    """Stage 3 on 2 ranks -> --pp 2 -> 1 process stage 0: the params of the run straight through."""
    flags, _, _ = law
    flags = [f for f in flags] + ["--ckpt-every", "2", "--keep-last", "3"]  # 2, 4 and 6 kept: the cuts go back
    flags[flags.index("--steps") + 1] = "6"
    straight = tmp_path / "straight"
    cli(straight, flags, procs=1)
    out = tmp_path / "moved"

    def cut_to(step):
        for p in (out / "ckpt").iterdir():
            if p.name.isdigit() and int(p.name) > step:
                shutil.rmtree(p)
        (out / "ckpt" / "latest").write_text(f"{step:06d}")

    cli(out, flags + ["--zero", "3"], procs=2)
    cut_to(2)
    cli(out, flags + ["--pp", "2", "--microbatches", "2", "--resume"], procs=2)
    cut_to(4)
    result = gpt.main(flags + ["--resume", "--out", str(out)])
    assert_same_losses(metrics(out), metrics(straight), "zero 3 x2 -> pp 2 -> 1 process")
    mine = load_file(zf.checkpoint.export(result["checkpoint"], tmp_path / "mine.safetensors"))
    theirs = load_file(zf.checkpoint.export(zf.checkpoint.latest(straight / "ckpt"), tmp_path / "theirs.safetensors"))
    assert all(torch.allclose(mine[k], theirs[k], rtol=1e-5, atol=1e-6) for k in theirs)


# ----------------------------------------------------------------------------- --deepspeed


def write_config(tmp_path: Path, config: dict, name="ds_config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("config, extra, layout", [
    (HF_ZERO2, [], "dp=2 pp=1, ZeRO 2, offload optimizer cpu params none"),
    (HF_ZERO3, ["--precision", "fp16"], "dp=2 pp=1, ZeRO 3, offload optimizer cpu params cpu"),
], ids=["hf-zero2-all-auto-cpu-optimizer", "hf-zero3-fp16-cpu-optimizer-and-params"])
def test_hugging_face_deepspeed_configs_train_the_recipe_on_two_processes(tmp_path, text_file, config, extra, layout):
    flags = LAW + ["--steps", "6", "--data", str(text_file), "--deepspeed", write_config(tmp_path, config), *extra]
    done = cli(tmp_path / "out", flags, procs=2)
    assert layout in done.stdout and done.stdout.count("model:") == 1
    assert "DeepSpeed keys have no meaning in zfunc and were ignored" in done.stdout  # the notice, once
    rows = metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[0]["lr"] == 0.0 and rows[-1]["lr"] > 0  # DeepSpeed's WarmupLR (log) from warmup_min_lr 0
    assert rows[-1]["loss"] < rows[0]["loss"] and all(math.isfinite(r["loss"]) for r in rows)
    if "--precision" in extra:
        assert all(r["loss_scale"] == 2.0**16 and not r["skipped"] for r in rows)


def _adagrad(c):
    c["optimizer"] = {"type": "Adagrad", "params": {"lr": 1e-3}}


def _stage_5(c):
    c["zero_optimization"]["stage"] = 5


def _batches_disagree(c):
    c.update(train_batch_size=10, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=1)


def _nvme_without_path(c):
    c["zero_optimization"]["offload_optimizer"] = {"device": "nvme"}


def _unknown_device(c):
    c["zero_optimization"]["offload_optimizer"] = {"device": "gpu"}


BAD_CONFIGS = [  # (change to HF's ZeRO-2 config, extra flags, the message)
    (_adagrad, [], "optimizer.type: Adagrad, a DeepSpeed optimizer zfunc does not have; zfunc maps Adam, AdamW, SGD, "
                "Lion, LAMB, OneBitAdam, ZeroOneAdam and OneBitLamb, got 'Adagrad'"),
    (_stage_5, [], "zero_optimization.stage: expected one of [0, 1, 2, 3], got 5"),
    (_batches_disagree, [], "train_batch_size=10, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=1, "
                            "world_size=1: expected train_batch_size = micro * accum * world_size = 3 * 1 * 1 = 3"),
    (_nvme_without_path, [], "zero_optimization.offload_optimizer.nvme_path: device 'nvme' needs the directory"),
    (_unknown_device, [], "zero_optimization.offload_optimizer.device: expected one of ['none', 'cpu', 'nvme'], "
                          "got 'gpu'"),
    (None, ["--zero", "1"], "--zero 1 contradicts zero_optimization.stage = 2 in --deepspeed"),
    (None, ["--offload-optimizer", "none"], "--offload-optimizer 'none' contradicts "
                                            "zero_optimization.offload_optimizer.device = 'cpu'"),
]


@pytest.mark.parametrize("change, extra, message", BAD_CONFIGS, ids=[m.split(":")[0][:40] for *_, m in BAD_CONFIGS])
def test_bad_deepspeed_configs_fail_before_training_naming_the_key(tmp_path, text_file, capsys, change, extra,
                                                                   message):
    config = json.loads(json.dumps(HF_ZERO2))
    if change is not None:
        change(config)
    err = exits_2(capsys, gpt.main, TINY + ["--data", str(text_file), "--out", str(tmp_path / "out"),
                                            "--deepspeed", write_config(tmp_path, config), *extra])
    assert message in err and "--deepspeed" in err
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_a_flag_contradicting_an_explicit_config_names_both_and_auto_takes_the_flags(tmp_path, text_file, capsys):
    explicit = dict(HF_ZERO2, gradient_accumulation_steps=2, train_batch_size="auto",
                    optimizer={"type": "AdamW", "params": {"lr": 1e-3, "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}},
                    scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": "auto"}})
    path = write_config(tmp_path, explicit)
    tiny = [f for i, f in enumerate(TINY) if "--lr" not in TINY[max(0, i - 1):i + 1]]  # --lr left at its default
    base = tiny + ["--data", str(text_file), "--out", str(tmp_path / "out"), "--deepspeed", path]
    err = exits_2(capsys, gpt.main, base + ["--accum", "4", "--lr", "0.02"])
    assert f"--accum 4 contradicts gradient_accumulation_steps = 2 in --deepspeed {path}" in err
    assert "--lr 0.02 contradicts optimizer.params.lr = 0.001" in err
    # flags left at their defaults yield to the config's explicit values, fill its "auto"s
    plan, args = layout.resolve(with_precision(parse_args(gpt.RECIPE, base + ["--weight-decay", "0.05"])), 1, gpt.UNITS,
                                notices=False)
    assert (args.accum, args.zero, args.offload_optimizer, plan.accum, plan.micro_batch) == (2, 2, "cpu", 2, 4)
    assert plan.optimizer_params["lr"] == 1e-3 and plan.optimizer_params["weight_decay"] == 0.05
    # an "auto" that must agree with an explicit value (Hugging Face's rule) names where autos come from
    del explicit["scheduler"]["params"]["warmup_max_lr"]
    explicit["scheduler"]["params"]["warmup_max_lr"] = "auto"
    err = exits_2(capsys, gpt.main, tiny + ["--data", str(text_file), "--out", str(tmp_path / "out"), "--deepspeed",
                                            write_config(tmp_path, explicit, "auto_lr.json")])
    assert "optimizer.params.lr: the config sets 0.001 and the auto value lr=0.003 differs" in err and "--lr" in err
    assert not (tmp_path / "out").exists()


LAYOUT_FLAGS = [  # (flags, world size, the message naming the flags)
    (["--microbatches", "2"], 1, "--microbatches (plan microbatches): pipeline microbatches need pp > 1"),
    (["--offload-params", "cpu", "--offload-optimizer", "cpu", "--zero", "1"], 1,
     "--offload-params (plan offload_params): offloading params needs ZeRO stage 3"),
    (["--remat-offload"], 1, "--remat-offload (plan remat_offload): offloads what remat keeps, so it needs remat=True"),
    (["--nvme-path", "/tmp/x"], 1, "--nvme-path (plan nvme_path): only 'nvme' offload uses it"),
    (["--offload-optimizer", "nvme"], 1, "--nvme-path (plan nvme_path): 'nvme' offload needs a directory"),
    (["--offload-params", "cpu"], 1, "--offload-params (plan offload_params): zf.offload keeps the optimizer state"),
    (["--accum", "3"], 1, "--batch-size: the global batch of 8 sequences must split over 1 data-parallel rank x 3 "
                          "accumulation steps; expected a multiple of 3"),
    (["--batch-size", "6"], 4, "--batch-size: the global batch of 6 sequences must split over 4 data-parallel ranks "
                               "x 1 accumulation steps; expected a multiple of 4"),
    (["--pp", "2"], 3, "--pp: 2 stages do not divide the 3 processes"),
    (["--sp", "2"], 3, "--sp: 2 ranks per replica (pp * sp) do not divide the 3 processes"),
    (["--sp", "2", "--pp", "2", "--microbatches", "2"], 4,
     "--zero (plan zero_stage): a pipeline over sp_size=2 ranks per stage reduces their grads through ZeRO stage 1"),
    (["--sp", "2", "--tp", "2", "--tp-sequence-parallel"], 4,
     "--tp-sequence-parallel (plan sp): Megatron's sequence parallelism of zf.tensor_parallel is not run with "
     "zf.sequence_parallel yet"),
    (["--pp", "2", "--microbatches", "2", "--virtual-stages", "2"], 2,
     "--virtual-stages (plan virtual_stages): more than one virtual stage per rank needs pipeline_schedule"),
    (["--pp", "2", "--accum", "2"], 2, "--accum (plan accum): a pipeline splits each batch into microbatches itself"),
    (["--pp", "2", "--microbatches", "3"], 2, "--batch-size: the global batch of 8 sequences must split over 1 "
                                              "data-parallel rank x 3 pipeline microbatches"),
    (["--deepspeed", "/no/such/ds.json"], 1, "--deepspeed: no DeepSpeed config file at '/no/such/ds.json'"),
]


@pytest.mark.parametrize("flags, world, message", LAYOUT_FLAGS, ids=[" ".join(f) for f, *_ in LAYOUT_FLAGS])
def test_layout_flags_that_cannot_work_are_named_before_anything_is_built(tmp_path, monkeypatch, flags, world,
                                                                         message):
    refused_before_built(tmp_path, monkeypatch, flags, world, message)


def test_help_states_the_global_batch_and_the_layout_flags(capsys):
    with pytest.raises(SystemExit):
        gpt.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "global batch: sequences per optimizer step, over all processes" in text
    for flag in ("--zero {0,1,2,3}", "--offload-optimizer {none,cpu,nvme}", "--offload-params {none,cpu,nvme}",
                 "--nvme-path", "--remat", "--remat-offload", "--pp", "--microbatches",
                 "--schedule {1f1b,gpipe,interleaved-1f1b,zero-bubble,zbv}", "--virtual-stages", "--deepspeed",
                 "--tile-lm-head", "--log-every"):
        assert flag in text, flag


def test_resume_may_change_the_layout_but_not_what_is_trained(tmp_path, text_file, capsys):
    flags = TINY + ["--eval-every", "0", "--data", str(text_file), "--out", str(tmp_path)]
    gpt.main(flags + ["--steps", "2"])
    capsys.readouterr()
    err = exits_2(capsys, gpt.main, flags + ["--steps", "4", "--resume", "--zero", "3", "--tile-lm-head", "2"])
    assert "--tile-lm-head: 0 in the checkpoint, 2 given" in err and "--zero" not in err
    result = gpt.main(flags + ["--steps", "3", "--resume", "--zero", "3", "--remat", "--accum", "2"])
    assert result["history"][-1][0] == 3


def test_a_padded_vocabulary_keeps_the_logits_and_the_flops_of_the_real_one(tmp_path, text_file):
    """vocab_multiple pads the embedding's rows (Megatron's make-vocab-size-divisible-by); the logits are
    vocab_size wide, the padded rows get no gradient from the loss, and MFU's FLOPs leave them out."""
    torch.manual_seed(0)
    plain = gpt.GPT(gpt.GPTConfig(vocab_size=61, block_size=8, n_layer=1, n_head=2, n_embd=16))
    padded = gpt.GPT(gpt.GPTConfig(vocab_size=61, block_size=8, n_layer=1, n_head=2, n_embd=16, vocab_multiple=64))
    assert padded.wte.weight.shape == (64, 16) and padded.lm_head.weight is padded.wte.weight
    assert padded.flops_per_token(8) == plain.flops_per_token(8)
    x = torch.randint(0, 61, (2, 8))
    logits = padded(x)
    assert logits.shape == (2, 8, 61)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    assert not padded.wte.weight.grad[61:].any() and padded.wte.weight.grad[:61].any()
    argv = TINY + ["--steps", "2", "--data", str(text_file), "--out"]
    extra = (gpt.main(argv + [str(tmp_path / "padded"), "--vocab-multiple", "100"])["n_params"]
             - gpt.main(argv + [str(tmp_path / "plain")])["n_params"])
    assert extra == (300 - 256) * 32  # bytes: 256 ids, padded to 300 rows of --n-embd 32


def test_vocab_multiple_below_one_is_refused(capsys):
    assert "--vocab-multiple" in exits_2(capsys, gpt.main, TINY + ["--vocab-multiple", "0"])


def test_compile_compiles_each_block_in_place_and_trains(tmp_path, text_file, monkeypatch):
    """--compile: every unit (Block) goes through nn.Module.compile before the model is functionalized
    (recorded here; compiling itself is torch's, checked on a GPU by benchmarks/gpu.py), and training runs."""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(type(self).__name__))
    out = gpt.main(TINY + ["--steps", "2", "--data", str(text_file), "--out", str(tmp_path), "--compile"])
    assert compiled == ["Block"] and math.isfinite(out["train_loss"])  # TINY: one layer


def test_compile_refuses_layouts_that_move_or_wrap_the_units(capsys, text_file, tmp_path):
    err = exits_2(capsys, gpt.main, TINY + ["--steps", "1", "--data", str(text_file), "--out", str(tmp_path),
                                            "--compile", "--remat"])
    assert "--compile: not with --remat" in err
