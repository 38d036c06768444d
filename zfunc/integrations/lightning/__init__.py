"""Lightning's ``Trainer(strategy=...)`` on zfunc: ``ZfuncStrategy``, where ``DeepSpeedStrategy`` would go.

    import lightning as L
    from zfunc.integrations.lightning import ZfuncStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ZfuncStrategy(stage=3, offload_optimizer=True),
                        max_steps=1000, accumulate_grad_batches=4, gradient_clip_val=1.0)
    trainer.fit(model, loader)                     # trainer.fit(model, loader, ckpt_path=PATH) continues a run
    L.Trainer(strategy="zfunc_stage_3_offload")    # names, as DeepSpeed's: zfunc, zfunc_stage_{1,2,3}[_offload]

The strategy is Lightning's DDP process setup (``DDPStrategy``: the process group, the
``DistributedSampler``; one process makes no group) with ``zfunc.deepspeed``'s engine where DDP's
wrapper would be (strategy.py):

- **setup** (``fit``): the LightningModule itself is the engine's model (``zfunc.deepspeed.build_engine``:
  ``zf.train_step`` under ``zf.parallelize``), so checkpoints name its params as its ``state_dict``
  does. The layout is a DeepSpeed config, ``config=`` (a dict or a JSON path, read by
  ``zf.config.from_deepspeed``: its keys and refusals), or DeepSpeedStrategy's arguments
  (``stage=``, default 2 as DeepSpeedStrategy's, ``offload_optimizer=``, ``offload_parameters=``,
  ``offload_optimizer_device=``, ``offload_params_device=``, ``nvme_path=``), completed from the
  Trainer as DeepSpeedStrategy completes it (config.py: accumulation, clipping, precision).
- **the optimizer**: the config's ``optimizer`` section when it has one (``configure_optimizers``
  is then not called, as DeepSpeedStrategy does); otherwise ``configure_optimizers``'s one
  ``torch.optim`` Adam, AdamW or SGD, its settings and param groups mapped as
  ``zfunc.deepspeed.initialize(optimizer=...)`` maps a client optimizer. The learning-rate schedule
  is the config's ``scheduler`` section (WarmupLR, WarmupDecayLR, WarmupCosineLR), stepped by the
  engine. Lightning needs ``configure_optimizers`` defined in either case. The Trainer holds
  ``zfunc.integrations.optimizer.TrainerOptimizer`` (the engine's lr).
- **the step** (``handles_gradient_accumulation``, as DeepSpeedStrategy): ``training_step`` runs
  inside the engine's step (Lightning's forward redirection with the engine as the wrapper); the
  precision plugin (precision.py) runs the closure, the engine's backward, then ``engine.step()``,
  which updates at every ``accumulate_grad_batches``-th batch. ``validation_step``, ``test_step``
  and ``predict_step`` run on the engine's current whole params.
- **checkpoints**: a checkpoint path is a folder holding ``zfunc/`` (``engine.save_checkpoint``: the
  whole ``TrainState`` by ``zf.checkpoint``, each rank its rows) and ``lightning.ckpt`` (the rest of
  Lightning's checkpoint through ``checkpoint_io``, written by rank 0: loops, callbacks, hyper-
  parameters; no ``state_dict``, no ``optimizer_states``). Loading restores both after setup, so
  ``fit(ckpt_path=...)`` continues the run, in any layout (another stage, offload, world size);
  ``validate``/``test``/``predict(ckpt_path=...)`` evaluate its params.
- ``model_sharded_context`` is ``zfunc.deepspeed.zero.Init``: modules made in ``configure_model``
  are built on the meta device and each rank makes only its rows (``zf.materialize.from_module``:
  their values follow each submodule's init, not an eager build's).
- After ``fit`` (at teardown) the module's params, and the buffers training updated, hold the
  trained values, whole, on every rank.

Law: a LightningModule trained by ``ZfuncStrategy`` sees the losses of the same module under
Lightning's DDP strategy (its default one on one process) and ends with its params, fp32, within
1e-5, with accumulation and clipping; a fit resumed from a checkpoint continues them.
Cost: the engine's per batch (``zfunc.deepspeed.engine``: two thread hand-overs), Lightning's own
loop around it; ``benchmarks/adapters.py`` measures both against calling the step directly.

Not supported (refused, naming it): manual optimization (``automatic_optimization = False``),
several optimizers, a learning-rate scheduler from ``configure_optimizers`` (give the config's
``scheduler``), torch optimizers other than Adam/AdamW/SGD, ``gradient_clip_algorithm="value"``,
``Trainer(precision=...)`` other than "32-true", "bf16-mixed" and "16-mixed", a config whose
``gradient_accumulation_steps``, ``gradient_clipping`` or fp16/bf16 contradict the Trainer's, an
epoch whose batches leave a partial accumulation window, a fit resumed where Lightning's count of a
window differs from the engine's (Lightning restarts the epoch of a checkpoint taken at a training
epoch's end with no validation, ``ModelCheckpoint(every_n_epochs=...)``, one batch late: checkpoint
with ``every_n_train_steps`` or after validation), a
``training_step`` that returns None, ``save_checkpoint(storage_options=...)``. As with DeepSpeed,
``on_before_optimizer_step`` runs at every batch and the module's ``.grad`` stay empty (the grads live
in the step). Supported versions: Lightning 2.6 and later 2.x (tested with 2.6.6); ``pip install zfunc[lightning]``.
"""
from lightning.pytorch.strategies import StrategyRegistry

from zfunc.integrations.lightning.precision import ZfuncPrecision
from zfunc.integrations.lightning.strategy import ZfuncStrategy

if "zfunc" not in StrategyRegistry:  # importing this package names the strategy for Trainer(strategy=...)
    ZfuncStrategy.register_strategies(StrategyRegistry)

__all__ = ["ZfuncPrecision", "ZfuncStrategy"]
