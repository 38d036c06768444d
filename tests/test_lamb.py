"""zf.optim.lamb: equals a plain-torch LAMB (You et al., 2020; DeepSpeed FusedLamb's formulas) to 1e-6."""
from __future__ import annotations

import pytest
import torch

from zfunc import optim


def _reference_lamb(params, grads_per_step, *, lr, b1, b2, eps, wd, bias_correction, max_coeff, min_coeff):
    """LAMB written out with torch ops, one tensor at a time, state in dicts."""
    params = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for k, (p, g) in enumerate(zip(params, grads)):
            m[k].mul_(b1).add_(g, alpha=1 - b1)
            v[k].mul_(b2).addcmul_(g, g, value=1 - b2)
            mh, vh = (m[k] / (1 - b1**t), v[k] / (1 - b2**t)) if bias_correction else (m[k], v[k])
            u = mh / (vh.sqrt() + eps) + wd * p
            w_norm, u_norm = p.norm().item(), u.norm().item()
            ratio = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
            p.sub_(lr * ratio * u)
    return params


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_lamb_equals_reference(bias_correction, wd):
    torch.manual_seed(0)
    params = {"w": torch.randn(16, 8), "b": torch.zeros(8), "s": torch.randn(3) * 1e-3}
    steps = [{k: torch.randn_like(p) for k, p in params.items()} for _ in range(20)]
    kw = dict(b1=0.9, b2=0.999, eps=1e-8, bias_correction=bias_correction, max_coeff=10.0, min_coeff=0.01)
    tx = optim.lamb(1e-2, weight_decay=wd, **kw)
    state, p = tx.init(params), dict(params)
    for g in steps:
        p, state = optim.apply(tx, g, state, {k: x.clone() for k, x in p.items()})
    names = list(params)
    ref = _reference_lamb([params[k] for k in names], [[g[k] for k in names] for g in steps], lr=1e-2, wd=wd, **kw)
    for k, r in zip(names, ref):
        torch.testing.assert_close(p[k], r, rtol=1e-6, atol=1e-6)


def test_lamb_trust_ratio_is_clamped_and_one_at_zero():
    assert optim.lamb(1.0).update is not None
    from zfunc.optim.lamb import trust_ratio
    assert trust_ratio(torch.zeros(3), torch.ones(3), 0.01, 10.0) == 1.0
    assert trust_ratio(torch.full((4,), 100.0), torch.ones(4), 0.01, 10.0) == 10.0
    assert trust_ratio(torch.full((4,), 1e-5), torch.ones(4), 0.01, 10.0) == 0.01


def test_lamb_leaves_a_param_without_grad_alone():
    tx = optim.lamb(1e-2)
    params = {"a": torch.ones(2), "b": torch.ones(2)}
    new, state = optim.apply(tx, {"a": torch.ones(2), "b": None}, tx.init(params), dict(params))
    assert torch.equal(new["b"], torch.ones(2)) and not torch.equal(new["a"], torch.ones(2))


@pytest.mark.parametrize("kw, field", [(dict(max_coeff=0.001), "max_coeff"), (dict(min_coeff=0.0), "min_coeff"),
                                        (dict(bias_correction=1), "bias_correction"), (dict(eps=0.0), "eps")])
def test_lamb_refuses_bad_arguments(kw, field):
    with pytest.raises(ValueError, match=field):
        optim.lamb(1e-3, **kw)
