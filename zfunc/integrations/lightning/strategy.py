"""``ZfuncStrategy``: Lightning's DDP process setup with zfunc's engine in place of DDP's wrapper.

What each Lightning hook does here is in the package docstring (``zfunc.integrations.lightning``).
The engine is ``zfunc.deepspeed.build_engine``'s over the LightningModule, built at setup (``fit``)
and dropped at teardown, after the module's params take its trained values.
"""
from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import safetensors.torch
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

import zfunc as zf
import zfunc.deepspeed as zds
from zfunc.config import deepspeed as ds_config
from zfunc.integrations.lightning.config import complete, layout_config, refuse
from zfunc.integrations.lightning.precision import from_trainer
from zfunc.integrations.optimizer import TrainerOptimizer

TAG = "zfunc"  # the engine's checkpoint inside a checkpoint folder
LIGHTNING_FILE = "lightning.ckpt"  # the rest of Lightning's checkpoint beside it
_ENGINE_KEYS = ("state_dict", "optimizer_states")  # held by the engine's checkpoint, not Lightning's file


class ZfuncStrategy(DDPStrategy):
    """Lightning's strategy over zfunc's engine (``zfunc.integrations.lightning``).

    Args: ``config`` (a DeepSpeed config dict or JSON path) or DeepSpeedStrategy's layout arguments
    (``stage`` 0-3, default 2; ``offload_optimizer``/``offload_parameters`` with their ``*_device``
    "cpu" or "nvme" and ``nvme_path``), not both; the rest as ``DDPStrategy``'s.
    Attributes: ``engine`` (the ``zfunc.deepspeed.Engine`` during ``fit``, else None), ``plan``.
    """

    strategy_name = "zfunc"

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``Trainer(strategy="zfunc")`` and DeepSpeedStrategy's stage names with ``zfunc`` for ``deepspeed``:
        ``zfunc_stage_1``, ``zfunc_stage_2``, ``zfunc_stage_2_offload``, ``zfunc_stage_3``,
        ``zfunc_stage_3_offload`` (an NVMe layout needs its ``nvme_path``: construct the strategy)."""
        register = lambda name, what, **kw: strategy_registry.register(name, cls, description=what, **kw)  # noqa: E731
        register("zfunc", "zfunc's engine, ZeRO stage 2 (as DeepSpeedStrategy's default)")
        for stage in (1, 2, 3):
            register(f"zfunc_stage_{stage}", f"zfunc's engine, ZeRO stage {stage}", stage=stage)
        register("zfunc_stage_2_offload", "zfunc's engine, ZeRO stage 2, optimizer on the CPU", stage=2,
                 offload_optimizer=True)
        register("zfunc_stage_3_offload", "zfunc's engine, ZeRO stage 3, optimizer and params on the CPU", stage=3,
                 offload_optimizer=True, offload_parameters=True)

    def __init__(self, config: str | Path | Mapping | None = None, *, stage: int | None = None,
                 offload_optimizer: bool = False, offload_parameters: bool = False,
                 offload_optimizer_device: str = "cpu", offload_params_device: str = "cpu",
                 nvme_path: str | None = None, accelerator: Any = None, parallel_devices: list | None = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, process_group_backend: str | None = None,
                 timeout: Any = None):
        if config is not None and (stage is not None or offload_optimizer or offload_parameters or nvme_path):
            raise ValueError("ZfuncStrategy(config=..., stage=/offload_*=/nvme_path=): give the layout once, in the "
                             "config or as arguments")
        given = {"timeout": timeout} if timeout is not None else {}  # else DDPStrategy's default
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         process_group_backend=process_group_backend, **given)
        if config is None:
            config = layout_config(2 if stage is None else stage, offload_optimizer, offload_parameters,
                                   offload_optimizer_device, offload_params_device, nvme_path)
        self._config = dict(config) if isinstance(config, Mapping) else ds_config.load(config)
        self.engine: zds.Engine | None = None
        self.plan: zf.config.Plan | None = None

    # ------------------------------------------------------------------ Lightning's contract

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True  # the engine counts batches to its accumulation boundary

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine a checkpoint loads into exists after setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the optimizer state

    def setup_distributed(self) -> None:
        """DDP's process group, except on one process (zfunc needs none, so none is left behind)."""
        self.set_world_ranks()
        if self.world_size > 1 or dist.is_initialized():
            super().setup_distributed()

    def _configure_launcher(self) -> None:
        if self.num_processes * self.num_nodes > 1:  # one process launches nothing (and sets no rank variables)
            super()._configure_launcher()

    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        self.precision_plugin = from_trainer(self.precision_plugin)
        if not any(p.is_meta for p in self.lightning_module.parameters()):
            self.model_to_device()
        self.setup_precision_plugin()
        self.optimizers, self.lr_scheduler_configs = [], []
        if trainer.state.fn == TrainerFn.FITTING:
            self._build_engine(trainer)
        self.barrier()

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Modules built inside (``configure_model``) land on the meta device; the engine makes each
        rank's rows (``zfunc.deepspeed.zero.Init``)."""
        with zds.zero.Init():
            yield

    # ------------------------------------------------------------------ the engine

    def _build_engine(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        if not module.automatic_optimization:
            raise refuse("LightningModule.automatic_optimization = False (manual optimization)",
                         "the engine runs backward and the update")
        algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm")
        if trainer.gradient_clip_val and algorithm != "norm":
            raise refuse(f"Trainer(gradient_clip_algorithm={algorithm!r})", "the engine clips the global norm")
        config = complete(self._config, trainer.accumulate_grad_batches, trainer.gradient_clip_val,
                          self.precision_plugin.precision)
        plan = zf.config.from_deepspeed(config, world_size=dist.get_world_size() if dist.is_initialized() else 1)
        client = self._client_optimizer(trainer) if plan.optimizer is None else None
        try:
            self.engine = zds.build_engine(module, plan, config, optimizer=client)
        except ValueError as e:  # the client optimizer's mapping names initialize's argument: name the hook
            if client is not None and str(e).startswith(("initialize(optimizer=", "optimizer.param_groups")):
                raise ValueError(f"configure_optimizers: {e}") from None
            raise
        self.plan = self.engine.plan
        self.optimizers = [TrainerOptimizer(lambda: self.engine, self.engine.get_lr()[0])]
        self.lr_scheduler_configs = []

    def _client_optimizer(self, trainer: pl.Trainer) -> torch.optim.Optimizer:
        """``configure_optimizers``'s one optimizer (Lightning's own reading of what it returns)."""
        super().setup_optimizers(trainer)
        optimizers, schedulers = self.optimizers, self.lr_scheduler_configs
        self.optimizers, self.lr_scheduler_configs = [], []
        if len(optimizers) != 1:
            raise refuse(f"configure_optimizers returning {len(optimizers)} optimizers", "one optimizer trains")
        if schedulers:
            raise refuse(f"configure_optimizers returning an lr scheduler ({type(schedulers[0].scheduler).__name__})",
                         "the schedule is the config's 'scheduler' section: WarmupLR, WarmupDecayLR, WarmupCosineLR")
        return optimizers[0]

    def engine_backward(self, loss: torch.Tensor) -> None:
        """The precision plugin's backward. Lightning divided the loss by ``accumulate_grad_batches``;
        the engine averages the batches of a window itself, so it gets the loss ``training_step`` gave."""
        accum = self.engine.gradient_accumulation_steps()
        self.engine.backward(loss * accum if accum != 1 else loss)

    def engine_step(self) -> None:
        """The precision plugin's optimizer step, after the closure: one batch counted."""
        self.engine.step()
        if not self.engine.window_open:
            self.optimizers[0].refresh()

    def on_train_start(self) -> None:
        batches = self.lightning_module.trainer.num_training_batches
        accum = self.engine.gradient_accumulation_steps()
        if batches != float("inf") and batches % accum:
            raise refuse(f"accumulate_grad_batches={accum} with {batches} batches an epoch",
                         "an epoch's last batches would leave a partial accumulation window")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Lightning's windows start at every ``accumulate_grad_batches``-th batch of an epoch; the engine's
        must start there too, or its updates would not be Lightning's steps."""
        accum = self.engine.gradient_accumulation_steps()
        held = self.engine.micro_steps % accum
        if (batch_idx % accum == 0) == (held == 0):
            return
        epoch = self.lightning_module.trainer.current_epoch
        raise refuse(f"batch {batch_idx} of epoch {epoch} with {held} of {accum} batches of an accumulation window "
                     "held", "Lightning and the engine count the window differently: Lightning restarts the epoch "
                     "of a checkpoint taken at a training epoch's end with no validation "
                     "(ModelCheckpoint(every_n_epochs=...)) one batch late; checkpoint with "
                     "ModelCheckpoint(every_n_train_steps=...) or after validation")

    # ------------------------------------------------------------------ the steps, through the engine

    def _run(self, name: str, args: tuple, kwargs: dict) -> Any:
        if self.engine is None:
            return getattr(self.lightning_module, name)(*args, **kwargs)
        return self._forward_redirection(self.engine, self.lightning_module, name, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._run("training_step", args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._run("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._run("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._run("predict_step", args, kwargs)

    # ------------------------------------------------------------------ checkpoints

    def optimizer_state(self, optimizer: Any) -> dict:
        return {}  # the engine's checkpoint holds it

    def lightning_module_state_dict(self) -> dict:
        if self.engine is not None:
            return {}  # the engine's checkpoint holds the params; no whole copy is gathered for Lightning's file
        return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise refuse("save_checkpoint(storage_options=...)", "zf.checkpoint writes the folder itself")
        if self.engine is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        self.engine.save_checkpoint(path, tag=TAG)
        if self.is_global_zero:
            rest = {k: v for k, v in checkpoint.items() if k not in _ENGINE_KEYS}
            self.checkpoint_io.save_checkpoint(rest, path / LIGHTNING_FILE)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / TAG / "manifest.json").is_file():
            raise FileNotFoundError(f"ckpt_path={str(checkpoint_path)!r}: not a ZfuncStrategy checkpoint (expected a "
                                    f"folder holding {TAG}/manifest.json and {LIGHTNING_FILE})")
        if self.engine is not None:
            self.engine.load_checkpoint(path, tag=TAG)
            self.optimizers[0].refresh()
        else:  # validate, test, predict: the module's params
            self._load_params(path / TAG)
        given = {} if weights_only is None else {"weights_only": weights_only}
        return self.checkpoint_io.load_checkpoint(path / LIGHTNING_FILE, **given)

    def _load_params(self, directory: Path) -> None:
        """The checkpoint's params (and trained buffers), whole, into the module on this rank
        (``zf.checkpoint.export`` to a temporary file: the whole model passes through it once)."""
        module = self.lightning_module
        with tempfile.TemporaryDirectory() as tmp:
            tensors = safetensors.torch.load_file(zf.checkpoint.export(directory, Path(tmp) / "model.safetensors"))
        result = module.load_state_dict(tensors, strict=False, assign=any(p.is_meta for p in module.parameters()))
        trained = {n for n, p in module.named_parameters() if p.requires_grad}
        missing = sorted(trained & set(result.missing_keys))
        if missing or result.unexpected_keys:
            raise ValueError(f"ckpt_path: {directory.parent} does not hold this module's params "
                             f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})")

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: ``load_checkpoint`` loaded the params (into the engine, or the module outside fit)."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: ``load_checkpoint`` loaded the optimizer state into the engine."""

    # ------------------------------------------------------------------ the end

    def _sync_module(self) -> None:
        """The module's params and trained buffers, whole, from the engine's state (every rank)."""
        engine = self.engine
        if engine.window_open:
            warnings.warn("ZfuncStrategy: fit ended inside an accumulation window; the module keeps the params it "
                          "had before that window", stacklevel=2)
            return
        module, state = self.lightning_module, engine.state
        whole = state.params if state.placement is None else zf.checkpoint.full_params(state)
        params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
        with torch.no_grad():
            for name, value in whole.items():
                p = params[name]
                if p.is_meta:  # built under model_sharded_context: the object stays (ties hold), its data becomes real
                    torch.utils.swap_tensors(p, torch.nn.Parameter(value.detach().clone(), p.requires_grad))
                else:
                    p.copy_(value)
            for name, value in (state.buffers or {}).items():
                if name in buffers:
                    buffers[name].copy_(value)

    def teardown(self) -> None:
        if self.engine is not None:
            try:
                self._sync_module()
            finally:
                self.engine.close()  # its step thread
                self.engine = None
        super().teardown()
