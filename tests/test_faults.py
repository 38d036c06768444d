"""Crash safety: a run killed with SIGKILL anywhere inside a checkpoint save or an offloaded (NVMe)
step resumes from ``zf.checkpoint.latest`` to the params of the run that was never interrupted.

A child process trains, saving a checkpoint after every step. ``Tripwire`` counts the calls to the
os functions that change files (fsync, replace, unlink, pwritev, ...); armed at call ``at`` of one
save or step, it prints "killme" and waits there, before the call, for the parent's SIGKILL. So a
kill lands at a chosen point: between any two file changes of a save (its rank file written, the
manifest, the directory renamed, ``latest`` replaced, the oldest checkpoint half pruned) or of an
offloaded step's swap writes (some leaves' new versions committed, others not).

A full swap disk (``FullDisk``: the os calls the swap engine writes through, failing with ENOSPC
for its folder only) fails the step that needed room, naming the folder, before the state passed in
is lost: it still saves (to another disk) and, once there is room, trains on as if never stopped.
"""
import errno
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
from tests.models import batches, fp16_dropout_step, make_offloaded, tree_equal
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


@pytest.mark.multiprocess
@pytest.mark.parametrize("at", [0.0, 0.5, 0.99], ids=["first", "middle", "last"])
@pytest.mark.parametrize("kind, where", [("plain", "save"), ("offloaded", "step")])
def test_killed_inside_a_save_or_an_offloaded_step_resumes_exactly(tmp_path, kind, where, at):
    assert assert_resumes_exactly(kind, where, at, tmp_path)


@pytest.mark.multiprocess
def test_killed_inside_the_save_of_an_offloaded_state_resumes_exactly(tmp_path):
    assert assert_resumes_exactly("offloaded", "save", 0.5, tmp_path)


@pytest.mark.multiprocess
def test_a_kill_mid_prune_leaves_no_debris_once_resumed(tmp_path):
    root = tmp_path / "ckpt"
    assert kill_inside(["child", "plain", "save", "0.99", str(root), str(tmp_path / "swap")])  # the last event
    resume("plain", root, tmp_path / "swap", killed_in="save")
    assert sorted(p.name for p in root.iterdir()) == [f"{STEPS - 1:06d}", f"{STEPS:06d}", "latest"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "offloaded"])
def test_killed_before_every_file_change_of_a_save_resumes_exactly(tmp_path, kind):
    at = 0
    while assert_resumes_exactly(kind, "save", at, tmp_path / str(at)):
        at += 1
    assert at >= 9  # every event of the save was a kill point, then the child ran past the last


@pytest.mark.multiprocess
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


@pytest.mark.multiprocess
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


# ----------------------------------------------------------------------------- the swap disk full


class FullDisk:
    """The file system of ``folder`` full, as the swap engine meets it (``os.pwritev``,
    ``os.posix_fallocate``, ``Path.write_bytes`` and ``os.statvfs`` patched, for files under
    ``folder`` only: a checkpoint saved elsewhere writes as usual). ``statvfs`` says 0 bytes are
    free there, and no new block can be had: allocating past
    the blocks a file holds, writing past them, or writing a new file fails with ENOSPC; a write
    into blocks a file holds goes through. ``cow``: a copy-on-write file system instead, where
    every write needs new blocks: writes fail once ``cow`` more bytes are written (the write that
    crosses it is short: the 4096-byte pages that fit)."""

    def __init__(self, monkeypatch, folder: Path, cow: int | None = None):
        self.folder, self.room = str(folder.resolve()) + os.sep, cow
        pwritev, fallocate, write_bytes, statvfs = os.pwritev, os.posix_fallocate, Path.write_bytes, os.statvfs

        def full_pwritev(fd, buffers, pos, *flags):
            if not self.ours(os.readlink(f"/proc/self/fd/{fd}")):
                return pwritev(fd, buffers, pos, *flags)
            data = memoryview(buffers[0]).cast("B")
            assert len(buffers) == 1
            if self.room is None:
                if pos + len(data) > os.fstat(fd).st_blocks * 512:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return pwritev(fd, buffers, pos, *flags)
            fits = min(len(data), self.room) // 4096 * 4096
            if not fits:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.room -= fits
            return pwritev(fd, [data[:fits]], pos, *flags)

        def full_fallocate(fd, offset, length):
            if self.ours(os.readlink(f"/proc/self/fd/{fd}")) and offset + length > os.fstat(fd).st_blocks * 512:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return fallocate(fd, offset, length)

        def full_write_bytes(path, data):
            if self.ours(str(Path(path).resolve())) and data:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return write_bytes(path, data)

        def full_statvfs(path):
            st = statvfs(path)
            if isinstance(path, int) or not self.ours(str(Path(path).resolve()) + os.sep):
                return st
            return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0, *st[5:]))

        monkeypatch.setattr(os, "statvfs", full_statvfs)
        monkeypatch.setattr(os, "pwritev", full_pwritev)
        monkeypatch.setattr(os, "posix_fallocate", full_fallocate)
        monkeypatch.setattr(Path, "write_bytes", full_write_bytes)

    def ours(self, path: str) -> bool:
        return path.startswith(self.folder)


def nvme(tmp_path: Path, name: str = "swap", params: str | None = "nvme", overlap=None):
    """Tiny offloaded to swap files under ``tmp_path / name``: the optimizer state, and the
    masters with it unless ``params`` is "cpu" (in RAM then), packed in groups of a few leaves (several
    files, some written before others); ``(step, state, its folder)``."""
    step, state = make_offloaded(False, where="nvme", params=params, path=tmp_path / name, overlap=overlap,
                                 group_bytes=256)
    return step, state, tmp_path / name


def saved(state, directory: Path):
    """``state`` saved to ``directory`` (another disk than the swap files'), loaded back into the
    plain step: its params, optimizer state and step."""
    plain, _ = make_offloaded(False)
    back = ck.load(ck.save(state, directory), plain)
    return back.params, back.opt_state, back.step


@pytest.mark.parametrize("overlap", [None, False], ids=["updates-overlapped", "updates-after-backward"])
@pytest.mark.parametrize("room", [0.0, 0.5], ids=["first-write", "mid-step"])
def test_a_full_swap_disk_fails_the_step_naming_it_and_the_state_before_saves_whole(tmp_path, monkeypatch, overlap,
                                                                                    room):
    from zfunc.offloading.swap.file_format import SwapPathError

    step, state, swap = nvme(tmp_path, overlap=overlap)
    data = batches(1, 3)
    for batch in data[:2]:
        state, _ = step(state, batch)
    before = saved(state, tmp_path / "before" / "000002")
    written = sum(f.stat().st_size for f in swap.glob("*.swap"))  # what a step writes: every file
    FullDisk(monkeypatch, swap, cow=int(room * written) // 4096 * 4096)
    committed = step.engine.bytes_written
    full = f"swap directory {swap} is full: 0 bytes free, needs [0-9]+ bytes"
    with pytest.raises(SwapPathError, match=full) as failed:
        step(state, data[2])
    assert (step.engine.bytes_written > committed) == (room > 0)  # mid-step: some files had their new versions
    assert failed.value.errno == errno.ENOSPC and "the state passed in is unchanged" in str(failed.value)
    assert not state.consumed and not list(swap.glob(".*.tmp"))
    assert tree_equal(saved(state, tmp_path / "after" / "000002"), before)


def test_a_checkpoint_of_the_current_state_saves_while_the_swap_disk_is_full(tmp_path, monkeypatch):
    step, state, swap = nvme(tmp_path)
    for batch in batches(1, 2):
        state, _ = step(state, batch)
    want = ck.full_params(state)
    FullDisk(monkeypatch, swap)
    got = saved(state, tmp_path / "ckpt" / "000002")  # reading the swap files back writes nothing there
    assert got[0].keys() == want.keys() and all(torch.equal(got[0][n], want[n]) for n in want)
    state, _ = step(state, batches(1, 3)[2])  # the files' room was allocated: training goes on
    assert state.step == 3


@pytest.mark.parametrize("overlap", [None, False], ids=["updates-overlapped", "updates-after-backward"])
def test_once_the_swap_disk_has_room_again_training_goes_on_from_the_state_before_the_failed_step(
        tmp_path, monkeypatch, overlap):
    from zfunc.offloading.swap.file_format import SwapPathError

    data = batches(1, 4)
    step, state, swap = nvme(tmp_path, overlap=overlap)
    for i, batch in enumerate(data):
        if i == 2:
            full = FullDisk(monkeypatch, swap, cow=64 << 10)
            with pytest.raises(SwapPathError, match=str(swap)):
                step(state, batch)
            monkeypatch.undo()  # room again
            assert full.room == 0
        state, _ = step(state, batch)
    ref, ref_state, _ = nvme(tmp_path, "unfaulted", overlap=overlap)
    for batch in data:
        ref_state, _ = ref(ref_state, batch)
    got, want = ck.full_params(state), ck.full_params(ref_state)
    assert state.step == len(data) and all(torch.equal(got[n], want[n]) for n in want)
    assert tree_equal(saved(state, tmp_path / "a" / "000004"), saved(ref_state, tmp_path / "b" / "000004"))


def test_a_step_whose_files_lack_room_fails_before_it_touches_the_state(tmp_path, monkeypatch):
    """Masters in RAM are updated in place: the step allocates its files' room (each file's
    spare) before it starts, so a full disk stops it there, the state untouched."""
    from zfunc.offloading.swap.file_format import SwapPathError

    step, state, swap = nvme(tmp_path, params=None)
    state, _ = step(state, batches(1, 1)[0])
    before = saved(state, tmp_path / "before" / "000001")
    spares = list(swap.glob(".*.spare"))
    assert spares
    for spare in spares[: len(spares) // 2]:  # their room is gone (a crash between a link and a rename, say)
        spare.unlink()
    FullDisk(monkeypatch, swap)
    with pytest.raises(SwapPathError, match=f"swap directory {swap} has 0 bytes free, needs [0-9]+ more"):
        step(state, batches(1, 2)[1])
    assert not state.consumed and tree_equal(saved(state, tmp_path / "after" / "000001"), before)


def test_a_full_swap_disk_after_init_trains_on_in_the_room_init_allocated(tmp_path, monkeypatch):
    for params in (None, "nvme"):
        step, state, swap = nvme(tmp_path, f"swap-{params}", params=params)
        FullDisk(monkeypatch, swap)
        for batch in batches(1, 3):
            state, _ = step(state, batch)
        monkeypatch.undo()


def test_where_ram_leaves_were_updated_in_place_a_failed_write_says_the_state_is_consumed(tmp_path, monkeypatch):
    from zfunc.offloading.swap.file_format import SwapPathError

    step, state, swap = nvme(tmp_path, params="cpu")  # the masters in RAM, the moments on NVMe
    for batch in batches(1, 2):
        state, _ = step(state, batch)
    FullDisk(monkeypatch, swap, cow=16 << 10)  # a copy-on-write disk: even the reserved room takes new blocks
    with pytest.raises(SwapPathError, match="the state passed in is consumed.*restart from a checkpoint"):
        step(state, batches(1, 3)[2])
    assert state.consumed and not list(swap.glob(".*.tmp"))
