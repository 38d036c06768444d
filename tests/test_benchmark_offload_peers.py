"""offload_peers' DeepSpeed configs put on NVMe what each row names (the module docstring of
benchmarks/offload_peers.py): the params only where DeepSpeed's swapper takes them."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.gpt import GPT, GPTConfig  # noqa: E402


@pytest.fixture
def peers(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what the benchmark sets on import, undone after the test
    from benchmarks import offload_peers

    return offload_peers


def gpt(n_embd: int) -> GPT:
    return GPT(GPTConfig(n_layer=1, n_head=4, n_embd=n_embd, block_size=16))


def test_cpu_row_offloads_the_optimizer_at_stage_2(peers, tmp_path):
    zero = peers.deepspeed_config("cpu", 8, tmp_path, gpt(64), 2)["zero_optimization"]
    assert zero == {"stage": 2, "offload_optimizer": {"device": "cpu"}}


def test_nvme_opt_row_keeps_the_params_in_ram(peers, tmp_path):
    zero = peers.deepspeed_config("nvme-opt", 8, tmp_path, gpt(64), 2)["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_param"] == {"device": "cpu"}


@pytest.mark.parametrize("n_embd, world, prefetch_off", [(64, 2, False), (512, 2, True), (512, 8, False)])
def test_nvme_row_asks_deepspeed_to_swap_every_param_it_can(peers, tmp_path, n_embd, world, prefetch_off):
    model = gpt(n_embd)
    zero = peers.deepspeed_config("nvme", 8, tmp_path, model, world)["zero_optimization"]
    sizes = [p.numel() for p in model.parameters()]
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": str(tmp_path / "deepspeed-nvme"),
                                     "max_in_cpu": 0, "buffer_count": len(sizes), "buffer_size": max(sizes)}
    # the prefetch goes only where a partition reaches the swapper's 1 MiB (512 x 2048 fp32 over 2 ranks: 2 MiB)
    assert (zero.get("stage3_prefetch_bucket_size") == 0) is prefetch_off


def test_keep_given_dtype_gives_zero_init_the_dtype_it_is_given(peers, monkeypatch):
    # the module itself: another test may have left a stand-in ``deepspeed`` in sys.modules
    Init = pytest.importorskip("deepspeed.runtime.zero.partition_parameters").Init

    original = Init._set_dtype
    monkeypatch.setattr(Init, "_set_dtype", original)  # put back after the test
    peers.keep_given_dtype()
    wrapped = Init._set_dtype
    peers.keep_given_dtype()  # twice: still one wrapper
    assert Init._set_dtype is wrapped is not original
    init = object.__new__(Init)
    Init._set_dtype(init, None, torch.float32)
    assert init.dtype is torch.float32
