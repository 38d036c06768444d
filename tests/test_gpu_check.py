"""benchmarks/gpu_check.sh --dry-run: the GPU check's stages run here without CUDA (wheels listed, the
environment recorded, the GPU tests collected, benchmarks/gpu.py's every figure at toy sizes on the CPU)
and write what the real run writes."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_the_dry_run_checks_every_stage_and_writes_the_results(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_NVRTC": "0"}  # NVRTC: tests/test_gpu_compile.py
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    for name in ("check.log", "env.txt", "pytest.log", "gpu.json", "gpu.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert doc["dry_run"] is True
    figures = doc["figures"]
    assert set(figures) >= {"copy_bandwidth", "adamw", "bf16_one_pass", "grad_norm", "gpt_125M", "gpt_1.3B",
                            "zfunc_vs_torch", "offload_largest", "plain_largest", "offload_optimizer_largest"}
    assert [k for k, v in figures.items() if "error" in v or "skipped" in v] == []
    assert figures["adamw"]["10M"]["zfunc"] == "needs CUDA"  # the kernels are not timed without a GPU
    assert figures["gpt_125M"]["tokens_per_s"] > 0
    for name in ("offload_largest", "plain_largest", "offload_optimizer_largest"):
        assert figures[name]["largest"] == "debug", (name, figures[name])
    assert figures["offload_optimizer_largest"]["params"] is None
    assert "tests/test_gpu_kernels.py" in (tmp_path / "check.log").read_text()  # among the files collected
    assert "zfunc GPU figures" in (tmp_path / "gpu.txt").read_text()


@pytest.mark.multiprocess
def test_the_adam_host_split_needs_a_gpu_and_says_so():
    import sys

    script = ROOT / "benchmarks" / "gpu_adam_host.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "usage: python benchmarks/gpu_adam_host.py LABEL" in done.stderr
