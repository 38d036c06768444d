"""The engine on one GPU: a zf.train_step on CUDA (zfunc's CUDA AdamW under it) trains as torch's own
loop with AdamW(fused=True); bf16 trains as the torch kernels do; NCCL world 1 (ZeRO 0-3) trains as the
plain step; offload's pinned buffers and side stream train as the plain step; the recipe picks cuda.
Marked gpu: deselected by default, skipped without CUDA (``pytest -m gpu``).

Tolerances: fp32 as ``tests.models.assert_same_training`` (losses and norms rtol 1e-5, params 1e-5);
bf16 losses rtol 1e-2 and params atol 1e-3 (bf16 compute copies cast from masters that differ by
rounding may round apart).
"""
import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("cupy")

import zfunc as zf  # noqa: E402
from tests.models import STEPS, Block, Tiny, assert_same_training, batches  # noqa: E402
from tests.recipe_runs import TINY  # noqa: E402
from zfunc.ops.gpu import adam as gpu_adam  # noqa: E402

DEV = torch.device("cuda")


def _loss_of(apply):
    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply(p, x).flatten(0, 1).float(), y.flatten())

    return loss_fn


def _step(precision="fp32", backend="auto", clip=True, stage=None, mesh=None, offload=None):
    torch.manual_seed(0)
    apply, params = zf.functionalize(Tiny().to(DEV))
    opt = zf.optim.adamw(1e-2, weight_decay=0.1, mask=zf.optim.decay_mask, backend=backend)
    tx = zf.optim.chain(zf.optim.clip_by_global_norm(0.1), opt) if clip else opt
    step = zf.train_step(_loss_of(apply), tx, precision)
    if stage is not None:
        step = zf.shard(step, mesh, stage, units=zf.units.by_class(Block) if stage == 3 else None)
    if offload is not None:
        step = zf.offload(step, *offload, units=zf.units.by_class(Block) if offload[1] and stage is None else None)
    return step, step.init(params)


def _train(step, state, data):
    losses, norms = [], []
    for x, y in data:
        state, m = step(state, (x.to(DEV), y.to(DEV)))
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    return losses, norms, {k: v.detach().float().cpu() for k, v in zf.checkpoint.full_params(state).items()}


def test_train_step_on_cuda_equals_torchs_loop_with_fused_adamw(monkeypatch):
    calls = []
    real = gpu_adam.adamw_many_
    monkeypatch.setattr(gpu_adam, "adamw_many_", lambda *a, **k: calls.append(1) or real(*a, **k))
    step, state = _step(clip=False)
    data = batches(1)
    losses, _, params = _train(step, state, data)
    assert len(calls) == STEPS  # zfunc's kernel ran every step

    torch.manual_seed(0)
    model = Tiny().to(DEV)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = [p for p in model.parameters() if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-2, fused=True)
    ref_losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x.to(DEV)).flatten(0, 1), y.to(DEV).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for p in model.parameters():
        torch.testing.assert_close(params[names[id(p)]], p.detach().cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_kernels_train_as_torchs_kernels(precision):
    got = _train(*_step(precision), batches(1))
    ref = _train(*_step(precision, backend="torch"), batches(1))
    if precision == "fp32":
        assert_same_training(got, ref, "zfunc's CUDA AdamW vs torch's fused AdamW")
    else:
        torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-2, atol=1e-3)
        for k in ref[2]:
            torch.testing.assert_close(got[2][k], ref[2][k], rtol=0, atol=1e-3, msg=k)


@pytest.fixture
def nccl_world_1():
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        yield zf.Mesh(dp=1)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nccl_world_1_shards_train_as_the_plain_step(nccl_world_1, stage):
    got = _train(*_step(stage=stage, mesh=nccl_world_1), batches(1))
    assert_same_training(got, _train(*_step(), batches(1)), f"NCCL world 1, ZeRO-{stage}")


@pytest.mark.parametrize("params", [None, "cpu"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_with_pinned_buffers_and_a_side_stream_trains_as_the_plain_step(params, precision):
    step, state = _step(precision, offload=("cpu", params))
    masters = [m for m in zf.tree.leaves(state.params) if isinstance(m, torch.Tensor)]
    assert masters and all(m.device.type == "cpu" and m.is_pinned() for m in masters)
    got = _train(step, state, batches(1))
    ref = _train(*_step(precision), batches(1))
    if precision == "fp32":
        assert_same_training(got, ref, f"offload optimizer=cpu params={params}")
    else:
        torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-2, atol=1e-3)


def test_the_recipe_trains_on_cuda_by_default(tmp_path, text_file):
    from recipes import gpt

    result = gpt.main(TINY + ["--steps", "5", "--eval-every", "0", "--data", str(text_file), "--out",
                              str(tmp_path / "out"), "--sample-len", "4"])
    assert result["mfu"] is not None and result["mfu"] > 0  # MFU is reported on a known GPU only
    rows = (tmp_path / "out" / "metrics.jsonl").read_text()
    assert "peak_mem_mb" in rows
