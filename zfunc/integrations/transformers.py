"""Hugging Face ``Trainer`` on zfunc: change the import, keep the ``--deepspeed`` JSON.

    from zfunc.integrations.transformers import Trainer, TrainingArguments   # was: from transformers import ...
    args = TrainingArguments("out", deepspeed="ds_config_zero2.json", per_device_train_batch_size=8, ...)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val)
    trainer.train()                                   # or train(resume_from_checkpoint=True)
    trainer.save_model()

``TrainingArguments`` keeps the ``deepspeed`` config for zfunc (``args.zfunc_deepspeed``) and hands
transformers none, so neither accelerate nor DeepSpeed is involved (DeepSpeed need not be
installed). ``Trainer`` trains through ``zfunc.deepspeed``'s engine, over the Trainer's public
extension points:

- ``create_optimizer`` / ``create_scheduler``: the engine is built (``zfunc.deepspeed.build_engine``)
  from the config with its "auto" values filled from the arguments as transformers fills them
  (``zf.config.from_deepspeed``'s names: micro batch, accumulation, clipping, lr, betas, eps,
  weight decay, warmup and total steps, fp16/bf16); the Trainer gets an optimizer and a scheduler
  that are views of the engine (their ``step`` does nothing: the engine updates).
- ``training_step``: the Trainer's ``compute_loss`` with the engine as the model (its loss scaling,
  ``num_items_in_batch`` included), ``engine.backward``, ``engine.step()`` per microbatch, so the
  engine updates at the accumulation boundary where the Trainer would.
  ``_clip_grad_norm`` does nothing (the engine clips) and ``_get_grad_norm`` is the engine's.
- ``evaluate`` / ``predict`` / ``save_model``: the model's params are made current from the
  engine's state first (whole params: a collective where the state is split, every rank calls).
- checkpoints: ``_save_optimizer_and_scheduler`` saves the engine's state into the checkpoint
  folder (``zf.checkpoint``, tag ``zfunc``), ``_load_optimizer_and_scheduler`` loads it back, so
  ``train(resume_from_checkpoint=...)`` continues the run (the Trainer restores its own counters
  and data position).

Law: with the same batches, the logged losses equal the plain Trainer's running the same
optimizer and schedule (the config's, e.g. WarmupLR), fp32, within 1e-4, on 1 and 2 processes.
Not supported (refused, naming them): a config without an ``optimizer`` section (the Trainer's own
optimizer and scheduler objects are not mapped), ``label_smoothing_factor``, an epoch whose
microbatches do not fill whole accumulation windows.
The config's optimizer decays every param, as transformers does with a DeepSpeed optimizer.
Supported versions: transformers 5.x (tested with 5.24), whose Trainer has these methods.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import transformers

import zfunc as zf
import zfunc.deepspeed as zds
from zfunc.config import deepspeed as ds_config
from zfunc.integrations.optimizer import TrainerOptimizer

TAG = "zfunc"  # the engine's checkpoint inside a Trainer checkpoint folder


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' ``TrainingArguments``; ``deepspeed`` is kept for zfunc (``zfunc_deepspeed``)."""

    def __post_init__(self):
        self.zfunc_deepspeed = self.deepspeed
        self.deepspeed = None
        super().__post_init__()


class _EngineScheduler(torch.optim.lr_scheduler.LRScheduler):
    """The Trainer's scheduler: ``get_last_lr`` is the learning rate of the engine's last update (what
    the Trainer logs for that step), ``get_lr`` the next one's; ``step`` changes nothing."""

    def __init__(self, optimizer: TrainerOptimizer, trainer: Trainer):
        self._trainer = trainer
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        engine = self._trainer.zfunc_engine
        return [engine.get_lr()[0] if engine is not None else self._trainer.args.learning_rate]

    def get_last_lr(self) -> list[float]:
        engine = self._trainer.zfunc_engine
        return [engine.last_lr() if engine is not None else self._trainer.args.learning_rate]


def _auto_values(args: transformers.TrainingArguments, num_training_steps: int, world: int) -> dict:
    """The "auto" values transformers fills (``HfTrainerDeepSpeedConfig.trainer_config_process``)."""
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "train_batch_size": micro * accum * world, "gradient_clipping": args.max_grad_norm,
            "lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
            "weight_decay": args.weight_decay,
            # DeepSpeed warms up over max(2, steps), so 0 steps (HF's default) and 1 are the same schedule
            "warmup_num_steps": max(1, args.get_warmup_steps(num_training_steps)),
            "total_num_steps": num_training_steps, "fp16": bool(args.fp16), "bf16": bool(args.bf16)}


class Trainer(transformers.Trainer):
    """transformers' ``Trainer`` training through zfunc's engine (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.zfunc_engine: zds.Engine | None = None
        config = getattr(self.args, "zfunc_deepspeed", None)
        if config is None:
            raise ValueError("args: zfunc's Trainer trains with a DeepSpeed config; build the arguments with "
                             "zfunc.integrations.transformers.TrainingArguments(..., deepspeed=PATH_OR_DICT)")
        if self.args.label_smoothing_factor:
            raise NotImplementedError(f"label_smoothing_factor={self.args.label_smoothing_factor}: not supported by "
                                      "zfunc's Trainer (the model's own loss is trained)")
        self._zfunc_config = dict(config) if isinstance(config, dict) else ds_config.load(config)

    # ------------------------------------------------------------------ optimizer and scheduler

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = TrainerOptimizer(lambda: self.zfunc_engine, self.args.learning_rate)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.zfunc_engine is None:
            self._build_engine(num_training_steps)
        if self.lr_scheduler is None:
            self.lr_scheduler = _EngineScheduler(self.optimizer, self)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _build_engine(self, num_training_steps: int) -> None:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        with warnings.catch_warnings():  # auto values for keys the config leaves out fill nothing, as in HF
            warnings.simplefilter("ignore", zf.config.IgnoredKeysWarning)
            plan = zf.config.from_deepspeed(self._zfunc_config, world_size=world,
                                            **_auto_values(self.args, num_training_steps, world))
        if plan.optimizer is None:
            raise NotImplementedError("the DeepSpeed config has no 'optimizer' section: zfunc's Trainer trains the "
                                      "config's optimizer (add one, e.g. AdamW with 'auto' params)")
        batches = len(self.get_train_dataloader())
        if batches % plan.accum:
            raise NotImplementedError(f"gradient_accumulation_steps={plan.accum}: an epoch of {batches} microbatches "
                                      "leaves a partial accumulation window, which zfunc's Trainer does not run")
        self.zfunc_engine = zds.build_engine(self.model, plan, self._zfunc_config)

    # ------------------------------------------------------------------ the step

    def training_step(self, model: Any, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's own ``compute_loss`` with the engine as the model; the loss scaled as the
        Trainer scales it (by the window's token count when the model takes ``num_items_in_batch``,
        else by the accumulation steps), undone for ``engine.backward``, which averages the window."""
        engine = self.zfunc_engine
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        accum = engine.gradient_accumulation_steps()
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        engine.backward(loss * accum if scaled else loss)
        engine.step()
        return loss.detach() if scaled else loss.detach() / accum

    def _clip_grad_norm(self, model: Any) -> None:
        return None  # the engine clipped (the config's gradient_clipping)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float | None:
        return self.zfunc_engine.get_global_grad_norm() if self.zfunc_engine is not None else None

    # ------------------------------------------------------------------ the model's params, current

    def _sync_model(self) -> None:
        engine = self.zfunc_engine
        if engine is None or engine.window_open:
            return
        state = engine.state
        whole = state.params if state.placement is None else zf.checkpoint.full_params(state)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in whole:
                    p.copy_(whole[name])

    def evaluate(self, *args: Any, **kwargs: Any) -> dict:
        self._sync_model()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_model()
        return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self._sync_model()
        super().save_model(output_dir, _internal_call)

    # ------------------------------------------------------------------ checkpoints

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.zfunc_engine.save_checkpoint(output_dir, tag=TAG)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path, _ = self.zfunc_engine.load_checkpoint(checkpoint, tag=TAG)
        if path is None:
            raise FileNotFoundError(f"resume_from_checkpoint: {checkpoint} holds no zfunc engine checkpoint "
                                    f"({TAG}/manifest.json)")
