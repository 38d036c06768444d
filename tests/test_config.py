"""zf.config: Plans are checked plain data; units strings resolve to selectors; schedules follow
DeepSpeed's formulas update for update; optimizer(plan) is clip + the optimizer on the schedule.
The DeepSpeed reader's tests are in test_deepspeed_config.py."""
import dataclasses
import json
import math
import re

import pytest
import torch
from torch import nn

import zfunc as zf
from zfunc import config as C
from zfunc.config import deepspeed as D
from zfunc import optim


# ----------------------------------------------------------------------------- Plan


def test_default_plan_is_a_plain_fp32_run_and_round_trips_through_json():
    plan = C.Plan()
    assert (plan.dp, plan.pp, plan.zero_stage, plan.precision, plan.accum) == (1, 1, 0, "fp32", 1)
    assert (plan.offload_optimizer, plan.offload_params, plan.remat, plan.tile_lm_head) == ("none", "none", False, 0)
    assert plan.optimizer == "adamw"
    assert plan.optimizer_params == {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    text = json.dumps(dataclasses.asdict(plan))
    assert C.Plan(**json.loads(text)) == plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dp = 2


def test_plan_completes_params_with_deepspeed_defaults_and_round_trips():
    plan = C.Plan(dp=4, zero_stage=3, offload_optimizer="nvme", offload_params="cpu", nvme_path="/scratch",
                  units="class:Block", remat=True, remat_offload=True, tile_lm_head=8, precision="fp16",
                  accum=2, gradient_clipping=1.0, optimizer="lion", optimizer_params={"lr": 1e-4},
                  scheduler="WarmupLR", scheduler_params={"warmup_num_steps": 10}, micro_batch=4, global_batch=32)
    assert plan.optimizer_params == {"lr": 1e-4, "betas": [0.9, 0.999], "weight_decay": 0.0}
    assert plan.scheduler_params == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-4, "warmup_num_steps": 10,
                                     "warmup_type": "log"}  # WarmupLR peaks at the optimizer's lr
    assert C.Plan(**json.loads(json.dumps(dataclasses.asdict(plan)))) == plan
    pipe = C.Plan(dp=2, pp=2, zero_stage=1, microbatches=8, pipeline_schedule="gpipe", micro_batch=2,
                  global_batch=32)
    assert pipe.global_batch == 2 * 8 * 2


@pytest.mark.parametrize("field, value, expected", [
    ("dp", 0, "an int >= 1"), ("pp", 1.5, "an int >= 1"), ("zero_stage", 4, "[0, 1, 2, 3]"),
    ("units", "blocks", "'auto'"), ("units", "class:", "'class:"), ("offload_optimizer", "disk", "'nvme'"),
    ("offload_params", "gpu", "'cpu'"), ("remat", 1, "true or false"), ("tile_lm_head", -1, "an int >= 0"),
    ("microbatches", 0, "an int >= 1"), ("pipeline_schedule", "zb", "'1f1b'"), ("precision", "fp8", "'bf16'"),
    ("initial_scale_power", 200, "[0, 127]"), ("loss_scale_window", 0, "an int >= 1"),
    ("hysteresis", 0, "an int >= 1"), ("consecutive_hysteresis", "no", "true or false"),
    ("min_loss_scale", 0, "> 0"), ("accum", 0, "an int >= 1"), ("gradient_clipping", -1.0, ">= 0"),
    ("optimizer", "lars", "'adamw'"), ("scheduler", "OneCycle", "'WarmupLR'"),
    ("micro_batch", 0, "an int >= 1"), ("global_batch", True, "an int >= 1"),
])
def test_plan_refuses_a_bad_field_naming_it_and_the_value(field, value, expected):
    with pytest.raises(ValueError) as e:
        C.Plan(**{field: value})
    assert str(e.value).startswith(f"{field}: ") and repr(value) in str(e.value) and expected in str(e.value)


@pytest.mark.parametrize("fields, message", [
    (dict(optimizer_params={"momentum": 0.9}), "optimizer_params.momentum: adamw takes"),
    (dict(optimizer_params={"betas": [0.9, 1.0]}), "optimizer_params.betas[1]"),
    (dict(optimizer_params={"lr": -1}), "optimizer_params.lr"),
    (dict(optimizer_params={"lr": True}), "optimizer_params.lr: expected a number >= 0.0, got True"),
    (dict(optimizer_params={"eps": 0}), "optimizer_params.eps: expected a number > 0, got 0"),
    (dict(optimizer="lion", optimizer_params={"betas": [0.9, True]}), "optimizer_params.betas[1]"),
    (dict(scheduler="WarmupCosineLR", scheduler_params={"cos_min_ratio": 2}),
     "scheduler_params.cos_min_ratio: expected a number in [0, 1], got 2"),
    (dict(scheduler="WarmupCosineLR", scheduler_params={"warmup_min_ratio": 1.5}),
     "scheduler_params.warmup_min_ratio: expected a number in [0, 1], got 1.5"),
    (dict(optimizer="sgd", optimizer_params={"nesterov": True}), "optimizer_params.nesterov: needs momentum > 0"),
    (dict(optimizer=None, optimizer_params={"lr": 1.0}), "optimizer_params: the plan names no optimizer"),
    (dict(scheduler="WarmupLR", scheduler_params={"warmup_type": "exp"}), "scheduler_params.warmup_type"),
    (dict(scheduler="WarmupLR", scheduler_params={"total_num_steps": 9}), "scheduler_params.total_num_steps: "
                                                                          "WarmupLR takes"),
    (dict(scheduler="WarmupDecayLR", scheduler_params={"warmup_num_steps": 0}), "scheduler_params.warmup_num_steps"),
    (dict(optimizer=None, scheduler="WarmupCosineLR"), "scheduler: WarmupCosineLR takes its peak"),
    (dict(scheduler_params={"warmup_num_steps": 3}), "scheduler_params: the plan names no scheduler"),
    (dict(pp=2, microbatches=2, virtual_stages=2), "virtual_stages: more than one virtual stage per rank needs "
                                                   "pipeline_schedule 'interleaved-1f1b', got 2 with '1f1b'"),
    (dict(microbatches=4), "microbatches: pipeline microbatches need pp > 1"),
    (dict(pp=2, accum=2), "accum: a pipeline splits"),
    (dict(zero_stage=2, offload_params="cpu"), "offload_params: offloading params needs ZeRO stage 3"),
    (dict(dp=2, offload_params="cpu"), "offload_params: offloading params needs ZeRO stage 3"),
    (dict(offload_optimizer="nvme"), "nvme_path: 'nvme' offload needs a directory"),
    (dict(offload_optimizer="cpu", nvme_path="/x"), "nvme_path: only 'nvme' offload uses it"),
    (dict(remat_offload=True), "remat_offload: offloads what remat keeps"),
    (dict(dp=2, accum=2, micro_batch=4, global_batch=12),
     "global_batch: expected micro_batch * accum * microbatches * dp = 4 * 2 * 1 * 2 = 16, got 12"),
])
def test_plan_refuses_inconsistent_fields_naming_them(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        C.Plan(**fields)


def test_units_strings_resolve_to_zf_units_selectors():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    by_class = C.selector("class:Sequential, Linear")(model)
    assert [u.name for u in by_class] == [""]  # the outermost Sequential is the root: one unit
    assert sorted(u.name for u in C.selector("class:Linear")(model)) == ["0", "2.0", "2.1"]
    assert [u.name for u in C.selector("names:0,2")(model)] == ["0", "2"]
    assert sorted(u.name for u in C.selector("auto:20")(model)) == ["0", "2.0", "2.1"]
    assert C.selector("auto")(model)[0].name == ""
    with pytest.raises(ValueError, match=r"units: the model has no module class named \['Block'\]"):
        C.selector("class:Block")(model)
    with pytest.raises(ValueError, match="units: expected None, 'auto'"):
        C.selector("auto:0")


# ----------------------------------------------------------------------------- schedules and the optimizer

# DeepSpeed's docs (lr_schedules.py docstrings): WarmupLR rises from warmup_min_lr to warmup_max_lr
# over warmup_num_steps, by log(it + 1) / log(W) or it / W, then stays; WarmupDecayLR then falls
# linearly to warmup_min_lr at total_num_steps; WarmupCosineLR scales the optimizer's lr by a ratio
# rising from warmup_min_ratio to 1, then a cosine to cos_min_ratio. The engine steps the scheduler
# after each update, so update n uses iteration it = n - 1 (the value at it = -1 is the initial one).


def test_warmup_lr_at_deepspeeds_iteration():
    lin = C.warmup_lr(1e-5, 1e-3, warmup_num_steps=10, warmup_type="linear")
    assert [lin(n) for n in (0, 1, 2, 6, 10, 11, 500)] == pytest.approx(
        [1e-5, 1e-5, 1e-5 + 0.1 * (1e-3 - 1e-5), 1e-5 + 0.5 * (1e-3 - 1e-5), 1e-5 + 0.9 * (1e-3 - 1e-5), 1e-3, 1e-3])
    log = C.warmup_lr(0.0, 1e-3, warmup_num_steps=10)
    assert log(0) == log(1) == 0.0
    assert log(4) == pytest.approx(1e-3 * math.log(4) / math.log(10))
    assert log(11) == 1e-3
    one = C.warmup_lr(0.0, 1.0, warmup_num_steps=1, warmup_type="linear")  # DeepSpeed: at least 2 steps
    assert [one(n) for n in range(4)] == [0.0, 0.0, 0.5, 1.0]


def test_warmup_decay_lr_falls_linearly_to_the_minimum():
    s = C.warmup_decay_lr(110, 1e-5, 1e-3, warmup_num_steps=10, warmup_type="linear")
    delta = 1e-3 - 1e-5
    assert s(11) == pytest.approx(1e-3)  # it = 10: (110 - 10) / (110 - 10)
    assert s(61) == pytest.approx(1e-5 + delta * 0.5)  # it = 60
    assert s(111) == pytest.approx(1e-5) and s(300) == pytest.approx(1e-5)


def test_warmup_cosine_lr_scales_the_optimizer_lr():
    s = C.warmup_cosine_lr(2e-3, total_num_steps=110, warmup_min_ratio=0.1, warmup_num_steps=10, cos_min_ratio=0.05,
                           warmup_type="linear")
    assert s(0) == 0.0  # DeepSpeed's lr before its first scheduler step
    assert s(1) == pytest.approx(2e-3 * 0.1)
    assert s(6) == pytest.approx(2e-3 * (0.1 + 0.5 * 0.9))
    cosine = lambda p: 0.05 + 0.95 * (1 + math.cos(math.pi * p)) / 2  # noqa: E731
    assert s(11) == pytest.approx(2e-3 * cosine(1 / 100))  # it = 10: (it - W + 1) / (T - W)
    assert s(60) == pytest.approx(2e-3 * cosine(0.5))
    assert s(110) == pytest.approx(2e-3 * 0.05) and s(400) == pytest.approx(2e-3 * 0.05)


def test_schedule_of_a_plan_and_its_total_steps():
    plan = C.Plan(scheduler="WarmupDecayLR", scheduler_params={"warmup_num_steps": 10, "warmup_max_lr": 1e-3,
                                                               "warmup_type": "linear"})
    s = C.schedule(plan, total_steps=110)
    assert s(61) == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="total_steps: WarmupDecayLR needs the number of updates"):
        C.schedule(plan)
    fixed = dataclasses.replace(plan, scheduler_params=dict(plan.scheduler_params, total_num_steps=50))
    with pytest.raises(ValueError, match="total_steps: the plan's WarmupDecayLR has total_num_steps=50, got 110"):
        C.schedule(fixed, total_steps=110)
    assert C.schedule(fixed, total_steps=50)(5) == C.schedule(fixed)(5)
    assert C.schedule(C.Plan(optimizer_params={"lr": 0.3}))(1000) == 0.3
    with pytest.raises(ValueError, match="plan.optimizer: the plan names no optimizer"):
        C.optimizer(C.Plan(optimizer=None))


@pytest.mark.parametrize("kind, make", [
    ("adamw", lambda lr: optim.adamw(lr, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)),
    ("adam", lambda lr: optim.adam(lr, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)),
    ("sgd", lambda lr: optim.sgd(lr, momentum=0.8, weight_decay=0.1)),
    ("lion", lambda lr: optim.lion(lr, b1=0.8, b2=0.99, weight_decay=0.1)),
    ("lamb", lambda lr: optim.lamb(lr, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)),
])
def test_optimizer_of_a_plan_is_clip_then_the_optimizer_on_the_schedule(kind, make):
    given = {"lr": 1e-2, "weight_decay": 0.1, **({"momentum": 0.8} if kind == "sgd" else {"betas": [0.8, 0.99]}),
             **({"eps": 1e-6} if kind.startswith("adam") or kind == "lamb" else {})}
    plan = C.Plan(optimizer=kind, optimizer_params=given, gradient_clipping=0.5, scheduler="WarmupLR",
                  scheduler_params={"warmup_num_steps": 3, "warmup_type": "linear"})
    lr = C.warmup_lr(0.0, 1e-2, 3, "linear")
    ours, ref = C.optimizer(plan), optim.chain(optim.clip_by_global_norm(0.5), make(lr))
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    p1, s1, p2, s2 = params, ours.init(params), params, ref.init(params)
    for step in range(5):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        assert optim.learning_rate(ours, s1) == lr(step)
        u1, s1 = ours.update(grads, s1, p1)
        u2, s2 = ref.update(grads, s2, p2)
        p1, p2 = optim.apply_updates(p1, u1), optim.apply_updates(p2, u2)
        for k in params:
            torch.testing.assert_close(p1[k], p2[k], rtol=0, atol=0)
    unclipped = C.optimizer(dataclasses.replace(plan, gradient_clipping=0.0))
    assert type(unclipped.init(params)) is not tuple  # no chain: the optimizer's own state, no clip



def test_zf_config_is_exported_with_the_deepspeed_reader():
    assert "config" in zf.__all__
    assert zf.config.Plan is C.Plan
    assert zf.config.from_deepspeed is C.from_deepspeed is D.from_deepspeed  # the reader's own, not a wrapper
    assert zf.config.IgnoredKeysWarning is D.IgnoredKeysWarning
    assert {"from_deepspeed", "IgnoredKeysWarning"} <= set(dir(C))
    with pytest.raises(AttributeError, match="module 'zfunc.config' has no attribute 'from_ds'"):
        C.from_ds
