"""functionalize: the pure apply equals the module, buffers are never mutated, errors are clear."""
import pytest
import torch
from torch import nn

import zfunc as zf


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


def test_apply_needs_every_trainable_param():
    """A missing name is an error, not silently the module's own tensor (which would never train)."""
    apply, params = zf.functionalize(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)))
    partial = {k: v for k, v in params.items() if not k.startswith("1.")}
    with pytest.raises(KeyError, match=r"params: 2 trainable parameters of the module are missing: "
                                       r"\['1.bias', '1.weight'\]"):
        apply(partial, torch.ones(1, 2))
