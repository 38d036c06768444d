"""recipes/gpt.py: the model, the data, a tiny training run through zfunc, and its flags checked."""
import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file

import zfunc as zf
from recipes import gpt

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
        "--batch-size", "8", "--lr", "1e-2", "--warmup", "5", "--eval-batches", "2",
        "--sample-len", "16", "--seed", "0"]


def exits_2(capsys, argv) -> str:
    """Run the command line: it must exit with status 2 before building anything; returns stderr."""
    with pytest.raises(SystemExit) as exc:
        gpt.main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and "model:" not in out, (out, err)
    return err


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog.\n" * 400)
    return path


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
    assert "--resume: no checkpoint under" in exits_2(capsys, TINY + ["--steps", "2", "--data", str(text_file),
                                                                      "--out", str(tmp_path), "--resume"])


def test_generate_returns_the_asked_number_of_bytes():
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)
    model = gpt.GPT(cfg).eval()
    out = gpt.generate(model, b"a prompt longer than the block", 20, cfg.block_size,
                       generator=torch.Generator().manual_seed(0))
    assert isinstance(out, bytes) and len(out) == 20
    again = gpt.generate(model, b"a prompt longer than the block", 20, cfg.block_size,
                         generator=torch.Generator().manual_seed(0))
    assert again == out
    assert gpt.generate(model, b"", 0, cfg.block_size) == b""


def test_default_corpus_loads_and_splits_deterministically():
    a, b = gpt.load_corpus(), gpt.load_corpus()
    assert a.n_files > 100 and "stdlib" in a.source
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    total = len(a.train) + len(a.val)
    assert total <= gpt.MAX_CORPUS_BYTES + a.n_files  # + the separators
    assert 0.03 < len(a.val) / total < 0.25
    assert b"def " in bytes(a.val[:100_000].tolist())
    assert 2.5 < gpt.unigram_entropy(a.val) < math.log(256)


def test_folder_is_split_by_file_and_single_file_by_position(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_bytes(f"file {i} ".encode() * 100)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01" * 500)  # binary: skipped
    corpus = gpt.load_corpus(tmp_path)
    assert corpus.n_files == 40
    val = bytes(corpus.val.tolist())
    val_names = {f"f{i:02d}.txt" for i in range(40) if gpt._is_val(f"f{i:02d}.txt")}
    for i in range(40):
        assert (f"file {i} ".encode() in val) == (f"f{i:02d}.txt" in val_names)
    single = gpt.load_corpus(tmp_path / "f00.txt")
    assert len(single.val) == len(b"file 0 ") * 100 // 10 and single.n_files == 1


def test_missing_or_empty_data_path_names_it(tmp_path, capsys):
    missing = tmp_path / "no_such_corpus"
    err = exits_2(capsys, ["--data", str(missing), "--steps", "1", "--out", str(tmp_path)])
    assert f"--data: path {str(missing)!r} does not exist" in err
    with pytest.raises(FileNotFoundError, match="no_such_corpus"):
        gpt.load_corpus(missing)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty_dir"):
        gpt.load_corpus(empty)


def test_get_batch_targets_are_inputs_shifted_by_one():
    data = torch.arange(100, dtype=torch.uint8)
    x, y = gpt.get_batch(data, 4, 10, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 10) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))
    with pytest.raises(ValueError, match="block_size=200"):
        gpt.get_batch(data, 4, 200)


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
    args = gpt.parse_args(flags + ["--out", str(tmp_path / "out")])
    with pytest.raises(gpt.FlagError, match=re.escape(message)):
        gpt.check_args(args)
    assert not (tmp_path / "out").exists()  # values are checked before --out is created


def test_bad_flags_exit_2_all_named_before_anything_is_built(tmp_path, capsys):
    err = exits_2(capsys, ["--batch-size", "0", "--ckpt-every", "-1", "--keep-last", "0", "--out", str(tmp_path)])
    assert "--batch-size: expected" in err and "--ckpt-every: expected" in err and "--keep-last: expected" in err


def test_an_unwritable_out_is_found_before_the_data_is_loaded(tmp_path, text_file, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    err = exits_2(capsys, TINY + ["--data", str(text_file), "--out", str(blocker / "run")])
    assert "--out: cannot write checkpoints under" in err and "a_file" in err
    assert gpt.check_args(gpt.parse_args(["--out", str(tmp_path / "new" / "run")])) is None
    assert (tmp_path / "new" / "run" / "ckpt").is_dir() and not any((tmp_path / "new" / "run" / "ckpt").iterdir())


def test_a_block_size_the_data_cannot_fill_is_found_before_the_model(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_bytes(b"0123456789" * 20)  # val: the last 20 bytes
    err = exits_2(capsys, TINY + ["--data", str(small), "--out", str(tmp_path)])
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
    err = exits_2(capsys, flags + ["--steps", "4", "--resume", "--n-layer", "2", "--lr", "2e-2"])
    assert "--n-layer: 1 in the checkpoint, 2 given" in err and "--lr: 0.01 in the checkpoint, 0.02 given" in err
    assert "--steps:" not in err and "--eval-every" not in err
    err = exits_2(capsys, flags + ["--steps", "4", "--resume", "--data", str(tmp_path / "ckpt" / "latest")])
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
        err = exits_2(capsys, flags + ["--steps", steps, "--resume"])
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
