"""zf.config: how to train, as checked plain data; read from DeepSpeed or Hugging Face configs; applied to a step.

``Plan`` (plan.py) is the checked data; ``from_deepspeed`` (deepspeed.py) reads a DeepSpeed JSON into one;
``zf.parallelize`` (apply.py) applies one to a plain step; hf.py and json_file.py read other people's
files within bounds.
"""
from zfunc.config.apply import check, prepare
from zfunc.config.deepspeed import IgnoredKeysWarning, from_deepspeed
from zfunc.config.plan import (OPTIMIZER_DEFAULTS, PIPELINE_SCHEDULES, PLACES, PRECISIONS, SCHEDULER_DEFAULTS,
                               SCHEDULERS, WARMUP_TYPES, Plan, optimizer, schedule, selector, warmup_cosine_lr,
                               warmup_decay_lr, warmup_lr)

__all__ = ["IgnoredKeysWarning", "OPTIMIZER_DEFAULTS", "PIPELINE_SCHEDULES", "PLACES", "PRECISIONS", "Plan",
           "SCHEDULERS", "SCHEDULER_DEFAULTS", "WARMUP_TYPES", "check", "from_deepspeed", "optimizer", "prepare",
           "schedule", "selector", "warmup_cosine_lr", "warmup_decay_lr", "warmup_lr"]
