"""step_cpu's own-process layout: each trainer steps in a process of its own, paired with the others
(the module docstring of benchmarks/step_cpu.py)."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_cpu.py"


def _run(*flags: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "1e4", "--rounds", "2", "--steps", "2",
                           "--offload-params", "0", "--no-deepspeed", "--grad-norm", "on", "--threads", "1",
                           *flags], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.multiprocess
def test_own_processes_pair_zfunc_with_each_peer():
    out = _run("--processes", "own")
    assert ("each trainer in a process of its own, torch's huge pages zfunc (grad norm on): off, "
            "torch AdamW(fused=True): off") in out
    assert "vs torch AdamW(fused=True)" in out and "speedup" in out
