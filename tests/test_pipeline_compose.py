"""The pipeline composes: pp x dp with ZeRO 2 and 3 over each stage's dp ranks, pipeline units
under zf.remat, a stage's optimizer offloaded (one rank per stage, or its ZeRO 1-3 slices over its
dp ranks); each trains as the plain step (fp32, 1e-5) and its checkpoints load into one process."""
import pytest
import torch

import zfunc as zf
from tests.models import Block, PipeTiny, adamw, assert_same_training, pipe_batches as batches, token_loss, train_on
from zfunc import checkpoint as ck

# (ZeRO stage, remat, schedule) on pp 2 x dp 2: ZeRO 2 and 3; remat'ed units (over ZeRO 1) with 1F1B and zero-bubble
CONFIGS = [(2, False, "1f1b"), (3, False, "1f1b"), (1, True, "1f1b"), (1, True, "zero-bubble")]


def make(pp=1, zero=0, remat=False, schedule="1f1b", world=1):
    """``(step, state)`` of the pipeline test model: plain, or ``pp`` stages over ZeRO stage ``zero``
    on the other ``world / pp`` ranks; ``remat``: every block's forward under zf.remat."""
    torch.manual_seed(0)
    model = PipeTiny()
    if remat:
        for block in model.blocks:
            block.forward = zf.remat(block.forward)
    apply, params = zf.functionalize(model)
    step = zf.train_step(token_loss(apply), adamw(True))
    if pp > 1:
        mesh = zf.Mesh(dp=world // pp, pp=pp)
        by_block = zf.units.by_class(Block)
        step = zf.shard(step, mesh, zero, units=by_block if zero == 3 else None)
        step = zf.pipeline(step, stages=pp, microbatches=2, schedule=schedule, model=model, units=by_block)
    return step, step.init(params)


def worker(rank, world, directory):
    out = []
    for zero, remat, schedule in CONFIGS:
        step, state = make(2, zero, remat, schedule, world)
        calls = []  # each call of a block, forward or recomputed
        for block in step.model.blocks:
            block.register_forward_pre_hook(lambda module, args: calls.append(module))
        state, losses, norms = train_on(step, state, batches(), step.mesh.rank, step.mesh.dp)
        ck.save(state, directory / checkpoint_name((zero, remat, schedule)))
        out.append((losses, norms, ck.full_params(state), len(calls)))
    return out


def checkpoint_name(config: tuple) -> str:
    """The folder a pp 2 x dp 2 worker saves ``config``'s state in."""
    return "-".join(map(str, config))


def check_block_calls(config: tuple, calls: int, what: str) -> None:
    """A stage's 2 blocks run once per microbatch (2 a step, 3 steps), 3 times with remat: twice in
    forward (zf.remat calls the module inside its call) and again in backward."""
    remat = config[1]
    assert calls >= 6 * 2 * (3 if remat else 1), (what, calls)


def offload_worker(rank, world, directory, where, params_at):
    torch.manual_seed(0)
    model = PipeTiny()
    apply, params = zf.functionalize(model)
    path = str(directory / "swap") if "nvme" in (where, params_at) else None
    units = "auto" if params_at else None
    step = zf.offload(zf.train_step(token_loss(apply), adamw(True)), where, params_at, path=path, units=units)
    step = zf.pipeline(step, stages=world, microbatches=2, model=model, units=zf.units.by_class(Block))
    state, losses, norms = train_on(step, step.init(params), batches())
    ck.save(state, directory / "pp-offload")
    full = ck.full_params(state)
    again = ck.load(directory / "pp-offload", step)  # resumed into the pipelined, offloaded step (its files)
    assert str(again.placement) == str(state.placement) and again.step == state.step
    for name, value in ck.full_params(again).items():
        assert torch.equal(value, full[name]), name
    within = str(again.placement.within)
    zf.offloading.release(step, again)
    return losses, norms, full, within


@pytest.mark.multiprocess
@pytest.mark.parametrize("where, params_at", [("cpu", None), ("nvme", None), ("cpu", "nvme")])
def test_pp2_with_the_optimizer_offloaded_equals_the_plain_step_and_loads_into_one_process(tmp_path, where,
                                                                                            params_at):
    """Each stage's optimizer state (and with ``params_at`` its masters) in CPU RAM or swap files."""
    results = zf.dist.spawn(offload_worker, 2, 2, tmp_path, where, params_at)
    assert not (tmp_path / "swap").exists() or not any((tmp_path / "swap").rglob("*.swap"))  # released
    plain_step, ref = make()
    ref, ref_losses, ref_norms = train_on(plain_step, ref, batches())
    for rank, out in enumerate(results):
        assert f"optimizer on {where}, params on {params_at or 'the compute device'}" in out[3], out[3]
        assert_same_training(out[:3], (ref_losses, ref_norms, ref.params), f"pp2 + {where} offload, rank {rank}")
    loaded = ck.load(tmp_path / "pp-offload", make()[0])
    assert loaded.step == ref.step
    for name, value in ref.params.items():
        torch.testing.assert_close(loaded.params[name], value, rtol=1e-5, atol=1e-5, msg=name)


SHARDED_OFFLOADS = [(1, "cpu", None), (2, "cpu", None), (3, "cpu", None), (2, "nvme", None), (3, "cpu", "nvme")]


def sharded_offload_worker(rank, world, directory):
    """pp 2 x dp 2, each stage's ZeRO-``zero`` slices' optimizer state (and masters: ``params``)
    offloaded to CPU RAM or swap files: losses, norms, the whole params; each state saved, its
    files released."""
    out = []
    for zero, where, params_at in SHARDED_OFFLOADS:
        torch.manual_seed(0)
        model = PipeTiny()
        apply, params = zf.functionalize(model)
        by_block = zf.units.by_class(Block)
        step = zf.shard(zf.train_step(token_loss(apply), adamw(True)), zf.Mesh(dp=world // 2, pp=2), zero,
                        units=by_block if zero == 3 else None)
        path = str(directory / f"swap{rank}") if "nvme" in (where, params_at) else None
        step = zf.pipeline(zf.offload(step, where, params_at, path=path), stages=2, microbatches=2, model=model,
                           units=by_block)
        state, losses, norms = train_on(step, step.init(params), batches(), step.mesh.rank, step.mesh.dp)
        ck.save(state, directory / checkpoint_name((zero, where, params_at)))
        out.append((losses, norms, ck.full_params(state), str(state.placement)))
        zf.offloading.release(step, state)
    return out


def check_placement(config: tuple, placement: str, what: str) -> None:
    """The state's placement names the stage's ZeRO stage over its 2 dp ranks and where offload put it."""
    zero, where, params_at = config
    want = f"stage {zero} over 2 ranks, optimizer on {where}, params on {params_at or 'the compute device'}"
    assert want in placement, (what, placement)


# pp 2 x dp 2 on 4 ranks: the worker, its configs, what a config is called, the check of what the worker
# returns beside losses, norms and params
PP2_X_DP2 = {
    "zero-2-3-and-remat": (worker, CONFIGS, "zero {}, remat {}, {}", check_block_calls),
    "zero-slices-offloaded": (sharded_offload_worker, SHARDED_OFFLOADS, "zero {}, optimizer on {}, params on {}",
                              check_placement),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", list(PP2_X_DP2))
def test_pp2_x_dp2_equals_the_plain_step_and_loads_into_one_process(tmp_path, family):
    """ZeRO 2 and 3 and remat'ed units over each stage's dp ranks (``CONFIGS``), or each stage's ZeRO
    slices offloaded (``SHARDED_OFFLOADS``): every rank trains as the plain step and every config's
    checkpoint loads into one process."""
    run, configs, label, check = PP2_X_DP2[family]
    results = zf.dist.spawn(run, 4, 4, tmp_path)
    plain_step, ref = make()
    ref, ref_losses, ref_norms = train_on(plain_step, ref, batches())
    for k, config in enumerate(configs):
        what = label.format(*config)
        for rank, out in enumerate(results):
            assert_same_training(out[k][:3], (ref_losses, ref_norms, ref.params), f"{what}, rank {rank}")
            check(config, out[k][3], f"{what}, rank {rank}")
        loaded = ck.load(tmp_path / checkpoint_name(config), make()[0])
        assert loaded.step == ref.step
        for name, value in ref.params.items():
            torch.testing.assert_close(loaded.params[name], value, rtol=1e-5, atol=1e-5, msg=f"{what}: {name}")
