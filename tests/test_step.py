"""train_step: accumulation, mixed precision, loss scaling, donation and purity, bad input."""
import copy

import pytest
import torch
from torch import nn

import zfunc as zf
from tests.models import PoisonGrad
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


# ------------------------------------------------------------------------------ non-finite steps


def guarded_step(precision="fp32", **kw):
    """A step whose batch is ``(x, y, fault)``: fault "nan_loss" multiplies the loss by nan,
    "inf_grads" keeps it finite and makes its grads inf, None trains normally."""
    apply, params = zf.functionalize(mlp())

    def loss_fn(p, batch):
        x, y, fault = batch
        loss = nn.functional.mse_loss(apply(p, x).float(), y)
        if fault == "nan_loss":
            return loss * float("nan")
        return PoisonGrad.apply(loss) if fault == "inf_grads" else loss

    step = zf.train_step(loss_fn, optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1)),
                         precision, **kw)
    return step, step.init(params)


def good(k=0):
    x, y = data(1, seed=k + 1)[0]
    return x, y, None


def assert_trees_equal(a, b):
    la, lb = zf.tree.leaves(a), zf.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fault", ["nan_loss", "one_nan_in_batch", "inf_grads"])
def test_a_non_finite_step_is_skipped_and_returns_the_state_it_was_given(fault, precision, donate):
    step, state = guarded_step(precision, donate=donate)
    state, _ = step(state, good())  # moments are non-zero from here on
    before = zf.tree.clone((state.params, state.opt_state))
    x, y, _ = good(1)
    batch = (x, y, fault)
    if fault == "one_nan_in_batch":
        x[3, 2] = float("nan")
        batch = (x, y, None)
    scale = state.loss_scale.scale
    after, m = step(state, batch)
    assert m["skipped"] and m["step"] == after.step == 2
    assert torch.isfinite(m["loss"]) == (fault == "inf_grads") and not torch.isfinite(m["grad_norm"])
    assert state.consumed == donate
    assert_trees_equal((after.params, after.opt_state), before)  # with donation too: decided before any write
    assert after.loss_scale.skips == 1 and after.loss_scale.scale == (scale / 2 if precision == "fp16" else 1.0)
    after, m = step(after, good(2))  # the next finite step trains and ends the run of skips
    assert not m["skipped"] and after.loss_scale.skips == 0 and after.opt_state[1].count == 2
    assert not torch.equal(after.params["0.weight"], before[0]["0.weight"])


def test_skipping_keeps_the_trajectory_of_a_run_without_the_bad_batch():
    ref_step, ref = guarded_step()
    step, state = guarded_step()
    for k in range(3):
        ref, _ = ref_step(ref, good(k))
        state, _ = step(state, good(k))
        state, m = step(state, (*good(k)[:2], "nan_loss"))
        assert m["skipped"]
    assert_trees_equal((state.params, state.opt_state), (ref.params, ref.opt_state))
    assert state.step == 6 and ref.step == 3  # skipped steps count (torch's GradScaler and DeepSpeed do too)


@pytest.mark.parametrize("fault, cause", [("nan_loss", r"non-finite loss \(nan\)"),
                                          ("inf_grads", r"non-finite grads \(grad norm (inf|nan)\)")])
def test_too_many_skips_in_a_row_raise_naming_the_step_and_the_cause(fault, cause):
    step, state = guarded_step(max_skips=2)
    state, _ = step(state, good())
    for _ in range(2):
        state, m = step(state, (*good()[:2], fault))
        assert m["skipped"]
    with pytest.raises(zf.NonFiniteError, match=rf"3 non-finite steps in a row, the last at state.step=3: {cause}; "
                                                r"train_step\(max_skips=2\)"):
        step(state, (*good()[:2], fault))
    assert not state.consumed  # nothing was written: the state is still usable
    state, m = step(state, good())
    assert not m["skipped"] and state.step == 4


def test_max_skips_0_raises_at_the_first_non_finite_step_and_fp16_names_its_scale():
    step, state = guarded_step("fp16", max_skips=0)
    with pytest.raises(zf.NonFiniteError, match=r"state.step=0: non-finite grads .* at loss scale 65536.0"):
        step(state, (*good()[:2], "inf_grads"))


def test_fp16_default_max_skips_lets_the_initial_scale_come_down():
    # a loss scaled by 1e4 overflows fp16 until the scale is down from 2**16 to 4: 13 skips in a
    # row, more than fp32/bf16's 10, fewer than fp16's 26
    apply, params = zf.functionalize(mlp())
    loss_fn = lambda p, b: nn.functional.mse_loss(apply(p, b[0]).float(), b[1]) * 1e4  # noqa: E731
    step = zf.train_step(loss_fn, optim.adamw(1e-3), "fp16")
    assert step.max_skips == 26 and zf.train_step(loss_fn, optim.adamw(1e-3)).max_skips == 10
    state, skipped = step.init(params), []
    for batch in data(16):
        state, m = step(state, batch)
        skipped.append(m["skipped"])
    assert skipped[:13] == [True] * 13 and not any(skipped[13:])
    strict = zf.train_step(loss_fn, optim.adamw(1e-3), "fp16", max_skips=10)
    state = strict.init(params)
    with pytest.raises(zf.NonFiniteError, match="11 non-finite steps in a row"):
        for batch in data(16):
            state, _ = strict(state, batch)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_max_skips_must_be_an_int_at_least_0(bad):
    with pytest.raises(ValueError, match=f"max_skips: expected None or an int >= 0, got {bad!r}"):
        zf.train_step(lambda p, b: p, optim.sgd(0.1), max_skips=bad)


def test_a_schedule_returning_nan_raises_naming_the_count_before_the_state_is_touched():
    step, state = make_step(mlp(), optim.adamw(lambda count: float("nan") if count == 1 else 1e-3))
    state, _ = step(state, data(1)[0])
    with pytest.raises(ValueError, match="learning_rate: the schedule returned nan at update count 1"):
        step(state, data(1)[0])
    assert not state.consumed


# ------------------------------------------------------------------------------ params without grads


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(6, 2)
        self.unused = nn.Linear(3, 3)  # trainable, never reached by the loss

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("backend, torch_kw, tol", [("torch", dict(fused=True), 0.0),
                                                    ("numba", dict(foreach=False), 1e-6)])
def test_a_param_the_loss_never_uses_is_left_alone_as_torch_adamw_leaves_it(backend, torch_kw, tol):
    model, batches = WithUnused(), data(4)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, **torch_kw)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    assert ref.unused.weight.grad is None
    apply, params = zf.functionalize(model)
    step = zf.train_step(lambda p, b: nn.functional.mse_loss(apply(p, b[0]), b[1]),
                         optim.adamw(1e-2, weight_decay=0.1, backend=backend))
    state = step.init(params)
    for batch in batches:
        state, _ = step(state, batch)
    for name, want in ref.named_parameters():
        torch.testing.assert_close(state.params[name], want.detach(), rtol=tol, atol=tol)
    assert torch.equal(state.params["unused.weight"], model.unused.weight.detach())  # no weight decay
    assert not state.opt_state.mu["unused.weight"].any() and not state.opt_state.nu["unused.bias"].any()


@pytest.mark.parametrize("flags", [[0, 0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]])
def test_a_param_used_by_one_microbatch_only_gets_that_grad(flags):
    apply, params = zf.functionalize(WithUnused())

    def loss_fn(p, batch):  # a batch with a flagged row also runs the "unused" weight
        x, y, flag = batch
        loss = nn.functional.mse_loss(apply(p, x), y)
        return loss + (p["unused.weight"] ** 2).sum() if flag.any() else loss

    x, y = data(1)[0]
    batch = (x, y, torch.tensor(flags))
    states = []
    for accum in (1, 2):
        step = zf.train_step(loss_fn, optim.sgd(0.1), accum=accum)
        states.append(step(step.init(params), batch)[0])
    # accum=1 sees the term on the whole batch; accum=2 in one microbatch of two (the other has no
    # grad for it), averaged over both: half the step
    w0 = params["unused.weight"]
    torch.testing.assert_close(w0 - states[1].params["unused.weight"], (w0 - states[0].params["unused.weight"]) / 2)
    assert torch.equal(states[1].params["unused.bias"], params["unused.bias"])


# ------------------------------------------------------------------------------ grad_norm on demand
@pytest.mark.parametrize("tx, precision, computed", [
    (lambda: optim.adamw(1e-2, weight_decay=0.1), "fp32", False),
    (lambda: optim.adamw(1e-2, weight_decay=0.1), "bf16", False),
    (lambda: optim.chain(optim.clip_by_global_norm(0.05), optim.adamw(1e-2)), "fp32", True),  # clipping reads it
    (lambda: optim.adamw(1e-2, weight_decay=0.1), "fp16", True),  # the overflow check reads it
], ids=["adamw", "adamw-bf16", "clip", "fp16"])
def test_grad_norm_is_computed_only_where_asked_for_or_needed(monkeypatch, tx, precision, computed):
    """``grad_norm=False``: no pass over the grads for the norm unless the update needs it; the
    training is the same, bit for bit, and a norm that is computed has today's value."""
    batches = data(4)
    ref_state, ref_norms = make_step(mlp(), tx(), precision=precision)[1], []
    ref_step = make_step(mlp(), tx(), precision=precision)[0]
    for b in batches:
        ref_state, m = ref_step(ref_state, b)
        ref_norms.append(m["grad_norm"])
    passes = []  # reads of the grads for a norm (CPU grads: zfunc's kernel; others: torch's)
    norms, squares = torch._foreach_norm, zf.optim.norm.sum_squares_in_ram
    monkeypatch.setattr(torch, "_foreach_norm", lambda g: passes.append(1) or norms(g))
    monkeypatch.setattr(zf.optim.norm, "sum_squares_in_ram", lambda g: passes.append(1) or squares(g))
    step, state = make_step(mlp(), tx(), precision=precision, grad_norm=False)
    for b, want in zip(batches, ref_norms):
        state, m = step(state, b)
        assert (m["grad_norm"] is not None) == computed
        if computed:
            assert torch.equal(m["grad_norm"], want)
    assert len(passes) == (len(batches) if computed else 0)
    for name, p in ref_state.params.items():
        assert torch.equal(state.params[name], p), name


def test_without_grad_norm_a_non_finite_loss_still_skips_the_step():
    step, state = make_step(mlp(), grad_norm=False)
    x, y = data(1)[0]
    before = {k: v.clone() for k, v in state.params.items()}
    state, m = step(state, (x, y * float("nan")))
    assert m["skipped"] and m["grad_norm"] is None
    assert all(torch.equal(state.params[k], v) for k, v in before.items())
    with pytest.raises(ValueError, match="grad_norm: expected a bool, got 'yes'"):
        zf.train_step(lambda p, b: p, optim.adamw(1e-3), grad_norm="yes")
