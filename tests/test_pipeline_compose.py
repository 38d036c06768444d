"""The pipeline composes: pp x dp with ZeRO 2 and 3 over each stage's dp ranks, and pipeline
units under zf.remat; each trains as the plain step (fp32, 1e-5) and its checkpoints load into one
process."""
import pytest
import torch

import zfunc as zf
from tests.models import Block, PipeTiny, adamw, assert_same_training, pipe_batches as batches, token_loss, train_on
from zfunc import checkpoint as ck


def make(pp=1, zero=0, remat=False, schedule="1f1b", world=1):
    """``(step, state)`` of the pipeline test model: plain, or ``pp`` stages over ZeRO stage ``zero``
    (0: none) on the other ``world / pp`` ranks; ``remat``: every block's forward under zf.remat."""
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
        if zero:
            step = zf.shard(step, mesh, zero, units=by_block if zero == 3 else None)
        step = zf.pipeline(step, stages=pp, microbatches=2, schedule=schedule, model=model, units=by_block,
                           mesh=None if zero else mesh)
    return step, step.init(params)


def zero_worker(rank, world, directory):
    out = {}
    for zero in (2, 3):
        step, state = make(2, zero, world=world)
        state, losses, norms = train_on(step, state, batches(), step.mesh.rank, step.mesh.dp)
        ck.save(state, directory / f"zero{zero}")
        out[zero] = (losses, norms, ck.full_params(state))
    return out


@pytest.mark.multiprocess
def test_pp2_x_dp2_with_zero_2_and_3_equals_the_plain_step_and_loads_into_one_process(tmp_path):
    results = zf.dist.spawn(zero_worker, 4, 4, tmp_path)
    plain_step, ref = make()
    ref, ref_losses, ref_norms = train_on(plain_step, ref, batches())
    for zero in (2, 3):
        for rank, out in enumerate(results):
            assert_same_training(out[zero], (ref_losses, ref_norms, ref.params), f"zero {zero}, rank {rank}")
        loaded = ck.load(tmp_path / f"zero{zero}", make()[0])
        assert loaded.step == ref.step
        for name, value in ref.params.items():
            torch.testing.assert_close(loaded.params[name], value, rtol=1e-5, atol=1e-5, msg=f"zero {zero}: {name}")


def remat_worker(rank, world):
    out = {}
    for schedule in ("1f1b", "zero-bubble"):
        step, state = make(2, remat=True, schedule=schedule, world=world)
        calls = []  # each call of a block, forward or recomputed (zf.remat calls the module inside its forward)
        for block in step.model.blocks:
            block.register_forward_pre_hook(lambda module, args: calls.append(module))
        state, losses, norms = train_on(step, state, batches())
        out[schedule] = (losses, norms, dict(state.params), len(calls))
    return out


@pytest.mark.multiprocess
def test_pp2_with_remat_of_whole_units_equals_the_plain_step():
    results = zf.dist.spawn(remat_worker, 2, 2)
    ref, ref_losses, ref_norms = train_on(*make(), batches())
    for schedule in ("1f1b", "zero-bubble"):
        for rank, out in enumerate(results):
            got = out[schedule]
            assert_same_training(got[:3], (ref_losses, ref_norms, ref.params), f"{schedule}, rank {rank}",
                                 names=got[2])
            # the stage's 2 blocks run 3 times per microbatch (2 a step, 3 steps): twice in forward (zf.remat
            # calls the module inside its call) and again in backward; once without remat
            assert got[3] >= 6 * 2 * 3, (schedule, rank, got[3])
