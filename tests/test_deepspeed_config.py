"""zf.config.from_deepspeed: DeepSpeed configs (Hugging Face's examples among them) read into Plans
by DeepSpeed's rules; "auto" values filled as the Hugging Face Trainer fills them; what zfunc lacks
is refused by key path; ignored knobs named once."""
import copy
import json
import re
import warnings

import pytest
import torch

from zfunc import config as C
from zfunc.config import deepspeed as D
from zfunc.config.deepspeed_keys import _BATCH_KEYS
from zfunc.config import json_file
from tests.recipe_runs import HF_ZERO2, HF_ZERO3
from zfunc import optim

# Hugging Face's example configs (transformers tests/deepspeed/ds_config_zero2.json and
# ds_config_zero3.json, as in its DeepSpeed guide): ZeRO-2 with every value "auto" and the
# optimizer offloaded to CPU; ZeRO-3 with fp16 and optimizer and params offloaded to CPU.
# The Trainer's values for the "auto"s above (TrainingArguments: learning_rate, adam_beta1/2, ...).
HF_AUTO = dict(lr=3e-4, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, warmup_num_steps=100,
               train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=4, gradient_clipping=1.0)
SMALL = {"train_micro_batch_size_per_gpu": 2}  # the least a config needs


def read(config, world_size=1, **auto):
    """``from_deepspeed`` with its notice silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", D.IgnoredKeysWarning)
        return D.from_deepspeed(config, world_size=world_size, **auto)


def with_(base, **changes):
    out = copy.deepcopy(base)
    out.update(changes)
    return out


# ----------------------------------------------------------------------------- Hugging Face's configs


def test_hf_zero2_all_auto_with_cpu_optimizer_offload():
    with pytest.warns(D.IgnoredKeysWarning) as record:
        plan = D.from_deepspeed(HF_ZERO2, world_size=2, bf16=True, fp16=False, **HF_AUTO)
    assert (plan.dp, plan.zero_stage, plan.offload_optimizer, plan.offload_params) == (2, 2, "cpu", "none")
    assert plan.precision == "bf16"
    assert (plan.micro_batch, plan.accum, plan.global_batch) == (8, 4, 8 * 4 * 2)  # HF: world * micro * accum
    assert plan.gradient_clipping == 1.0
    assert plan.optimizer == "adamw"
    assert plan.optimizer_params == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert plan.scheduler == "WarmupLR"  # HF: warmup_min_lr 0, warmup_max_lr = learning_rate
    assert plan.scheduler_params == {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100,
                                     "warmup_type": "log"}
    assert len(record) == 1


def test_hf_zero3_fp16_with_cpu_offload_of_optimizer_and_params():
    plan = read(HF_ZERO3, world_size=4, fp16=True, **HF_AUTO)
    assert (plan.zero_stage, plan.offload_optimizer, plan.offload_params, plan.nvme_path) == (3, "cpu", "cpu", None)
    assert plan.precision == "fp16"
    assert (plan.initial_scale_power, plan.loss_scale_window, plan.hysteresis, plan.min_loss_scale) == (16, 1000, 2, 1)
    assert (plan.micro_batch, plan.accum, plan.global_batch) == (8, 4, 128)
    # the "auto" tuning knobs need no value: they are ignored
    assert {"zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"} <= set(
        plan.ignored)
    tx = C.optimizer(plan)
    params = {"w": torch.ones(3)}
    state = tx.init(params)
    assert optim.learning_rate(tx, state) == 0.0  # WarmupLR starts at warmup_min_lr


def test_hf_zero3_with_explicit_values_needs_no_auto_but_a_batch_size():
    explicit = with_(HF_ZERO3, fp16=dict(HF_ZERO3["fp16"], enabled=True),
                     optimizer={"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8,
                                                            "weight_decay": 3e-7}},
                     scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                               "warmup_num_steps": 500}},
                     gradient_clipping=1.0)
    for key in ("gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu"):
        del explicit[key]
    with pytest.raises(ValueError, match="give train_batch_size or train_micro_batch_size_per_gpu"):
        read(explicit)
    plan = read(with_(explicit, train_micro_batch_size_per_gpu=1), world_size=8)
    assert (plan.precision, plan.global_batch, plan.accum) == ("fp16", 8, 1)
    assert plan.optimizer_params["betas"] == [0.8, 0.999]


# ----------------------------------------------------------------------------- "auto"


def test_auto_without_a_value_is_an_error_naming_the_key():
    auto = dict(HF_AUTO, fp16=True, bf16=False)
    for name, path in [("lr", "optimizer.params.lr"), ("betas", "optimizer.params.betas"),
                       ("eps", "optimizer.params.eps"), ("weight_decay", "optimizer.params.weight_decay"),
                       ("warmup_num_steps", "scheduler.params.warmup_num_steps"),
                       ("gradient_clipping", "gradient_clipping"), ("fp16", "fp16.enabled"), ("bf16", "bf16.enabled")]:
        given = {k: v for k, v in auto.items() if k != name}
        with pytest.raises(ValueError, match=re.escape(f"{path}: the config says 'auto' and no value was given; "
                                                       f"pass {name}=")):
            read(HF_ZERO2, **given)


def test_auto_batch_sizes_follow_the_batch_rule_and_fail_only_when_underdetermined():
    auto = dict(HF_AUTO, fp16=False, bf16=False)
    del auto["gradient_accumulation_steps"]  # auto accum, no value: one size alone gives accum 1
    plan = read(HF_ZERO2, world_size=2, **auto)
    assert (plan.micro_batch, plan.accum, plan.global_batch) == (8, 1, 16)
    plan = read(HF_ZERO2, world_size=2, **dict(auto, train_batch_size=64))
    assert (plan.micro_batch, plan.accum, plan.global_batch) == (8, 4, 64)
    del auto["train_micro_batch_size_per_gpu"]
    with pytest.raises(ValueError, match="train_batch_size=not given, train_micro_batch_size_per_gpu=not given"):
        read(HF_ZERO2, **auto)


def test_auto_names_mismatches_and_hf_defaults():
    with pytest.raises(ValueError, match=r"auto: unknown names \['learning_rate'\]"):
        read(SMALL, learning_rate=1e-3)
    explicit = with_(SMALL, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    with pytest.raises(ValueError, match=r"optimizer.params.lr: the config sets 0.001 and the auto value lr=0.0003 "
                                         "differs"):
        read(explicit, lr=3e-4)
    assert read(explicit, lr=1e-3).optimizer_params["lr"] == 1e-3
    with pytest.raises(ValueError, match=r"zero_optimization.stage: 'auto' is filled only at"):
        read(with_(SMALL, zero_optimization={"stage": "auto"}))
    sched = with_(explicit, scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": "auto"}})
    assert read(sched).scheduler_params["warmup_min_lr"] == 0.0  # what HF fills
    assert read(sched, warmup_min_lr=1e-5).scheduler_params["warmup_min_lr"] == 1e-5
    with pytest.warns(D.IgnoredKeysWarning, match="auto values with no 'auto' to fill: total_num_steps"):
        D.from_deepspeed(SMALL, total_num_steps=10)


# ----------------------------------------------------------------------------- batch sizes


@pytest.mark.parametrize("given, world_size, expected", [
    (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 4, (32, 4, 2)),
    (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), 4, (32, 4, 2)),
    (dict(train_batch_size=32, gradient_accumulation_steps=2), 4, (32, 4, 2)),
    (dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 4, (32, 4, 2)),
    (dict(train_batch_size=32), 4, (32, 8, 1)),
    (dict(train_micro_batch_size_per_gpu=4), 4, (16, 4, 1)),
    (dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 1, (8, 4, 2)),
    (dict(train_batch_size=3e1, train_micro_batch_size_per_gpu=15), 1, (30, 15, 2)),  # 3e1: a JSON float
])
def test_any_two_batch_sizes_give_the_third(given, world_size, expected):
    plan = read(given, world_size=world_size)
    assert (plan.global_batch, plan.micro_batch, plan.accum, plan.dp) == (*expected, world_size)


@pytest.mark.parametrize("given, world_size, why", [
    (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 2,
     "4 * 2 * 2 = 16"),
    (dict(train_batch_size=16, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 4,
     "4 * 2 * 4 = 32"),
    (dict(train_batch_size=30, train_micro_batch_size_per_gpu=4), 2, "30 is not a positive multiple of 8"),
    (dict(train_batch_size=30, gradient_accumulation_steps=4), 1, "30 is not a positive multiple of 4"),
    (dict(train_batch_size=4, train_micro_batch_size_per_gpu=4), 2, "4 is not a positive multiple of 8"),
    (dict(train_batch_size=6), 4, "6 is not a positive multiple of 4"),
    (dict(gradient_accumulation_steps=2), 1, "give train_batch_size or train_micro_batch_size_per_gpu"),
    ({}, 1, "give train_batch_size or train_micro_batch_size_per_gpu"),
])
def test_batch_disagreements_name_all_three_values_and_the_world_size(given, world_size, why):
    with pytest.raises(ValueError) as e:
        read(given, world_size=world_size)
    message = str(e.value)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert f"{key}={given[key] if key in given else 'not given'}" in message
    assert f"world_size={world_size}" in message and why in message


@pytest.mark.parametrize("key, value", [("train_batch_size", 0), ("train_micro_batch_size_per_gpu", -2),
                                        ("gradient_accumulation_steps", 2.5), ("train_batch_size", "8"),
                                        ("train_micro_batch_size_per_gpu", True), ("gradient_accumulation_steps", [2])])
def test_bad_batch_values_name_their_key(key, value):
    with pytest.raises(ValueError, match=re.escape(f"{key}: expected an int >= 1, got {value!r}")):
        read(with_(SMALL, **{key: value}))


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("config, path, value", [
    ({"optimizer": {"type": "Adagrad", "params": {"lr": 1e-3}}}, "optimizer.type", "Adagrad"),
    ({"optimizer": {"type": "Lamb", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad", True),
    ({"optimizer": {"type": "RMSprop"}}, "optimizer.type", "RMSprop"),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "optimizer.params.max_grad_norm", 1.0),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad", True),
    ({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}}, "optimizer.params.momentum", 0.9),
    ({"moe": {"num_experts": 8}}, "moe", {"num_experts": 8}),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, "expert_parallel", {"enabled": True, "autoep_size": 2}),
    ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention", {"mode": "fixed"}),
    ({"curriculum_learning": {"enabled": True}}, "curriculum_learning", {"enabled": True}),
    ({"data_efficiency": {"enabled": True}}, "data_efficiency", {"enabled": True}),
    ({"compression_training": {"weight_quantization": {}}}, "compression_training", {"weight_quantization": {}}),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp", {"enabled": True, "opt_level": "O1"}),
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op", "sum"),
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage", 5),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "disk"}}},
     "zero_optimization.offload_optimizer.device", "disk"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.nvme_path", None),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device", "cpu"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer.device", "cpu"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                            "offload_param": {"device": "nvme", "nvme_path": "/b"}}},
     "zero_optimization.offload_param.nvme_path", "/b"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio", 0.3),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size",
     8),  # 8 does not divide the one rank
    ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}, "zero_optimization.zero_hpz_partition_size",
     2),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "zero_optimization.overlap_com", True),
    ({"trian_batch_size": 8}, "trian_batch_size", 8),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale", 128),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads", True),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "bf16.bf16_optimizer_states", True),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type", "OneCycle"),
    ({"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}},
     "scheduler.params.warmup_type", "exp"),
    ({"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupDecayLR", "params": {}}},
     "scheduler.params.total_num_steps", None),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}}, "scheduler.type", None),
    ({"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}},
     "scheduler.params.last_batch_iteration", 5),
    ({"activation_checkpointing": {"cpu_checkpointing": "yes"}}, "activation_checkpointing.cpu_checkpointing", "yes"),
    # every value read is typed and in range, whether or not its section is on
    ({"optimizer": {"type": "AdamW", "params": {"eps": 0}}}, "optimizer.params.eps", 0),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": 1}}}, "optimizer.params.bias_correction", 1),
    ({"optimizer": {"type": "SGD", "params": {"maximize": 0}}}, "optimizer.params.maximize", 0),
    ({"optimizer": {"type": "Adam", "params": []}}, "optimizer.params", []),
    ({"optimizer": {"type": "Adam", "params": 0}}, "optimizer.params", 0),
    ({"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupLR", "params": [1]}}, "scheduler.params", [1]),
    ({"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 10, "cos_min_ratio": 5}}}, "scheduler.params.cos_min_ratio", 5),
    ({"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 10, "warmup_min_ratio": 1.5}}}, "scheduler.params.warmup_min_ratio", 1.5),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "nvme_path": 5}}},
     "zero_optimization.offload_optimizer.nvme_path", 5),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "none", "nvme_path": ["/a"]}}},
     "zero_optimization.offload_param.nvme_path", ["/a"]),
    ({"fp16": {"enabled": False, "loss_scale": "dynamic"}}, "fp16.loss_scale", "dynamic"),
    ({"fp16": {"enabled": False, "hysteresis": -3}}, "fp16.hysteresis", -3),
    ({"fp16": {"enabled": False, "min_loss_scale": 0}}, "fp16.min_loss_scale", 0),
    ({"fp16": {"enabled": True, "initial_scale_power": 200}}, "fp16.initial_scale_power", 200),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": 1}}, "fp16.consecutive_hysteresis", 1),
])
def test_refusals_name_the_key_path_and_value(config, path, value):
    with pytest.raises(ValueError) as e:
        read(with_(SMALL, **config))
    assert str(e.value).startswith(f"{path}: ")
    if value is not None:
        assert repr(value) in str(e.value)


def test_fp16_and_bf16_together_are_refused():
    with pytest.raises(ValueError, match="fp16.enabled, bf16.enabled: both true"):
        read(with_(SMALL, fp16={"enabled": True}, bf16={"enabled": True}))


def test_zero_plus_plus_keys_map_to_the_quantized_collectives():
    plan = read(with_(SMALL, zero_optimization={"stage": 3, "zero_quantized_weights": True,
                                                "zero_quantized_gradients": True}))
    assert (plan.quantized_weights, plan.quantized_grads) == (True, 4)
    assert read(with_(SMALL, zero_optimization={"stage": 2, "zero_quantized_gradients": True})).quantized_grads == 4
    with pytest.raises(ValueError, match="zero_optimization.zero_quantized_weights: .* the stage is 2"):
        read(with_(SMALL, zero_optimization={"stage": 2, "zero_quantized_weights": True}))
    with pytest.raises(ValueError, match="zero_optimization.zero_quantized_gradients: .* the stage is 0"):
        read(with_(SMALL, zero_optimization={"stage": 0, "zero_quantized_gradients": True}))
    hpz = read(with_(SMALL, zero_optimization={"stage": 3, "zero_hpz_partition_size": 2}), world_size=4)
    assert hpz.hpz_partition == 2  # zf.shard(hpz=2)


def test_features_that_are_off_are_accepted_and_listed_as_ignored():
    plan = read(with_(SMALL, curriculum_learning={"enabled": False}, amp={"enabled": False},
                      zero_optimization={"stage": 1, "zero_hpz_partition_size": 1, "mics_shard_size": -1}))
    assert set(plan.ignored) == {"curriculum_learning", "amp",
                                 "zero_optimization.zero_hpz_partition_size", "zero_optimization.mics_shard_size"}
    assert plan.zero_stage == 1


# ----------------------------------------------------------------------------- notice, mapping details


def test_ignored_knobs_are_listed_once_in_one_warning():
    config = with_(HF_ZERO3, aio={"block_size": 262144}, tensorboard={"enabled": True},
                   activation_checkpointing={"partition_activations": True, "cpu_checkpointing": True})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan = D.from_deepspeed(config, fp16=True, **HF_AUTO)
    notices = [w for w in record if issubclass(w.category, D.IgnoredKeysWarning)]
    assert len(notices) == 1
    expected = ["steps_per_print", "wall_clock_breakdown", "aio", "tensorboard",
                "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                "zero_optimization.sub_group_size", "zero_optimization.reduce_bucket_size",
                "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
                "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
                "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.pin_memory",
                "activation_checkpointing.partition_activations"]
    assert sorted(plan.ignored) == sorted(expected)
    text = str(notices[0].message)
    assert all(text.count(key) == 1 for key in expected if key != "aio")  # "aio" is a substring of others
    assert f"{len(expected)} DeepSpeed keys" in text
    assert (plan.remat, plan.remat_offload) == (True, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read(SMALL).ignored == ()  # nothing ignored: no warning
        D.from_deepspeed(SMALL)


def test_from_deepspeed_leaves_the_callers_dict_alone():
    config = copy.deepcopy(HF_ZERO2)
    read(config, bf16=True, fp16=False, **HF_AUTO)
    assert config == HF_ZERO2


@pytest.mark.parametrize("optimizer, kind, params", [
    ({"type": "Adam"}, "adamw", {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}),
    ({"type": "adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}}, "adam", {"weight_decay": 0.01}),
    ({"type": "ADAMW", "params": {"adam_w_mode": False}}, "adamw", {}),  # the name AdamW forces AdamW
    ({"type": "AdamW", "params": {"torch_adam": True}}, "adamw", {"weight_decay": 0.01}),  # torch's default
    ({"type": "AdamW", "params": {"lr": 2e-4, "bias_correction": True, "set_grad_none": True}}, "adamw",
     {"lr": 2e-4}),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}, "sgd",
     {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": True}),
    ({"type": "Lion", "params": {"lr": 1e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}}, "lion",
     {"lr": 1e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}),
    ({"type": "lion"}, "lion", {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0}),  # DeepSpeed's defaults
    ({"type": "LAMB", "params": {"lr": 1e-3, "max_coeff": 0.3, "min_coeff": 0.01, "weight_decay": 0.01}}, "lamb",
     {"lr": 1e-3, "max_coeff": 0.3, "min_coeff": 0.01, "bias_correction": True, "eps": 1e-8}),
    # DeepSpeed's BERT configs: bias_correction and max_grad_norm, which its 1-bit optimizers never read
    ({"type": "OneBitAdam", "params": {"lr": 4e-4, "max_grad_norm": 1.0, "weight_decay": 0.01,
                                       "bias_correction": False, "freeze_step": 23000, "cuda_aware": False,
                                       "comm_backend_name": "nccl"}}, "onebit_adam",
     {"lr": 4e-4, "weight_decay": 0.01, "freeze_step": 23000}),
    ({"type": "ZeroOneAdam", "params": {"lr": 1e-3, "var_freeze_step": 1000, "var_update_scaler": 16,
                                        "local_step_scaler": 1000, "local_step_clipper": 16}}, "zero_one_adam",
     {"var_freeze_step": 1000, "local_step_scaler": 1000, "local_step_clipper": 16, "var_update_scaler": 16}),
    ({"type": "OneBitLamb", "params": {"lr": 11e-3, "max_coeff": 0.3, "min_coeff": 0.01, "freeze_step": 1000,
                                       "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5,
                                       "factor_threshold": 0.1}}, "onebit_lamb",
     {"lr": 11e-3, "max_coeff": 0.3, "freeze_step": 1000, "factor_threshold": 0.1}),
])
def test_optimizer_types_map_as_deepspeed_builds_them(optimizer, kind, params):
    plan = read(with_(SMALL, optimizer=optimizer))
    assert plan.optimizer == kind
    assert params.items() <= plan.optimizer_params.items()


def test_a_1bit_optimizer_with_zero_stage_1_is_refused_naming_the_stage():
    with pytest.raises(ValueError, match="zero_optimization.stage.*onebit_adam.*expected 0, got 1"):
        read(with_(SMALL, optimizer={"type": "OneBitAdam"}, zero_optimization={"stage": 1}))


def test_config_sections_map_to_plan_fields():
    plan = read(with_(SMALL, zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                                  "nvme_path": "/nvme"},
                                                "offload_param": {"device": "nvme", "nvme_path": "/nvme"}},
                      fp16={"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 1,
                            "consecutive_hysteresis": True, "min_loss_scale": 0.5}))
    assert (plan.offload_optimizer, plan.offload_params, plan.nvme_path) == ("nvme", "nvme", "/nvme")
    assert (plan.initial_scale_power, plan.loss_scale_window, plan.hysteresis, plan.consecutive_hysteresis,
            plan.min_loss_scale) == (12, 500, 1, True, 0.5)
    assert plan.gradient_clipping == 1.0  # DeepSpeed's default since 0.19.3
    assert read(with_(SMALL, gradient_clipping=0)).gradient_clipping == 0.0
    legacy = read(with_(SMALL, zero_optimization={"stage": 2, "cpu_offload": True}, bfloat16={"enabled": True}))
    assert (legacy.offload_optimizer, legacy.precision) == ("cpu", "bf16")
    assert read(with_(SMALL, zero_optimization=True)).zero_stage == 1
    assert read(with_(SMALL, optimizer={"type": "SGD"})).optimizer == "sgd"
    assert read(SMALL).optimizer is None  # no optimizer section: DeepSpeed trains the client's
    cpu_with_path = read(with_(SMALL, zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu",
                                                                                           "nvme_path": "/x"}}))
    assert cpu_with_path.nvme_path is None and "zero_optimization.offload_optimizer.nvme_path" in cpu_with_path.ignored


# ----------------------------------------------------------------------------- files


def test_a_config_file_path_reads_like_the_dict(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_ZERO2, indent=2))
    auto = dict(HF_AUTO, bf16=True, fp16=False)
    assert read(path, **auto) == read(str(path), **auto) == read(HF_ZERO2, **auto)
    with pytest.raises(ValueError, match=re.escape(f"{path}: fp16.enabled: the config says 'auto'")):
        read(path, train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1)


def test_bad_files_give_errors_naming_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,\n "fp16": {"enabled": true,}}')
    with pytest.raises(ValueError, match=re.escape(f"{bad}: not valid JSON:") + ".*line 2"):
        read(bad)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "missing.json"))):
        read(tmp_path / "missing.json")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match=re.escape(f"{listed}: expected a JSON object at the top, got list")):
        read(listed)
    twice = tmp_path / "twice.json"
    twice.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match=re.escape(f"{twice}: duplicate keys ['train_batch_size']")):
        read(twice)
    with pytest.raises(TypeError, match="config: expected a path to a JSON file or a dict, got int"):
        read(3)


def test_a_deeply_nested_config_is_refused_naming_the_file_and_the_limit(tmp_path):
    limit = f"nested more than {json_file.MAX_DEPTH} levels deep"
    for levels in (json_file.MAX_DEPTH + 1, 100_000):  # past the limit; past Python's recursion limit
        path = tmp_path / f"deep{levels}.json"
        path.write_text('{"train_micro_batch_size_per_gpu": 2, "aio": ' + '{"a": ' * levels + "1" + "}" * (levels + 1))
        with pytest.raises(ValueError, match=re.escape(f"{path}: {limit}")):
            read(path)
    path.write_text('{"a": ' * (json_file.MAX_DEPTH - 1) + "1" + "}" * (json_file.MAX_DEPTH - 1))  # at the limit
    with pytest.raises(ValueError, match=re.escape(f"{path}: a: not a key zfunc knows")):
        read(path)
    deep = inner = {}
    for _ in range(5000):  # a dict from a caller: refused before it is copied
        inner["a"] = inner = {}
    with pytest.raises(ValueError, match=re.escape(f"config: {limit}")):
        read(deep)


def test_json_that_is_not_json_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "nan.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": NaN}')
    with pytest.raises(ValueError, match=re.escape(f"{path}: NaN is not a JSON number")):
        read(path)
    path.write_bytes(b'{"train_micro_batch_size_per_gpu": 2, "steps_per_print": "\xff"}')
    with pytest.raises(ValueError, match=re.escape(f"{path}: not UTF-8 text")):
        read(path)


# ----------------------------------------------------------------------------- a recipe's --deepspeed


def resolve(tmp_path, config, *flags, notices=False):
    """``recipes.layout.resolve`` of the tiny GPT's flags with ``config`` as --deepspeed, on 1 process."""
    from recipes import cli, gpt, layout
    from tests.recipe_runs import TINY

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    args = cli.parse_args(gpt.RECIPE, TINY + ["--deepspeed", str(path), *flags])
    return layout.resolve(cli.with_precision(args), 1, gpt.UNITS, notices=notices)


def test_a_config_without_batch_sizes_takes_them_from_the_flags_and_says_so_once(tmp_path, capsys):
    no_sizes = {k: v for k, v in HF_ZERO2.items() if k not in _BATCH_KEYS}  # left to the Trainer, as HF's
    plan, args = resolve(tmp_path, no_sizes, "--batch-size", "16", "--accum", "2", "--precision", "bf16",
                         notices=True)
    assert (plan.global_batch, plan.micro_batch, plan.accum, args.batch_size, args.accum) == (16, 8, 2, 16, 2)
    said = capsys.readouterr().out.splitlines()
    told = [line for line in said if "no batch size" in line]
    assert told == [f"--deepspeed {tmp_path / 'ds_config.json'}: the config gives no batch size, so "
                    "train_batch_size is --batch-size 16 and gradient_accumulation_steps is --accum 2"]
    resolve(tmp_path, no_sizes, "--precision", "bf16")  # the recipe's later calls print nothing
    assert "no batch size" not in capsys.readouterr().out
    plan, args = resolve(tmp_path, dict(no_sizes, gradient_accumulation_steps=4), "--precision", "bf16")
    assert (plan.global_batch, plan.micro_batch, plan.accum, args.accum) == (8, 2, 4, 4)  # TINY's --batch-size 8
    from recipes.layout import FlagError

    with pytest.raises(FlagError, match=re.escape("--batch-size: the global batch of 6 sequences must split over 1 "
                                                  "data-parallel rank x 4 accumulation steps")):
        resolve(tmp_path, dict(no_sizes, gradient_accumulation_steps=4), "--precision", "bf16", "--batch-size", "6")
    with pytest.raises(FlagError, match=re.escape("--batch-size: the global batch of 6 sequences must split over 1 "
                                                  "data-parallel rank x 4 accumulation steps")):
        resolve(tmp_path, no_sizes, "--precision", "bf16", "--batch-size", "6", "--accum", "4")


def test_autotp_size_reads_as_tp():
    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}
    plan = C.from_deepspeed({**base, "tensor_parallel": {"autotp_size": 2}}, world_size=2)
    assert (plan.dp, plan.tp) == (2, 2)  # world_size: DeepSpeed's data-parallel size, as its batch rule counts it
    with pytest.raises(ValueError, match=r"tensor_parallel.tp: zfunc reads AutoTP's autotp_size only"):
        C.from_deepspeed({**base, "tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 2}}}, world_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel.autotp_size: expected an int >= 1, got 0.5"):
        C.from_deepspeed({**base, "tensor_parallel": {"autotp_size": 0.5}}, world_size=2)
def test_sequence_parallel_size_is_the_plans_sp_size():
    assert read(with_(SMALL, sequence_parallel_size=2)).sp_size == 2
    assert read(SMALL).sp_size == 1
    with pytest.raises(ValueError, match=r"sequence_parallel_size \(plan sp_size\): expected an int >= 1, got 0"):
        read(with_(SMALL, sequence_parallel_size=0))
