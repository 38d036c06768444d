"""The DeepSpeed config a ``ZfuncStrategy`` trains with: the user's, completed from the Trainer.

``layout_config`` writes DeepSpeedStrategy's layout arguments (``stage``, ``offload_optimizer``, ...)
as the config they stand for; ``complete`` adds what DeepSpeedStrategy takes from the Trainer:
``gradient_accumulation_steps`` is ``accumulate_grad_batches``, ``gradient_clipping`` is
``gradient_clip_val`` (0 when unset), fp16/bf16 follow ``precision="16-mixed"``/``"bf16-mixed"``
(a section saying "auto" takes the Trainer's), and ``train_micro_batch_size_per_gpu`` is 1 when the
config gives no batch size (the DataLoader batches; the engine reads the number only to count
samples). A value the config sets that contradicts the Trainer's is a ``ValueError`` naming both.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Trainer(precision=...) -> the plan's precision (None: the config's fp16/bf16 sections decide, fp32 without them)
PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}
_HALF_KEYS = ("fp16", "bf16", "bfloat16")


def refuse(what: str, why: str) -> NotImplementedError:
    """The error for what ``ZfuncStrategy`` does not support, naming it."""
    return NotImplementedError(f"{what}: not supported by ZfuncStrategy ({why})")


def layout_config(stage: int, offload_optimizer: bool, offload_parameters: bool, offload_optimizer_device: str,
                  offload_params_device: str, nvme_path: str | None) -> dict:
    """DeepSpeedStrategy's config for its layout arguments (the keys zfunc reads)."""
    zero: dict = {"stage": stage}
    for on, key, device in ((offload_optimizer, "offload_optimizer", offload_optimizer_device),
                            (offload_parameters, "offload_param", offload_params_device)):
        if on:
            zero[key] = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
    return {"zero_optimization": zero}


def complete(config: Mapping[str, Any], accumulate_grad_batches: int, gradient_clip_val: float | None,
             precision: str) -> dict:
    """A copy of ``config`` with the Trainer's values (module docstring)."""
    config = dict(config)
    accum = int(accumulate_grad_batches)
    given = config.get("gradient_accumulation_steps", "auto")
    if given != "auto" and given != accum:
        raise ValueError(f"config gradient_accumulation_steps={given!r} and Trainer(accumulate_grad_batches={accum}): "
                         "Lightning counts the batches; set accumulate_grad_batches only")
    config["gradient_accumulation_steps"] = accum
    given = config.get("gradient_clipping", "auto")
    if given == "auto":
        config["gradient_clipping"] = float(gradient_clip_val or 0.0)
    elif gradient_clip_val is not None and float(given) != float(gradient_clip_val):
        raise ValueError(f"config gradient_clipping={given!r} and Trainer(gradient_clip_val={gradient_clip_val}): "
                         "give one")
    _set_precision(config, PRECISIONS[precision])
    if config.get("train_batch_size", "auto") == "auto" and config.get("train_micro_batch_size_per_gpu",
                                                                        "auto") == "auto":
        config.pop("train_batch_size", None)
        config["train_micro_batch_size_per_gpu"] = 1
    return config


def _set_precision(config: dict, wanted: str | None) -> None:
    """The Trainer's mixed precision into ``config``: "auto" sections take it, an absent one is added."""
    for key in _HALF_KEYS:
        section = config.get(key)
        if isinstance(section, Mapping) and section.get("enabled") == "auto":
            config[key] = {**section, "enabled": wanted == key[:4]}
    if wanted is None:
        return
    for key in _HALF_KEYS:
        section = config.get(key)
        if key[:4] != wanted and isinstance(section, Mapping) and section.get("enabled"):
            raise ValueError(f"config {key}.enabled=true and Trainer(precision=...) asks for {wanted}: give one")
    key = "bfloat16" if wanted == "bf16" and "bfloat16" in config else wanted
    config[key] = {**config.get(key, {}), "enabled": True}
