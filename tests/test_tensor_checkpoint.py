"""zf.checkpoint of tensor-parallel states (2 gloo ranks, the recipes' tiny GPT: vocab 61 padded to 62 at
tp=2, a fused q/k/v, row-parallel projections, a tied head): a tp2 checkpoint holds the whole params (the
slicing in the manifest, no padding row), loads bit-exact into tp2, one process and ZeRO-3 over dp2, each of
which trains on as the uninterrupted tp2 run (fp32, 1e-5); a one-process checkpoint loads into tp2."""
import copy
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

import zfunc as zf
from models import assert_same_training, fixtures_step, tree_equal
from test_tensor_parallel import GPT_PLAN, gpt_loss, opt, recipe_model, token_batches

SAVED_AT = 2  # steps before the save; the other three after it


def trained_on(step, state, batches, rank=None):
    """``(state, losses, grad norms)`` after ``batches`` (with ``rank``: its half of each, for dp2)."""
    losses, norms = [], []
    for x, y in batches:
        if rank is not None:
            x, y = x.chunk(2)[rank], y.chunk(2)[rank]
        state, m = step(state, (x, y))
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    return state, losses, norms


def plain_step(model):
    apply, params = zf.functionalize(model)
    return zf.train_step(gpt_loss(apply), opt()), params


def resume_laws(rank, root):
    """Save a tp2 state after 2 steps; load it at tp2, at tp1 and at dp2 ZeRO-3, train 3 more steps on each;
    and load a one-process checkpoint at tp2."""
    root = Path(root)
    model, _ = recipe_model("gpt")
    whole_model = copy.deepcopy(model)
    zf.tensor_parallel(model, zf.Mesh(tp=2), GPT_PLAN)
    layout = zf.tensor_parallel.layout_of(model)
    apply, params = zf.functionalize(model)
    step = zf.tensor_parallel.step(zf.train_step(gpt_loss(apply), opt()), model)
    batches = token_batches()
    state, _, _ = trained_on(step, step.init(params), batches[:SAVED_AT])
    zf.checkpoint.save(state, root / "tp2")
    saved, held = zf.checkpoint.full_params(state), zf.tree.clone((state.params, state.opt_state))
    cont, losses, norms = trained_on(step, state, batches[SAVED_AT:])
    out = {"saved": saved, "uninterrupted": (losses, norms, zf.checkpoint.full_params(cont))}

    back = zf.checkpoint.load(root / "tp2", step)
    out["tp2 bit-exact"] = tree_equal((back.params, back.opt_state), held)
    back, *trained = trained_on(step, back, batches[SAVED_AT:])
    out["tp2"] = (*trained, zf.checkpoint.full_params(back))

    one, whole_params = plain_step(copy.deepcopy(whole_model))
    loaded = zf.checkpoint.load(root / "tp2", one, params=whole_params)
    out["tp1 bit-exact"] = all(torch.equal(loaded.params[n], saved[n]) for n in saved)
    loaded, *trained = trained_on(one, loaded, batches[SAVED_AT:])
    out["tp1"] = (*trained, loaded.params)

    dp = zf.Mesh(dp=2)
    inner, dp_params = plain_step(copy.deepcopy(whole_model))
    zero3 = zf.shard(inner, dp, stage=3)
    loaded = zf.checkpoint.load(root / "tp2", zero3, params=dp_params)
    whole = zf.checkpoint.full_params(loaded, dp)
    out["dp2 bit-exact"] = all(torch.equal(whole[n], saved[n]) for n in saved)
    loaded, *trained = trained_on(zero3, loaded, batches[SAVED_AT:], rank)
    out["dp2"] = (*trained, zf.checkpoint.full_params(loaded, dp))

    if rank == 0:  # a one-process checkpoint (tp1) of the whole model, trained 2 steps
        fresh, fresh_params = plain_step(copy.deepcopy(whole_model))
        ref, _, _ = trained_on(fresh, fresh.init(fresh_params), batches[:SAVED_AT])
        zf.checkpoint.save(ref, root / "tp1")
    dist.barrier()
    ref = zf.checkpoint.load(root / "tp1", plain_step(copy.deepcopy(whole_model))[0], params=whole_params)
    cut = zf.checkpoint.load(root / "tp1", step)
    moments = {n: (m, v) for n, m, v in moment_pairs(ref)}
    out["tp1 -> tp2 bit-exact"] = all(
        torch.equal(cut.params[n], layout.piece(n, ref.params[n]))
        and all(torch.equal(mine, layout.piece(n, whole)) for mine, whole in zip(moments_of(cut, n), moments[n]))
        for n in cut.params)
    return out


def moments_of(state, name):
    """AdamW's two moments of param ``name`` in a state of the tests' optimizer (clip, then adamw)."""
    adam = state.opt_state[1]
    return adam.mu[name], adam.nu[name]


def moment_pairs(state):
    return [(n, *moments_of(state, n)) for n in state.params]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-checkpoints")
    return root, zf.dist.spawn(resume_laws, 2, str(root), timeout_s=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tp2", "tp1", "dp2"])
def test_a_tp2_checkpoint_loads_bit_exact_and_trains_on(resumed, layout):
    _, results = resumed
    for out in results:
        assert out[f"{layout} bit-exact"], f"the params loaded at {layout} differ from the saved ones"
        assert_same_training(out[layout], out["uninterrupted"], f"resumed at {layout}")


@pytest.mark.multiprocess
def test_a_one_process_checkpoint_loads_into_tp2_with_its_moments(resumed):
    for out in resumed[1]:
        assert out["tp1 -> tp2 bit-exact"]


@pytest.mark.multiprocess
def test_the_manifest_records_the_slicing_and_no_vocab_padding(resumed):
    root, results = resumed
    manifest = zf.checkpoint.read_manifest(root / "tp2")
    leaves = {e["path"]: e for e in manifest["leaves"]}
    assert (manifest["format"], manifest["world"], manifest["tp"]) == (3, 2, 2)
    wte = leaves["params/wte.weight"]
    assert wte["full_shape"] == [61, 32] and wte["slicing"] == {"dim": 0, "tp": 2, "padded": 62, "parts": 1}
    pieces = sorted((p["slice"], p["file"], tuple(p["rows"])) for p in wte["pieces"])
    assert pieces == [(0, 0, (0, 31)), (1, 1, (0, 31))]  # slice r by rank r, padding row included
    assert leaves["params/blocks.0.attn.qkv.weight"]["slicing"]["parts"] == 3
    assert leaves["params/blocks.0.attn.proj.weight"]["slicing"]["dim"] == 1
    assert "slicing" not in leaves["params/blocks.0.ln1.weight"]  # replicated: written once, whole
    assert [p["file"] for p in leaves["params/blocks.0.ln1.weight"]["pieces"]] == [0]
    exported = safetensors.torch.load_file(zf.checkpoint.export(root / "tp2", root / "model.safetensors"))
    saved = results[0]["saved"]
    assert exported.keys() == saved.keys()
    for name, value in exported.items():
        assert torch.equal(value, saved[name]), name


def test_a_deepspeed_checkpoint_fills_a_tp_ranks_slices():
    """An imported checkpoint (DeepSpeed ZeRO-1, read without deepspeed) fills tp rank 1's state of the same
    model, its embedding and head vocab-sliced: each sliced leaf read whole and this rank's slice (rows 6-11)
    cut from it, params and Adam moments; one process (the tp=2 mesh's shape only: nothing is trained)."""
    from fixtures.make_deepspeed_checkpoints import model
    from models import mesh_shaped
    from test_checkpoint_import import FIXTURES, fixture

    net = model()
    zf.tensor_parallel(net, mesh_shaped(tp=2, tp_rank=1), {"emb": "vocab", "head": "vocab"})
    apply, params = zf.functionalize(net)
    step = zf.tensor_parallel.step(zf.train_step(lambda p, b: apply(p, b).sum(), zf.optim.adamw(1e-2)), net)
    state = zf.checkpoint.load_deepspeed(FIXTURES / "zero1", step, params=params)
    layout, whole = zf.tensor_parallel.layout_of(net), fixture(1)["params"]
    assert state.params["emb.weight"].shape == (6, 5) and set(layout.slicings) == {"emb.weight", "head.weight"}
    for name, piece in state.params.items():
        assert torch.equal(piece, layout.piece(name, whole[name])), name
    plain_step, plain_params = fixtures_step()
    plain = zf.checkpoint.load_deepspeed(FIXTURES / "zero1", plain_step, params=plain_params)
    for name in state.params:
        assert torch.equal(state.opt_state.mu[name], layout.piece(name, plain.opt_state.mu[name])), name
