"""zfunc.checkpoint.background: a background save writes the state as it was at the call, while training goes
on; its errors reach the caller; a crash during it leaves the previous checkpoint."""
import os
import sys
import textwrap
import threading
import time

import pytest
import torch

import zfunc as zf
from zfunc import checkpoint as ck
from zfunc.checkpoint import background as ca, files as cf, disk_io as cio
from tests.models import STALL_MID_SAVE, batches, kill_mid_save, make, run


def big_step():
    """A plain AdamW step over leaves above ``EAGER_BYTES``: copied by the writer thread."""
    torch.manual_seed(0)
    params = {"w": torch.randn(600, 600), "b": torch.randn(600)}

    def loss_fn(p, x):
        return ((x @ p["w"]).tanh() + p["b"]).square().mean()

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    return step, step.init(params)


def test_background_save_writes_the_state_of_the_call_while_steps_go_on(tmp_path, monkeypatch):
    step, state = big_step()
    xs = [torch.randn(8, 600, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    state, _ = step(state, xs[0])
    ck.save(state, tmp_path / "blocking")
    take = ca.Snapshot.take
    monkeypatch.setattr(ca.Snapshot, "take", lambda self: time.sleep(0.5) or take(self))  # a slow copy
    handle = ck.save(state, tmp_path / "background", blocking=False)
    assert isinstance(handle, ck.SaveHandle) and not handle.done()
    for x in xs[1:]:  # the first step waits for the copy before it writes into the state
        state, _ = step(state, x)
    assert handle.wait() == tmp_path / "background" and handle.done()
    blocking, background = ck.load(tmp_path / "blocking", step), ck.load(tmp_path / "background", step)
    for a, b in zip(zf.tree.leaves(blocking), zf.tree.leaves(background)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert ck.latest(tmp_path) == tmp_path / "background"


def test_the_next_save_waits_for_the_previous_and_errors_reach_the_caller(tmp_path, monkeypatch):
    step, state = big_step()
    write = cf.write_safetensors
    started = threading.Event()

    def slow(path, tensors, *pace):
        started.set()
        time.sleep(0.3)
        return write(path, tensors, *pace)

    monkeypatch.setattr(cf, "write_safetensors", slow)
    first = ck.save(state, tmp_path / "000001", blocking=False)
    assert started.wait(10)
    ck.save(state, tmp_path / "000002")  # waits for 000001 to be in place
    assert first.done() and ck.latest(tmp_path) == tmp_path / "000002"

    def broken(path, tensors, *pace):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cf, "write_safetensors", broken)
    failed = ck.save(state, tmp_path / "000003", blocking=False)
    with pytest.raises(OSError, match="No space"):
        failed.wait()
    assert failed.done() and ck.latest(tmp_path) == tmp_path / "000002"
    unseen = ck.save(state, tmp_path / "000004", blocking=False)  # nobody waits for this one's error ...
    while not unseen.done():
        time.sleep(0.01)
    monkeypatch.setattr(cf, "write_safetensors", write)
    with pytest.raises(OSError, match="No space"):  # ... so the next save raises it
        ck.save(state, tmp_path / "000005")
    ck.save(state, tmp_path / "000005", blocking=False).wait()
    assert ck.latest(tmp_path) == tmp_path / "000005"
    with pytest.raises(TypeError, match="blocking"):
        ck.save(state, tmp_path / "000006", blocking="no")


KILLED_MID_BACKGROUND_SAVE = textwrap.dedent("""
    import sys, time, torch
    sys.path[:0] = {paths!r}
    from zfunc import checkpoint as ck
    from zfunc.checkpoint import files as cf
    from test_checkpoint_async import big_step
    step, state = big_step()
    ck.save(state, {root!r} + "/000001")
""") + STALL_MID_SAVE + """
handle = ck.save(state, {root!r} + "/000002", blocking=False)
while True:  # training goes on until the kill
    state, _ = step(state, torch.randn(8, 600))
"""


@pytest.mark.multiprocess
def test_a_kill_during_a_background_save_leaves_the_previous_checkpoint(tmp_path):
    kill_mid_save(KILLED_MID_BACKGROUND_SAVE.format(paths=sys.path, root=str(tmp_path)))
    assert ck.latest(tmp_path) == tmp_path / "000001"
    step, state = big_step()
    loaded = ck.load(ck.latest(tmp_path), step)
    assert torch.equal(loaded.params["w"], state.params["w"])
    assert not (tmp_path / "000002").exists() and (tmp_path / ".000002.tmp").is_dir()
    ck.save(state, tmp_path / "000002", blocking=False).wait()  # the next save clears the scratch
    assert ck.latest(tmp_path) == tmp_path / "000002" and not (tmp_path / ".000002.tmp").exists()


def sharded_worker(rank, world, stage, directory):
    """Training straight vs saved in the background mid-way (training's collectives run during
    the save's), loaded, and trained on: the same params."""
    ca.EAGER_BYTES = 0  # every leaf copied by the writer thread, while the steps go on
    mesh = zf.Mesh(dp=world)
    data = batches(world, 8)
    step, state = make(stage, mesh)
    straight = ck.full_params(run(step, state, data, rank, world), mesh)
    step, state = make(stage, mesh)
    state = run(step, state, data[:4], rank, world)
    handle = ck.save(state, directory, extra={"at": 4}, blocking=False)
    run(step, state, data[4:], rank, world)
    handle.wait()
    state = ck.load(directory, step)
    resumed = ck.full_params(run(step, state, data[4:], rank, world), mesh)
    return all(torch.equal(resumed[n], straight[n]) for n in straight)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [3, pytest.param(1, marks=pytest.mark.slow)])
def test_a_sharded_background_save_resumes_bit_exact(tmp_path, stage):
    directory = str(tmp_path / "ckpt")
    assert zf.dist.spawn(sharded_worker, 2, 2, stage, directory) == [True, True]
    assert ck.read_manifest(directory)["extra"] == {"at": 4}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_state_is_snapshotted_before_save_returns(tmp_path):
    step, state = big_step()
    state = ck.load(ck.save(state, tmp_path / "a"), step, device="cuda")
    want = zf.tree.map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, state)
    handle = ck.save(state, tmp_path / "b", blocking=False)
    for i in range(3):
        state, _ = step(state, torch.randn(8, 600, device="cuda"))
    handle.wait()
    got = ck.load(tmp_path / "b", step)
    for a, b in zip(zf.tree.leaves(want), zf.tree.leaves(got)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def failing_rank_worker(rank, world, directory):
    """Rank 1's write fails in the background: every rank's handle raises, naming rank 1, and the
    checkpoint saved before stays the latest."""
    mesh = zf.Mesh(dp=world)
    step, state = make(3, mesh)
    ck.save(state, f"{directory}/000001")
    if rank == 1:
        def broken(path, tensors, *pace):
            raise OSError(28, "No space left on device")
        cf.write_safetensors = broken
    handle = ck.save(state, f"{directory}/000002", blocking=False)
    try:
        handle.wait()
    except (OSError, ck.CheckpointError) as e:
        return str(e)
    return None


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_whose_background_write_fails_fails_the_save_on_every_rank(tmp_path):
    errors = zf.dist.spawn(failing_rank_worker, 2, 2, str(tmp_path))
    assert all(e and "rank 1 could not write its file" in e and "No space" in e for e in errors), errors
    assert ck.latest(tmp_path) == tmp_path / "000001"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_background_save_frees_its_host_buffers_when_it_finishes(tmp_path, monkeypatch):
    params = {"w": torch.randn(2048, 4096)}  # 32 MB, and 64 more of moments: copied to host buffers
    step = zf.train_step(lambda p, x: (x @ p["w"]).square().mean(), zf.optim.adamw(1e-3))
    state = step.init(params)
    snapshots = []
    init = ca.Snapshot.__init__
    monkeypatch.setattr(ca.Snapshot, "__init__", lambda self, *a, **k: snapshots.append(self) or init(self, *a, **k))
    monkeypatch.setattr(ca, "KEEP_BYTES", 0)  # freed when the save finishes
    ca.free_buffers()
    before = _rss()
    handle = ck.save(state, tmp_path / "000001", blocking=False)
    handle.wait()
    assert len(snapshots) == 1 and snapshots[0].copies == {} and ca.kept_bytes() == 0
    assert _rss() - before < 32 << 20  # the 96 MB of copies are gone (torch returns them to the OS)
    monkeypatch.setattr(ca, "KEEP_BYTES", 80 << 20)  # bounded reuse: two of the three 32 MB buffers fit
    ck.save(state, tmp_path / "000002", blocking=False).wait()
    assert ca.kept_bytes() == 64 << 20
    ptrs = {t.data_ptr() for ts in ca._free.values() for t in ts}
    ck.save(state, tmp_path / "000003", blocking=False).wait()  # takes the kept ones, keeps them again
    assert ptrs == {t.data_ptr() for ts in ca._free.values() for t in ts}
    ca.free_buffers()
    assert ca.kept_bytes() == 0
    assert torch.equal(ck.load(tmp_path / "000003", step).params["w"], params["w"])


@pytest.mark.skipif(not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"),
                    reason="no per-thread priority here")
def test_the_writer_gives_way_to_training_once_its_copies_are_taken(monkeypatch):
    monkeypatch.setattr(ca, "WRITER_NICE", 7)
    seen = []

    def writer():
        ca._yield_to_training()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=writer)
    t.start()
    t.join()
    assert seen == [max(7, before)]  # never less nice than it was
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # that thread only


def test_a_paced_background_save_writes_at_full_speed_once_waited_for(tmp_path, monkeypatch):
    step, state = big_step()
    monkeypatch.setattr(ca, "SAVE_DUTY", 1e-4)  # unhurried: minutes per block
    monkeypatch.setattr(cio, "BLOCK", 64 << 10)
    t0 = time.perf_counter()
    first = ck.save(state, tmp_path / "000001", blocking=False)
    time.sleep(0.2)
    assert not first.done()  # still pacing
    second = ck.save(state, tmp_path / "000002", blocking=False)  # hurries the first, waits for it
    assert first.done() and second.wait() == tmp_path / "000002"
    assert time.perf_counter() - t0 < 10
    for d in ("000001", "000002"):
        assert torch.equal(ck.load(tmp_path / d, step).params["w"], state.params["w"])


def test_the_exit_hook_finishes_the_last_save_at_full_speed(tmp_path, monkeypatch):
    step, state = big_step()
    monkeypatch.setattr(ca, "SAVE_DUTY", 1e-4)  # unhurried: minutes per block
    monkeypatch.setattr(cio, "BLOCK", 64 << 10)
    handle = ck.save(state, tmp_path / "000001", blocking=False)
    t0 = time.perf_counter()
    ca._finish_at_exit()  # what threading runs at exit, before concurrent.futures refuses new work
    assert handle.done() and time.perf_counter() - t0 < 10
    assert ck.latest(tmp_path) == tmp_path / "000001"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_exiting_interpreter_finishes_a_paced_save_at_full_speed(tmp_path):
    import subprocess

    script = textwrap.dedent(f"""
        import torch, zfunc as zf
        from zfunc import checkpoint as ck
        from zfunc.checkpoint import background as ca, disk_io as cio
        ca.SAVE_DUTY, cio.BLOCK = 1e-4, 64 << 10  # unhurried: minutes per block
        step = zf.train_step(lambda p, x: (x @ p["w"]).sum(), zf.optim.adamw(1e-3))
        ck.save(step.init({{"w": torch.ones(600, 600)}}), {str(tmp_path / "000001")!r}, blocking=False)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)
    assert time.perf_counter() - t0 < 30
    step = zf.train_step(lambda p, x: (x @ p["w"]).sum(), zf.optim.adamw(1e-3))
    assert torch.equal(ck.load(tmp_path / "000001", step).params["w"], torch.ones(600, 600))
