"""The benchmarks' command lines refuse bad numbers naming the flag, before anything is built."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.recipe_runs import exits_2  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--world", "0"], "--world: expected ints >= 1, got [0]"),
    (["--rounds", "-1"], "--rounds: expected ints >= 1, got -1"),
    (["--batch", "0"], "--batch: expected ints >= 1, got 0"),
    (["--kinds", "disk"], "--kinds: expected a comma-separated subset of cpu,nvme,nvme-opt, got 'disk'"),
])
def test_offload_peers_refuses_bad_flags(capsys, monkeypatch, argv, message):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what the benchmark sets on import, undone after the test
    from benchmarks import offload_peers

    assert message in exits_2(capsys, offload_peers.main, argv)


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds: expected an int >= 1, got 0"),
    (["--world", "-1"], "--world: expected an int >= 1, got -1"),
    (["--batch", "0"], "--batch: expected an int >= 1, got 0"),
    (["--processes", "mine"], "argument --processes: invalid choice: 'mine'"),
])
def test_shard_refuses_bad_flags(capsys, argv, message):
    from benchmarks import shard

    assert message in exits_2(capsys, shard.main, argv)


@pytest.mark.parametrize("argv, message", [
    (["--stages", "0,4"], "--stages: expected a comma-separated subset of 0,1,2,3, got '0,4'"),
    (["--dim", "6"], "--dim: expected an int >= 1 and a multiple of 4 (4 heads), got 6"),
    (["--rounds", "0"], "--rounds: expected an int >= 1, got 0"),
])
def test_zero_cpu_refuses_bad_flags(capsys, argv, message):
    from benchmarks import zero_cpu

    assert message in exits_2(capsys, zero_cpu.main, argv)


@pytest.mark.parametrize("argv, message", [
    (["--mb", "abc"], "--mb: expected comma-separated sizes in MB, each > 0, got 'abc'"),
    (["--mb", "1,0"], "--mb: expected comma-separated sizes in MB, each > 0, got '1,0'"),
    (["--mb", "nan"], "--mb: expected comma-separated sizes in MB, each > 0, got 'nan'"),
    (["--world", "1"], "--world: expected an int >= 2, got 1"),
    (["--reps", "0"], "--reps: expected an int >= 1, got 0"),
])
def test_collectives_refuses_bad_flags(capsys, argv, message):
    from benchmarks import collectives

    assert message in exits_2(capsys, collectives.main, argv)
