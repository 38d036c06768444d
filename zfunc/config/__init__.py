"""zf.config: how to train, as checked plain data; read from DeepSpeed or Hugging Face configs; applied to a step.

``Plan`` (plan.py) is the checked data (value checks: checks.py; optimizer and scheduler params: params.py);
``optimizer`` and ``schedule`` (optimizers.py) build what it names, on DeepSpeed's schedulers (schedules.py);
``from_deepspeed`` (deepspeed.py) reads a DeepSpeed JSON into one;
``zf.parallelize`` (apply.py) applies one to a plain step; hf.py and json_file.py read other people's
files within bounds.
"""
from zfunc.config.apply import check, prepare
from zfunc.config.deepspeed import IgnoredKeysWarning, from_deepspeed
from zfunc.config.optimizers import optimizer, schedule
from zfunc.config.params import OPTIMIZER_DEFAULTS, SCHEDULER_DEFAULTS, SCHEDULERS, WARMUP_TYPES
from zfunc.config.plan import PIPELINE_SCHEDULES, PLACES, PRECISIONS, Plan, selector
from zfunc.config.schedules import warmup_cosine_lr, warmup_decay_lr, warmup_lr

__all__ = ["IgnoredKeysWarning", "OPTIMIZER_DEFAULTS", "PIPELINE_SCHEDULES", "PLACES", "PRECISIONS", "Plan",
           "SCHEDULERS", "SCHEDULER_DEFAULTS", "WARMUP_TYPES", "check", "from_deepspeed", "optimizer", "prepare",
           "schedule", "selector", "warmup_cosine_lr", "warmup_decay_lr", "warmup_lr"]
