"""precision: compute dtypes, casts and the fp16 loss-scale rule."""
import pytest
import torch

from zfunc.core import precision as mp


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
    ls = mp.init_loss_scale("fp16", init_scale=4.0, growth_interval=2)
    assert ls == mp.LossScale(4.0, 0, 2) and ls.dynamic and ls.skips == 0
    assert mp.next_loss_scale(ls, finite=False) == mp.LossScale(2.0, -1, 2)  # halved, one skip in a row
    ls = mp.next_loss_scale(ls, finite=True)
    assert ls == mp.LossScale(4.0, 1, 2)
    assert mp.next_loss_scale(ls, finite=True) == mp.LossScale(8.0, 0, 2)
    assert mp.next_loss_scale(mp.LossScale(1.0), finite=False).scale == 1.0  # floor
    for bad in (dict(init_scale=0), dict(init_scale=float("nan")), dict(init_scale=float("inf"))):
        with pytest.raises(ValueError, match="init_scale"):
            mp.init_loss_scale("fp16", **bad)
    with pytest.raises(ValueError, match="growth_interval: expected an int >= 1, got 0"):
        mp.init_loss_scale("fp16", growth_interval=0)


def test_skips_in_a_row_are_counted_and_a_finite_step_ends_the_run():
    ls = mp.init_loss_scale("fp16", init_scale=8.0, growth_interval=3)
    for k in (1, 2, 3):
        ls = mp.next_loss_scale(ls, finite=False)
        assert ls.skips == k and ls.scale == max(8.0 / 2**k, 1.0)
    ls = mp.next_loss_scale(ls, finite=True)
    assert ls == mp.LossScale(1.0, 1, 3) and ls.skips == 0  # growth counts from the end of the run


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fp32_and_bf16_carry_a_fixed_scale_of_one_that_only_counts_skips(precision):
    ls = mp.init_loss_scale(precision)
    assert ls == mp.LossScale(1.0, 0, 0) and not ls.dynamic and mp.scale_of(ls) is None
    ls = mp.next_loss_scale(mp.next_loss_scale(ls, finite=False), finite=False)
    assert ls == mp.LossScale(1.0, -2, 0) and ls.skips == 2
    assert mp.next_loss_scale(ls, finite=True) == mp.LossScale(1.0, 0, 0)  # never grows


def test_default_max_skips_lets_fp16_halve_its_initial_scale_down_to_one():
    assert mp.default_max_skips("fp32") == mp.default_max_skips("bf16") == 10
    assert mp.default_max_skips("fp16") == 10 + 16 and mp.init_loss_scale("fp16").scale == 2.0**16


def test_deepspeed_rule_halves_at_the_hysteresis_th_overflow_never_below_the_floor():
    ls = mp.deepspeed_loss_scale(initial_scale_power=3, loss_scale_window=2, hysteresis=2, min_loss_scale=4.0)
    assert ls.scale == 8.0 and ls.tolerance == 2
    ls = mp.next_loss_scale(ls, finite=False)
    assert ls.scale == 8.0 and ls.skips == 1  # the first overflow is tolerated (still skipped)
    ls = mp.next_loss_scale(ls, finite=False)
    assert ls.scale == 4.0 and ls.skips == 2  # the second halves
    ls = mp.next_loss_scale(ls, finite=False)
    assert ls.scale == 4.0  # never below min_loss_scale
    ls = mp.next_loss_scale(mp.next_loss_scale(ls, finite=True), finite=True)
    assert ls.scale == 8.0 and ls.tolerance == 2  # growth refills the hysteresis, as DeepSpeed does
    one = mp.next_loss_scale(ls, finite=False)
    assert one.scale == 8.0 and mp.next_loss_scale(mp.next_loss_scale(one, True), False).scale == 4.0  # not refilled
    consecutive = mp.deepspeed_loss_scale(3, 100, 2, consecutive_hysteresis=True)
    consecutive = mp.next_loss_scale(mp.next_loss_scale(consecutive, False), True)  # refilled by a finite step
    assert mp.next_loss_scale(consecutive, False).scale == 8.0
    with pytest.raises(ValueError, match="hysteresis: expected an int >= 1, got 0"):
        mp.deepspeed_loss_scale(hysteresis=0)
    with pytest.raises(ValueError, match="min_loss_scale: expected a finite number > 0"):
        mp.deepspeed_loss_scale(min_loss_scale=0.0)
