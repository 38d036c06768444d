"""train_step: accumulation, mixed precision, loss scaling, donation and purity, bad input."""
import copy

import pytest
import torch
from torch import nn

import zfunc as zf
from zfunc import optim


def mlp(dropout=0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 2))


def data(n, batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randn(batch, 2, generator=g)) for _ in range(n)]


def make_step(model, tx=None, **kw):
    apply, params = zf.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return nn.functional.mse_loss(apply(p, x).float(), y)

    step = zf.train_step(loss_fn, tx or optim.adamw(1e-2, weight_decay=0.1), **kw)
    return step, step.init(params)


def run(step, state, batches):
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"].item())
    return state, losses


def test_accum_4_on_batch_4b_equals_accum_1():
    batches = data(5, batch=16)
    s1, l1 = run(*make_step(mlp(), accum=1), batches)
    s4, l4 = run(*make_step(mlp(), accum=4), batches)
    for name in s1.params:
        torch.testing.assert_close(s4.params[name], s1.params[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(l4), torch.tensor(l1), rtol=1e-5, atol=0)


def test_bf16_tracks_fp32():
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 0.2%) in forward and backward; with fp32
    # masters the run stays on the fp32 trajectory: losses within 2% relative over 30 steps.
    batches = data(30)
    _, l32 = run(*make_step(mlp()), batches)
    _, l16 = run(*make_step(mlp(), precision="bf16"), batches)
    torch.testing.assert_close(torch.tensor(l16), torch.tensor(l32), rtol=2e-2, atol=0)
    assert l16[-1] < l16[0] * 0.8


def test_fp16_trains_and_reports_its_loss_scale():
    step, state = make_step(mlp(), precision="fp16")
    state, losses = run(step, state, data(1) * 20)
    _, l32 = run(*make_step(mlp()), data(1) * 20)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(l32), rtol=2e-2, atol=0)
    assert losses[-1] < losses[0] * 0.5 and state.loss_scale.scale == 2.0**16
    assert state.params["0.weight"].dtype == torch.float32


def test_fp16_overflow_skips_update_and_halves_scale():
    apply, params = zf.functionalize(mlp())

    def loss_fn(p, batch):  # a loss whose scaled grads overflow fp16 when the batch says so
        x, y, blow_up = batch
        return nn.functional.mse_loss(apply(p, x).float(), y) * (1e6 if blow_up else 1.0)

    step = zf.train_step(loss_fn, optim.adamw(1e-2), precision="fp16", donate=False)
    state = step.init(params)
    x, y = data(1)[0]
    state, m = step(state, (x, y, False))
    assert not m["skipped"]
    before = state
    after, m = step(before, (x, y, True))
    assert m["skipped"] and m["loss_scale"] == 2.0**15 and after.loss_scale.scale == 2.0**15
    for name in before.params:
        assert torch.equal(after.params[name], before.params[name])
    assert after.opt_state.count == before.opt_state.count == 1
    after, m = step(after, (x, y, False))
    assert not m["skipped"] and after.opt_state.count == 2


def test_loss_scale_grows_after_interval():
    step, state = make_step(mlp(), precision="fp16")
    state = state.replace(loss_scale=zf.precision.LossScale(8.0, 0, growth_interval=3))
    state, _ = run(step, state, data(3))
    assert state.loss_scale == zf.precision.LossScale(16.0, 0, 3)


def test_inputs_unmodified_with_donate_false():
    step, state = make_step(mlp(), donate=False)
    before = zf.tree.clone(state.params), zf.tree.clone(state.opt_state)
    batch = data(1)[0]
    batch_before = copy.deepcopy(batch)
    new_state, _ = step(state, batch)
    for a, b in zip(zf.tree.leaves((state.params, state.opt_state)), zf.tree.leaves(before)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert all(torch.equal(a, b) for a, b in zip(batch, batch_before))
    assert not torch.equal(new_state.params["0.weight"], state.params["0.weight"])


def test_donated_state_raises_when_touched():
    step, state = make_step(mlp())
    new_state, _ = step(state, data(1)[0])
    assert state.consumed and not new_state.consumed
    with pytest.raises(zf.ConsumedStateError, match="consumed"):
        state.params
    with pytest.raises(zf.ConsumedStateError):
        step(state, data(1)[0])
    with pytest.raises(zf.ConsumedStateError):
        zf.tree.leaves(state)
    assert "consumed" in repr(state)


def test_donate_and_no_donate_compute_the_same():
    batches = data(4)
    s1, _ = run(*make_step(mlp()), batches)
    s2, _ = run(*make_step(mlp(), donate=False), batches)
    for name in s1.params:
        assert torch.equal(s1.params[name], s2.params[name])


def test_failed_step_leaves_state_usable():
    apply, params = zf.functionalize(mlp())

    def loss_fn(p, batch):
        if batch is None:
            raise RuntimeError("bad batch")
        return apply(p, batch).sum()

    step = zf.train_step(loss_fn, optim.sgd(0.1))
    state = step.init(params)
    with pytest.raises(RuntimeError, match="bad batch"):
        step(state, None)
    state, _ = step(state, torch.randn(2, 6))  # not consumed by the failed call
    assert state.step == 1


def test_init_copies_params():
    model = mlp()
    step, _ = make_step(model)
    apply, params = zf.functionalize(model)
    original = params["0.weight"].clone()
    state = step.init(params)
    state, _ = step(state, data(1)[0])
    assert torch.equal(params["0.weight"], original)
    assert torch.equal(model[0].weight.detach(), original)


def test_dropout_is_seeded_by_state():
    step, state = make_step(mlp(dropout=0.5), donate=False)
    batch = data(1)[0]
    _, m1 = step(state, batch)
    _, m2 = step(state, batch)
    assert m1["loss"] == m2["loss"]
    _, m3 = step(state.replace(rng=7), batch)
    assert m3["loss"] != m1["loss"]


def test_metrics():
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.linear_warmup(1e-2, 2)))
    step, state = make_step(mlp(), tx)
    state, m = step(state, data(1)[0])
    assert set(m) == {"loss", "grad_norm", "lr", "skipped", "step"}
    assert m["lr"] == 5e-3 and m["step"] == 1 and m["grad_norm"] > 0 and m["loss"].dim() == 0


def test_has_aux():
    apply, params = zf.functionalize(mlp())

    def loss_fn(p, batch):
        out = apply(p, batch)
        return out.pow(2).mean(), {"mean_out": out.mean().detach()}

    step = zf.train_step(loss_fn, optim.sgd(0.1), has_aux=True)
    _, m = step(step.init(params), torch.randn(4, 6))
    assert "mean_out" in m["aux"]


def test_value_and_grad_matches_torch_func():
    apply, params = zf.functionalize(mlp())
    x = torch.randn(3, 6)
    fn = lambda p: apply(p, x).pow(2).sum()  # noqa: E731
    loss, grads = zf.value_and_grad(fn)(params)
    ref = torch.func.grad(fn)(params)
    assert loss.requires_grad is False
    for name in params:
        torch.testing.assert_close(grads[name], ref[name])


def test_unused_params_get_zero_grads():
    params = {"used": torch.ones(2), "unused": torch.ones(3)}
    _, grads = zf.value_and_grad(lambda p: p["used"].sum())(params)
    assert torch.equal(grads["unused"], torch.zeros(3))


# ------------------------------------------------------------------------------------ bad input


def test_non_scalar_loss_is_rejected():
    step = zf.train_step(lambda p, b: p["w"] * b, optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"loss_fn: expected a 0-d .*shape \(3,\)"):
        step(step.init({"w": torch.ones(3)}), torch.ones(3))


def test_non_tensor_loss_is_rejected():
    step = zf.train_step(lambda p, b: 1.0, optim.sgd(0.1))
    with pytest.raises(ValueError, match="loss_fn.*float"):
        step(step.init({"w": torch.ones(3)}), None)


def test_mixed_device_params_are_rejected():
    step = zf.train_step(lambda p, b: p["a"].sum(), optim.sgd(0.1))
    with pytest.raises(ValueError, match="mixed devices.*cpu.*meta"):
        step.init({"a": torch.ones(2), "b": torch.ones(2, device="meta")})


def test_unknown_precision_is_rejected():
    with pytest.raises(ValueError, match="precision.*'fp8'"):
        zf.train_step(lambda p, b: p, optim.sgd(0.1), precision="fp8")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(loss_fn=lambda p: p, optimizer=optim.sgd(0.1)), "loss_fn"),
        (dict(loss_fn=lambda p, b: p, optimizer=torch.optim.SGD), "optimizer"),
        (dict(loss_fn=lambda p, b: p, optimizer=optim.sgd(0.1), accum=0), "accum"),
    ],
)
def test_bad_train_step_arguments(kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        zf.train_step(**kw)


def test_batch_not_divisible_by_accum_is_rejected():
    step, state = make_step(mlp(), accum=3)
    with pytest.raises(ValueError, match="accum=3.*shape \\(8, 6\\)"):
        step(state, data(1)[0])


def test_state_must_be_a_train_state():
    step, _ = make_step(mlp())
    with pytest.raises(TypeError, match="state: expected a TrainState"):
        step({"params": {}}, None)


def test_train_state_is_a_pytree_and_replace_checks_fields():
    _, state = make_step(mlp())
    assert len(zf.tree.tensors(state)) == 4 + 8  # params + adam moments
    with pytest.raises(TypeError, match="unknown fields"):
        state.replace(parms={})
