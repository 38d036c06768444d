"""What the tests that run the recipes as a user would (their command line, torchrun) share: the
repository ``ROOT`` and a child Python's path to it (``checkout_pythonpath``), the ``TINY`` GPT flags, a
refused command line (``exits_2``, ``refused_before_built``), reading ``OUT/metrics.jsonl``, comparing
losses, and Hugging Face's DeepSpeed test configs (``HF_ZERO2``, ``HF_ZERO3``)."""
import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def checkout_pythonpath() -> str:
    """``PYTHONPATH`` for a child Python that must import this checkout's zfunc, installed or not:
    ``ROOT`` first, then the session's own ``PYTHONPATH`` where it has one (no empty entry)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
        "--batch-size", "8", "--lr", "1e-2", "--warmup", "5", "--eval-batches", "2",
        "--sample-len", "16", "--seed", "0"]


def exits_2(capsys, main, argv: list[str]) -> str:
    """Run the command line ``main(argv)``: it must exit with status 2 before building anything (no
    ``model:`` line); returns stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and "model:" not in out, (out, err)
    return err


def refused_before_built(tmp_path, monkeypatch, flags: list[str], world: int, message: str) -> None:
    """``TINY`` GPT with ``flags`` under ``world`` processes is refused by ``check_args`` with ``message``
    before anything is made (no ``--out``)."""
    import re

    from recipes import gpt
    from recipes.cli import check_args, parse_args
    from recipes.layout import FlagError

    if world > 1:  # as torchrun would set it; check_args reads it, nothing joins a process group
        monkeypatch.setenv("WORLD_SIZE", str(world))
    args = parse_args(gpt.RECIPE, TINY + flags + ["--out", str(tmp_path / "out")])
    with pytest.raises(FlagError, match=re.escape(message)):
        check_args(gpt.RECIPE, args)
    assert not (tmp_path / "out").exists()


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_losses(rows: list[dict], want: list[dict], what: str) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in want], what
    for key in ("loss", "val_loss"):
        got, ref = [r[key] for r in rows if key in r], [r[key] for r in want if key in r]
        assert len(got) == len(ref) and got, (what, key)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0, msg=f"{what}: {key}")


# Hugging Face's DeepSpeed test configs (transformers' tests/deepspeed/ds_config_zero{2,3}.json)
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
