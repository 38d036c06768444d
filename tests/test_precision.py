"""precision: compute dtypes, casts and the fp16 loss-scale rule."""
import pytest
import torch

from zfunc import precision as mp


def test_compute_dtype():
    assert mp.compute_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="precision: expected one of"):
        mp.compute_dtype("float16")


def test_cast_floating_leaves_integers_alone():
    t = {"w": torch.ones(2), "ids": torch.arange(2)}
    out = mp.cast_floating(t, torch.bfloat16)
    assert out["w"].dtype == torch.bfloat16 and out["ids"].dtype == torch.int64
    assert mp.cast_floating(t, torch.float32)["w"] is t["w"]


def test_loss_scale_rule():
    assert mp.init_loss_scale("bf16") is None
    ls = mp.init_loss_scale("fp16", init_scale=4.0, growth_interval=2)
    assert ls == mp.LossScale(4.0, 0, 2)
    assert mp.next_loss_scale(ls, finite=False) == mp.LossScale(2.0, 0, 2)
    ls = mp.next_loss_scale(ls, finite=True)
    assert ls == mp.LossScale(4.0, 1, 2)
    assert mp.next_loss_scale(ls, finite=True) == mp.LossScale(8.0, 0, 2)
    assert mp.next_loss_scale(mp.LossScale(1.0), finite=False).scale == 1.0  # floor
    with pytest.raises(ValueError, match="init_scale"):
        mp.init_loss_scale("fp16", init_scale=0)
