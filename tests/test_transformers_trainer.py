"""zfunc.integrations.transformers: a transformers.Trainer user changes the import and trains through zfunc.

The law: a tiny GPT-2 with Hugging Face's ZeRO-2 "auto" config (``recipe_runs.HF_ZERO2``: AdamW,
WarmupLR, optimizer offload) logs the losses (and grad norms, learning rates) of the plain Trainer
running the same optimizer and schedule, within 1e-4 for 5 updates, with gradient accumulation, on
1 process and on 2; a run resumed from its step-3 checkpoint continues them.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
import hf_trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECORDED = Path(__file__).resolve().parent / "fixtures" / "hf_trainer_plain_2ranks.json"


def assert_same_logs(got, want, what):
    assert [r[0] for r in got] == [r[0] for r in want], what
    for col, name in ((1, "loss"), (2, "grad_norm"), (3, "learning_rate")):
        torch.testing.assert_close(torch.tensor([r[col] for r in got]), torch.tensor([r[col] for r in want]),
                                   rtol=0, atol=1e-4, msg=f"{what}: {name}")


def test_trainer_logs_the_plain_trainers_losses_and_resumes(tmp_path):
    plain = hf_trainer.train("plain", str(tmp_path / "plain"))
    got = hf_trainer.train("zfunc", str(tmp_path / "zfunc"), save_steps=3)
    assert len(got) == 5
    assert_same_logs(got, plain, "1 process")
    assert (tmp_path / "zfunc" / "checkpoint-3" / "zfunc" / "manifest.json").is_file()
    shutil.rmtree(tmp_path / "zfunc" / "checkpoint-5")  # resume_from_checkpoint=True takes the latest left
    resumed = hf_trainer.train("zfunc", str(tmp_path / "zfunc"), resume=True)
    assert_same_logs(resumed, plain, "1 process, resumed from checkpoint-3")


def test_save_model_writes_the_trained_weights(tmp_path):
    from safetensors.torch import load_file
    from zfunc.integrations.transformers import Trainer, TrainingArguments

    model = hf_trainer.model()
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=hf_trainer.HF_ZERO2, per_device_train_batch_size=2,
                             gradient_accumulation_steps=1, max_steps=2, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, learning_rate=1e-2)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids],
                      eval_dataset=[{"input_ids": x, "labels": x} for x in ids[:4]])
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    state = trainer.zfunc_engine.state
    name = "transformer.h.0.mlp.c_fc.weight"
    torch.testing.assert_close(saved[name], state.params[name])
    assert "eval_loss" in trainer.evaluate()


def test_refusals_name_what(tmp_path):
    from zfunc.integrations.transformers import Trainer, TrainingArguments
    import transformers

    out = str(tmp_path / "out")  # the Trainer makes its output folder: not in the checkout
    with pytest.raises(ValueError, match="zfunc.integrations.transformers.TrainingArguments"):
        Trainer(model=hf_trainer.model(), args=transformers.TrainingArguments(out, use_cpu=True, report_to=[]))
    with pytest.raises(NotImplementedError, match="label_smoothing_factor"):
        Trainer(model=hf_trainer.model(), args=TrainingArguments(out, deepspeed=hf_trainer.HF_ZERO2, use_cpu=True,
                                                                 report_to=[], label_smoothing_factor=0.1))


@pytest.mark.multiprocess
def test_two_processes_log_the_plain_trainers_losses(tmp_path):
    """2 torchrun ranks (gloo): the plain Trainer's losses, recorded by ``test_record_plain_two_ranks``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    got = _torchrun("zfunc", tmp_path / "z", env)
    want = json.loads(RECORDED.read_text())
    for rank in range(2):
        assert_same_logs(got[rank], want[rank], f"2 processes, rank {rank}")


def _torchrun(impl, out, env, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(hf_trainer.__file__)), "--impl", impl, "--out", str(out), *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"losses.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_record_plain_two_ranks(tmp_path):
    """The plain Trainer on 2 ranks gives the recorded losses (rewrite them with ZFUNC_RECORD=1)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    got = _torchrun("plain", tmp_path / "p", env)
    if os.environ.get("ZFUNC_RECORD"):
        RECORDED.write_text(json.dumps(got) + "\n")
    assert_same_logs(got[0], json.loads(RECORDED.read_text())[0], "plain Trainer, 2 processes")
