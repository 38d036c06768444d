"""recipes/gpt.py: the model, the data, and a tiny training run through zfunc."""
import math

import pytest
import torch
from safetensors.torch import load_file

import zfunc as zf
from recipes import gpt

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
        "--batch-size", "8", "--lr", "1e-2", "--warmup", "5", "--eval-batches", "2",
        "--sample-len", "16", "--seed", "0"]


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
    resumed = gpt.main(flags + ["--resume"])["checkpoint"]
    again = load_file(zf.checkpoint.export(resumed, tmp_path / "resumed.safetensors"))
    assert all(torch.equal(again[k], saved[k]) for k in saved)


def test_resume_without_a_checkpoint_says_so(tmp_path, text_file):
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint under"):
        gpt.main(TINY + ["--steps", "2", "--data", str(text_file), "--out", str(tmp_path), "--resume"])


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


def test_missing_or_empty_data_path_names_it(tmp_path):
    missing = tmp_path / "no_such_corpus"
    with pytest.raises(FileNotFoundError, match="no_such_corpus"):
        gpt.main(["--data", str(missing), "--steps", "1"])
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
