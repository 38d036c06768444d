"""recipes/layout.py: torchrun's environment is read as ints in range, named when not."""
import pytest

from recipes import layout


@pytest.mark.parametrize("env, launch", [
    ({}, layout.Launch(1, 0, 0)),
    ({"WORLD_SIZE": "2"}, layout.Launch(2, 0, 0)),
    ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}, layout.Launch(4, 3, 1)),
])
def test_the_launch_is_torchruns_environment(monkeypatch, env, launch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert layout.Launch.from_env() == launch


@pytest.mark.parametrize("env", [
    {"WORLD_SIZE": "0"}, {"WORLD_SIZE": "-2"}, {"WORLD_SIZE": "2", "RANK": "2"}, {"WORLD_SIZE": "2", "RANK": "-1"},
    {"WORLD_SIZE": "2", "LOCAL_RANK": "-1"},
])
def test_an_environment_out_of_range_is_refused_naming_the_variables(monkeypatch, env):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    shown = ", ".join(f"{k}={env.get(k, '0')}" for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
    with pytest.raises(layout.FlagError, match=f"expected WORLD_SIZE >= 1 and RANK, LOCAL_RANK in \\[0, WORLD_SIZE\\), "
                                               f"got {shown}"):
        layout.Launch.from_env()


@pytest.mark.parametrize("launch, given, device", [
    (layout.Launch(1, 0, 0), "cuda", "cuda:0"),  # torch.cuda.set_device refuses a bare "cuda"
    (layout.Launch(4, 3, 1), "cuda", "cuda:1"),
    (layout.Launch(4, 3, 1), "cuda:0", "cuda:0"),
    (layout.Launch(2, 1, 1), "cpu", "cpu"),
])
def test_a_bare_cuda_device_is_this_ranks_gpu_with_its_index(launch, given, device):
    import torch

    assert launch.device(given) == torch.device(device)
