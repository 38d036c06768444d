"""The code's house rules a linter checks: lines at most 120 columns, and pyflakes' findings (unused
imports and variables, undefined names), over zfunc/, recipes/, benchmarks/ and tests/ (pyproject.toml's
``[tool.ruff]``)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.multiprocess  # ruff is a program of its own
def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="the linter is in the test extra: pip install -e '.[test]'")
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "zfunc", "recipes", "benchmarks", "tests"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"ruff check found problems:\n{run.stdout}{run.stderr}"
