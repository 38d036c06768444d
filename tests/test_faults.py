"""Crash safety: a run killed with SIGKILL anywhere inside a checkpoint save or an offloaded (NVMe)
step resumes from ``zf.checkpoint.latest`` to the params of the run that was never interrupted.

A child process trains, saving a checkpoint after every step. ``Tripwire`` counts the calls to the
os functions that change files (fsync, replace, unlink, pwritev, ...); armed at call ``at`` of one
save or step, it prints "killme" and waits there, before the call, for the parent's SIGKILL. So a
kill lands at a chosen point: between any two file changes of a save (its rank file written, the
manifest, the directory renamed, ``latest`` replaced, the oldest checkpoint half pruned) or of an
offloaded step's swap writes (some leaves' new versions committed, others not).
"""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zfunc as zf
from recipes import gpt
from zfunc import checkpoint as ck
from tests.models import batches, fp16_dropout_step, make_offloaded
from tests.recipe_runs import TINY

STEPS, TARGET, KEEP = 6, 4, 2  # the step or save killed is TARGET's; the saves before it already prune
REPO = Path(__file__).resolve().parents[1]
EVENTS = ("fsync", "replace", "rename", "link", "unlink", "rmdir", "mkdir", "pwritev")


class Tripwire:
    """Counts calls to the os functions that change files; armed at call ``at``, stops there."""

    def __init__(self):
        self.count, self.at, self.lock, self.seen = 0, None, threading.Lock(), {}
        for name in EVENTS:
            setattr(os, name, self._wrap(getattr(os, name)))

    def _wrap(self, fn):
        def counted(*args, **kwargs):
            with self.lock:
                n, self.count = self.count, self.count + 1
            if n == self.at:
                print(f"killme before os.{fn.__name__} (event {n})", flush=True)
                time.sleep(600)
            return fn(*args, **kwargs)

        return counted

    def run(self, phase: str, armed: bool, at, fn):
        """``fn()``, stopping at event ``at`` (an index, or a float: that fraction of the events the
        last ``phase`` had) when ``armed``."""
        if armed and isinstance(at, float):
            at = min(int(at * self.seen[phase]), self.seen[phase] - 1)
        self.count, self.at = 0, at if armed else None
        out = fn()
        self.seen[phase], self.at = self.count, None
        return out


def make(kind: str, swap: Path):
    if kind == "plain":  # fp16 loss scale, dropout RNG and Adam moments: everything resume carries
        return fp16_dropout_step()
    return make_offloaded(False, where="nvme", params="nvme", path=swap)  # masters and moments in swap files


def child(kind: str, where: str, at: str, root: str, swap: str) -> None:
    """Train STEPS steps saving each; stop inside step or save TARGET (``where``) at event ``at``."""
    wire = Tripwire()
    step, state = make(kind, Path(swap))
    at = float(at) if "." in at else int(at)
    for i, batch in enumerate(batches(1, STEPS), 1):
        state, _ = wire.run("step", where == "step" and i == TARGET, at, lambda: step(state, batch))
        wire.run("save", where == "save" and i == TARGET, at,
                 lambda: ck.save(state, Path(root) / f"{i:06d}", keep_last=KEEP))
    print("finished", flush=True)


def kill_inside(argv: list[str]) -> bool:
    """Run ``child(*argv)`` (or ``recipe_child``); SIGKILL it where it stops. False: it finished
    without reaching that event."""
    code = f"import sys; sys.path[:0] = {sys.path!r}; import test_faults; test_faults.{argv[0]}(*sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", code, *argv[1:]], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        for line in proc.stdout:
            if line.startswith("killme"):
                proc.kill()
                assert proc.wait() == -9
                return True
            if line.startswith("finished"):
                assert proc.wait() == 0
                return False
        raise AssertionError(f"the child died before its kill point, status {proc.wait()}")
    finally:
        proc.kill()
        proc.wait()


def resume(kind: str, root: Path, swap: Path, *, killed_in: str):
    """Continue from ``latest`` to STEPS, saving each step as the child did; the final params."""
    latest = ck.latest(root)
    allowed = [TARGET - 1] if killed_in == "step" else [TARGET - 1, TARGET]  # a killed save: either
    assert latest is not None and latest.name in [f"{n:06d}" for n in allowed], latest
    step, _ = make(kind, swap)  # an offloaded one reuses the killed run's swap directory
    state = ck.load(latest, step)  # offloaded: written leaf by leaf into the step's swap files
    if kind == "offloaded":
        assert step.memory(state)["cpu"] == 0 < step.memory(state)["nvme"]  # a true resume onto NVMe
    for i, batch in enumerate(batches(1, STEPS)[state.step:], state.step + 1):
        state, _ = step(state, batch)
        ck.save(state, root / f"{i:06d}", keep_last=KEEP)
    assert ck.latest(root) == root / f"{STEPS:06d}"
    return ck.full_params(state)


_STRAIGHT = {}


def straight(kind: str, tmp_path: Path) -> dict:
    if kind not in _STRAIGHT:
        step, state = make(kind, tmp_path / "straight-swap")
        for batch in batches(1, STEPS):
            state, _ = step(state, batch)
        _STRAIGHT[kind] = ck.full_params(state)
    return _STRAIGHT[kind]


def assert_resumes_exactly(kind: str, where: str, at, tmp_path: Path) -> bool:
    root, swap = tmp_path / "ckpt", tmp_path / "swap"
    if not kill_inside(["child", kind, where, str(at), str(root), str(swap)]):
        return False
    got, want = resume(kind, root, swap, killed_in=where), straight(kind, tmp_path)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), (name, where, at)
    return True


@pytest.mark.parametrize("at", [0.0, 0.5, 0.99], ids=["first", "middle", "last"])
@pytest.mark.parametrize("kind, where", [("plain", "save"), ("offloaded", "step")])
def test_killed_inside_a_save_or_an_offloaded_step_resumes_exactly(tmp_path, kind, where, at):
    assert assert_resumes_exactly(kind, where, at, tmp_path)


def test_killed_inside_the_save_of_an_offloaded_state_resumes_exactly(tmp_path):
    assert assert_resumes_exactly("offloaded", "save", 0.5, tmp_path)


def test_a_kill_mid_prune_leaves_no_debris_once_resumed(tmp_path):
    root = tmp_path / "ckpt"
    assert kill_inside(["child", "plain", "save", "0.99", str(root), str(tmp_path / "swap")])  # the last event
    resume("plain", root, tmp_path / "swap", killed_in="save")
    assert sorted(p.name for p in root.iterdir()) == [f"{STEPS - 1:06d}", f"{STEPS:06d}", "latest"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "offloaded"])
def test_killed_before_every_file_change_of_a_save_resumes_exactly(tmp_path, kind):
    at = 0
    while assert_resumes_exactly(kind, "save", at, tmp_path / str(at)):
        at += 1
    assert at >= 9  # every event of the save was a kill point, then the child ran past the last


@pytest.mark.slow
def test_killed_at_32_points_of_an_offloaded_step_resumes_exactly(tmp_path):
    for k in range(32):  # of its ~225 file changes (3 swap files a leaf, each a link, writes, a replace)
        assert assert_resumes_exactly("offloaded", "step", k / 32, tmp_path / str(k))


# ----------------------------------------------------------------------------- the recipe


def recipe_child(target: str, at: str, *argv: str) -> None:
    """``python -m recipes.gpt *argv``, stopped inside the save of step ``target`` at event ``at``."""
    wire, save = Tripwire(), ck.save
    ck.save = lambda state, directory, **kw: wire.run("save", Path(directory).name == f"{int(target):06d}",
                                                      float(at), lambda: save(state, directory, **kw))
    gpt.main(list(argv))
    print("finished", flush=True)


def test_a_recipe_run_killed_mid_save_resumes_to_the_same_val_loss(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"the quick brown fox jumps over the lazy dog.\n" * 400)
    flags = TINY + ["--steps", "8", "--eval-every", "0", "--ckpt-every", "1", "--keep-last", "2", "--data", str(data)]
    want = gpt.main(flags + ["--out", str(tmp_path / "straight")])
    out = tmp_path / "killed"
    assert kill_inside(["recipe_child", "5", "0.5", *flags, "--out", str(out)])
    assert zf.checkpoint.latest(out / "ckpt").name in {"000004", "000005"}
    got = gpt.main(flags + ["--out", str(out), "--resume"])
    assert got["val_loss"] == want["val_loss"] and got["train_loss"] == want["train_loss"]
    mine = load_file(zf.checkpoint.export(got["checkpoint"], tmp_path / "resumed.safetensors"))
    theirs = load_file(zf.checkpoint.export(want["checkpoint"], tmp_path / "straight.safetensors"))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
