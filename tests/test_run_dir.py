"""recipes/rundir.py and the loop around it: one run at a time in an --out (a second is refused naming the
holder; a lock a killed run left blocks nothing), a previous run is never overwritten (refused, or moved
aside whole by --overwrite), --dry-run creates nothing in OUT, and a torn OUT/metrics.jsonl is repaired on
--resume with its unreadable lines set aside."""
import json
import os
import shlex
import signal
import subprocess
import sys
import warnings

import pytest

from recipes import gpt, llama, rundir, watch
from tests.recipe_runs import ROOT, TINY, exits_2

WATCH = dict(flops_per_token=0.0, peak_flops=None, world=1)


def a_finished_run(out):
    """What a run leaves in OUT: its log, its plot, its checkpoints under one ``latest``."""
    (out / "ckpt" / "000004").mkdir(parents=True)
    (out / "ckpt" / "000004" / "manifest.json").write_text("{}")
    (out / "ckpt" / "latest").write_text("000004")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 5)))
    (out / "loss.png").write_bytes(b"\x89PNG old")
    (out / "tokens").mkdir(exist_ok=True)  # the token cache: shared by every run into OUT, never moved
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and "tokens" not in p.parts}


# ----------------------------------------------------------------------------- the lock
def test_a_second_run_into_a_locked_out_is_refused_naming_the_holder(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    with rundir.acquire(out):  # as a run in progress holds it
        record = json.loads((out / rundir.LOCK).read_text())
        assert record["pid"] == os.getpid() and record["command"] == shlex.join(sys.orig_argv)
        err = exits_2(capsys, gpt.main, TINY + ["--steps", "1", "--data", str(text_file), "--out", str(out)])
        assert f"--out: {str(out)!r} is in use by another run: pid {os.getpid()}" in err
        assert shlex.join(sys.orig_argv) in err and "another --out" in err
        assert not (out / "metrics.jsonl").exists()
        with pytest.raises(rundir.RunDirError, match=f"pid {os.getpid()}"):
            rundir.acquire(out)  # refused within one process too: each acquire is its own open file
    with rundir.acquire(out) as lock:  # released: free again
        assert lock.path == out / rundir.LOCK
    assert (out / rundir.LOCK).read_text() == ""  # a released lock names no holder


HOLD = """
import sys, time
from pathlib import Path
from recipes import rundir
lock = rundir.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.multiprocess
def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path):
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(rundir.RunDirError, match=f"pid {child.pid} on "):
            rundir.acquire(out)
    finally:
        child.send_signal(signal.SIGKILL)  # the kernel releases its flock; the file stays, naming it
        child.wait(timeout=30)
    assert json.loads((out / rundir.LOCK).read_text())["pid"] == child.pid
    with rundir.acquire(out):
        assert json.loads((out / rundir.LOCK).read_text())["pid"] == os.getpid()


# ----------------------------------------------------------------------------- a previous run
def test_a_previous_run_is_refused_then_moved_aside_whole_by_overwrite(tmp_path):
    out = tmp_path / "out"
    old = a_finished_run(out)
    with pytest.raises(rundir.RunDirError) as refused:
        rundir.claim(out, resume=False, overwrite=False)
    message = str(refused.value)
    assert f"--out: {str(out)!r} holds a previous run (ckpt, loss.png, metrics.jsonl)" in message
    assert "--resume" in message and "--overwrite" in message and "another --out" in message
    assert rundir.acquire(out).release() is None  # the refusal let go of the lock
    with rundir.claim(out, resume=True, overwrite=False) as lock:  # --resume continues it in place
        assert lock.moved is None
    with rundir.claim(out, resume=False, overwrite=True) as lock:
        moved = lock.moved
        assert moved.parent == out and moved.name.startswith("previous-")
        assert {p.relative_to(moved): p.read_bytes() for p in moved.rglob("*") if p.is_file()} == old
        assert rundir.previous_run(out) == [] and (out / "tokens").is_dir()
    a_finished_run(out)  # a second --overwrite keeps the first one moved aside too
    with rundir.claim(out, resume=False, overwrite=True) as lock:
        assert lock.moved != moved and moved.is_dir() and lock.moved.is_dir()


def test_a_recipe_into_a_previous_run_without_resume_is_refused_and_writes_nothing(tmp_path, text_file, capsys):
    out = tmp_path / "out"
    old = a_finished_run(out)
    err = exits_2(capsys, gpt.main, TINY + ["--steps", "1", "--data", str(text_file), "--out", str(out)])
    assert "holds a previous run" in err and "--resume" in err and "--overwrite" in err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != rundir.LOCK
            and "tokens" not in p.parts} == old
    err = exits_2(capsys, gpt.main, TINY + ["--steps", "1", "--data", str(text_file), "--out", str(out),
                                            "--resume", "--overwrite"])
    assert "--overwrite: expected either --resume or --overwrite, got both" in err


def test_a_dry_run_creates_nothing_in_out(tmp_path, text_file, capsys):
    out = tmp_path / "new" / "out"
    llama.main(["--n-layer", "1", "--dry-run", "--data", str(text_file), "--out", str(out)])
    assert "plan (zfunc.plan" in capsys.readouterr().out and not (tmp_path / "new").exists()
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train([str(text_file)], trainers.BpeTrainer(vocab_size=280, show_progress=False,
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    llama.main(["--n-layer", "1", "--dry-run", "--data", str(text_file), "--tokenizer", str(tmp_path),
                "--block-size", "16", "--out", str(out)])
    assert "280" in capsys.readouterr().out and not (tmp_path / "new").exists()  # no OUT/tokens either


# ----------------------------------------------------------------------------- a torn log
def test_a_torn_metrics_log_is_repaired_on_resume_with_its_torn_lines_set_aside(tmp_path):
    good = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 7)]
    torn = [b'{"step": 7, "loss": 0.1', b'\xff\xfe{"step": 8}']  # cut by a crash; not UTF-8
    (tmp_path / "metrics.jsonl").write_bytes("\n".join(good).encode() + b"\n" + b"\n".join(torn))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch.Watch(tmp_path, 0, 4, **WATCH)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == good[:4]  # up to the checkpoint's step
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.torn-")]
    assert len(aside) == 1 and aside[0].read_bytes() == b"\n".join(torn) + b"\n"
    said = [str(w.message) for w in caught]
    assert any(aside[0].name in m and "2 unreadable lines" in m for m in said), said
