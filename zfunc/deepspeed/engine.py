"""``Engine``: DeepSpeed's engine calls over a zfunc step (``zf.train_step`` + ``zf.parallelize``).

The engine holds the current ``TrainState`` and the step the config's plan lays out; everything
else is the step's. A training loop written for DeepSpeed runs unchanged:

    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config="ds_config.json")
    for x, y in loader:
        loss = criterion(engine(x), y)
        engine.backward(loss)            # or loss.backward()
        engine.step()                    # the update at the accumulation boundary

**The call sequence.** ``engine(*inputs)`` in training (``module.training`` and grad enabled)
starts the step at the first microbatch of an accumulation window and runs the model inside it
(``zfunc.deepspeed.suspended``: the step's thread, the outputs cut); ``backward`` hands the
microbatch's grads to the step; ``engine.step()`` counts a microbatch as DeepSpeed does (the
update happens at the ``gradient_accumulation_steps``-th) and, at the boundary, takes the step's
new state. A plain ``loss.backward()`` is noticed at ``step()`` or at the next forward, so both
spellings train alike. Outside training (``engine.eval()`` or ``torch.no_grad()``), ``engine(x)``
runs the model on whole params (gathered once per state when the state is split) with no step.

**Law.** ``k`` calls of forward/backward/step with ``gradient_accumulation_steps = k`` train as
``zf.train_step(loss, accum=k)`` on those microbatches, under the config's plan (ZeRO stage,
offload, precision, clipping, optimizer and scheduler): the same update DeepSpeed makes, within
fp32 rounding. Loss scaling (fp16), non-finite skips and randomness are the step's
(``zf.train_step``): the forward's random numbers come from ``state.rng``, not torch's global stream.

**Cost.** Per microbatch, two turns between the caller's thread and the step's and one multiply
of the outputs' grads (``suspended``); per step, the step's own cost. ``benchmarks/adapters.py``
measures it against calling the step directly.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zfunc as zf
from zfunc.config import Plan
from zfunc.deepspeed.refused import DEEPSPEED_ENGINE_ONLY
from zfunc.deepspeed.suspended import SuspendedStep

EXTRA_KEY = "zfunc.deepspeed"  # the manifest's ``extra`` entry holding the engine's counters and client_state


def _refuse(call: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"{call}: not supported by zfunc.deepspeed ({why})")


class Engine:
    """What ``zfunc.deepspeed.initialize`` returns first; see the module docstring.

    Attributes as DeepSpeed's: ``module`` (the model; its params are those it was built with, made
    current by ``zero.GatheredParameters``), ``global_steps`` (updates, skipped ones included),
    ``micro_steps``, ``global_samples``, ``skipped_steps``, ``global_rank``, ``local_rank``,
    ``world_size``, ``dp_world_size``, ``device``, ``config`` (the dict), ``plan`` (the
    ``zf.config.Plan`` it runs), ``step_fn`` and ``state`` (the zfunc step and its current state).
    """

    def __init__(self, model: nn.Module, plan: Plan, config: dict, optimizer: Any, step_fn: Any, state: Any,
                 apply: Any, schedule: Any):
        self.module, self.plan, self.config = model, plan, config
        self.step_fn, self.state = step_fn, state
        self._optimizer, self._apply, self._schedule = optimizer, apply, schedule
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.dp_world_size = plan.dp
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = next((t.device for t in zf.tree.leaves(state.params) if isinstance(t, torch.Tensor)),
                           torch.device("cpu"))
        if self.device.type == "meta":
            self.device = torch.device("cpu")
        self.global_steps = self.micro_steps = self.global_samples = self.skipped_steps = 0
        self._suspended = SuspendedStep(apply)  # its thread runs every step of this engine
        self._running: SuspendedStep | None = None  # the suspended step, while an accumulation window is open
        self._backward_pending = False  # engine.backward ran for the current microbatch, step() not yet
        self._metrics: dict | None = None
        self._whole: tuple[Any, Any] | None = None  # (state, whole compute params) for eval forwards
        self._step_applied = False

    # ------------------------------------------------------------------ DeepSpeed's getters

    def gradient_accumulation_steps(self) -> int:
        return self.plan.accum

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.plan.micro_batch

    def train_batch_size(self) -> int:
        return self.plan.global_batch

    def zero_optimization_stage(self) -> int:
        return self.plan.zero_stage

    def zero_optimization(self) -> bool:
        return self.plan.zero_stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.plan.zero_stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.plan.zero_stage == 3

    def zero_offload_optimizer(self) -> bool:
        return self.plan.offload_optimizer != "none"

    def zero_offload_param(self) -> bool:
        return self.plan.offload_params != "none"

    def fp16_enabled(self) -> bool:
        return self.plan.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.plan.precision == "bf16"

    def gradient_clipping(self) -> float:
        return self.plan.gradient_clipping

    def optimizer_name(self) -> str | None:
        return self.plan.optimizer

    def get_type(self) -> list[str | None]:
        return [self.plan.optimizer]

    def scheduler_name(self) -> str | None:
        return self.plan.scheduler

    def steps_per_print(self) -> int:
        return int(self.config.get("steps_per_print", 10))

    def get_data_parallel_rank(self) -> int:
        return self.global_rank

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current microbatch ends an accumulation window: ``(micro_steps + 1) % accum == 0``."""
        return (self.micro_steps + 1) % self.plan.accum == 0

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the params (False off the boundary and for a skipped step)."""
        return self._step_applied

    def get_lr(self) -> list[float]:
        """DeepSpeed's ``get_lr()``: the optimizer's current learning rate, the one the next update
        uses; one value (zfunc has one param group)."""
        return [float(self._schedule(self.global_steps - self.skipped_steps))]

    def last_lr(self) -> float:
        """The learning rate the last applied update used (the first update's before any)."""
        return float(self._schedule(max(self.global_steps - self.skipped_steps - 1, 0)))

    @property
    def window_open(self) -> bool:
        """Whether an accumulation window is under way (some microbatches of the next update taken)."""
        return self._running is not None

    def get_global_grad_norm(self) -> float | None:
        """The global norm of the grads of the last update (before clipping); None before the first."""
        if self._metrics is None or self._metrics.get("grad_norm") is None:
            return None
        return float(self._metrics["grad_norm"])

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    @property
    def last_metrics(self) -> dict | None:
        """The zfunc step's metrics of the last update (``loss`` is the mean over microbatches and ranks)."""
        return self._metrics

    # ------------------------------------------------------------------ modes

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def zero_grad(self) -> None:
        """Nothing to do: grads live inside the step, never on the module."""

    # ------------------------------------------------------------------ forward, backward, step

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The model's output. In training: run inside the step (module docstring); the floating
        outputs that carry grad are detached copies whose grads the step takes at ``backward``."""
        if not (self.module.training and torch.is_grad_enabled()):
            return self._eval_forward(inputs, kwargs)
        if self._optimizer is None:
            raise ValueError("engine(...) in training: the engine has no optimizer (the config has no 'optimizer' "
                             "and initialize got none); call engine.eval() to only run the model")
        running = self._running
        if running is not None and (self._backward_pending or running.backward_seen()):
            raise ValueError("engine(...): a forward after this microbatch's backward and before engine.step(); "
                             "DeepSpeed counts a microbatch per step(), call engine.step() first")
        if running is None:
            running = self._running = self._suspended
            marker = torch.zeros(self.plan.accum, dtype=torch.int64)  # the step splits it into accum microbatches
            running.start(self.step_fn, self.state, marker)
            self.state = None  # the step consumes it; its successor comes back at the boundary
        return running.forward(self._cast(inputs), self._cast(kwargs))

    def _cast(self, inputs: Any) -> Any:
        dtype = self.step_fn.compute_dtype
        return inputs if dtype is torch.float32 else zf.precision.cast_floating(inputs, dtype)

    def _eval_forward(self, inputs: tuple, kwargs: dict) -> Any:
        self._require_state("engine(...) outside training")
        if self._whole is None or self._whole[0] is not self.state:
            if self.state.placement is None:
                whole = self.state.params
            else:
                whole = zf.checkpoint.full_params(self.state)
            dtype = self.step_fn.compute_dtype
            if dtype is not torch.float32:
                whole = zf.precision.cast_floating(whole, dtype)
            self._whole = (self.state, whole)
        with zf.functional.using(self.state):
            return self._apply(self._whole[1], *self._cast(inputs), **self._cast(kwargs))

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """``loss.backward()`` into the step: the microbatch's grads go to the step's backward
        (ZeRO reduction, offload's updates). Returns ``loss / gradient_accumulation_steps``, detached,
        as DeepSpeed returns the scaled loss."""
        if not scale_wrt_gas:
            raise _refuse("engine.backward(loss, scale_wrt_gas=False)", "zfunc averages the microbatches' grads; "
                          "scale the loss yourself")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            raise ValueError(f"engine.backward(loss): expected a 0-d floating tensor, got "
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
        if self._backward_pending:
            raise ValueError("engine.backward(loss): called twice in one microbatch; DeepSpeed counts a microbatch "
                             "per step(), call engine.step() between them")
        running = self._running
        if running is None or not running.forwarded():
            raise ValueError("engine.backward(loss): no forward of the engine in this microbatch; call engine(...) "
                             "first")
        if loss.requires_grad:
            loss.backward(retain_graph=retain_graph)
        self._deliver(loss.detach())
        return loss.detach() / self.plan.accum

    def _deliver(self, loss_value: torch.Tensor | None) -> None:
        self._backward_pending = True
        self._running.backward(loss_value)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count a microbatch; at the accumulation boundary, take the update the step made."""
        if lr_kwargs is not None:
            raise _refuse("engine.step(lr_kwargs=...)", "the config's scheduler follows the step count")
        running = self._running
        if running is None or not running.forwarded() and not self._backward_pending:
            raise ValueError("engine.step(): no forward and backward in this microbatch; call engine(...) and "
                             "engine.backward(loss) (or loss.backward()) first")
        if not self._backward_pending:
            if not running.backward_seen():
                raise ValueError("engine.step(): the microbatch's outputs got no grad; call engine.backward(loss) "
                                 "or loss.backward() first")
            self._deliver(None)  # a plain loss.backward(): the loss value is unknown to the engine
        self._backward_pending = False
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self._step_applied = False
        if running.done is not None and not boundary or boundary and running.done is None:
            raise AssertionError("zfunc.deepspeed: the step and the engine disagree on the accumulation boundary")
        if not boundary:
            return
        self.state, self._metrics = running.done
        self._running = None
        self.global_steps += 1
        self.global_samples += self.plan.micro_batch * self.plan.accum * self.plan.dp if self.plan.micro_batch else 0
        skipped = bool(self._metrics.get("skipped"))
        self.skipped_steps += skipped
        self._step_applied = not skipped

    # ------------------------------------------------------------------ checkpoints

    def _require_state(self, call: str) -> None:
        if self._running is not None:
            raise ValueError(f"{call}: in the middle of an accumulation window ({self.micro_steps % self.plan.accum} "
                             f"of {self.plan.accum} microbatches); call it after the boundary's engine.step()")

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """``zf.checkpoint.save`` of the state into ``save_dir/tag`` (default ``global_step<N>``), every
        rank; ``save_dir/latest`` names it. ``client_state`` (JSON values) is stored in the manifest
        and returned by ``load_checkpoint``."""
        self._require_state("engine.save_checkpoint")
        if not save_latest:
            raise _refuse("engine.save_checkpoint(save_latest=False)", "zf.checkpoint.save always updates 'latest'")
        if exclude_frozen_parameters:
            raise _refuse("engine.save_checkpoint(exclude_frozen_parameters=True)", "frozen params are never saved")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        extra = {EXTRA_KEY: {"client_state": dict(client_state or {}), "global_steps": self.global_steps,
                             "global_samples": self.global_samples, "skipped_steps": self.skipped_steps,
                             "micro_steps": self.micro_steps}}
        try:
            zf.checkpoint.save(self.state, Path(save_dir) / tag, extra=extra)
        except TypeError as e:
            raise TypeError(f"engine.save_checkpoint(client_state=...): zfunc saves JSON values; {e}") from None
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, dict | None]:
        """Load ``load_dir/tag`` (default: the tag ``load_dir/latest`` names) into the engine's layout:
        a zfunc checkpoint of any layout, or a DeepSpeed ZeRO checkpoint directory
        (``zf.checkpoint.load_deepspeed``). Returns ``(path, client_state)``, ``(None, None)`` when
        there is nothing to load, as DeepSpeed does. A DeepSpeed checkpoint's client_state is not
        read (its pickle is not unpickled): ``{}``."""
        self._require_state("engine.load_checkpoint")
        for name, value, default in (("load_module_strict", load_module_strict, True),
                                     ("load_optimizer_states", load_optimizer_states, True),
                                     ("load_lr_scheduler_states", load_lr_scheduler_states, True),
                                     ("load_module_only", load_module_only, False), ("custom_load_fn", custom_load_fn,
                                                                                    None)):
            if value != default:
                raise _refuse(f"engine.load_checkpoint({name}={value!r})", "a zfunc load restores the whole state")
        root = Path(load_dir)
        if tag is None:
            latest = root / "latest"
            if not latest.is_file():
                return None, None
            tag = latest.read_text().strip()
        path = root / str(tag)
        if (path / "manifest.json").is_file():
            self.state = zf.checkpoint.load(path, self.step_fn)
            saved = zf.checkpoint.read_manifest(path).get("extra", {}).get(EXTRA_KEY, {})
        elif path.is_dir():
            self.state = zf.checkpoint.load_deepspeed(root, self.step_fn, tag=str(tag))
            saved = {}
        else:
            return None, None
        self.global_steps = int(saved.get("global_steps", self.state.step))
        self.global_samples = int(saved.get("global_samples", 0))
        self.skipped_steps = int(saved.get("skipped_steps", 0))
        self.micro_steps = int(saved.get("micro_steps", self.global_steps * self.plan.accum))
        self._whole = None
        return str(path), saved.get("client_state", {})

    # ------------------------------------------------------------------ the rest

    def close(self) -> None:
        """End the thread the engine's steps run on (otherwise it lives until the interpreter exits). A
        step under way is abandoned, and the state it took with it; between steps the engine keeps its
        state, and a later training forward starts a new thread."""
        self._suspended.close()
        self._running = None
        self._backward_pending = False

    def module_state_dict(self) -> dict:
        """The module's state dict with the current params, whole (a collective where the state is split)."""
        self._require_state("engine.module_state_dict")
        whole = self.state.params if self.state.placement is None else zf.checkpoint.full_params(self.state)
        out = self.module.state_dict()
        for name, value in whole.items():
            out[name] = value.detach().clone()
        return out

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        raise _refuse("engine.set_gradient_accumulation_boundary", "the boundary is every "
                      "gradient_accumulation_steps-th step()")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in DEEPSPEED_ENGINE_ONLY:
            raise _refuse(f"engine.{name}", "a DeepSpeed engine call with no zfunc counterpart")
        return getattr(self.__dict__["module"], name)

