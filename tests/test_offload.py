"""offload: state in CPU RAM or swap files trains exactly as the plain (or sharded) step."""
import gc
import os
import subprocess
import sys
import re
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from tests.models import (Block, Tiny, assert_same_training, batches, local, token_loss, tree_equal, train_on,
                          with_faults)
from tests.models import make_offloaded as make  # this file's step: Tiny, offloaded or not
from zfunc.offloading.copies import ComputeCopies
from zfunc.offloading.placement import OffloadSpec, in_ram
from zfunc.offloading.teardown import release
from zfunc.offloading.step import offload
from zfunc.sharding.run import StepRun
from zfunc.checkpoint import full_params
from zfunc.core.tree import leaves as tree_leaves
from zfunc.offloading.swap.file_format import SwapInUseError, SwapPathError

PLACES = [("cpu", None), ("nvme", None), ("cpu", "cpu"), ("nvme", "nvme")]


def run(step, state, world=1, rank=0, n=5, shards=1):
    """``n`` steps on the batches of a ``world``-rank run, this process taking its share of
    ``shards`` (1: the whole batch, as the plain reference does)."""
    return train_on(step, state, batches(world, n), rank, shards)


@pytest.mark.parametrize("where, params", PLACES)
@pytest.mark.parametrize("clip, precision, accum", [(False, "fp32", 1), (True, "fp32", 1), (False, "bf16", 2)])
def test_offloaded_step_equals_the_plain_step(tmp_path, where, params, clip, precision, accum):
    ref, ref_losses, ref_norms = run(*make(clip, precision, accum))
    step, state = make(clip, precision, accum, where, params, tmp_path)
    assert step.overlap == (not clip and accum == 1)
    state, losses, norms = run(step, state)
    assert losses == ref_losses and norms == pytest.approx(ref_norms, rel=1e-6)
    got = zf.checkpoint.full_params(state)
    for name, want in ref.params.items():
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=0)
    placed = step.memory(state)
    assert (placed["nvme"] > 0) == ("nvme" in (where, params))
    assert (placed["device"] > 0) == (params is None)


def cyclic_garbage(fn) -> list:
    """What ``fn()`` leaves that only Python's cyclic GC would free (reference cycles)."""
    gc.collect()
    gc.disable()
    try:
        fn()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.parametrize("where, params, clip", [("nvme", "nvme", True), ("nvme", "cpu", True), ("cpu", None, False)])
def test_a_call_leaves_no_reference_cycles(tmp_path, where, params, clip):
    # a cycle through a call's run and roles keeps every buffer of the call (reads, grads) alive
    # until the cyclic GC happens to run: a 12.8M GPT's NVMe step grew by ~100 MB of RSS a step
    step, state = make(clip, "fp32", 1, where, params, tmp_path)
    holder = {"state": state}
    data = batches(1, 2)

    def one_step(batch):
        holder["state"], _ = step(holder["state"], batch)

    one_step(data[0])  # the first call learns the layout
    garbage = cyclic_garbage(lambda: one_step(data[1]))
    assert not [type(o).__qualname__ for o in garbage if torch.is_tensor(o) or hasattr(o, "__dict__")]


@pytest.mark.parametrize("where, params", [("cpu", None), ("nvme", "nvme")])
@pytest.mark.parametrize("overlap", [True, False])
def test_grad_norm_false_offloaded_reads_no_norm_and_trains_as_the_plain_step(tmp_path, monkeypatch, where, params,
                                                                             overlap):
    """train_step(grad_norm=False) under offload, held or overlapped: no norm is computed (no
    global_norm, no per-slice norm), metrics["grad_norm"] is None, and the training is the plain
    grad_norm=False step's."""
    ref_step, ref = make(False, grad_norm=False)
    step, state = make(False, "fp32", 1, where, params, tmp_path, grad_norm=False, overlap=overlap)
    norms = []
    monkeypatch.setattr(zf.optim, "global_norm", lambda *a: norms.append(a) or torch.zeros(()))
    vector_norm = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda *a, **k: norms.append(a) or vector_norm(*a, **k))
    for batch in batches(1, 3):
        ref, m_ref = ref_step(ref, batch)
        state, m = step(state, batch)
        assert m["grad_norm"] is None and m_ref["grad_norm"] is None and m["loss"] == m_ref["loss"]
    assert norms == []
    got = zf.checkpoint.full_params(state)
    for name, want in ref.params.items():
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=0)


def test_overlapped_update_takes_the_grad_norm_from_the_kernels_pass(monkeypatch):
    """With overlap the norm's sum of squares comes out of CPU-Adam's own pass over each grad
    (``optim.apply(squares=)``): no second read of the grads, and the norm the plain step's."""
    ref_step, ref = make(False)
    step, state = make(False, "fp32", 1, "cpu", None)
    assert step.overlap
    reads = []
    vector_norm = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda *a, **k: reads.append(a) or vector_norm(*a, **k))
    for batch in batches(1, 2):
        state, m = step(state, batch)
        assert reads == []
        with monkeypatch.context() as undo:
            undo.setattr(torch.linalg, "vector_norm", vector_norm)
            ref, m_ref = ref_step(ref, batch)
        assert m["grad_norm"].item() == pytest.approx(m_ref["grad_norm"].item(), rel=1e-6)


def test_fp16_overflow_skips_the_offloaded_update_like_the_plain_step(tmp_path):
    def big_loss(step):
        inner = step.loss_fn
        step.loss_fn = lambda p, b: inner(p, b) * 1e4  # overflows fp16 at the initial scale
        return step

    ref_step, ref = make(False, "fp16")
    step, state = make(False, "fp16", 1, "nvme", "nvme", tmp_path)
    ref_step, step = big_loss(ref_step), big_loss(step)
    for batch in batches(1, 3):
        ref, m_ref = ref_step(ref, batch)
        state, m = step(state, batch)
        assert m["skipped"] == m_ref["skipped"] and m["loss_scale"] == m_ref["loss_scale"]
    got = zf.checkpoint.full_params(state)
    for name, want in ref.params.items():
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=0)


def faulty_run(step, state, faults):
    """Run ``step`` on batches carrying ``faults`` (see ``tests.models.inject``); per step, whether
    it was skipped and whether params and optimizer state came back as they went in."""
    with_faults(step)
    report = []
    for batch, fault in zip(batches(1, len(faults)), faults):
        before = (zf.checkpoint.full_params(state), in_ram(state).opt_state)
        state, m = step(state, (*batch, fault))
        report.append((m["skipped"], tree_equal((zf.checkpoint.full_params(state), in_ram(state).opt_state), before)))
    return state, report


def test_overlap_follows_what_the_optimizer_declares_it_needs():
    """offload reads ``needs_global_norm`` (it no longer runs the optimizer to find out): a
    transformation that declares it turns overlap off; asking for overlap then names the reason."""
    adamw = zf.optim.adamw(1e-2)
    reads_norm = zf.optim.GradientTransformation(lambda p: zf.optim.EmptyState(), lambda g, s, p=None: (g, s),
                                                 needs_global_norm=True)
    apply, _ = zf.functionalize(Tiny())
    for tx, overlap in ((adamw, True), (zf.optim.chain(reads_norm, adamw), False)):
        assert offload(zf.train_step(lambda p, b: apply(p, b).sum(), tx)).overlap == overlap
    with pytest.raises(ValueError, match="reads the global grad norm"):
        offload(zf.train_step(lambda p, b: apply(p, b).sum(), zf.optim.chain(reads_norm, adamw)), overlap=True)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("params", [None, "cpu"])
def test_the_compute_copy_written_in_the_update_pass_equals_the_cast_at_the_gather(monkeypatch, tmp_path, precision,
                                                                                 params):
    """bf16/fp16: the update writes each RAM master's compute copy in its own pass and the next
    forward gathers it; the same training, bit for bit, as casting the masters at the gather."""
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(ComputeCopies, "of", lambda self, master: None)
        step, state = make(False, precision, where="cpu", params=params, path=tmp_path)
        state, losses, norms = run(step, state, n=4)
        if fused:
            masters = [m for m in zf.tree.leaves(state.params)]
            copies = [step.compute_copies.of(m) for m in masters]
            assert all(c is not None and c.dtype == step.compute_dtype for c in copies)
            assert all(torch.equal(c, m.to(c.dtype)) for c, m in zip(copies, masters))
            pieces, _ = StepRun(step, state)._pieces(state.params)  # what the next forward gathers: the copies
            assert all(pieces[i] is c for i, c in enumerate(copies))
        runs.append((losses, norms, {k: v.clone() for k, v in state.params.items()}))
    (l1, n1, p1), (l2, n2, p2) = runs
    assert l1 == l2 and n1 == n2
    assert all(torch.equal(p1[k], p2[k]) for k in p1)


# overlapped updates (clip=False) catch a non-finite loss only (see test below); held grads catch both
@pytest.mark.parametrize("clip, fault, overlap", [(True, "nan_loss", None), (True, "inf_grads", None),
                                                  (False, "nan_loss", None), (False, "inf_grads", False)])
@pytest.mark.parametrize("where, params", [("cpu", None), ("nvme", "nvme")])
def test_a_non_finite_step_is_skipped_by_the_offloaded_step_like_the_plain_step(tmp_path, where, params, clip,
                                                                                fault, overlap):
    faults = [None, fault, None]
    ref, ref_report = faulty_run(*make(clip), faults)
    step, state = make(clip, where=where, params=params, path=tmp_path, overlap=overlap)
    assert step.overlap == (not clip and overlap is None)
    state, report = faulty_run(step, state, faults)
    assert report == ref_report == [(False, False), (True, True), (False, False)]
    assert state.loss_scale == ref.loss_scale and state.step == 3
    got = zf.checkpoint.full_params(state)
    for name, want in ref.params.items():
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=0)


def test_with_overlap_non_finite_grads_behind_a_finite_loss_raise_instead_of_returning_nan_params(tmp_path):
    step, state = make(False, where="cpu")
    assert step.overlap
    state, _ = faulty_run(step, state, [None])
    with pytest.raises(zf.NonFiniteError, match=r"state.step=1 behind a finite loss, with offload's overlap.*"
                                                r"overlap=False"):
        step(state, (*batches(1, 1)[0], "inf_grads"))
    assert state.consumed  # the leaves were updated during backward: this is the documented loss


def test_too_many_non_finite_steps_raise_with_the_offloaded_state_intact(tmp_path):
    step, state = make(False, where="nvme", params="nvme", path=tmp_path)
    step.max_skips = 1
    state, _ = faulty_run(step, state, [None, "nan_loss"])
    with pytest.raises(zf.NonFiniteError, match="2 non-finite steps in a row, the last at state.step=2"):
        step(state, (*batches(1, 1)[0], "nan_loss"))
    state, m = step(state, batches(1, 1)[0])  # nothing was written: the state still trains
    assert not m["skipped"] and state.step == 3


@pytest.mark.parametrize("overlap", [True, False])
def test_a_param_the_loss_never_uses_is_left_alone_by_the_offloaded_step(overlap):
    def build(where):
        torch.manual_seed(0)
        apply, p = zf.functionalize(Tiny())

        def loss_fn(p, batch):  # block 1 is skipped: its params get no grad
            return F.cross_entropy(apply(p, batch[0], 1).flatten(0, 1), batch[1].flatten())

        step = zf.train_step(loss_fn, zf.optim.adamw(1e-2, weight_decay=0.1, backend="numba"))
        step = offload(step, where, overlap=overlap) if where else step
        return step, step.init(p)

    init = build(None)[1].params
    ref, _, _ = run(*build(None), n=2)
    state, _, _ = run(*build("cpu"), n=2)
    got = zf.checkpoint.full_params(state)
    assert torch.equal(ref.params["blocks.1.fc.weight"], init["blocks.1.fc.weight"])
    for name, want in ref.params.items():
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=0)


def offload_nonfinite_worker(rank, world, path):
    """Stage 2 with overlap (the loss all-reduced before backward), stage 3 with params offloaded
    and held grads: rank 0's loss is nan at the second step."""
    mesh = zf.Mesh(dp=world)
    out = []
    for stage, where, params, clip in ((2, "cpu", None, False), (3, "nvme", "nvme", True)):
        step, state = make(clip, where=where, params=params, path=f"{path}/{stage}-{rank}", mesh=mesh, stage=stage)
        with_faults(step)
        flags = []
        for k, batch in enumerate(batches(world, 3)):
            state, m = step(state, (*local(batch, rank, world), "nan_loss" if k == 1 and rank == 0 else None))
            flags.append(m["skipped"])
        out.append((step.overlap, flags, full_params(in_ram(state), mesh)))
    return out


@pytest.mark.multiprocess
def test_a_non_finite_loss_on_one_rank_skips_the_offloaded_step_on_every_rank(tmp_path):
    results = zf.dist.spawn(offload_nonfinite_worker, 2, 2, str(tmp_path))
    for k, (overlap, clip) in enumerate(((True, False), (False, True))):
        ref_step, ref = make(clip)
        for batch in batches(2, 3)[::2]:  # the plain step on the whole batches, without the bad one
            ref, _ = ref_step(ref, batch)
        for rank in range(2):
            assert results[rank][k][:2] == (overlap, [False, True, False])
            for name, want in ref.params.items():
                torch.testing.assert_close(results[rank][k][2][name], want, rtol=1e-5, atol=1e-6)


def offload_unused_worker(rank, world, path):
    mesh = zf.Mesh(dp=world)
    step, state = make(True, where="nvme", path=f"{path}/{rank}", mesh=mesh, stage=2)
    for batch in batches(world, 2):  # every rank leaves block 1 out
        state, _ = step(state, (*local(batch, rank, world), 1))
    return full_params(in_ram(state), mesh)


@pytest.mark.multiprocess
def test_offload_over_ranks_leaves_alone_a_param_no_rank_produced_a_grad_for(tmp_path):
    ref_step, ref = make(True)
    init = ref.params["blocks.1.fc.weight"].clone()
    for batch in batches(2, 2):
        ref, _ = ref_step(ref, (*batch, 1))
    assert torch.equal(ref.params["blocks.1.fc.weight"], init)
    for got in zf.dist.spawn(offload_unused_worker, 2, 2, str(tmp_path)):
        for name, want in ref.params.items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6)


def sharded_worker(rank, world, path, configs):
    mesh = zf.Mesh(dp=world)
    out = []
    for stage, where, params, clip in configs:
        step, state = make(clip, where=where, params=params, path=f"{path}/{stage}-{where}-{params}-{rank}",
                           mesh=mesh, stage=stage)
        state, losses, norms = run(step, state, world, rank, shards=world)
        out.append((losses, norms, full_params(in_ram(state), mesh)))
    return out


SHARDED = [(1, "cpu", None, True), (2, "nvme", None, True), (2, "cpu", None, False), (3, "nvme", "nvme", False),
           (3, "cpu", "cpu", True)]


@pytest.mark.multiprocess
def test_offload_composes_with_shard_stages_1_2_and_3(tmp_path):
    results = zf.dist.spawn(sharded_worker, 2, 2, str(tmp_path), SHARDED)
    for k, (stage, where, params, clip) in enumerate(SHARDED):
        ref_state, ref_losses, ref_norms = run(*make(clip), world=2)
        for rank in range(2):
            assert_same_training(results[rank][k], (ref_losses, ref_norms, ref_state.params),
                                 f"stage {stage}, optimizer {where}, params {params}, rank {rank}")


def test_params_built_on_the_meta_device_are_materialized_one_leaf_at_a_time(tmp_path):
    torch.manual_seed(0)
    values = dict(zf.functionalize(Tiny())[1])
    with torch.device("meta"):
        meta_model = Tiny()
    apply, meta = zf.functionalize(meta_model)
    asked = []

    def materialize(name, like):
        asked.append(name)
        assert like.device.type == "meta"
        return values[name].clone()

    step = offload(zf.train_step(token_loss(apply),
                                 zf.optim.adamw(1e-2)), "nvme", "nvme", path=tmp_path, units=zf.units.by_class(Block))
    state = step.init(meta, materialize=materialize)
    assert sorted(asked) == sorted(values)
    got = zf.checkpoint.full_params(state)
    for name, want in values.items():
        assert torch.equal(got[name], want)
    state, m = step(state, batches(1, 1)[0])
    assert torch.isfinite(m["loss"])
    with pytest.raises(ValueError, match="meta device; pass materialize"):
        step.init(meta)


def test_a_corrupted_swap_file_is_reported_by_name(tmp_path):
    step, state = make(False, where="nvme", params="nvme", path=tmp_path)
    victim = max(tmp_path.glob("*.swap"), key=lambda f: f.stat().st_size)
    with open(victim, "r+b") as f:
        f.seek(4096 + 7)
        byte = f.read(1)
        f.seek(4096 + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    from zfunc.offloading.swap.file_format import SwapChecksumError

    with pytest.raises(SwapChecksumError, match=victim.name):
        step(state, batches(1, 1)[0])


def test_bad_arguments_are_named(tmp_path):
    step = zf.train_step(lambda p, b: p["w"].sum(), zf.optim.chain(zf.optim.clip_by_global_norm(1.0),
                                                                    zf.optim.adamw(1e-2)))
    with pytest.raises(ValueError, match="optimizer: expected one of"):
        offload(step, "gpu")
    with pytest.raises(ValueError, match="params: expected None"):
        offload(step, "cpu", "disk")
    with pytest.raises(ValueError, match="path: 'nvme' offload needs a directory"):
        offload(step, "nvme")
    with pytest.raises(ValueError, match="overlap: updates cannot start during backward.*clip_by_global_norm"):
        offload(step, "cpu", overlap=True)
    with pytest.raises(ValueError, match="donating step"):
        offload(zf.train_step(step.loss_fn, step.optimizer, donate=False), "cpu")
    with pytest.raises(ValueError, match="offloaded already"):
        offload(offload(step, "cpu"), "cpu")
    with pytest.raises(ValueError, match="params: offloading params needs stage 3"):
        offload(zf.shard(step, zf.Mesh(), 2), "cpu", "cpu")
    off = offload(step, "cpu")
    plain_state = step.init({"w": torch.ones(3)})
    with pytest.raises(ValueError, match="state: this state is not offloaded"):
        off(plain_state, None)
    with pytest.raises(ValueError, match="this state is sharded"):
        step(off.init({"w": torch.ones(3)}), None)


def test_an_unwritable_or_full_path_fails_at_init_before_training(tmp_path):
    from zfunc.offloading.swap.file_format import SwapError

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    step = offload(zf.train_step(lambda p, b: p["w"].sum(), zf.optim.adamw(1e-2)), "nvme", path=blocker / "swap")
    with pytest.raises(SwapError, match="swap"):
        step.init({"w": torch.ones(3)})
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    huge = {"w": torch.empty(0).expand(0)}  # no memory; the room asked for comes from the layout below
    step = offload(zf.train_step(lambda p, b: p["w"].sum(), zf.optim.adamw(1e-2)), "nvme", path=tmp_path / "s")
    with torch.device("meta"):
        big = {"w": torch.empty(free // 8 + 1)}  # 16 bytes per param asked for: twice the free space
    with pytest.raises(SwapError, match="free"):
        step.init(big, materialize=lambda name, like: torch.zeros(like.shape))
    del huge


RSS_CAP_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    from torch import nn
    import zfunc as zf
    cap = int(sys.argv[2])
    # 48 layers of 1M fp32 params: 192 MB of params; with grads and Adam moments 768 MB
    with torch.device("meta" if sys.argv[1] == "nvme" else "cpu"):
        model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(48)])
    apply, params = zf.functionalize(model)
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-3, backend="numba"))
    if sys.argv[1] == "nvme":
        step = zf.offload(step, "nvme", "nvme", path=sys.argv[3], chunk_bytes=16 << 20)
    import numba  # noqa: F401  (thread pools and JIT before the cap, as a long run would have them)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (base + cap, base + cap))
    init = lambda name, like: torch.randn(like.shape) * 0.02
    state = step.init(params, materialize=init) if sys.argv[1] == "nvme" else step.init(params)
    for _ in range(2):
        state, m = step(state, torch.ones(2, 1024))
    print("trained", float(m["loss"]))
""")


# The run that must fail is slow-marked: in 2 of ~6 full-suite runs it hung until its 300 s timeout instead
# of failing (a thread dying of the cap, others left waiting; with one thread it even fit: the cap is
# over RSS, RLIMIT_DATA counts VmData), so it is not a CI test until that is understood.
@pytest.mark.multiprocess
@pytest.mark.parametrize("where, ok", [pytest.param("plain", False, marks=pytest.mark.slow), ("nvme", True)])
def test_optimizer_state_beyond_an_rss_cap_trains_only_with_nvme_offload(tmp_path, where, ok):
    cap = 400 * 2**20  # below the 768+ MB a plain AdamW step of 48M params needs (params, grads, moments)
    # glibc would otherwise raise its mmap threshold after the first large free and serve later
    # blocks from a heap that never shrinks: a fixed threshold makes freed memory go back at once.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
    proc = subprocess.run([sys.executable, "-c", RSS_CAP_SCRIPT, where, str(cap), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env)
    if ok:
        assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-2000:]
    else:
        assert proc.returncode != 0 and "memory" in proc.stderr.lower(), proc.stderr[-2000:]


@pytest.mark.parametrize("clip", [False, True])
def test_the_state_a_step_took_is_consumed(tmp_path, clip):
    step, state = make(clip, where="nvme", params="nvme", path=tmp_path)
    new, _ = step(state, batches(1, 1)[0])
    with pytest.raises(zf.ConsumedStateError):
        state.params
    step(new, batches(1, 1)[0])


def test_an_offloaded_state_saves_and_exports_its_params(tmp_path):
    step, state = make(False, where="nvme", params="nvme", path=tmp_path / "swap")
    state, _ = step(state, batches(1, 1)[0])
    zf.checkpoint.save(state, tmp_path / "ckpt" / "000001")
    exported = zf.checkpoint.export(tmp_path / "ckpt" / "000001", tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    saved, full = load_file(exported), zf.checkpoint.full_params(state)
    assert saved.keys() == full.keys()
    for name in full:
        assert torch.equal(saved[name], full[name])
    step(state, batches(1, 1)[0])  # saving only read the state


def resume(step, state, start, stop):
    """Train on batches [start, stop) of the 1-rank run; the state, losses and norms."""
    losses, norms = [], []
    for batch in batches(1, stop)[start:]:
        state, m = step(state, batch)
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    return state, losses, norms


@pytest.mark.parametrize("where, params", PLACES)
def test_a_checkpoint_loads_straight_into_an_offloaded_step(tmp_path, where, params):
    """A plain step's checkpoint loads into the offloaded step: the state lands where the step
    keeps it (RAM or its swap files) and continues as the plain step does from it; the offloaded
    state's own checkpoint is the plain state's (it loads into the plain step, equal)."""
    plain, state = make(False)
    state, _, _ = resume(plain, state, 0, 2)
    directory = zf.checkpoint.save(state, tmp_path / "ckpt" / "000002")
    ref, ref_losses, ref_norms = resume(plain, zf.checkpoint.load(directory, plain), 2, 5)
    step, _ = make(False, where=where, params=params, path=tmp_path / "swap")
    loaded = zf.checkpoint.load(directory, step)
    placed = step.memory(loaded)
    assert (placed["nvme"] > 0) == ("nvme" in (where, params)) and (placed["device"] > 0) == (params is None)
    assert loaded.step == 2 and isinstance(loaded.placement, OffloadSpec)
    state, losses, norms = resume(step, loaded, 2, 5)
    assert losses == ref_losses and norms == pytest.approx(ref_norms, rel=1e-6)
    got = zf.checkpoint.full_params(state)
    for name, want in ref.params.items():
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=0)
    back = zf.checkpoint.load(zf.checkpoint.save(state, tmp_path / "ckpt" / "000005"), plain)
    assert back.opt_state[-1].count == 5 and all(torch.equal(back.params[n], got[n]) for n in got)


def test_loading_into_nvme_holds_one_group_of_leaves_at_a_time(tmp_path, monkeypatch):
    """Each leaf's values are read only once the group of leaves before its own is handed to its
    swap files (one file of masters, one of moments), no read is larger than a leaf and no file
    than a group: the state never sits in RAM whole."""
    from zfunc.checkpoint import files as checkpoint_files
    from zfunc.offloading import store

    plain, state = make(False)
    directory = zf.checkpoint.save(state, tmp_path / "ckpt" / "000000")
    group = 256  # bytes of masters: several groups of Tiny's leaves (1 KB in all)
    step, _ = make(False, where="nvme", params="nvme", path=tmp_path / "swap", group_bytes=group)
    keys, events = sorted(state.params), []  # the leaf order
    read, pack = checkpoint_files.RankFiles.read, store.Store.pack

    def reading(self, rank, name, crc=None):
        t = read(self, rank, name, crc)
        events.append(("read", next(i for i, k in enumerate(keys) if name.endswith("/" + k)), t.numel()))
        return t

    def packing(self, name, tensors):
        events.append(("pack", int(name.removeprefix("group").split(".")[0]), sum(t.numel() for t in tensors)))
        return pack(self, name, tensors)

    monkeypatch.setattr(checkpoint_files.RankFiles, "read", reading)
    monkeypatch.setattr(store.Store, "pack", packing)
    loaded = zf.checkpoint.load(directory, step)
    groups = store.leaf_groups(loaded.placement, group)
    group_of = {i: k for k, g in enumerate(groups) for i in g}
    assert len(groups) > 2
    reads = [i for kind, i, _ in events if kind == "read"]
    assert reads == sorted(reads) and len(reads) == 3 * len(keys)  # master, m, v: leaf after leaf
    for k, (kind, i, n) in enumerate(events):
        if kind == "read":
            assert n <= state.params[keys[i]].numel()
            if group_of[i] > 0:  # the group before is placed (its moments and masters) already
                assert sum(1 for e in events[:k] if e[:2] == ("pack", group_of[i] - 1)) == 2, (k, events[:k])
        else:
            assert n <= 2 * group // 4 or len(groups[i]) == 1  # fp32 moments: twice a group's masters
    assert step.memory(loaded)["cpu"] == 0
    got = zf.checkpoint.full_params(loaded)
    for name, want in state.params.items():
        assert torch.equal(got[name], want)


@pytest.mark.parametrize("clip, precision, accum", [(False, "fp32", 1), (True, "fp32", 1), (False, "bf16", 2)],
                         ids=["updates-overlapped", "updates-after-backward", "bf16-accumulated"])
@pytest.mark.parametrize("params", [None, "nvme"])
def test_leaves_packed_in_several_groups_train_as_the_plain_step(tmp_path, clip, precision, accum, params):
    """With small groups (``group_bytes`` 256: a few leaves a group), the update reads and writes a
    group's file once, members updated in its buffer, and training equals the plain step's; the
    files are a pair per group (masters, moments), each with its spare; the grads held until backward
    ends (a clip, accumulation) fit in ``chunk_bytes``: held in RAM, no scratch files."""
    from zfunc.offloading.store import leaf_groups

    ref, ref_losses, ref_norms = run(*make(clip, precision, accum))
    step, state = make(clip, precision, accum, where="nvme", params=params, path=tmp_path, group_bytes=256)
    groups = leaf_groups(state.placement, 256)
    assert 2 < len(groups) < len(tree_leaves(state.params))
    reads = step.engine.bytes_read
    state, losses, norms = run(step, state)
    assert losses == ref_losses and norms == pytest.approx(ref_norms, rel=1e-6)
    got = zf.checkpoint.full_params(state)
    for name, want in ref.params.items():
        torch.testing.assert_close(got[name], want, rtol=1e-6, atol=0)
    files = {x.name for x in tree_leaves((state.params, state.opt_state)) if hasattr(x, "file_bytes")}
    assert len(files) == 2 * len(groups) == len(list(tmp_path.glob("group*.s*.swap")) +
                                                list(tmp_path.glob("group*.masters.swap")))
    assert not list(tmp_path.glob("group*.grads.swap"))  # spilled ones: test_offload_memory.py
    assert step.engine.bytes_read > reads


def alone_worker(rank, world, path):
    step, state = make(False, where="nvme", path=f"{path}/{rank}")  # a plain step, in a 2-rank world
    state, losses, _ = run(step, state, n=2)
    return step.mesh.dp, losses


@pytest.mark.multiprocess
def test_a_plain_offloaded_step_in_a_multi_process_run_keeps_to_itself(tmp_path):
    results = zf.dist.spawn(alone_worker, 2, 2, str(tmp_path))
    _, ref_losses, _ = run(*make(False), n=2)
    assert results == [(1, ref_losses)] * 2


def shared_path_worker(rank, world, path, stages):
    mesh = zf.Mesh(dp=world)
    out = []
    for stage in stages:  # every rank given the same path: each keeps its files in its own folder
        step, state = make(False, where="nvme", path=f"{path}/{stage}", mesh=mesh, stage=stage)
        state, losses, norms = run(step, state, world, rank, n=4, shards=world)
        out.append((losses, norms, full_params(in_ram(state), mesh)))
    return out


@pytest.mark.multiprocess
def test_ranks_given_one_nvme_path_keep_their_files_apart_and_train_as_the_plain_step(tmp_path):
    stages = (1, 2)
    results = zf.dist.spawn(shared_path_worker, 2, 2, str(tmp_path), stages)
    ref_state, ref_losses, ref_norms = run(*make(False), world=2, n=4)
    for k, stage in enumerate(stages):
        for rank in range(2):
            assert_same_training(results[rank][k], (ref_losses, ref_norms, ref_state.params),
                                 f"stage {stage}, rank {rank}")
        files = sorted(str(f.relative_to(tmp_path / str(stage))) for f in (tmp_path / str(stage)).rglob("*.swap"))
        assert {f.split("/")[0] for f in files} == {"rank00000", "rank00001"}, files


@pytest.mark.parametrize("group", [256, None], ids=["several-groups", "one-group"])
def test_nvme_init_asks_for_whole_blocks_per_file(tmp_path, monkeypatch, group):
    from zfunc.offloading.store import leaf_groups

    block = 1 << 20
    step, state = make(False, where="nvme", path=tmp_path / "c", group_bytes=group)
    n_groups = len(leaf_groups(state.placement, step.group_bytes))
    free = [4 * n_groups - 1]  # a group's masters and its moments, each beside its spare: one 1 MiB block each
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free[0], f_frsize=block))
    with pytest.raises(SwapPathError, match=f"{4 * n_groups} files in {block}-byte blocks"):
        make(False, where="nvme", path=tmp_path / "a", group_bytes=group)  # though the files hold a few KB
    free[0] += 1
    make(False, where="nvme", path=tmp_path / "b", group_bytes=group)


def test_a_second_run_on_a_path_in_use_is_refused_and_a_later_one_starts_there(tmp_path):
    first, state = make(False, where="nvme", path=tmp_path)
    with pytest.raises(SwapInUseError, match=f"{re.escape(str(tmp_path))} is in use .*pid {os.getpid()}"):
        make(False, where="nvme", path=tmp_path)
    run(first, state, n=1)
    del first, state  # the run ends: its engine goes with its step (collected, if in a reference cycle)
    step, state = make(False, where="nvme", path=tmp_path)  # the same path again, as a resumed run would
    assert run(step, state, n=2)[1] == run(*make(False), n=2)[1]


def test_release_removes_the_swap_files_and_the_folders_init_made_and_nothing_else(tmp_path):
    (tmp_path / "notes.txt").write_text("the user's")
    path = tmp_path / "swap" / "run"  # neither folder exists: init makes both
    step, state = make(False, where="nvme", params="nvme", path=path)
    state, _ = step(state, batches(1, 1)[0])
    files = [p for p in path.iterdir() if p.name.endswith((".swap", ".spare"))]
    assert files and any(p.name.endswith(".spare") for p in files)
    on_disk = sum(p.stat().st_size for p in files)
    assert release(step, state) == on_disk
    assert not (tmp_path / "swap").exists() and (tmp_path / "notes.txt").read_text() == "the user's"
    with pytest.raises(zf.ConsumedStateError):  # its leaves were in the files removed
        state.params
    step, state = make(False, where="nvme", path=path)  # the path is free again: a new engine starts there
    assert run(step, state, n=1)[1] == run(*make(False), n=1)[1]


def test_release_leaves_a_folder_it_did_not_make_and_what_else_it_holds(tmp_path):
    (tmp_path / "notes.txt").write_text("the user's")
    step, state = make(False, where="nvme", path=tmp_path)
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir() if p.name.endswith((".swap", ".spare")))
    assert release(step, state) == on_disk > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert release(step, state) == 0  # released: nothing left to remove


def test_release_of_a_step_without_swap_files_touches_nothing(tmp_path):
    step, state = make(False, where="cpu")
    assert release(step, state) == 0 and not state.consumed
    plain, state = make(False)
    assert release(plain, state) == 0 and not state.consumed


@pytest.mark.parametrize("where, params, accum", [("cpu", None, 1), ("cpu", "cpu", 1), ("nvme", "nvme", 2)])
def test_offloaded_step_carries_batchnorm_statistics_like_torch(tmp_path, where, params, accum):
    from tests.models import BN_STATS, BNNet, assert_trained_like, bn_batches, bn_step, torch_train

    torch.manual_seed(0)
    model = BNNet()
    _, step = bn_step(model, accum)
    step = offload(step, where, params, path=tmp_path)
    state = step.init(zf.functionalize(model)[1])
    for batch in bn_batches():
        state, _ = step(state, batch)
    assert set(state.buffers) == BN_STATS  # kept where the forward computes, not offloaded
    assert_trained_like(zf.checkpoint.full_params(state), state.buffers, torch_train(model, bn_batches(), accum))


@pytest.mark.parametrize("where, params", [("cpu", None), ("nvme", "nvme")])
def test_the_held_update_calls_the_optimizer_once_per_group_of_leaves(tmp_path, monkeypatch, where, params):
    """Leaves of a group whose states merge (``merge_states``: per-param dicts joined, counts equal)
    go through the optimizer's kernel in one call: one call per group, the group's leaves in it."""
    from zfunc.offloading import run as offload_run
    from zfunc.offloading.store import leaf_groups

    calls, apply = [], offload_run.optim.apply
    monkeypatch.setattr(offload_run.optim, "apply", lambda tx, grads, *a, **k: calls.append(len(grads))
                        or apply(tx, grads, *a, **k))
    step, state = make(True, where=where, params=params, path=tmp_path, group_bytes=256)
    state, losses, _ = run(step, state, n=2)
    assert calls == [len(g) for g in leaf_groups(state.placement, 256)] * 2
    assert losses == run(*make(True), n=2)[1]


def test_states_merge_only_where_per_param_dicts_and_equal_counts_make_one():
    from zfunc.offloading.merge import NO_MERGE, merge_states, split_state

    opt = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(1e-3))
    a, b = opt.init({"a": torch.ones(2)}), opt.init({"b": torch.zeros(3)})
    merged = merge_states([a, b], ["a", "b"])
    assert merged[1].mu.keys() == {"a", "b"} and merged[1].count == 0
    back = split_state(merged, b, "b")
    assert type(back[1]) is type(b[1]) and back[1].mu.keys() == {"b"} and torch.equal(back[1].nu["b"], b[1].nu["b"])
    assert merge_states([a, (b[0], b[1]._replace(count=1))], ["a", "b"]) is NO_MERGE  # counts differ
    assert merge_states([torch.ones(1), torch.ones(1)], ["a", "b"]) is NO_MERGE  # a tensor keyed by no param


def test_a_stage_3_offloaded_step_starts_its_param_reads_before_the_first_gather(tmp_path, monkeypatch):
    """With params on NVMe, once a step has recorded the order it reads units in, the next step's
    reads of masters start with the call, before the forward gathers its first unit; training is
    unchanged (the laws above)."""
    from zfunc.offloading.swap.engine import SwapEngine
    from zfunc.sharding.prefetch import Gatherer

    events, read, ensure = [], SwapEngine.read, Gatherer.ensure
    monkeypatch.setattr(SwapEngine, "read", lambda self, name, out: events.append(name) or read(self, name, out))
    monkeypatch.setattr(Gatherer, "ensure", lambda self, u: events.append("gather") or ensure(self, u))
    step, state = make(True, where="nvme", params="nvme", path=tmp_path)
    state, _, _ = train_on(step, state, batches(1, 1))  # records the read order
    events.clear()
    train_on(step, state, batches(1, 1))
    assert events.index("gather") > 0 and events[0].endswith(".masters"), events[:4]


def test_the_held_update_reads_its_masters_and_moments_while_backward_runs(tmp_path, monkeypatch):
    """Without overlap (a clip), the update's reads of the groups' masters and moments start as
    backward starts, before the grads exist: the update finds them read."""
    from zfunc.offloading.grads import SpilledGrads
    from zfunc.offloading.swap.engine import SwapEngine

    events, read, deliver = [], SwapEngine.read, SpilledGrads.deliver
    monkeypatch.setattr(SwapEngine, "read", lambda self, name, out: events.append(name) or read(self, name, out))
    monkeypatch.setattr(SpilledGrads, "deliver", lambda self, *a: events.append("deliver") or deliver(self, *a))
    # grads over chunk_bytes, so held in swap files (SpilledGrads) beside the groups being read
    step, state = make(True, where="nvme", path=tmp_path, group_bytes=4096, tiny=dict(d=64, n=2), chunk_bytes=4096)
    run(step, state, n=1)
    last = max(k for k, e in enumerate(events) if e == "deliver")
    assert any(e.endswith(".states") for e in events[:last]) and any(e.endswith(".masters") for e in events[:last])
