"""--tp on the recipes: ``torchrun --nproc_per_node 4 -m recipes.llama --tp 2 --zero 1`` trains as one process
does (OUT/metrics.jsonl: losses and val losses within 1e-5, fp32), its checkpoint resumes in one process, and
--tp flags that cannot work are named before anything is built."""
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


TP_FLAGS = [  # (flags, world size, the message naming the flags)
    (["--tp", "3"], 4, "--tp: 3 ranks per replica (tp) do not divide the 4 processes"),
    (["--tp", "2", "--sp", "2"], 2, "--sp, --tp: 4 ranks per replica (sp * tp) do not divide the 2 processes"),
    (["--tp", "0"], 1, "--tp: expected an int >= 1, got 0"),
    (["--tp", "2", "--tile-lm-head", "2"], 2, "--tile-lm-head (plan tile_lm_head): a tiled LM head under tensor"),
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
