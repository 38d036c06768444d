"""recipes/refusal.py: under torchrun a refusal is said once, by rank 0, and every rank leaves with
status 2; another rank says its own refusal where rank 0's differs (or rank 0 passed), and a launcher
without torchrun's agent store hears every rank."""
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from recipes import gpt, refusal
from tests.recipe_runs import ROOT

STEPS_0 = "python -m recipes.gpt: error: --steps: expected an int >= 1, got 0"


@pytest.fixture
def agent_store(monkeypatch):
    """A store standing in for torchrun's agent's, and a 2-process job's environment around it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="test", TORCHELASTIC_RESTART_COUNT="0")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return store


def as_rank(monkeypatch, r: int) -> None:
    monkeypatch.setenv("RANK", str(r))
    monkeypatch.setenv("LOCAL_RANK", str(r))


def leaves(capsys, argv) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        gpt.main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.mark.parametrize("argv, said", [(["--steps", "0"], STEPS_0),
                                        (["--zero", "7"], "argument --zero: invalid choice: 7")],
                         ids=["flag check", "argparse"])
def test_rank_0_says_the_refusal_and_another_rank_refusing_the_same_says_nothing(argv, said, agent_store, capsys,
                                                                                monkeypatch, tmp_path):
    argv = argv + ["--out", str(tmp_path)]
    agent_store.add(refusal._key("arrived", "check"), 1)  # rank 1 has arrived: rank 0 need not wait for it
    as_rank(monkeypatch, 0)
    code, out, err = leaves(capsys, argv)
    assert code == 2 and said in err and err.count("error:") == 1 and out == ""
    as_rank(monkeypatch, 1)
    assert leaves(capsys, argv) == (2, "", "")


def test_help_is_printed_by_rank_0_alone(agent_store, capsys, monkeypatch):
    as_rank(monkeypatch, 1)
    assert leaves(capsys, ["--help"]) == (0, "", "")
    as_rank(monkeypatch, 0)
    code, out, _ = leaves(capsys, ["--help"])
    assert code == 0 and "--dry-run" in out


def test_a_rank_whose_refusal_rank_0_did_not_share_says_it_with_its_rank(agent_store, capsys, monkeypatch, tmp_path):
    as_rank(monkeypatch, 0)
    refusal.checked()  # rank 0's flags passed (its --data exists there)
    as_rank(monkeypatch, 1)
    code, _, err = leaves(capsys, ["--data", str(tmp_path / "missing"), "--out", str(tmp_path)])
    assert code == 2 and err.startswith("rank 1: python -m recipes.gpt: error: --data: path")


def test_a_rank_that_hears_nothing_from_rank_0_says_its_refusal(agent_store, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(refusal, "WAIT_S", 0.2)
    as_rank(monkeypatch, 1)
    code, _, err = leaves(capsys, ["--steps", "0", "--out", str(tmp_path)])
    assert code == 2 and f"rank 1: {STEPS_0}" in err


def test_without_an_agent_store_every_rank_says_its_refusal(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    as_rank(monkeypatch, 1)
    code, _, err = leaves(capsys, ["--steps", "0", "--out", str(tmp_path)])
    assert code == 2 and err == f"rank 1: {STEPS_0}\n"


@pytest.mark.multiprocess
def test_a_bad_flag_under_torchrun_is_said_once_and_every_rank_exits_2(tmp_path):
    """Two ranks under torchrun, a flag refused before anything is built: the refusal appears once in
    torchrun's combined output, and its summary lists both ranks with exit status 2 (whether or not
    torchrun's SIGTERM reached the later rank before it left: its handler leaves with 2 too)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "recipes.gpt", "--steps", "0", "--out", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    both = done.stdout + done.stderr
    assert done.returncode != 0 and both.count("--steps: expected an int >= 1, got 0") == 1, both
    assert both.count("exitcode  : 2 ") == 2 and "exitcode  : -" not in both, both
    assert not (tmp_path / "out").exists()
