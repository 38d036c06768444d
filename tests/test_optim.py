"""zf.optim equals torch.optim, step for step, through the pure update and the fused apply."""
import copy
import math

import pytest
import torch
from torch import nn

import zfunc as zf
from zfunc import optim

STEPS = 20


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batches(n=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 7, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def torch_run(model, make_opt, data, clip=None, scheduler=None):
    """Parameters after training ``model`` (a copy) with a torch optimizer on ``data``."""
    model = _copy(model)
    opt = make_opt(model.parameters())
    sched = scheduler(opt) if scheduler else None
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched:
            sched.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def zf_run(model, tx, data, *, pure=False):
    """Parameters after training ``model`` with ``tx``: through the step (fused ``apply``) or,
    with ``pure``, through ``update`` + ``apply_updates``."""
    apply, params = zf.functionalize(_copy(model))

    def loss_fn(p, batch):
        return nn.functional.mse_loss(apply(p, batch[0]), batch[1])

    if pure:
        state = tx.init(params)
        for batch in data:
            _, grads = zf.value_and_grad(loss_fn)(params, batch)
            updates, state = tx.update(grads, state, params)
            params = optim.apply_updates(params, updates)
        return params
    step = zf.train_step(loss_fn, tx)
    state = step.init(params)
    for batch in data:
        state, _ = step(state, batch)
    return state.params


def _copy(model):
    return copy.deepcopy(model)


def assert_params_close(ours, theirs, rtol=1e-6, atol=0.0):
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# Adam divides m by sqrt(v): where a grad is rounding noise near zero, a one-ulp difference in the
# order of operations can flip the step's sign, i.e. move the param by up to 2*lr. Over 20 steps
# such flips stay rare; an absolute bound of 2*lr*STEPS/10 covers a handful and still catches any
# real formula error (which moves every element by ~lr per step).
def adam_atol(lr):
    return 2 * lr * STEPS / 10


@pytest.mark.parametrize("pure", [False, True], ids=["fused", "pure"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_torch(pure, wd):
    lr = 1e-2
    model, data = mlp(), batches()
    theirs = torch_run(model, lambda p: torch.optim.AdamW(p, lr=lr, betas=(0.9, 0.95), weight_decay=wd, fused=not pure),
                       data)
    ours = zf_run(model, optim.adamw(lr, b1=0.9, b2=0.95, weight_decay=wd, backend="torch"), data, pure=pure)
    assert_params_close(ours, theirs, atol=0.0 if not pure else adam_atol(lr))


@pytest.mark.parametrize("pure", [False, True], ids=["fused", "pure"])
def test_adam_matches_torch(pure):
    lr = 1e-2
    model, data = mlp(), batches()
    theirs = torch_run(model, lambda p: torch.optim.Adam(p, lr=lr, weight_decay=0.05, fused=not pure), data)
    ours = zf_run(model, optim.adam(lr, weight_decay=0.05, backend="torch"), data, pure=pure)
    assert_params_close(ours, theirs, atol=0.0 if not pure else adam_atol(lr))


@pytest.mark.parametrize(
    "kw", [dict(), dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=0.01),
           dict(momentum=0.5, dampening=0.3)]
)
def test_sgd_matches_torch(kw):
    model, data = mlp(), batches()
    theirs = torch_run(model, lambda p: torch.optim.SGD(p, lr=0.05, **kw), data)
    # optax's shape materialises the update -lr*d and adds it: two roundings where torch's
    # p.add_(d, alpha=-lr) has one. Each step may differ by half an ulp of lr*|d| (<= 0.05 here,
    # ulp 3.7e-9), so 20 steps stay under 5e-8 absolute; relative error explodes only where a
    # param crosses zero.
    assert_params_close(zf_run(model, optim.sgd(0.05, **kw), data), theirs, atol=5e-8)


def test_fused_adamw_path_equals_pure_update():
    model, data = mlp(), batches()
    tx = optim.adamw(1e-3, weight_decay=0.1)
    assert_params_close(zf_run(model, tx, data), zf_run(model, tx, data, pure=True), atol=adam_atol(1e-3))


@pytest.mark.parametrize("pure", [False, True], ids=["fused", "pure"])
def test_decay_mask_decays_matrices_not_biases(pure):
    model, data = mlp(), batches(1)  # one step: each param's update depends only on its own decay
    masked = zf_run(model, optim.adamw(1e-2, weight_decay=0.5, mask=optim.decay_mask), data, pure=pure)
    decayed = zf_run(model, optim.adamw(1e-2, weight_decay=0.5), data, pure=pure)
    undecayed = zf_run(model, optim.adamw(1e-2, weight_decay=0.0), data, pure=pure)
    for name, p in masked.items():
        expected = decayed[name] if name.endswith("weight") else undecayed[name]
        torch.testing.assert_close(p, expected, rtol=0, atol=0, msg=name)
    assert optim.decay_mask({"w": torch.zeros(2, 2), "b": torch.zeros(2)}) == {"w": True, "b": False}


def test_mask_is_honoured_by_pure_and_fused_paths():
    model, data = mlp(), batches(5)
    mask = lambda params: {n: n.startswith("0.") for n in params}  # noqa: E731
    tx = optim.adamw(1e-2, weight_decay=0.3, mask=mask)
    assert_params_close(zf_run(model, tx, data), zf_run(model, tx, data, pure=True), atol=adam_atol(1e-2))


def test_clip_by_global_norm_matches_torch():
    model, data = mlp(), batches()
    theirs = torch_run(model, lambda p: torch.optim.SGD(p, lr=0.1), data, clip=0.05)
    ours = zf_run(model, optim.chain(optim.clip_by_global_norm(0.05), optim.sgd(0.1)), data)
    assert_params_close(ours, theirs, atol=5e-8)  # sgd's two roundings: see test_sgd_matches_torch


def test_chained_clip_and_adamw_matches_torch_fused():
    model, data = mlp(), batches()
    theirs = torch_run(model, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, fused=True), data, clip=0.5)
    ours = zf_run(model, optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(3e-3, weight_decay=0.1)), data)
    assert_params_close(ours, theirs, atol=adam_atol(3e-3))


def test_clip_scales_in_place_only_where_the_grads_are_owned():
    grads = {"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}
    clip = optim.clip_by_global_norm(1.0)
    clipped, _ = clip.update(grads, optim.EmptyState())  # pure: a new tree, grads untouched
    assert grads["a"].item() == 3.0 and math.isclose(clipped["a"].item(), 0.6, rel_tol=1e-6)
    tx = optim.chain(optim.chain(clip), optim.sgd(1.0))  # apply owns grads: scaled where they are
    params, _ = optim.apply(tx, grads, tx.init({"a": torch.zeros(1), "b": torch.zeros(1, 1)}),
                            {"a": torch.zeros(1), "b": torch.zeros(1, 1)})
    assert math.isclose(grads["a"].item(), 0.6, rel_tol=1e-6) and math.isclose(params["a"].item(), -0.6, rel_tol=1e-6)


def test_warmup_cosine_schedule_matches_torch_lambda_lr():
    sched = optim.warmup_cosine(1e-2, 5, STEPS, end_value=1e-3)
    model, data = mlp(), batches()
    theirs = torch_run(model, lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True), data,
                       scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: sched(t) / 1e-2))
    assert_params_close(zf_run(model, optim.adamw(sched), data), theirs, rtol=1e-5, atol=1e-7)


def test_schedule_values():
    s = optim.warmup_cosine(1.0, 4, 14, end_value=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == 1.0 and math.isclose(s(9), 0.55) and math.isclose(s(14), 0.1) and math.isclose(s(100), 0.1)
    assert optim.linear_warmup(2.0, 2)(0) == 1.0 and optim.linear_warmup(2.0, 2)(5) == 2.0
    lin = optim.linear_schedule(1.0, 0.0, 10)
    assert lin(0) == 1.0 and lin(5) == 0.5 and lin(20) == 0.0
    assert optim.constant_schedule(0.3)(123) == 0.3


def test_lion_matches_reference_formula():
    torch.manual_seed(0)
    p0, g = torch.randn(50), torch.randn(50)
    tx = optim.lion(1e-3, b1=0.9, b2=0.99, weight_decay=0.1)
    state = tx.init({"w": p0})
    params = {"w": p0}
    m = torch.zeros(50)
    p = p0.clone()
    for _ in range(3):
        updates, state = tx.update({"w": g}, state, params)
        params = optim.apply_updates(params, updates)
        p = p * (1 - 1e-3 * 0.1) - 1e-3 * torch.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
    torch.testing.assert_close(params["w"], p, rtol=1e-6, atol=1e-7)


def test_learning_rate_reported_from_chain():
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.linear_warmup(1.0, 4)))
    state = tx.init({"w": torch.zeros(3)})
    assert optim.learning_rate(tx, state) == 0.25
    assert optim.learning_rate(optim.clip_by_global_norm(1.0), optim.EmptyState()) is None


def test_optimizers_declare_whether_they_need_the_global_norm():
    assert not optim.adamw(1e-3).needs_global_norm and not optim.sgd(0.1).needs_global_norm
    assert optim.clip_by_global_norm(1.0).needs_global_norm
    assert optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3)).needs_global_norm
    assert not optim.chain(optim.lion(1e-3)).needs_global_norm


def test_global_norm():
    t = {"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}
    assert optim.global_norm(t).item() == 5.0


def test_known_norm_is_reused_only_for_the_same_unmodified_grads():
    grads = {"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}
    given = torch.tensor(7.0)
    known = optim.known_norm(grads, given)
    assert optim.global_norm(grads, known) is given  # what clip_by_global_norm sees inside the step
    assert optim.global_norm(dict(grads), known) is given  # another container, the same tensors
    assert optim.global_norm({"a": grads["a"].clone(), "b": grads["b"]}, known).item() == 5.0
    assert optim.global_norm({"a": grads["a"]}, known).item() == 3.0
    grads["b"].mul_(0.0)  # changed in place since: computed again
    assert optim.global_norm(grads, known).item() == 3.0
    assert optim.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}).item() == 5.0


def test_no_context_variable_steers_a_norm_or_a_steps_collectives():
    """The norm, the optimizer and the runs hold no ``ContextVar``: what is summed over the ranks, and
    which norm a clip reads, is passed explicitly (``sum_over_ranks``, ``apply(norm=)``)."""
    import contextvars
    import importlib

    for name in ("zfunc.optim.norm", "zfunc.optim.base", "zfunc.core.step", "zfunc.core.grads", "zfunc.core.totals",
                 "zfunc.core.roles", "zfunc.core.microbatches", "zfunc.sharding.run", "zfunc.offloading.run",
                 "zfunc.pipelining.step", "zfunc.pipelining.stage"):
        module = importlib.import_module(name)
        held = [k for k, v in vars(module).items() if isinstance(v, contextvars.ContextVar)]
        assert not held, (name, held)


@pytest.mark.parametrize("grad_scale", [None, 0.5])
def test_clipping_takes_the_norm_the_step_hands_to_apply(grad_scale):
    """``optim.apply(norm=known_norm(grads, n))``: a clip reads ``n`` as the norm of the grads it is
    given (scaled with them by ``grad_scale``), not the norm of the tensors, as a sharded step's
    share of the grads needs; nothing else holds it, so a clip outside the call computes its own."""
    def fresh():  # apply consumes its arguments: new tensors for each call
        return {"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}, {"a": torch.zeros(1), "b": torch.zeros(1, 1)}

    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(1.0))
    total = torch.tensor(50.0)  # the norm over every rank: this rank's grads are 1/10 of it
    grads, params = fresh()
    new, _ = optim.apply(tx, dict(grads), tx.init(params), params, grad_scale=grad_scale,
                         norm=optim.known_norm(grads, total))
    factor = grad_scale or 1.0
    want = 1.0 / (50.0 * factor + 1e-6) * factor  # clip by the given norm, then sgd's -lr * g
    torch.testing.assert_close(new["a"], -3.0 * want * torch.ones(1))
    grads, params = fresh()
    alone, _ = optim.apply(tx, grads, tx.init(params), params)  # no norm given: its own, 5
    torch.testing.assert_close(alone["a"], torch.tensor([-3.0 / (5.0 + 1e-6)]))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: optim.adamw(-1.0), "learning_rate"),
        (lambda: optim.adamw(1e-3, b1=1.0), "b1"),
        (lambda: optim.adamw(1e-3, backend="cuda"), "backend"),
        (lambda: optim.sgd(0.1, nesterov=True), "nesterov"),
        (lambda: optim.clip_by_global_norm(0.0), "max_norm"),
        (lambda: optim.warmup_cosine(1.0, 10, 5), "warmup_steps"),
        (lambda: optim.chain(optim.sgd(0.1), "adam"), "chain argument 1"),
    ],
)
def test_bad_arguments_raise_clear_errors(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: optim.adamw(NAN), "learning_rate: expected a finite float >= 0 or a schedule, got nan"),
        (lambda: optim.adamw(INF), "learning_rate: expected a finite float >= 0 or a schedule, got inf"),
        (lambda: optim.sgd(-1), "learning_rate: expected a finite float >= 0 or a schedule, got -1"),
        (lambda: optim.lion("1e-3"), "learning_rate: expected a finite float >= 0 or a schedule, got '1e-3'"),
        (lambda: optim.adam(1e-3, b2=NAN), "b2: expected a value in [0, 1), got nan"),
        (lambda: optim.adamw(1e-3, b1=-0.1), "b1: expected a value in [0, 1), got -0.1"),
        (lambda: optim.lion(1e-3, b2=1.0), "b2: expected a value in [0, 1), got 1.0"),
        (lambda: optim.adamw(1e-3, eps=0.0), "eps: expected a finite float > 0, got 0.0"),
        (lambda: optim.adam(1e-3, eps=NAN), "eps: expected a finite float > 0, got nan"),
        (lambda: optim.adamw(1e-3, weight_decay=-0.1), "weight_decay: expected a finite float >= 0, got -0.1"),
        (lambda: optim.adamw(1e-3, weight_decay=INF), "weight_decay: expected a finite float >= 0, got inf"),
        (lambda: optim.sgd(0.1, weight_decay=NAN), "weight_decay: expected a finite float >= 0, got nan"),
        (lambda: optim.lion(1e-3, weight_decay=-1), "weight_decay: expected a finite float >= 0, got -1"),
        (lambda: optim.sgd(0.1, momentum=1.0), "momentum: expected a value in [0, 1), got 1.0"),
        (lambda: optim.sgd(0.1, momentum=NAN), "momentum: expected a value in [0, 1), got nan"),
        (lambda: optim.sgd(0.1, momentum=0.9, dampening=-0.5), "dampening: expected a value in [0, 1), got -0.5"),
        (lambda: optim.sgd(0.1, momentum=0.9, nesterov=1), "nesterov: expected a bool, got 1"),
        (lambda: optim.clip_by_global_norm(NAN), "max_norm: expected a finite float > 0, got nan"),
        (lambda: optim.clip_by_global_norm(-1.0), "max_norm: expected a finite float > 0, got -1.0"),
        (lambda: optim.constant_schedule(-1e-3), "value: expected a finite float >= 0, got -0.001"),
        (lambda: optim.linear_schedule(1e-3, NAN, 10), "end_value: expected a finite float >= 0, got nan"),
        (lambda: optim.linear_schedule(1e-3, 0.0, 0), "transition_steps: expected an int >= 1, got 0"),
        (lambda: optim.linear_warmup(-1.0, 10), "peak_value: expected a finite float >= 0, got -1.0"),
        (lambda: optim.linear_warmup(1e-3, -1), "warmup_steps: expected an int >= 0, got -1"),
        (lambda: optim.linear_warmup(1e-3, 2.5), "warmup_steps: expected an int >= 0, got 2.5"),
        (lambda: optim.warmup_cosine(NAN, 10, 100), "peak_value: expected a finite float >= 0, got nan"),
        (lambda: optim.warmup_cosine(1e-3, 10, 100, end_value=-1e-4), "end_value: expected a finite float >= 0"),
        (lambda: optim.warmup_cosine(1e-3, -1, 100), "warmup_steps: expected an int >= 0, got -1"),
        (lambda: optim.warmup_cosine(1e-3, 0, 0), "total_steps: expected an int >= 1, got 0"),
        (lambda: optim.warmup_cosine(1e-3, 0, 10.0), "total_steps: expected an int >= 1, got 10.0"),
    ],
)
def test_every_hyperparameter_is_checked_finite_and_in_range_naming_it(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("value", [NAN, -1e-3, INF, None])
@pytest.mark.parametrize("make", [optim.adamw, optim.adam, optim.sgd, optim.lion])
def test_a_schedule_value_is_checked_when_used_naming_the_count(make, value):
    tx = make(lambda count: 1e-3 if count < 2 else value)
    params = {"w": torch.ones(3)}
    state = tx.init(params)
    for _ in range(2):
        _, state = tx.update({"w": torch.ones(3)}, state, params)
    with pytest.raises(ValueError, match="at update count 2"):
        optim.learning_rate(tx, state)  # what the step reads first, before it writes anything
    with pytest.raises(ValueError, match=rf"learning_rate: the schedule returned {value!r} at update count 2"):
        tx.update({"w": torch.ones(3)}, state, params)
    with pytest.raises(ValueError, match="at update count 2"):
        tx.apply({"w": torch.ones(3)}, state, params)


# Each optimizer, each path: a param whose grad is None is left exactly as it was (no weight
# decay), its moments/momentum untouched, and the other params move exactly as if it were absent.
NO_GRAD_OPTIMIZERS = {
    "adamw": lambda backend: optim.adamw(1e-2, weight_decay=0.1, backend=backend),
    "adam": lambda backend: optim.adam(1e-2, weight_decay=0.1, backend=backend),
    "sgd": lambda backend: optim.sgd(0.1, momentum=0.9, weight_decay=0.1, backend=backend),
    "lion": lambda backend: optim.lion(1e-2, weight_decay=0.1, backend=backend),
}


@pytest.mark.parametrize("path", ["update", "apply"])
@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("name", sorted(NO_GRAD_OPTIMIZERS))
def test_a_param_without_grad_is_left_alone_by_every_optimizer(name, backend, path):
    tx = NO_GRAD_OPTIMIZERS[name](backend)
    g = torch.Generator().manual_seed(0)
    # "a" (no grad) comes first in leaf order: a grad list that dropped it would shift "b"'s onto it
    both = {"a": torch.randn(4, generator=g), "b": torch.randn(5, generator=g)}
    alone = {"b": both["b"].clone()}
    s_both, s_alone = tx.init(both), tx.init(alone)
    a0 = both["a"].clone()
    for _ in range(3):
        grad = torch.randn(5, generator=g)
        for params, state, grads in ((both, s_both, {"a": None, "b": grad}), (alone, s_alone, {"b": grad.clone()})):
            if path == "apply":
                new, state = tx.apply(grads, state, params)
            else:
                updates, state = tx.update(grads, state, params)
                assert "a" not in grads or updates["a"] is None
                new = optim.apply_updates(params, updates)
            if params is both:
                both, s_both = new, state
            else:
                alone, s_alone = new, state
    assert torch.equal(both["a"], a0)
    torch.testing.assert_close(both["b"], alone["b"], rtol=1e-6, atol=1e-7)
    for leaf in zf.tree.leaves(s_both):
        if isinstance(leaf, torch.Tensor) and leaf.shape == (4,):  # a's moments or momentum
            assert not leaf.any()


@pytest.mark.parametrize("path", ["update", "apply"])
def test_a_chain_with_clipping_takes_grads_that_are_all_none(path):
    # an offloaded leaf without grad is updated alone: clipping then sees no grad at all
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    params = {"w": torch.ones(3)}
    if path == "apply":
        new, state = tx.apply({"w": None}, tx.init(params), {"w": params["w"].clone()})
    else:
        updates, state = tx.update({"w": None}, tx.init(params), params)
        new = optim.apply_updates(params, updates)
    assert torch.equal(new["w"], params["w"]) and state[1].count == 1


@pytest.mark.parametrize("ours, theirs", [
    (lambda: optim.adam(1e-2, weight_decay=0.05),
     lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.05, fused=True)),
    (lambda: optim.sgd(0.05, momentum=0.9, weight_decay=0.01),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01)),
    (lambda: optim.sgd(0.05, momentum=0.9, weight_decay=0.01, backend="numba"),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False)),
])
def test_an_unused_layer_is_left_alone_as_torch_leaves_it(ours, theirs):
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(7, 3), "unused": nn.Linear(2, 2)})
    data = batches(5)

    class Used(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner["used"](x)

    want = torch_run(Used(model), theirs, data)
    got = zf_run(Used(model), ours(), data)
    assert_params_close(got, want, rtol=1e-6, atol=5e-8)
    assert torch.equal(got["inner.unused.weight"], model["unused"].weight.detach())


def test_mask_of_wrong_length_is_rejected():
    tx = optim.adamw(1e-3, mask={"a": True})
    params = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match="mask"):
        tx.update(params, tx.init(params), params)


# ------------------------------------------------------------------------------ kernel backends
# zfunc's Numba kernels match torch.optim's single-tensor formulas to about an ulp per step (torch's
# CPU sqrt is not correctly rounded, and the kernel multiplies by 1/sqrt(bc2) where torch divides);
# over 20 steps that stays under 1e-6 relative, or 1e-6 absolute for params crossing zero.
@pytest.mark.parametrize("name, ours, theirs", [
    ("adamw", lambda: optim.adamw(1e-2, weight_decay=0.1, backend="numba"),
     lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False)),
    ("adam", lambda: optim.adam(1e-2, weight_decay=0.05, backend="numba"),
     lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.05, foreach=False)),
    ("sgd", lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=0.01, backend="numba"),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False)),
])
def test_numba_backend_matches_torch(name, ours, theirs):
    model, data = mlp(), batches()
    assert_params_close(zf_run(model, ours(), data), torch_run(model, theirs, data), rtol=1e-6, atol=1e-6)


def test_numba_lion_matches_the_pure_update():
    model, data = mlp(), batches()
    kernel = zf_run(model, optim.lion(1e-3, weight_decay=0.1, backend="numba"), data)
    pure = zf_run(model, optim.lion(1e-3, weight_decay=0.1), data, pure=True)
    assert_params_close(kernel, pure, rtol=1e-6, atol=1e-6)


def test_auto_backend_follows_where_the_state_lives(monkeypatch):
    from zfunc.ops.cpu import adam as cpu_adam

    calls = []
    kernel = cpu_adam.adamw_many_
    monkeypatch.setattr(cpu_adam, "adamw_many_", lambda ps, *a, **k: calls.extend(ps) or kernel(ps, *a, **k))
    tx = optim.adamw(1e-3)
    cpu = {"a": torch.randn(1000), "b": torch.randn(7), "w": torch.randn(3, 4)}  # fp32 CPU, any shape -> numba
    tx.apply(cpu, tx.init(cpu), cpu)
    assert len(calls) == 3
    strided = {"w": torch.randn(4, 3).t()}  # not contiguous -> torch's multi-tensor kernel
    tx.apply(strided, tx.init(strided), strided)
    doubles = {"w": torch.randn(3, 4, dtype=torch.float64)}
    tx.apply(doubles, tx.init(doubles), doubles)
    assert len(calls) == 3


# The placement's kernel (Numba, on CPU) against torch's on the same shaped leaves: 20 steps of
# an MLP (matrices and biases), with weight decay, a decay mask and clipping.
@pytest.mark.parametrize("make", [
    lambda backend: optim.adamw(1e-2, weight_decay=0.1, backend=backend),
    lambda backend: optim.adamw(1e-2, weight_decay=0.1, mask=optim.decay_mask, backend=backend),
    lambda backend: optim.adam(1e-2, weight_decay=0.05, backend=backend),
    lambda backend: optim.chain(optim.clip_by_global_norm(0.05), optim.adamw(1e-2, weight_decay=0.1, backend=backend)),
], ids=["adamw", "adamw-mask", "adam-l2", "clip-adamw"])
def test_auto_backend_on_cpu_equals_the_torch_kernel_on_shaped_leaves(make):
    model, data = mlp(), batches()
    assert_params_close(zf_run(model, make("auto"), data), zf_run(model, make("torch"), data), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make", [lambda: optim.adamw(1e-2, weight_decay=0.1, backend="numba"),
                                  lambda: optim.sgd(0.1, momentum=0.9, backend="numba"),
                                  lambda: optim.lion(1e-2, backend="numba")])
def test_numba_backend_takes_grads_of_any_layout(make):
    # autograd hands ``p.sum()``'s grad out expanded (stride 0); a transposed grad is strided
    grads = {"b": torch.full((1,), 0.5).expand(6), "w": torch.randn(3, 2).t()[0]}  # strides 0 and 2
    tx = make()
    results = []
    for g in (grads, {k: v.contiguous() for k, v in grads.items()}):
        params = {"b": torch.linspace(-1, 1, 6), "w": torch.linspace(0, 1, 3)}
        results.append(tx.apply(g, tx.init(params), params)[0])
    assert_params_close(results[0], results[1], rtol=0, atol=0)


def test_numba_backend_rejects_what_it_cannot_update():
    with pytest.raises(ValueError, match="backend='numba': expected contiguous fp32 CPU params"):
        optim.adamw(1e-3, backend="numba").init({"w": torch.zeros(2, dtype=torch.float64)})
    tx = optim.sgd(0.1, backend="numba")
    params = {"w": torch.zeros(4, 4).t()}
    with pytest.raises(ValueError, match="non-contiguous"):
        tx.apply(params, tx.init(params), params)


def gpt_run(make_zf=None, make_torch=None, steps=STEPS):
    """The recipe's GPT (tiny) trained ``steps`` steps by zfunc's step or by a torch optimizer."""
    from recipes.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16))
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 37, (4, 9), generator=g) for _ in range(steps)]

    def loss(logits, tokens):
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    if make_torch:
        opt = make_torch(model.parameters())
        for t in data:
            opt.zero_grad(set_to_none=True)
            loss(model(t[:, :-1]), t).backward()
            opt.step()
        return {n: p.detach() for n, p in model.named_parameters()}
    apply, params = zf.functionalize(model)
    step = zf.train_step(lambda p, t: loss(apply(p, t[:, :-1]), t), make_zf())
    state = step.init(params)
    for t in data:
        state, _ = step(state, t)
    return state.params


@pytest.mark.parametrize("ours, theirs, atol", [
    (lambda: optim.adamw(3e-3, weight_decay=0.1, backend="torch"),
     lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, fused=True), 0),
    (lambda: optim.adam(3e-3, backend="torch"), lambda p: torch.optim.Adam(p, lr=3e-3, fused=True), 0),
    # "auto" on CPU: zfunc's Numba kernel, torch's single-tensor formulas to an ulp per step
    (lambda: optim.adamw(3e-3, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1), 1e-6),
    # sgd's two roundings (see test_sgd_matches_torch) with updates lr*|d| up to ~0.1 here (ulp 7.5e-9):
    # 20 steps stay under 2e-7
    (lambda: optim.sgd(0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 2e-7),
])
def test_optimizers_match_torch_on_the_gpt(ours, theirs, atol):
    assert_params_close(gpt_run(make_zf=ours), gpt_run(make_torch=theirs), rtol=1e-6, atol=atol)


@pytest.mark.parametrize("make", [
    lambda: optim.adamw(1e-2, weight_decay=0.1),  # CPU-Adam writes out in its pass
    lambda: optim.adamw(1e-2, weight_decay=0.1, backend="torch"),  # torch's kernel, then a copy
    lambda: optim.chain(optim.clip_by_global_norm(0.1), optim.adam(1e-2)),
    lambda: optim.sgd(0.1, momentum=0.9),  # no writes_out: apply, then a copy
], ids=["adamw-numba", "adamw-torch", "chain", "sgd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_apply_out_holds_the_new_params_cast_bit_for_bit(make, dtype):
    tx = make()
    params = {"w": torch.randn(4, 3), "b": torch.randn(3), "unused": torch.randn(2)}
    grads = {"w": torch.randn(4, 3), "b": torch.randn(3), "unused": None}
    ref_params, _ = optim.apply(tx, {k: None if g is None else g.clone() for k, g in grads.items()},
                                tx.init(params), {k: p.clone() for k, p in params.items()})
    out = {k: torch.full(p.shape, 7.0, dtype=dtype) for k, p in params.items()}
    new, _ = optim.apply(tx, grads, tx.init(params), {k: p.clone() for k, p in params.items()}, out=out)
    for k in params:
        assert torch.equal(new[k], ref_params[k]) and torch.equal(out[k], new[k].to(dtype)), k


def _leaves(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 30, generator=g), "b": torch.randn(30, generator=g)}


@pytest.mark.parametrize("tx", [
    lambda: optim.adamw(1e-2, weight_decay=0.1, backend="numba"),
    lambda: optim.adamw(1e-2, weight_decay=0.1, backend="torch"),
    lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1, backend="numba")),
    lambda: optim.sgd(1e-2, momentum=0.9),
    lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.sgd(1e-2, momentum=0.9)),
], ids=["adamw numba", "adamw torch", "clip, adamw", "sgd", "clip, sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_with_a_grad_scale_equals_apply_on_the_scaled_fp32_grads(tx, dtype):
    """``apply(grad_scale=s)`` on bf16/fp16/fp32 grads is ``apply`` on ``grads.float() * s``: in
    the kernel's pass where the optimizer scales grads (a clip in front folded into it), else
    by a multiply first; ``squares`` is the scaled grads' sum of squares."""
    tx = tx()
    params, ref = _leaves(0), _leaves(0)
    state, ref_state = tx.init(params), tx.init(ref)
    for k in range(3):
        raw = {n: (t * 1e3).to(dtype) for n, t in _leaves(k + 1).items()}
        scale = 1.0 / 1024
        scaled = {n: g.float() * scale for n, g in raw.items()}
        squares = []
        params, state = optim.apply(tx, raw, state, params, squares=squares, grad_scale=scale)
        ref, ref_state = optim.apply(tx, scaled, ref_state, ref)
        for n in ref:
            torch.testing.assert_close(params[n], ref[n], rtol=1e-6, atol=1e-7)
        if squares:
            want = sum(float((g.double() ** 2).sum()) for g in scaled.values())
            assert squares[0] == pytest.approx(want, rel=1e-6)


def test_a_chain_folds_grad_factors_only_in_front_of_a_kernel_that_scales_grads():
    clip, adamw, sgd = optim.clip_by_global_norm(1.0), optim.adamw(1e-3, backend="numba"), optim.sgd(1e-2)
    assert optim.chain(clip, adamw).scales_grads and optim.chain(adamw).scales_grads
    assert not optim.chain(clip, sgd).scales_grads and not sgd.scales_grads
    assert not optim.chain(optim.lion(1e-3), adamw).scales_grads  # lion is no mere grad factor
