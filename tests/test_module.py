"""functionalize: the pure apply equals the module, the module is never mutated, a step carries the
buffers training updates (BatchNorm statistics) as torch's own loop updates them, a module changed
after functionalize is refused before anything runs, errors are clear."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from tests.models import (BN_STATS, BNNet, Tiny, assert_trained_like, batches, bn_batches, bn_step, hf_model,
                          token_loss, torch_train)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.emb(idx))


def test_apply_equals_module():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    apply, params = zf.functionalize(m)
    x = torch.randn(4, 3)
    torch.testing.assert_close(apply(params, x), m(x))
    assert set(params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(not p.requires_grad for p in params.values())
    assert params["0.weight"].data_ptr() == m[0].weight.data_ptr()  # detached alias, no copy


def test_apply_uses_given_params():
    m = nn.Linear(2, 1)
    apply, params = zf.functionalize(m)
    zero = {k: torch.zeros_like(v) for k, v in params.items()}
    assert torch.equal(apply(zero, torch.ones(3, 2)), torch.zeros(3, 1))


def test_tied_weights_appear_once_and_stay_tied():
    m = Tied()
    apply, params = zf.functionalize(m)
    assert list(params) == ["emb.weight"]
    w = torch.randn(10, 4)
    out = apply({"emb.weight": w}, torch.tensor([1, 2]))
    torch.testing.assert_close(out, w[[1, 2]] @ w.T)


def test_frozen_params_are_not_trainable():
    m = nn.Linear(2, 2)
    m.bias.requires_grad_(False)
    apply, params = zf.functionalize(m)
    assert list(params) == ["weight"]
    torch.testing.assert_close(apply(params, torch.ones(1, 2)), m(torch.ones(1, 2)))


def test_batchnorm_buffers_are_never_mutated():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    before = {n: b.clone() for n, b in m.named_buffers()}
    apply, params = zf.functionalize(m)
    apply(params, torch.randn(8, 3))
    for n, b in m.named_buffers():
        assert torch.equal(b, before[n]), n


def test_batchnorm_stats_returned_with_buffers():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    apply, (params, buffers) = zf.functionalize(m, with_buffers=True)
    given = {n: b.clone() for n, b in buffers.items()}
    x = torch.randn(8, 3)
    out, new_buffers = apply(params, buffers, x)
    ref = m(x)  # the module itself updates its stats in place: that is what we must reproduce
    torch.testing.assert_close(out, ref)
    for n, b in m.named_buffers():
        torch.testing.assert_close(new_buffers[n], b)
        assert torch.equal(buffers[n], given[n])  # inputs untouched


def test_bad_inputs():
    with pytest.raises(TypeError, match="module: expected a torch.nn.Module"):
        zf.functionalize(lambda x: x)
    apply, params = zf.functionalize(nn.Linear(2, 2))
    with pytest.raises(KeyError, match="not parameters of the module"):
        apply({"wieght": torch.ones(2, 2)}, torch.ones(1, 2))
    with pytest.raises(TypeError, match="params: expected a dict"):
        apply([torch.ones(2, 2)], torch.ones(1, 2))


# ----------------------------------------------------------------------------- buffers a step carries

@pytest.mark.parametrize("accum", [1, 2])
def test_batchnorm_trains_like_torch(accum):
    """Params and running_mean / running_var / num_batches_tracked equal torch's own loop: a step
    of k microbatches updates the statistics k times."""
    torch.manual_seed(0)
    model = BNNet()
    apply, step = bn_step(model, accum)
    state = step.init(zf.functionalize(model)[1])
    assert state.buffers == {}  # they join at the first step that writes them
    for batch in bn_batches():
        state, _ = step(state, batch)
    ref = torch_train(model, bn_batches(), accum)
    assert set(state.buffers) == BN_STATS
    assert_trained_like(state.params, state.buffers, ref)
    assert state.buffers["bn.num_batches_tracked"].item() == 3 * accum
    assert model.bn.num_batches_tracked.item() == 0  # the module itself is never written


def test_evaluation_uses_the_trained_statistics():
    torch.manual_seed(0)
    model = BNNet()
    apply, step = bn_step(model)
    state = step.init(zf.functionalize(model)[1])
    for batch in bn_batches():
        state, _ = step(state, batch)
    ref = torch_train(model, bn_batches()).eval()
    x = torch.randn(4, 3)
    model.eval()
    with zf.functional.using(state):
        out = apply(state.params, x)
    with zf.functional.using(state.buffers):  # a dict of buffers works too
        again = apply(state.params, x)
    untrained = apply(state.params, x)  # outside a step or ``using``: the snapshot's statistics
    model.train()
    torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-6)
    assert torch.equal(out, again)
    assert not torch.allclose(untrained, out)
    with zf.functional.using(state):  # train mode under ``using``: the update is discarded
        apply(state.params, x)
    assert state.buffers["bn.num_batches_tracked"].item() == 3


def test_unwritten_buffers_stay_out_of_the_state():
    torch.manual_seed(0)
    model = BNNet(mask=True)
    apply, step = bn_step(model)
    state = step.init(zf.functionalize(model)[1])
    state, _ = step(state, bn_batches(1)[0])
    assert set(state.buffers) == BN_STATS  # the mask is read from the snapshot, never carried
    model.eval()  # BatchNorm in eval mode writes nothing: a frozen norm carries nothing either
    apply, step = bn_step(model)
    state, _ = step(step.init(zf.functionalize(model)[1]), bn_batches(1)[0])
    assert state.buffers == {}


class Counting(nn.Module):
    """Buffers written without BatchNorm: an EMA updated in place and a count reassigned."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("ema", torch.zeros(3))
        self.register_buffer("calls", torch.tensor(0))
        self.register_buffer("scale", torch.tensor(2.0))  # read only

    def forward(self, x):
        if self.training:
            self.ema.mul_(0.5).add_(0.5 * x.detach().mean(0))
            self.calls = self.calls + 1
        return self.fc(x) * self.scale


def test_buffers_written_in_place_or_reassigned_are_carried():
    torch.manual_seed(0)
    model = Counting()
    ref = copy.deepcopy(model)
    apply, params = zf.functionalize(model)
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.sgd(0.1), accum=2)
    state = step.init(params)
    data = [torch.randn(4, 3) for _ in range(2)]
    for x in data:
        state, _ = step(state, x)
        for xc in x.chunk(2):
            ref(xc)
    assert set(state.buffers) == {"ema", "calls"}
    torch.testing.assert_close(state.buffers["ema"], ref.ema)
    assert state.buffers["calls"].item() == ref.calls.item() == 4


def test_the_state_given_is_never_written_and_a_failed_step_loses_nothing():
    torch.manual_seed(0)
    model = BNNet()
    apply, params = zf.functionalize(model)

    def loss_fn(p, batch):
        out = apply(p, batch[0])  # updates the statistics, then the loss may fail
        if batch[1] is None:
            raise RuntimeError("bad batch")
        return F.mse_loss(out, batch[1])

    for donate in (False, True):
        step = zf.train_step(loss_fn, zf.optim.sgd(0.1), donate=donate)
        state, _ = step(step.init(params), bn_batches(1)[0])
        before = {n: b.clone() for n, b in state.buffers.items()}
        with pytest.raises(RuntimeError, match="bad batch"):
            step(state, (torch.randn(8, 3), None))
        for n, b in state.buffers.items():
            assert torch.equal(b, before[n]), n  # the failed call changed nothing
        new, _ = step(state, bn_batches(1)[0])
        assert new.buffers["bn.num_batches_tracked"].item() == 2
        if not donate:
            for n, b in state.buffers.items():
                assert torch.equal(b, before[n]), n  # donate=False: the input state stays as it was


def test_buffer_errors_are_clear():
    torch.manual_seed(0)
    a, b = BNNet(), BNNet()
    apply_a, params_a = zf.functionalize(a)
    apply_b, params_b = zf.functionalize(b)
    step = zf.train_step(lambda p, x: apply_a(p, x).sum() + apply_b(params_b, x).sum(), zf.optim.sgd(0.1))
    with pytest.raises(ValueError, match="carries one module's buffers.*with_buffers=True"):
        step(step.init(params_a), torch.randn(4, 3))
    apply, step = bn_step(a)
    state = step.init(params_a).replace(buffers={"nope": torch.zeros(1)})
    with pytest.raises(KeyError, match=r"state.buffers: names \['nope'\] are not buffers"):
        step(state, bn_batches(1)[0])
    with pytest.raises(TypeError, match="state_or_buffers: expected a TrainState or a dict"):
        zf.functional.using([1, 2])
    with pytest.raises(TypeError, match="buffers: expected a dict"):
        zf.TrainState({}, (), buffers=[torch.zeros(1)])


def test_run_by_registers_who_runs_the_module_now():
    """functionalize knows one registry: each apply enters every registered runner, outer first."""
    from contextlib import contextmanager

    seen = []

    class Runner:
        def __init__(self, name):
            self.name = name

        @contextmanager
        def running(self, module):
            seen.append((self.name, type(module).__name__))
            yield
            seen.append((self.name, "done"))

    m = nn.Linear(2, 1)
    apply, params = zf.functionalize(m)
    with zf.functional.run_by(Runner("outer")), zf.functional.run_by(Runner("inner")):
        apply(params, torch.ones(1, 2))
    apply(params, torch.ones(1, 2))  # outside: nobody
    assert seen == [("outer", "Linear"), ("inner", "Linear"), ("inner", "done"), ("outer", "done")]


def test_apply_needs_every_trainable_param():
    """A missing name is an error, not silently the module's own tensor (which would never train)."""
    apply, params = zf.functionalize(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))
    partial = {k: v for k, v in params.items() if not k.startswith("1.")}
    with pytest.raises(KeyError, match=r"params: 2 trainable parameters of the module are missing: "
                                       r"\['1.bias', '1.weight'\]"):
        apply(partial, torch.ones(1, 2))


# ------------------------------------------------------------------- a module changed after functionalize


def _lm_step(model):
    """``(step, params)``: cross-entropy of a causal LM (an HF model's ``.logits`` or a plain one)."""
    apply, params = zf.functionalize(model)

    def loss_fn(p, batch):
        out = apply(p, batch[0])
        return F.cross_entropy(getattr(out, "logits", out).flatten(0, 1), batch[1].flatten())

    return zf.train_step(loss_fn, zf.optim.adamw(1e-3)), params


def _lm_batch(vocab, b=2, t=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


def _snapshot(state):
    return copy.deepcopy((state.params, state.opt_state, state.step, state.buffers))


def _assert_untouched(state, before):
    got = (state.params, state.opt_state, state.step, state.buffers)
    flat_got, flat_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(before)
    assert len(flat_got) == len(flat_want)
    for a, b in zip(flat_got, flat_want):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b


@pytest.mark.parametrize("when", ["after init", "before init"])
def test_an_hf_gpt2_moved_to_meta_after_functionalize_is_refused_before_the_state_changes(when):
    """The module is what ``apply`` runs: moved to meta, its head (tied to the embedding, so not in
    params) would be read from meta storage. The first step refuses it, naming the tensor and what
    to do, whether the module moved before ``init`` or after a step."""
    model, _ = hf_model("gpt2")
    step, params = _lm_step(model)
    batch = _lm_batch(model.config.vocab_size)
    if when == "before init":
        model.to("meta")
    state = step.init(params)
    if when == "after init":
        state, _ = step(state, batch)
        model.to("meta")
    before = _snapshot(state)
    with pytest.raises(zf.functional.ModuleChangedError,
                       match=r"parameter 'transformer\.wte\.weight'.*meta \(was cpu.*(\n|.)*functionalize"
                             r"(\n|.)*materialize"):
        step(state, batch)
    _assert_untouched(state, before)


def test_an_offloaded_step_refuses_a_module_moved_to_meta_and_keeps_its_state(tmp_path):
    """Under offload to nvme the same change raises the same error (not NonFiniteError) before any
    leaf is touched: the state stays usable."""
    model, block = hf_model("gpt2")
    step, params = _lm_step(model)
    step = zf.offload(step, optimizer="nvme", params="nvme", path=tmp_path, units=zf.units.by_class(block))
    state = step.init(params)
    batch = _lm_batch(model.config.vocab_size)
    state, _ = step(state, batch)
    before = zf.checkpoint.full_params(state)
    model.to("meta")
    with pytest.raises(zf.functional.ModuleChangedError, match=r"'transformer\.wte\.weight'.*meta"):
        step(state, batch)
    assert not state.consumed
    for name, want in before.items():
        assert torch.equal(zf.checkpoint.full_params(state)[name], want), name


def _fc(m):
    return m.blocks[0].fc


CHANGES = {  # name -> (change made to a tests.models.Tiny, what the error says)
    "to meta": (lambda m: m.to("meta"), r"parameter 'emb\.weight' was replaced by a tensor on meta \(was cpu"),
    "to float64 in place": (lambda m: m.double(), r"parameter 'emb\.weight' had its data replaced in place: "
                                                  r"cpu torch\.float64 \(was cpu torch\.float32"),
    "a part moved": (lambda m: _fc(m).to("meta"),
                     r"parameter 'blocks\.0\.fc\.weight' was replaced by a tensor on meta"),
    "param replaced": (lambda m: setattr(_fc(m), "bias", nn.Parameter(torch.zeros(6))),
                       r"parameter 'blocks\.0\.fc\.bias' was replaced by another tensor"),
    "param deleted": (lambda m: delattr(_fc(m), "bias"), r"parameter 'blocks\.0\.fc\.bias' was deleted"),
    "param added": (lambda m: _fc(m).register_parameter("scale", nn.Parameter(torch.ones(6))),
                    r"parameter 'blocks\.0\.fc\.scale' was added"),
    "frozen": (lambda m: _fc(m).weight.requires_grad_(False),
               r"parameter 'blocks\.0\.fc\.weight' has requires_grad=False \(was True"),
    "unfrozen": (lambda m: m.ln_f.bias.requires_grad_(True),
                 r"parameter 'ln_f\.bias' has requires_grad=True \(was False"),
    "tiled": (lambda m: zf.tile(m, tiles=2, modules=["head"]), r"submodule 'emb' was replaced by a TiledEmbedding"),
    "layer swapped": (lambda m: setattr(m.blocks, "1", nn.Identity()),
                      r"submodule 'blocks\.1' was replaced by an Identity \(was a Block"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_apply_refuses_a_module_changed_after_functionalize(change):
    """Moved (meta, dtype), replaced, deleted, added, re-flagged, tiled or swapped after
    functionalize: apply's first call names the tensor and what changed; a step's state is untouched."""
    torch.manual_seed(0)
    model = Tiny()
    model.ln_f.bias.requires_grad_(False)
    apply, params = zf.functionalize(model)
    step = zf.train_step(token_loss(apply),
                         zf.optim.adamw(1e-2))
    state, _ = step(step.init(params), batches(1, 1)[0])
    mutate, says = CHANGES[change]
    mutate(model)
    before = _snapshot(state)
    with pytest.raises(zf.functional.ModuleChangedError, match=says):
        step(state, batches(1, 1)[0])
    _assert_untouched(state, before)
    with pytest.raises(zf.functional.ModuleChangedError, match=says):  # and every later call, outside a step too
        apply(params, batches(1, 1)[0][0])


def test_apply_with_buffers_refuses_a_module_whose_buffer_was_replaced():
    torch.manual_seed(0)
    model = BNNet()
    apply, (params, buffers) = zf.functionalize(model, with_buffers=True)
    x = torch.randn(8, 3)
    apply(params, buffers, x)
    model.bn.running_mean = torch.zeros(5)
    with pytest.raises(zf.functional.ModuleChangedError, match=r"buffer 'bn\.running_mean' was replaced by another"):
        apply(params, buffers, x)


def test_what_does_not_change_the_module_is_accepted():
    """train/eval, a remat set on a unit's forward, new hooks and in-place updates of values keep
    the tensors apply relies on: the same training as on the untouched module."""
    def losses(after):
        torch.manual_seed(0)
        model = Tiny()
        apply, params = zf.functionalize(model)
        after(model)
        step = zf.train_step(token_loss(apply),
                             zf.optim.adamw(1e-2))
        state, out = step.init(params), []
        for batch in batches(1, 3):
            state, m = step(state, batch)
            out.append(m["loss"].item())
            model.eval(), model.train()
        return out

    def remat_and_hook(model):
        for b in model.blocks:
            b.forward = zf.remat(b.forward)
        model.head.register_forward_hook(lambda *a: None)

    assert losses(remat_and_hook) == losses(lambda m: None)


def test_values_loaded_into_the_module_between_functionalize_and_init_are_the_ones_trained():
    """``load_state_dict`` writes the module's tensors in place (no slot changes): apply reads the
    loaded buffers as it reads the loaded frozen params, never a copy stale since functionalize."""
    torch.manual_seed(0)
    model, trained = BNNet(mask=True), BNNet(mask=True)
    model.fc2.bias.requires_grad_(False)
    trained.fc2.bias.requires_grad_(False)
    for x, _ in bn_batches(3):
        trained(x)  # running statistics of its own
    with torch.no_grad():
        trained.mask.mul_(2.0)
    apply, step = bn_step(model)
    _, params = zf.functionalize(model)
    model.load_state_dict(trained.state_dict())
    state = step.init(params)
    x = torch.randn(8, 3)
    model.eval(), trained.eval()
    with zf.functional.using(state):
        torch.testing.assert_close(apply(state.params, x), trained(x))
    model.train(), trained.train()
    ref = copy.deepcopy(trained)
    state, _ = step(state, bn_batches(1)[0])
    ref(bn_batches(1)[0][0])
    for name in BN_STATS:
        torch.testing.assert_close(state.buffers[name], ref.get_buffer(name))
