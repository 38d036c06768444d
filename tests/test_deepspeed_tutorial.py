"""DeepSpeed's getting-started loop, run with ``import zfunc.deepspeed as deepspeed`` under torchrun,
equals real DeepSpeed: each rank's loss per microbatch within 1e-5 for 5 updates, on 1 and 2
processes, with a ZeRO-2 + CPU-offload config and a ZeRO-3 config; a run resumed from its
checkpoint (saved with ``client_state`` after update 3) continues them.

DeepSpeed's losses are recorded in ``fixtures/deepspeed_tutorial_losses.json``
(``fixtures/make_deepspeed_tutorial_losses.py``), so the check runs without DeepSpeed; where
DeepSpeed is installed, ``test_recorded_losses_are_deepspeeds`` runs it again and compares.
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
import make_deepspeed_tutorial_losses as maker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads(maker.FIXTURE.read_text())
ZFUNC_ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}


def assert_same(got: list[dict], want: list[dict], what: str, skip: int = 0) -> None:
    assert len(got) == len(want), what
    for rank, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(w["losses"][skip:]), rtol=0, atol=1e-5,
                                   msg=f"{what}, rank {rank}: losses")
        torch.testing.assert_close(torch.tensor(g["lr"]), torch.tensor(w["lr"][skip:], dtype=torch.float32),
                                   rtol=1e-6, atol=0, msg=f"{what}, rank {rank}: lr")


SLOW = pytest.mark.slow  # the same law again on one process (tests/test_deepspeed_engine.py checks it in-process)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,nproc", [("zero2_offload", 2), ("zero3", 2),
                                        pytest.param("zero2_offload", 1, marks=SLOW),
                                        pytest.param("zero3", 1, marks=SLOW)])
def test_tutorial_equals_deepspeed_and_resumes(tmp_path, name, nproc):
    """DeepSpeed's recorded losses; on 2 processes, the run resumed from update 3 continues them."""
    config = RECORDED["configs"][name]
    want = RECORDED["runs"][f"{name}/{nproc}"]
    ckpt = tmp_path / "ckpt"
    got = maker.run("zfunc", config, nproc, tmp_path, "--save_dir", str(ckpt), "--save_at", "3", env=ZFUNC_ENV)
    assert_same(got, want, f"{name} on {nproc} processes")
    assert (ckpt / "latest").read_text().strip() == "step5"  # the tag names the microbatch it was saved after
    if nproc == 2:
        resumed = maker.run("zfunc", config, nproc, tmp_path, "--load_dir", str(ckpt), env=ZFUNC_ENV)
        assert all(r["start"] == 6 for r in resumed)  # client_state came back
        assert_same(resumed, want, f"{name} on {nproc} processes, resumed after update 3", skip=6)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(maker.CONFIGS))
def test_recorded_losses_are_deepspeeds(tmp_path, name):
    """Real DeepSpeed (CPU accelerator) gives the recorded losses on 2 processes."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin in (None, "namespace"):  # fixtures/deepspeed/ (on the path) is data, not DeepSpeed
        pytest.skip("DeepSpeed is not installed")
    got = maker.run("deepspeed", RECORDED["configs"][name], 2, tmp_path, env={"DS_ACCELERATOR": "cpu"})
    assert_same(got, RECORDED["runs"][f"{name}/2"], f"DeepSpeed {name}")
