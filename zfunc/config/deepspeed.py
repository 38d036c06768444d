"""zf.config.from_deepspeed: a DeepSpeed JSON config (Hugging Face's among them) read into a Plan.

``from_deepspeed(path_or_dict, world_size=N, **auto)`` returns the ``zf.config.Plan`` the config
asks for, by DeepSpeed's rules; keys with no meaning here are named in one ``IgnoredKeysWarning``,
anything zfunc lacks is refused by key path. Both names are also ``zf.config``'s. Which keys are mapped,
ignored or refused, section by section, is in ``zfunc.config.deepspeed_keys``; each section is read in
``zfunc.config.deepspeed_sections``.

DeepSpeed key -> Plan field (key paths as in DeepSpeed's "Configuration JSON" reference):

| DeepSpeed key                                                   | Plan field                  |
|-----------------------------------------------------------------|-----------------------------|
| ``world_size=`` argument (DeepSpeed's data-parallel world size)  | ``dp``                      |
| ``train_batch_size``                                            | ``global_batch``            |
| ``train_micro_batch_size_per_gpu``                              | ``micro_batch``             |
| ``gradient_accumulation_steps``                                 | ``accum``                   |
| ``gradient_clipping`` (absent: 1.0 as DeepSpeed >= 0.19.3)       | ``gradient_clipping``       |
| ``zero_optimization.stage`` (legacy ``true``/``false``: 1/0)     | ``zero_stage``              |
| ``zero_optimization.zero_quantized_weights`` (ZeRO++ qwZ)       | ``quantized_weights``       |
| ``zero_optimization.zero_quantized_gradients`` (qgZ, int4)      | ``quantized_grads`` (4)     |
| ``zero_optimization.zero_hpz_partition_size`` (hpZ; 0/1: off)    | ``hpz_partition``           |
| ``zero_optimization.offload_optimizer.device`` (stage 1-3)      | ``offload_optimizer``       |
| ``zero_optimization.offload_param.device`` (stage 3)            | ``offload_params``          |
| ``zero_optimization.offload_{optimizer,param}.nvme_path``       | ``nvme_path`` (one for both)|
| ``zero_optimization.cpu_offload`` / ``cpu_offload_param`` (old) | the offloads, "cpu"         |
| ``fp16.enabled`` / ``bf16.enabled`` (old name ``bfloat16``)     | ``precision``               |
| ``fp16.initial_scale_power``, ``.loss_scale_window``,           | the same names              |
| ``.hysteresis``, ``.consecutive_hysteresis``, ``.min_loss_scale`` |                           |
| ``optimizer.type``, ``optimizer.params``                        | ``optimizer``, ``optimizer_params`` |
| ``scheduler.type``, ``scheduler.params``                        | ``scheduler``, ``scheduler_params`` |
| ``activation_checkpointing`` (the section present)              | ``remat=True``              |
| ``activation_checkpointing.cpu_checkpointing``                  | ``remat_offload``           |
| ``sequence_parallel_size`` (Ulysses; ``world_size`` stays dp)   | ``sp_size``                 |
Not in DeepSpeed's JSON, set on the Plan: ``pp``, ``microbatches``, ``pipeline_schedule``, ``units``,
``tile_lm_head``, ``sp_kind``, ``tile_mlp``.

Choices where DeepSpeed leaves room, each stated once:
- Batch sizes follow DeepSpeed's rule ``train_batch_size = micro * accum * world_size``: any two
  give the third, one alone sets accum to 1; a disagreement (or a third that does not divide out)
  is an error naming the three values and the world size.
- Optimizers: type is case-insensitive. "Adam" with ``adam_w_mode`` (default true) is AdamW, as
  DeepSpeed's FusedAdam/CPUAdam; "AdamW" is AdamW whatever ``adam_w_mode`` says. Params left out
  take DeepSpeed's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0 (torch's 0.01
  for AdamW with ``torch_adam``); SGD as ``torch.optim.SGD``; Lion as DeepSpeed's (betas 0.9, 0.999);
  LAMB as DeepSpeed's FusedLamb (``bias_correction``, ``max_coeff`` 10, ``min_coeff`` 0.01);
  OneBitAdam, ZeroOneAdam, OneBitLamb as ``zf.optim.onebit_adam``, ``zero_one_adam``, ``onebit_lamb``
  with DeepSpeed's defaults (their ``cuda_aware``, ``comm_backend_name``, and the ``bias_correction``
  and ``max_grad_norm`` they never read, are ignored); ZeRO stage 0 only (the rulebook).
  Weight decay applies to every param, as in a DeepSpeed config (``zf.config.optimizer(plan, mask=)``
  narrows).
- Schedulers: WarmupLR, WarmupDecayLR and WarmupCosineLR, the type case-insensitive; their
  formulas and DeepSpeed's step counting are zf.config's (``warmup_lr``, ``warmup_decay_lr``,
  ``warmup_cosine_lr``, ``schedule``; see its docstring).
- fp16: ``loss_scale`` 0 is the dynamic scale zfunc has; a nonzero (static) scale is refused.
- Combinations: DeepSpeed's own (the optimizer offloads with ZeRO stage 1-3, params with stage 3)
  are refused as DeepSpeed refuses them; then ``zfunc.core.compose``'s rulebook refuses what
  contradicts or what zfunc does not run (params offload without optimizer offload), naming the key
  path and the Plan field (``zero_optimization.offload_param.device (plan offload_params): ...``).
- ``activation_checkpointing``: DeepSpeed configures the checkpointing that model code calls; here
  the model is unchanged, so the section itself asks for remat (applied per unit by the builder).
  ``partition_activations`` splits checkpoints over model-parallel ranks, which zfunc has none of.
- "auto" values (the Hugging Face convention) come from ``**auto``, by these names (HF's
  ``TrainingArguments`` source in brackets): ``train_micro_batch_size_per_gpu``
  [per_device_train_batch_size], ``gradient_accumulation_steps``, ``train_batch_size``,
  ``gradient_clipping`` [max_grad_norm], ``lr`` [learning_rate; fills ``optimizer.params.lr`` and
  ``scheduler.params.warmup_max_lr``], ``betas`` [adam_beta1, adam_beta2], ``eps`` [adam_epsilon],
  ``weight_decay``, ``warmup_min_lr`` [HF fills 0, so does this when not given],
  ``warmup_num_steps`` [warmup_steps], ``total_num_steps`` [num_training_steps], ``fp16``, ``bf16``
  (bools: ``fp16.enabled``, ``bf16.enabled``). An "auto" batch size with no value is worked out by
  the batch rule; any other "auto" with no value is an error naming its key. As in HF, a value given
  for a key the config sets explicitly must agree with it, and values for absent keys are unused.
- Values: a file is read within ``zfunc.config.json_file``'s bounds (nesting, size, no duplicate keys, no
  NaN), a dict is refused past the same nesting. Every value read is typed and in range, in a
  section that is off too (fp16's loss-scale values with fp16 disabled): batch sizes, accum and
  fp16 counts ints >= 1 (never bools), stage in 0..3, lr, weight decay and clip >= 0 and finite,
  betas in [0, 1), eps > 0, cosine ratios in [0, 1], offload devices "none"/"cpu"/"nvme", an
  nvme_path a non-empty string; errors name the dotted key path (and the file).
- Tuning knobs with no meaning here (bucket sizes, overlap_comm, pin_memory, aio, logging,
  monitors, ...) are accepted, recorded in ``plan.ignored`` and named in one ``IgnoredKeysWarning``.
  A feature zfunc lacks (Muon/Adagrad optimizers, MoE/expert parallel, tensor or sequence
  parallel, sparse attention, curriculum/data efficiency, compression, Apex AMP, ZeRO++'s hpZ,
  partial offload, ...) and any unknown key are refused before training with a ``ValueError``
  naming the key path and value.
"""
from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zfunc.config import json_file
from zfunc.core import compose
from zfunc.config.checks import _check_int, _check_number
from zfunc.config.deepspeed_keys import _TOP_FEATURES, _TOP_KNOBS, _TOP_MAPPED, _Reader
from zfunc.config.deepspeed_sections import (_read_batch, _read_optimizer, _read_precision, _read_remat,
                                             _read_scheduler, _read_tensor_parallel, _read_zero)
from zfunc.config.plan import Plan


class IgnoredKeysWarning(UserWarning):
    """``from_deepspeed`` read keys that have no meaning in zfunc (listed once, in one warning)."""


def _read(config: dict, world_size: int, auto: dict[str, Any]) -> Plan:
    r = _Reader(auto)
    r.sort(config, "", _TOP_MAPPED, _TOP_KNOBS, _TOP_FEATURES)
    fields = {"dp": world_size, **_read_batch(r, config, world_size), **_read_zero(r, config, world_size),
              **_read_precision(r, config), **_read_optimizer(r, config), **_read_remat(r, config),
              **_read_tensor_parallel(config)}
    fields.update(_read_scheduler(r, config, fields))
    fields["sp_size"] = r.value(config, "sequence_parallel_size", "sequence_parallel_size", 1)
    clip = r.value(config, "gradient_clipping", "gradient_clipping", 1.0)
    _check_number("gradient_clipping", clip)
    try:  # Plan asks the rulebook for settings that contradict, then for what zfunc does not run
        plan = Plan(**fields, gradient_clipping=float(clip), ignored=tuple(r.ignored))
        refusal = compose.check_plan(plan, compose.UNSUPPORTED)
    except ValueError as e:
        refusal = str(e)
    if refusal is not None:
        raise ValueError(_by_key_path(refusal)) from None
    _warn_ignored(r.ignored, sorted(set(auto) - r.used))
    return plan


# Plan field -> the key path (or argument) it is read from, for the refusals that name a field.
_KEY_PATHS = {
    "dp": "world_size", "zero_stage": "zero_optimization.stage",
    "offload_optimizer": "zero_optimization.offload_optimizer.device",
    "offload_params": "zero_optimization.offload_param.device",
    "nvme_path": "zero_optimization.offload_param.nvme_path",
    "remat": "activation_checkpointing", "remat_offload": "activation_checkpointing.cpu_checkpointing",
    "accum": "gradient_accumulation_steps", "micro_batch": "train_micro_batch_size_per_gpu",
    "global_batch": "train_batch_size", "precision": "fp16.enabled, bf16.enabled",
    "gradient_clipping": "gradient_clipping", "tp": "tensor_parallel.autotp_size", "sp_size": "sequence_parallel_size",
    "hpz_partition": "zero_optimization.zero_hpz_partition_size",
}


def _by_key_path(refusal: str) -> str:
    """A Plan refusal "field: why" as "key.path (plan field): why"."""
    field, sep, why = refusal.partition(": ")
    return f"{_KEY_PATHS[field]} (plan {field}): {why}" if sep and field in _KEY_PATHS else refusal


def from_deepspeed(config: str | os.PathLike | Mapping[str, Any], *, world_size: int = 1, **auto: Any) -> Plan:
    """A Plan from a DeepSpeed config: a path to a JSON file, or the dict itself (not modified).

    ``world_size``: DeepSpeed's data-parallel world size (``dp``). ``auto``: values for "auto"
    entries, by the names in the module docstring. The mapping, the refusals and the notice of
    ignored keys are in the module docstring. Raises ``ValueError`` naming the key path (and the
    file) for anything refused, ``FileNotFoundError`` for a missing file.
    """
    _check_int("world_size", world_size, 1)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            return _read(load(path), world_size, auto)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    if not isinstance(config, Mapping):
        raise TypeError(f"config: expected a path to a JSON file or a dict, got {type(config).__name__}")
    try:
        json_file.check_depth(config)  # before the copy, which recurses
    except ValueError as e:
        raise ValueError(f"config: {e}") from None
    return _read(copy.deepcopy(dict(config)), world_size, auto)


def load(path: str | os.PathLike) -> dict:
    """The JSON object in the DeepSpeed config file at ``path``, read within ``zfunc.config.json_file``'s
    bounds (nesting, size, no duplicate keys, no NaN). ``FileNotFoundError`` names the path;
    ``ValueError`` says what is wrong (the caller adds the path)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config: no DeepSpeed config file at {str(path)!r}")
    data = json_file.read(path)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object at the top, got {type(data).__name__}")
    return data


def _warn_ignored(keys: list[str], unused_auto: list[str]) -> None:
    """One warning naming every ignored key (and any auto value that filled nothing)."""
    parts = [f"{len(keys)} DeepSpeed keys have no meaning in zfunc and were ignored: {', '.join(keys)}"] if keys else []
    if unused_auto:
        parts.append(f"auto values with no 'auto' to fill: {', '.join(unused_auto)}")
    if parts:
        warnings.warn("zf.config.from_deepspeed: " + "; ".join(parts), IgnoredKeysWarning, stacklevel=4)
