"""checkpoint: resume is bit-exact, any layout reshards into any other, faults are caught."""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import zfunc as zf
from zfunc import checkpoint as ck
from test_shard import Tiny, batches, local, make  # noqa: E402  (tests/ is on sys.path)


def run(step, state, data, rank=0, world=1):
    for batch in data:
        state, _ = step(state, local(batch, rank, world))
    return state


def fp16_dropout_step():
    """A plain step with everything resume must carry: fp16 loss scale, dropout RNG, Adam moments."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(13, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 13))
    apply, params = zf.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply(p, x).float().flatten(0, 1), y.flatten())

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2), precision="fp16", seed=3)
    return step, step.init(params).replace(loss_scale=zf.precision.LossScale(2.0**10, 0, growth_interval=3))


def resume_plain(directory):
    step, _ = fp16_dropout_step()
    state = ck.load(directory, step)
    position = ck.read_manifest(directory)["extra"]["data_position"]
    return run(step, state, batches(1, 10)[position:]).params


def test_plain_resume_is_bit_exact_in_a_new_process(tmp_path):
    step, state = fp16_dropout_step()
    straight = run(*fp16_dropout_step(), batches(1, 10))
    state = run(step, state, batches(1, 10)[:5])
    ck.save(state, tmp_path / "000005", extra={"data_position": 5})
    resumed = zf.dist.spawn(lambda_free_resume, 1, str(tmp_path / "000005"))[0]
    assert straight.loss_scale == (2.0**13, 1, 3)  # the scale grew mid-run: it is carried
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


@pytest.mark.parametrize("stage", [1, 2, 3])
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
    assert state.sharding.world == world and state.sharding.stage == stage
    return ck.full_params(state, mesh), zf.tree.leaves(state.opt_state)[0]


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
    state = zf.TrainState({{"w": torch.ones(1000)}}, (), 0, 0, None)
    ck.save(state, {root!r} + "/000001")
    write = ck._write_safetensors
    def stuck(path, tensors):   # mid-save: the rank file is written, the manifest is not
        write(path, tensors)
        print("mid-save", flush=True)
        time.sleep(60)
    ck._write_safetensors = stuck
    ck.save(state.replace(step=2), {root!r} + "/000002")
""")


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path):
    code = KILLED_MID_SAVE.format(paths=sys.path, root=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mid-save"
    finally:
        proc.kill()
        proc.wait()
    assert ck.latest(tmp_path) == tmp_path / "000001"
    template = zf.TrainState({"w": torch.zeros(1000)}, (), 0, 0, None)
    assert ck.load(ck.latest(tmp_path), template).params["w"].sum() == 1000
    assert not (tmp_path / "000002").exists()


def test_corruption_and_mismatches_raise_clear_errors(tmp_path):
    step, state = fp16_dropout_step()
    directory = ck.save(state, tmp_path / "000000")
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    other = zf.train_step(step.loss_fn, zf.optim.sgd(0.1))  # another optimizer: another structure
    with pytest.raises(ck.CheckpointError, match="structure differs"):
        ck.load(directory, other)
    template = zf.tree.map(lambda x: x.double() if isinstance(x, torch.Tensor) else x, state)
    with pytest.raises(ck.CheckpointError, match="float32 in the checkpoint, torch.float64 in the state"):
        ck.load(directory, template)
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
    from test_shard import hf_model

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
    """Stage 3 over ``world`` ranks of test_module's BatchNorm model: 3 steps straight, or 2 saved
    and then 1 after loading; returns the whole params and the buffers."""
    from test_module import BNNet, bn_batches, bn_step

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


def test_module_buffers_round_trip_plain_and_sharded(tmp_path):
    from test_module import BN_STATS, BNNet, bn_batches, bn_step

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
