"""checkpoint: resume is bit-exact, any layout reshards into any other, faults are caught."""
import os
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

import zfunc as zf
from zfunc import checkpoint as ck
from tests.models import (STALL_MID_SAVE, Tiny, adamw, batches, fp16_dropout_step, kill_mid_save, local, make, run,
                          token_loss)


def resume_plain(directory):
    step, _ = fp16_dropout_step()
    state = ck.load(directory, step)
    position = ck.read_manifest(directory)["extra"]["data_position"]
    return run(step, state, batches(1, 10)[position:]).params


@pytest.mark.multiprocess
def test_plain_resume_is_bit_exact_in_a_new_process(tmp_path):
    step, state = fp16_dropout_step()
    straight = run(*fp16_dropout_step(), batches(1, 10))
    state = run(step, state, batches(1, 10)[:5])
    ck.save(state, tmp_path / "000005", extra={"data_position": 5})
    resumed = zf.dist.spawn(lambda_free_resume, 1, str(tmp_path / "000005"))[0]
    assert straight.loss_scale[:3] == (2.0**13, 1, 3)  # the scale grew mid-run: it is carried
    for name in straight.params:
        assert torch.equal(resumed[name], straight.params[name]), name


def lambda_free_resume(rank, directory):
    return resume_plain(directory)


def sharded_worker(rank, world, stage, directory, phase):
    mesh = zf.Mesh(dp=world)
    step, state = make(stage, mesh)
    data = batches(world, 10)
    if phase == "straight":
        return ck.full_params(run(step, state, data, rank, world), mesh)
    if phase == "save":
        ck.save(run(step, state, data[:5], rank, world), directory)
        return None
    state = ck.load(directory, step)
    return ck.full_params(run(step, state, data[5:], rank, world), mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sharded_resume_is_bit_exact(tmp_path, stage):
    directory = str(tmp_path / "ckpt")
    straight = zf.dist.spawn(sharded_worker, 2, 2, stage, directory, "straight")[0]
    zf.dist.spawn(sharded_worker, 2, 2, stage, directory, "save")
    resumed = zf.dist.spawn(sharded_worker, 2, 2, stage, directory, "load")[0]
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name


def reshard_worker(rank, world, stage, directory, phase):
    mesh = zf.Mesh(dp=world)
    step, state = make(stage, mesh)
    if phase == "save":
        state = run(step, state, batches(world, 3), rank, world)
        ck.save(state, directory)
        return ck.full_params(state, mesh)
    state = ck.load(directory, step)
    assert state.placement.world == world and state.placement.stage == stage
    return ck.full_params(state, mesh), zf.tree.leaves(state.opt_state)[0]


@pytest.mark.multiprocess
def test_reshard_4_ranks_stage_3_into_2_ranks_stage_2_and_one_process(tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = zf.dist.spawn(reshard_worker, 4, 4, 3, directory, "save")[0]
    two = zf.dist.spawn(reshard_worker, 2, 2, 2, directory, "load")
    plain_step, _ = make()
    one = ck.load(directory, plain_step)
    for name in saved:
        assert torch.equal(two[0][0][name], saved[name]) and torch.equal(two[1][0][name], saved[name])
        assert torch.equal(one.params[name], saved[name])
    assert two[0][1] == one.opt_state[1].count == 3  # the optimizer's step count travels too
    # the exported state dict loads into a fresh model and computes the same outputs
    out = ck.export(directory, tmp_path / "model.safetensors")
    fresh = Tiny()
    result = fresh.load_state_dict(load_file(out), strict=False)
    assert result.missing_keys == ["head.weight"] and not result.unexpected_keys  # tied to emb.weight
    apply, _ = zf.functionalize(Tiny())
    x = batches(1, 1)[0][0]
    torch.testing.assert_close(fresh(x), apply(saved, x), rtol=0, atol=0)


def replicated_worker(rank, world, stage, directory, steps, saved_to):
    """Load ``directory`` (if given) at ``stage``, train ``steps`` steps, save to ``saved_to``;
    returns the whole params and Adam moments at the start and at the end."""
    mesh = zf.Mesh(dp=world)
    step, state = make(stage, mesh)
    if directory:
        state = ck.load(directory, step)
    moments = lambda s: [ck.full_params(s.replace(params=m), mesh) for m in s.opt_state[1][1:]]  # noqa: E731
    start = ck.full_params(state, mesh), moments(state)
    state = run(step, state, batches(world, 8)[state.step : state.step + steps], rank, world)
    ck.save(state, saved_to)
    return start, (ck.full_params(state, mesh), moments(state))


def assert_equal_trees(got, want, what):
    for name in want:
        assert torch.equal(got[name], want[name]), (what, name)


@pytest.mark.multiprocess
def test_stage_0_saves_once_and_reshards_into_stage_3_and_back(tmp_path):
    """A stage-0 state is whole on every rank: rank 0 writes every leaf, once;
    stage 3 on 2 ranks picks it up, params and moments bit for bit, and hands it back; training
    through the round trip follows the law (stage 0 all along, up to the order of sums)."""
    d0, d3, back = (str(tmp_path / name) for name in ("stage0", "stage3", "back"))
    _, saved0 = zf.dist.spawn(replicated_worker, 2, 2, 0, None, 3, d0)[0]
    manifest = ck.read_manifest(d0)
    assert manifest["stage"] == 0
    pieces = [p for e in manifest["leaves"] for p in e.get("pieces", [])]
    assert pieces and all(p["file"] == 0 for p in pieces)  # every leaf written once, by rank 0
    plain_step, _ = make()
    one = ck.load(d0, plain_step)  # one process reads it as it reads a plain state's
    assert_equal_trees(one.params, saved0[0], "plain from stage 0")
    for rank_out in zf.dist.spawn(replicated_worker, 2, 2, 3, d0, 2, d3):
        loaded3, saved3 = rank_out
        assert_equal_trees(loaded3[0], saved0[0], "stage 3 from stage 0")
        for got, want in zip(loaded3[1], saved0[1]):
            assert_equal_trees(got, want, "moments, stage 3 from stage 0")
    for loaded0, after in zf.dist.spawn(replicated_worker, 2, 2, 0, d3, 3, back):
        assert_equal_trees(loaded0[0], saved3[0], "stage 0 from stage 3")
        for got, want in zip(loaded0[1], saved3[1]):
            assert_equal_trees(got, want, "moments, stage 0 from stage 3")
    assert ck.read_manifest(back)["step"] == 8
    _, straight = zf.dist.spawn(replicated_worker, 2, 2, 0, None, 8, str(tmp_path / "straight"))[0]
    for name in straight[0]:
        torch.testing.assert_close(after[0][name], straight[0][name], rtol=1e-5, atol=1e-5)


def test_latest_and_keep_last(tmp_path):
    step, state = fp16_dropout_step()
    assert ck.latest(tmp_path) is None
    for i in range(4):
        ck.save(state, tmp_path / f"{i:06d}", keep_last=2)
    assert ck.latest(tmp_path) == tmp_path / "000003"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["000002", "000003"]


KILLED_MID_SAVE = textwrap.dedent("""
    import os, sys, time, torch
    sys.path[:0] = {paths!r}
    import zfunc as zf
    from zfunc import checkpoint as ck
    from zfunc.checkpoint import files as cf
    state = zf.TrainState({{"w": torch.ones(1000)}}, (), 0, 0, None)
    ck.save(state, {root!r} + "/000001")
""") + STALL_MID_SAVE + """
ck.save(state.replace(step=2), {root!r} + "/000002")
"""


@pytest.mark.multiprocess
def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path):
    kill_mid_save(KILLED_MID_SAVE.format(paths=sys.path, root=str(tmp_path)))
    assert ck.latest(tmp_path) == tmp_path / "000001"
    template = zf.TrainState({"w": torch.zeros(1000)}, (), 0, 0, None)
    assert ck.load(ck.latest(tmp_path), template).params["w"].sum() == 1000
    assert not (tmp_path / "000002").exists()
    assert (tmp_path / ".000002.tmp").is_dir()  # the crashed save's scratch, and its lock file
    # the next save to that name removes the scratch (it holds only a rank file: zfunc's own)
    ck.save(template.replace(step=2), tmp_path / "000002")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000001", "000002", "latest"]


def test_corruption_and_mismatches_raise_clear_errors(tmp_path):
    step, state = fp16_dropout_step()
    directory = ck.save(state, tmp_path / "000000")
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    other = zf.train_step(step.loss_fn, zf.optim.sgd(0.1))  # another optimizer: another structure
    with pytest.raises(ck.CheckpointError, match="structure differs"):
        ck.load(directory, other)
    template = zf.tree.map(lambda x: x.double() if isinstance(x, torch.Tensor) else x, state)
    with pytest.raises(ck.CheckpointError, match=r"2.bias: \(13,\) float32 in the checkpoint, \(13,\) float64 in "
                                                 "the model"):
        ck.load(directory, template)  # the params' dtypes: reported as the model's
    template = template.replace(params=state.params)
    with pytest.raises(ck.CheckpointError, match="float32 in the checkpoint, torch.float64 in the state"):
        ck.load(directory, template)  # the optimizer state's
    with pytest.raises(TypeError, match="step_or_template"):
        ck.load(directory, "a step")
    with pytest.raises(ck.CheckpointError, match="no checkpoint at"):
        ck.load(tmp_path / "nope", step)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before  # nothing was overwritten

    shard = directory / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match="rank00000.safetensors: checksum mismatch"):
        ck.load(directory, step)
    shard.unlink()
    with pytest.raises(ck.CheckpointError, match="rank00000.safetensors: shard file missing"):
        ck.load(directory, step)


def test_files_open_with_the_safetensors_library(tmp_path):
    from safetensors.torch import load_file

    _, state = fp16_dropout_step()
    directory = ck.save(state, tmp_path / "000000")
    on_disk = load_file(directory / "rank00000.safetensors")
    assert torch.equal(on_disk["params/2.weight"], state.params["2.weight"])


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="state: expected a TrainState"):
        ck.save({"w": torch.ones(1)}, tmp_path / "x")
    _, state = fp16_dropout_step()
    with pytest.raises(ValueError, match="keep_last"):
        ck.save(state, tmp_path / "x", keep_last=0)
    with pytest.raises(ck.CheckpointError, match="cannot be saved"):
        ck.save(state.replace(rng=object()), tmp_path / "y")
    assert ck.full_params(state)["0.weight"].data_ptr() != state.params["0.weight"].data_ptr()


def test_export_loads_with_hugging_face_from_pretrained(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2LMHeadModel
    from tests.models import hf_model

    model, _ = hf_model("gpt2")
    apply, params = zf.functionalize(model)
    step = zf.train_step(lambda p, ids: apply(p, input_ids=ids).logits.float().mean(), zf.optim.adamw(1e-2))
    state, _ = step(step.init(params), torch.randint(0, 61, (2, 8)))
    ck.export(ck.save(state, tmp_path / "ckpt" / "000001"), tmp_path / "hf" / "model.safetensors")
    model.config.save_pretrained(tmp_path / "hf")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 61, (2, 8))
    torch.testing.assert_close(loaded(input_ids=ids).logits, apply(state.params, input_ids=ids).logits,
                               rtol=0, atol=0)


def bn_sharded_worker(rank, world, directory, phase):
    """Stage 3 over ``world`` ranks of the shared BatchNorm model (tests.models.BNNet): 3 steps straight, or 2 saved
    and then 1 after loading; returns the whole params and the buffers."""
    from tests.models import BNNet, bn_batches, bn_step

    mesh = zf.Mesh(dp=world)
    torch.manual_seed(0)
    model = BNNet()
    step = zf.shard(bn_step(model)[1], mesh, stage=3)
    state = step.init(zf.functionalize(model)[1])
    data = [local(b, rank, world) for b in bn_batches(3)]
    if phase == "save":
        ck.save(run(step, state, data[:2]), directory)
        return None
    state = run(step, state, data) if phase == "straight" else run(step, ck.load(directory, step), data[2:])
    return ck.full_params(state, mesh), state.buffers


@pytest.mark.multiprocess
def test_module_buffers_round_trip_plain_and_sharded(tmp_path):
    from tests.models import BN_STATS, BNNet, bn_batches, bn_step

    # plain: saved after 2 steps, loaded by the step or into a state from init, the 3rd step equal
    torch.manual_seed(0)
    model = BNNet()
    _, step = bn_step(model, donate=False)
    fresh = step.init(zf.functionalize(model)[1])
    ck.save(fresh, tmp_path / "000000")  # no buffers yet
    saved = run(step, fresh, bn_batches(3)[:2])
    ck.save(saved, tmp_path / "000002")
    for loaded in (ck.load(tmp_path / "000002", step), ck.load(tmp_path / "000002", fresh)):
        assert set(loaded.buffers) == BN_STATS
        for name, b in saved.buffers.items():
            assert torch.equal(loaded.buffers[name], b) and loaded.buffers[name].dtype == b.dtype, name
        a, b = run(step, saved, bn_batches(3)[2:]), run(step, loaded, bn_batches(3)[2:])
        for name in BN_STATS:
            assert torch.equal(a.buffers[name], b.buffers[name]), name
    assert ck.load(tmp_path / "000000", saved).buffers == {}  # the checkpoint's absence is loaded too
    # exported: the trained statistics load into a fresh module
    out = ck.export(tmp_path / "000002", tmp_path / "model.safetensors")
    module = BNNet()
    assert not module.load_state_dict(load_file(out)).missing_keys
    for name, b in saved.buffers.items():
        assert torch.equal(module.get_buffer(name), b), name

    # sharded: 2 ranks at stage 3 resume bit-exactly; one process loads the same statistics
    directory = str(tmp_path / "sharded")
    straight = zf.dist.spawn(bn_sharded_worker, 2, 2, directory, "straight")
    zf.dist.spawn(bn_sharded_worker, 2, 2, directory, "save")
    resumed = zf.dist.spawn(bn_sharded_worker, 2, 2, directory, "load")
    for rank in range(2):
        (params, buffers), (ref_params, ref_buffers) = resumed[rank], straight[rank]
        assert set(buffers) == BN_STATS
        for name in ref_params:
            assert torch.equal(params[name], ref_params[name]), name
        for name in BN_STATS:
            assert torch.equal(buffers[name], ref_buffers[name]), name
    one = ck.load(directory, step)
    assert one.buffers["bn.num_batches_tracked"].item() == 2 and set(one.buffers) == BN_STATS


# ------------------------------------------------------------- issue 23: nothing lost, nothing silently wrong


def small(step=0, value=1.0):
    """A plain state without a step object: enough for the file-level laws."""
    return zf.TrainState({"w": torch.full((100,), float(value))}, (), step, 0, None)


def loaded(directory):
    return ck.load(directory, small()).params["w"]


def snapshot(root):
    """Every file under ``root`` with its bytes: what must not change."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_save_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "notes.txt").write_text("my experiment")
    before = snapshot(tmp_path)
    with pytest.raises(ck.CheckpointError, match=r"results holds files a checkpoint does not write: \['notes.txt'\]"
                                                 r".*expected a new path, an empty directory or a zfunc checkpoint"):
        ck.save(small(), mine)
    assert snapshot(tmp_path) == before  # nothing written: no scratch, no latest, the file intact


def test_save_refuses_a_folder_of_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    ck.save(small(100, 7.0), root / "000100")
    before = snapshot(tmp_path)
    with pytest.raises(ck.CheckpointError, match=r"ckpt holds files a checkpoint does not write: "
                                                 r"\['000100', 'latest'\]"):
        ck.save(small(200), root)  # meant ckpt/000200
    assert snapshot(tmp_path) == before
    assert ck.latest(root) == root / "000100" and torch.equal(loaded(root / "000100"), torch.full((100,), 7.0))


def test_save_refuses_a_plain_file_and_a_link(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"precious")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    before = snapshot(tmp_path)
    with pytest.raises(ck.CheckpointError, match="weights.bin is a file, not a directory"):
        ck.save(small(), tmp_path / "weights.bin")
    with pytest.raises(ck.CheckpointError, match="link is a symbolic link"):
        ck.save(small(), tmp_path / "link")
    assert snapshot(tmp_path) == before


def test_save_refuses_a_broken_or_extended_checkpoint(tmp_path):
    garbage = tmp_path / "000001"
    garbage.mkdir()
    (garbage / "manifest.json").write_text("{not json")
    extended = ck.save(small(2), tmp_path / "000002")
    (extended / "eval.csv").write_text("step,loss\n2,0.5\n")
    before = snapshot(tmp_path)
    with pytest.raises(ck.CheckpointError, match=r"000001 is not a zfunc checkpoint .*manifest.json: not a zfunc "
                                                 "manifest, it does not parse as JSON"):
        ck.save(small(), garbage)
    with pytest.raises(ck.CheckpointError, match=r"000002 holds files a checkpoint does not write: \['eval.csv'\]"):
        ck.save(small(), extended)
    assert snapshot(tmp_path) == before


def test_save_replaces_its_own_checkpoint_and_fills_an_empty_directory(tmp_path):
    first = ck.save(small(1, 1.0), tmp_path / "000001")
    assert torch.equal(loaded(ck.save(small(1, 2.0), first)), torch.full((100,), 2.0))
    (tmp_path / "000002").mkdir()
    assert torch.equal(loaded(ck.save(small(2, 3.0), tmp_path / "000002")), torch.full((100,), 3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000001", "000002", "latest"]  # no scratch left


def test_save_replaces_with_two_renames_where_it_cannot_swap(tmp_path, monkeypatch):
    from zfunc.checkpoint import folder as checkpoint_folder

    monkeypatch.setattr(checkpoint_folder, "exchange", lambda a, b: False)  # e.g. NFS: no RENAME_EXCHANGE
    first = ck.save(small(1, 1.0), tmp_path / "000001")
    assert torch.equal(loaded(ck.save(small(1, 2.0), first)), torch.full((100,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000001", "latest"]


def test_save_removes_only_its_own_leftovers(tmp_path):
    (tmp_path / ".000001.tmp").mkdir()
    (tmp_path / ".000001.tmp" / "rank00000.safetensors").write_bytes(b"half written")
    ck.save(small(1), tmp_path / "000001")  # a crashed save's scratch: removed
    assert not (tmp_path / ".000001.tmp").exists()
    (tmp_path / ".000002.tmp").mkdir()
    (tmp_path / ".000002.tmp" / "draft.txt").write_text("not ours")
    before = snapshot(tmp_path)
    with pytest.raises(ck.CheckpointError, match=r"\.000002\.tmp holds files a checkpoint does not write"):
        ck.save(small(2), tmp_path / "000002")
    assert snapshot(tmp_path) == before


def test_save_writes_latest_only_over_its_own_pointer(tmp_path):
    (tmp_path / "latest").write_text("my notes\nabout the latest run\n")
    before = snapshot(tmp_path)
    with pytest.raises(ck.CheckpointError, match="latest is not zfunc's pointer file"):
        ck.save(small(), tmp_path / "000001")
    assert snapshot(tmp_path) == before


def test_save_refuses_bad_names_and_nesting(tmp_path):
    for bad in (tmp_path / "latest", tmp_path / ".hidden", "."):
        with pytest.raises(ValueError, match="directory: expected a path whose last part names the checkpoint"):
            ck.save(small(), bad)
    inside = ck.save(small(), tmp_path / "000001")
    before = snapshot(tmp_path)
    with pytest.raises(ck.CheckpointError, match="its parent .*000001 is a checkpoint itself"):
        ck.save(small(), inside / "000002")
    assert snapshot(tmp_path) == before
    project = tmp_path / "project"  # a folder with a manifest.json of its own is not a checkpoint
    project.mkdir()
    (project / "manifest.json").write_text('{"name": "my app"}')
    ck.save(small(), project / "000001")


def test_keep_last_orders_by_recorded_step_not_by_name(tmp_path):
    for step in (8, 9, 10, 11):  # as strings step10 < step11 < step8 < step9
        ck.save(small(step, step), tmp_path / f"step{step}", keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step10", "step11"]
    assert ck.latest(tmp_path) == tmp_path / "step11"
    assert ck.read_manifest(tmp_path / "step11")["run"] == "step"


def test_keep_last_never_touches_another_run_in_a_shared_folder(tmp_path):
    for step in (1, 2, 3):
        ck.save(small(step), tmp_path / f"a-{step:06d}", keep_last=1)
    for step in (1, 2):
        ck.save(small(step), tmp_path / f"b-{step:06d}", keep_last=1)
    for step in (5, 6):  # bare numbers: the run is named explicitly
        ck.save(small(step), tmp_path / f"{step:06d}", keep_last=1, run="c")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["000006", "a-000003", "b-000002"]
    assert ck.latest(tmp_path) == tmp_path / "000006"


def test_keep_last_keeps_what_was_just_written_and_what_it_does_not_own(tmp_path):
    ck.save(small(5), tmp_path / "000005")
    again = ck.save(small(1), tmp_path / "000001", keep_last=1)  # an older step saved last: kept
    assert ck.latest(tmp_path) == again and (tmp_path / "000005").exists()
    (tmp_path / "000005" / "eval.csv").write_text("mine")  # now it holds a file zfunc did not write
    ck.save(small(6), tmp_path / "000006", keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["000005", "000006"]
    assert (tmp_path / "000005" / "eval.csv").read_text() == "mine"


def test_latest_refuses_to_name_what_is_not_a_checkpoint(tmp_path):
    import shutil

    ck.save(small(1), tmp_path / "000001")
    shutil.rmtree(tmp_path / "000001")  # by hand: resuming must not silently start over
    with pytest.raises(ck.CheckpointError, match="latest names '000001', which is not a checkpoint"):
        ck.latest(tmp_path)
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(ck.CheckpointError, match="latest is not zfunc's pointer file"):
        ck.latest(tmp_path)


def test_concurrent_saves_to_one_directory_leave_one_whole_checkpoint(tmp_path):
    import threading

    target = tmp_path / "000001"
    errors = []

    def saver(value):
        try:
            for _ in range(3):
                ck.save(small(1, value), target)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=saver, args=(v,)) for v in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    w = loaded(target)  # checksums verified: one whole checkpoint
    assert any(torch.equal(w, torch.full((100,), float(v))) for v in range(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000001", "latest"]


def test_concurrent_saves_into_one_folder_keep_latest_and_pruning_consistent(tmp_path):
    import threading

    def saver(first):
        for step in range(first, 12, 3):
            ck.save(small(step, step), tmp_path / f"{step:06d}", keep_last=2)

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert ck.latest(tmp_path).name in kept and "000011" in kept and len(kept) <= 3
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_load_refuses_a_model_with_another_layer_or_width(tmp_path):
    step, state = make()
    directory = ck.save(state, tmp_path / "000000")
    deeper, _ = make(model_kw={"n": 4})  # its init recorded the model: one block more
    with pytest.raises(ck.CheckpointError, match=r"the params step.init last received.*4 params of the model not in "
                                                 r"the checkpoint \['blocks.3.fc.bias', 'blocks.3.fc.weight'"):
        ck.load(directory, deeper)
    shallower, _ = make(model_kw={"n": 2})
    with pytest.raises(ck.CheckpointError, match=r"params in the checkpoint not in the model \['blocks.2.fc.bias'"):
        ck.load(directory, shallower)
    wider, _ = make(model_kw={"d": 8})
    with pytest.raises(ck.CheckpointError, match=r"differ: blocks.0.fc.bias: \(6,\) float32 in the checkpoint, "
                                                 r"\(8,\) float32 in the model"):
        ck.load(directory, wider)


def test_load_checks_the_params_it_is_given(tmp_path):
    step, state = make()
    directory = ck.save(state, tmp_path / "000000")
    fresh = zf.train_step(step.loss_fn, step.optimizer)  # never initialised: nothing recorded
    with torch.device("meta"):  # no memory for the model's values: the load fills the state
        _, deeper = zf.functionalize(Tiny(n=4))
        _, right = zf.functionalize(Tiny())
    with pytest.raises(ck.CheckpointError, match=r"\(from params=\).*blocks.3.fc.weight"):
        ck.load(directory, fresh, params=deeper)
    assert torch.equal(ck.load(directory, fresh, params=right).params["emb.weight"], state.params["emb.weight"])
    with pytest.raises(ValueError, match="params: give it with a Step"):
        ck.load(directory, state, params=right)


def test_unhelpful_errors_now_name_the_problem(tmp_path):
    with pytest.raises(ck.CheckpointError, match=r"directory: expected a checkpoint directory, got None "
                                                 r"\(zf.checkpoint.latest\(root\) returns None"):
        ck.load(ck.latest(tmp_path / "nope"), small())
    directory = ck.save(small(), tmp_path / "000001")
    (directory / "manifest.json").write_text("{garbage")
    with pytest.raises(ck.CheckpointError, match=r"000001/manifest.json: not a zfunc manifest"):
        ck.load(directory, small())
    with pytest.raises(TypeError, match="directory: expected a path"):
        ck.load(3, small())


def test_bad_extra_and_leaves_are_refused_before_anything_is_written(tmp_path):
    before = snapshot(tmp_path)
    with pytest.raises(TypeError, match=r"extra\['loss'\]: a Tensor cannot be saved as JSON .*\.item\(\)"):
        ck.save(small(), tmp_path / "000001", extra={"loss": torch.tensor(0.5), "position": 3})
    with pytest.raises(TypeError, match="extra: expected a dict"):
        ck.save(small(), tmp_path / "000001", extra=[1, 2])
    with pytest.raises(TypeError, match=r"extra: keys must be strings, got 1"):
        ck.save(small(), tmp_path / "000001", extra={1: 2})
    with pytest.raises(ck.CheckpointError, match="leaf params/z has dtype torch.complex64"):
        ck.save(small().replace(params={"z": torch.zeros(2, dtype=torch.complex64)}), tmp_path / "000001")
    with pytest.raises(ck.CheckpointError, match="leaf rng = <object"):
        ck.save(small().replace(rng=object()), tmp_path / "000001")
    with pytest.raises(TypeError, match="run: expected a str"):
        ck.save(small(), tmp_path / "000001", run=3)
    assert snapshot(tmp_path) == before


def arrival_worker(rank, world, directory):
    """Saves and gathers called on a subset of ranks fail fast on every rank that came."""
    zf.dist.comm.ARRIVAL_TIMEOUT_S = 2.0
    store = torch.distributed.distributed_c10d._get_default_store()
    _, state = make(2, zf.Mesh(dp=world))
    errors = []
    if rank == 0:  # a plain state is one rank's own: saved alone, no waiting for the others
        ck.save(small(), os.path.dirname(directory) + "-rank0/000001")

    def attempt(fn, *args):
        try:
            fn(*args)
            errors.append(None)
        except zf.dist.CollectiveError as e:
            errors.append(str(e))

    # rank 0 saves alone; rank 1 comes only after rank 0 gave up
    if rank == 0:
        attempt(ck.save, state, directory)
        errors.append(os.path.exists(os.path.dirname(directory)))  # nothing was written
        store.set("test/saved", "1")
    else:
        store.wait(["test/saved"])
        attempt(ck.save, state, directory)
    # rank 1 gathers alone; rank 0 comes after
    if rank == 1:
        attempt(ck.full_params, state)
        store.set("test/gathered", "1")
    else:
        store.wait(["test/gathered"])
        attempt(ck.full_params, state)
    attempt(ck.save, state, directory) if rank == 0 else attempt(ck.full_params, state)  # different calls
    ck.save(state, directory)  # every rank: works again
    return errors, sorted(os.listdir(os.path.dirname(directory)))


@pytest.mark.multiprocess
def test_a_collective_called_on_one_rank_fails_fast_naming_the_call(tmp_path):
    directory = str(tmp_path / "ckpt" / "000001")
    (r0, files), (r1, _) = zf.dist.spawn(arrival_worker, 2, 2, directory)
    assert r0[0] == "zf.checkpoint.save: every rank of the 2-rank state must call it; rank 1 did not arrive within 2 s"
    assert r1[0] == r0[0] + " (this rank arrived after the others gave up)"
    assert r1[1] == "zf.checkpoint.full_params: every rank of the 2-rank state must call it; rank 0 did not arrive " \
                    "within 2 s"
    assert r0[1] is False  # rank 0's failed save wrote nothing, not even the folder
    assert r0[2] == r1[1] + " (this rank arrived after the others gave up)"
    assert r0[3] == r1[2] == ("ranks made different calls: rank 0: zf.checkpoint.save; rank 1: zf.checkpoint."
                              "full_params (every rank must make the same collective calls in the same order)")
    assert files == ["000001", "latest"]


def test_prune_finishes_what_a_killed_prune_or_save_left(tmp_path):
    from zfunc.checkpoint import folder as checkpoint_folder

    first = ck.save(small(1), tmp_path / "000001")
    os.replace(first, tmp_path / ".000001.pruned")  # killed after the rename, before the delete
    (tmp_path / ".000001.pruned" / "manifest.json").unlink()  # ... or halfway through it
    (tmp_path / ".000002.lock").touch()  # a save killed while holding its lock
    with checkpoint_folder.locked(tmp_path / ".000009.lock"):  # a live save's lock stays
        ck.save(small(3), tmp_path / "000003", keep_last=1)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".000009.lock", "000003", "latest"]


# ------------------------------------------------------------- issue 18: checkpoints in any layout

K, N = 2, 4  # steps before the save, steps in all


def layout_step(layout, world):
    """``(step, state, mesh)`` of the pipeline's model (tests.models.PipeTiny: tied embedding and head, 4 blocks) in
    ``layout = (pp, zero)``: a pipeline of ``pp`` stages (0: none) over a step sharded at ZeRO
    stage ``zero`` (0: plain) over the other ``world / pp`` ranks."""
    from tests.models import Block, PipeTiny  # its Block: the class PipeTiny is built of

    pp, zero = layout
    torch.manual_seed(0)
    model = PipeTiny()
    apply, params = zf.functionalize(model)
    step = zf.train_step(token_loss(apply), adamw())
    mesh = zf.Mesh(dp=world // max(pp, 1), pp=max(pp, 1)) if world > 1 else None
    if zero:
        step = zf.shard(step, mesh, zero, units=zf.units.by_class(Block) if zero == 3 else None)
    if pp:
        step = zf.pipeline(step, stages=pp, microbatches=2, model=model, units=zf.units.by_class(Block),
                           mesh=None if zero else mesh)
    return step, step.init(params), mesh


def layout_worker(rank, world, plan):
    """Run ``plan``, entries ``(layout, load_from, start, stop, save_to)``: a fresh step in
    ``layout`` starts from ``load_from`` (or init), trains on batches [start, stop) (each dp rank its
    share) and saves to ``save_to``. Returns, per entry, the losses, grad norms, whole params and
    the rank files the load opened."""
    from tests.models import pipe_batches
    from zfunc.checkpoint.files import RankFiles

    out, opened, open_file = [], set(), RankFiles._open
    RankFiles._open = lambda files, r: opened.add(r) or open_file(files, r)
    for layout, load_from, start, stop, save_to in plan:
        step, state, mesh = layout_step(layout, world)
        opened.clear()
        if load_from:
            state = ck.load(load_from, step)
            assert state.step == start
        losses, norms = [], []
        for batch in pipe_batches(n=N)[start:stop]:
            state, m = step(state, local(batch, mesh.rank, mesh.dp) if mesh else batch)
            losses.append(m["loss"].item())
            norms.append(m["grad_norm"].item())
        if save_to:
            ck.save(state, save_to)
        gathered = ck.full_params(state, None if layout[0] else mesh)
        out.append((losses, norms, gathered, sorted(opened)))
    return out


def assert_same(got, want, what, exact=False):
    """Two trainings (losses, norms, params) agree: bitwise, or as fp32 allows (1e-5 / 1e-6)."""
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), **tol, msg=what)
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), **tol, msg=what)
    assert got[2].keys() == want[2].keys(), what
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], **tol, msg=f"{what}: {name}")


def assert_written_once(directory):
    """Every leaf is in the files once: a split leaf's pieces cover its rows without overlap, any
    other leaf is in one file; the files hold nothing else."""
    from safetensors import safe_open

    manifest = ck.read_manifest(directory)
    held = {}
    for name in manifest["files"]:
        with safe_open(str(directory / name), "pt") as f:
            for key in f.keys():
                held.setdefault(key, []).append((int(name[4:9]), f.get_slice(key).get_shape()))
    tensors = [e for e in manifest["leaves"] if "dtype" in e]
    assert set(held) == {e["path"] for e in tensors}
    for e in tensors:
        files = [p["file"] for p in e["pieces"]]
        assert sorted(files) == sorted(r for r, _ in held[e["path"]]), e["path"]
        if e["split_like"]:
            rows = sorted(tuple(p["rows"]) for p in e["pieces"])
            whole = e["full_shape"][0] if e["full_shape"] else 1
            assert [a for a, _ in rows] == [0] + [b for _, b in rows[:-1]] and rows[-1][1] == whole, e["path"]
        else:
            assert len(files) == 1, e["path"]


@pytest.mark.multiprocess
def test_a_pipeline_over_zero_1_reshards_into_zero_3_and_one_process(tmp_path):
    """pp=2 x dp=2 (ZeRO-1 in each stage), saved after K steps: resumed in its own layout it is
    exact; loaded into stage 3 on 2 ranks or a plain process, continuing equals training straight
    through in that layout; export and full_params give the same whole params."""
    saved = tmp_path / "pp2-dp2"
    pp_dp, zero3 = (2, 1), (0, 3)
    runs = zf.dist.spawn(layout_worker, 4, 4, [(pp_dp, None, 0, N, None), (pp_dp, None, 0, K, saved),
                                               (pp_dp, saved, K, N, None)])
    straight, at_k, resumed = runs[0]
    for rank in range(4):
        for got, want in zip(runs[rank], runs[0]):
            assert_same(got, want, f"full_params on rank {rank}", exact=True)  # every rank: the whole model
    assert_same(resumed, (straight[0][K:], straight[1][K:], straight[2]), "pp2 x dp2 resumed", exact=True)
    assert [runs[rank][2][3] for rank in range(4)] == [[0], [1], [2], [3]]  # each rank reads its own file only
    assert_written_once(saved)
    assert ck.read_manifest(saved)["pipeline"] == 2

    z = zf.dist.spawn(layout_worker, 2, 2, [(zero3, None, 0, N, None), (zero3, saved, K, N, None)])[0]
    assert_same(z[1], (z[0][0][K:], z[0][1][K:], z[0][2]), "pp2 x dp2 -> stage 3 on 2 ranks")

    plain = layout_worker(0, 1, [((0, 0), None, 0, N, None), ((0, 0), saved, K, N, None)])
    assert_same(plain[1], (plain[0][0][K:], plain[0][1][K:], plain[0][2]), "pp2 x dp2 -> one process")
    exported = load_file(ck.export(saved, tmp_path / "model.safetensors"))
    for name, value in at_k[2].items():
        if name != "head.weight":  # tied to emb.weight: exported once
            assert torch.equal(exported[name], value), name


@pytest.mark.multiprocess
def test_plain_and_zero_1_checkpoints_load_into_a_pipeline_and_back(tmp_path):
    """A plain checkpoint and a ZeRO-1 one (2 ranks) load into pp=2; continuing equals the
    pipeline trained straight through. A pp=2 checkpoint resumes exactly and loads into one process."""
    plain_ckpt, zero1_ckpt, pp_ckpt = tmp_path / "plain", tmp_path / "zero1", tmp_path / "pp2"
    plain = layout_worker(0, 1, [((0, 0), None, 0, N, None), ((0, 0), None, 0, K, plain_ckpt)])
    pp = (2, 0)
    runs = zf.dist.spawn(layout_worker, 2, 2, [((0, 1), None, 0, K, zero1_ckpt), (pp, None, 0, N, None),
                                               (pp, None, 0, K, pp_ckpt), (pp, pp_ckpt, K, N, None),
                                               (pp, plain_ckpt, K, N, None), (pp, zero1_ckpt, K, N, None)])
    _, straight, _, resumed, from_plain, from_zero1 = runs[0]
    assert_same(runs[1][1], straight, "full_params on rank 1", exact=True)
    rest = (straight[0][K:], straight[1][K:], straight[2])
    assert_same(resumed, rest, "pp2 resumed", exact=True)
    assert_same(from_plain, rest, "plain -> pp2")
    assert_same(from_zero1, rest, "stage 1 on 2 ranks -> pp2")
    assert resumed[3] == [0] and runs[1][3][3] == [1]  # each stage reads only the file holding its params
    assert runs[1][5][3] == [0, 1]  # stage 1 of 2 needs rows of its params from both ZeRO-1 ranks
    assert_written_once(pp_ckpt)
    back = layout_worker(0, 1, [((0, 0), pp_ckpt, K, N, None)])[0]
    assert_same(back, (plain[0][0][K:], plain[0][1][K:], plain[0][2]), "pp2 -> one process")


def test_a_format_1_checkpoint_still_loads_and_is_checked_whole(tmp_path):
    """Checkpoints written before format 2 (every rank's file holding all its leaves, one crc32
    per file) load as they did: rows from each rank's file, unsplit leaves from rank 0's."""
    import json
    import zlib

    from safetensors.torch import save_file

    w = torch.arange(10.0)
    directory = tmp_path / "000003"
    directory.mkdir()
    crcs = {}
    for rank in range(2):  # chunk 5: rank r holds rows [5r, 5r + 5) of w and of its moment
        name = f"rank{rank:05d}.safetensors"
        save_file({"params/w": w[5 * rank : 5 * rank + 5].clone(), "opt_state/0/w": -w[5 * rank : 5 * rank + 5],
                   "opt_state/1": torch.tensor(3)}, str(directory / name))
        crcs[name] = zlib.crc32((directory / name).read_bytes())
    split = {"split_like": "w", "full_shape": [10], "chunk": 5}
    (directory / "manifest.json").write_text(json.dumps({
        "format": 1, "world": 2, "stage": 1, "step": 3, "run": "", "rng": 0, "extra": {}, "files": crcs,
        "leaves": [{"path": "params/w", "dtype": "float32", "shape": [5], **split},
                   {"path": "opt_state/0/w", "dtype": "float32", "shape": [5], **split},
                   {"path": "opt_state/1", "dtype": "int64", "shape": [], "split_like": None, "full_shape": None,
                    "chunk": None},
                   {"path": "step", "value": 3}, {"path": "rng", "value": 0}]}))
    template = zf.TrainState({"w": torch.zeros(10)}, ({"w": torch.zeros(10)}, torch.tensor(0)))
    state = ck.load(directory, template)
    assert torch.equal(state.params["w"], w) and torch.equal(state.opt_state[0]["w"], -w)
    assert state.opt_state[1].item() == 3 and state.step == 3
    data = bytearray((directory / "rank00001.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (directory / "rank00001.safetensors").write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match=r"rank00001.safetensors: checksum mismatch.*whole file"):
        ck.load(directory, template)


def bn_pipeline_worker(rank, world, directory):
    """The BatchNorm stack (tests.models.NormStack) on 2 stages: 2 steps saved; loaded by a fresh pipelined step,
    each stage gets back its own units' statistics, and the 3rd step equals the uninterrupted one."""
    from tests.models import bn_batches
    from tests.models import norm_step

    step, state = norm_step(zf.Mesh(pp=world))
    for batch in bn_batches()[:2]:
        state, _ = step(state, batch)
    ck.save(state, directory)
    fresh, _ = norm_step(zf.Mesh(pp=world))
    loaded = ck.load(directory, fresh)
    assert loaded.buffers.keys() == state.buffers.keys()
    assert all(torch.equal(loaded.buffers[n], b) for n, b in state.buffers.items())
    saved = zf.tree.clone(state.buffers)
    (a, _), (b, _) = step(state, bn_batches()[2]), fresh(loaded, bn_batches()[2])
    assert all(torch.equal(a.buffers[n], b.buffers[n]) for n in a.buffers)
    return saved


@pytest.mark.multiprocess
def test_a_pipelined_state_keeps_each_stage_batchnorm_statistics(tmp_path):
    from tests.models import norm_step

    directory = str(tmp_path / "000002")
    stages = zf.dist.spawn(bn_pipeline_worker, 2, 2, directory)
    assert stages[0] and stages[1] and not stages[0].keys() & stages[1].keys()
    plain = ck.load(directory, norm_step()[0])  # one process: every stage's statistics
    assert plain.buffers.keys() == stages[0].keys() | stages[1].keys()
    for buffers in stages:
        assert all(torch.equal(plain.buffers[n], b) for n, b in buffers.items())


def test_reads_ahead_follow_the_plan_and_any_other_order_reads_the_same(tmp_path, monkeypatch):
    from zfunc.checkpoint import files as cf

    monkeypatch.setattr(cf, "AHEAD_BYTES", 1)  # one tensor read ahead past the first
    tensors = {f"t{i}": torch.randn(1000 + i) for i in range(5)}
    cf.write_safetensors(tmp_path / cf.rank_file(0), tensors)
    crcs = cf.write_safetensors(tmp_path / "again", tensors)
    manifest = {"format": 2, "world": 1, "files": {cf.rank_file(0): crcs[cf.HEADER]}}
    with cf.RankFiles(tmp_path, manifest, verify=True) as files:
        files.plan([(0, "t0"), (0, "t1"), (0, "t1"), (0, "nope"), (0, "t4")])
        for name in ["t0", "t3", "t1", "t1", "t2"]:  # off the plan at t3: read when asked
            assert torch.equal(files.read(0, name, crcs[name]), tensors[name])
        with pytest.raises(ck.CheckpointError, match="tensor nope missing"):
            files.read(0, "nope")
    with pytest.raises(ck.CheckpointError, match="checksum mismatch"), cf.RankFiles(tmp_path, manifest, True) as files:
        files.plan([(0, "t0"), (0, "t1")])
        files.read(0, "t0", crcs["t1"])
        files.read(0, "t1", crcs["t1"])
