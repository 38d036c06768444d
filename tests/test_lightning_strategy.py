"""zfunc.integrations.lightning: a LightningModule trains under ``ZfuncStrategy`` as under Lightning's own strategies.

The law: ``training_step``'s losses and the params after ``fit`` equal those of Lightning's DDP
strategy (2 processes, gloo) and of its default strategy (1 process), fp32, within 1e-5, for 5
updates of 2 accumulated batches with clipping; a fit resumed from a checkpoint (another layout)
continues the losses.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
import lightning_fit  # noqa: E402
from lightning_fit import ACCUM, UPDATES_PER_EPOCH, fit, loader, trainer  # noqa: E402

from zfunc.integrations.lightning import ZfuncStrategy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def assert_same(got: dict, want: dict, what: str, skip: int = 0) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"][skip:]), rtol=0, atol=1e-5,
                               msg=f"{what}: losses")
    assert got["params"].keys() == want["params"].keys(), what
    for name in want["params"]:
        torch.testing.assert_close(torch.tensor(got["params"][name]), torch.tensor(want["params"][name]), rtol=0,
                                   atol=1e-5, msg=f"{what}: {name}")


@pytest.mark.parametrize("stage", [0, 3])
def test_one_process_equals_lightnings_own_and_resumes(tmp_path, stage):
    # one process: the batches in order (Lightning gives ZfuncStrategy, as DDP, a shuffling DistributedSampler)
    want = fit("auto", 1, tmp_path / "plain", use_distributed_sampler=False)
    got = fit(ZfuncStrategy(stage=stage), 1, tmp_path / "z", save=True, use_distributed_sampler=False)
    assert len(got["losses"]) == ACCUM * 5
    assert_same(got, want, f"stage {stage}, 1 process")
    ckpt = tmp_path / "z" / f"epoch=1-step={2 * UPDATES_PER_EPOCH}.ckpt"
    assert (ckpt / "zfunc" / "manifest.json").is_file() and (ckpt / "lightning.ckpt").is_file()
    resumed = fit(ZfuncStrategy(stage={0: 2, 3: 0}[stage]), 1, tmp_path / "r", ckpt_path=str(ckpt),  # another layout
                  use_distributed_sampler=False)
    assert_same(resumed, want, f"stage {stage}, 1 process, resumed after update 4", skip=4 * ACCUM)


def test_the_strategy_is_named_as_deepspeeds():
    import lightning as L

    for name, stage, offload in [("zfunc", 2, False), ("zfunc_stage_1", 1, False), ("zfunc_stage_3", 3, False),
                                 ("zfunc_stage_2_offload", 2, True), ("zfunc_stage_3_offload", 3, True)]:
        strategy = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False).strategy
        assert isinstance(strategy, ZfuncStrategy), name
        zero = strategy._config["zero_optimization"]
        assert zero["stage"] == stage and ("offload_optimizer" in zero) == offload, (name, zero)


@pytest.mark.multiprocess
def test_two_processes_equal_ddp_and_resume(tmp_path):
    """One torchrun launch of 2 gloo ranks: DDP, then ZeRO-2 + CPU offload, then resumed as ZeRO-3."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           lightning_fit.__file__, "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        runs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(runs["zfunc"]["losses"]) == ACCUM * 5
        assert_same(runs["zfunc"], runs["ddp"], f"2 processes, rank {rank}")
        assert_same(runs["resumed"], runs["ddp"], f"2 processes, rank {rank}, resumed as ZeRO-3", skip=4 * ACCUM)


def test_validation_runs_on_the_trained_params(tmp_path):
    """Validation inside fit runs on the engine's params; after fit the module holds them and the engine's
    step thread is gone; validate(ckpt_path=) evaluates a checkpoint's params."""
    import threading

    def step_threads():
        return sum(t.name == "zfunc-step" and t.is_alive() for t in threading.enumerate())

    before = step_threads()
    model = lightning_fit.Net()
    t = trainer(ZfuncStrategy(stage=0), 1, tmp_path, steps=2, save=True)
    t.fit(model, loader(1), loader(1))
    plain = lightning_fit.Net()
    plain.load_state_dict(model.state_dict())
    want = trainer("auto", 1, tmp_path).validate(plain, loader(1), verbose=False)[0]["val_loss"]
    assert abs(t.callback_metrics["val_loss"].item() - want) < 1e-6
    ckpt = str(tmp_path / "epoch=0-step=2.ckpt")  # validate(ckpt_path=) with no fit: the checkpoint's params
    again = trainer(ZfuncStrategy(stage=3), 1, tmp_path / "v").validate(lightning_fit.Net(), loader(1), ckpt_path=ckpt,
                                                                       verbose=False)[0]["val_loss"]
    assert abs(again - want) < 1e-6
    assert step_threads() == before


def test_refusals_name_what(tmp_path):
    class Adagrad(lightning_fit.Net):
        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters())

    class Scheduled(lightning_fit.Net):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters())
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    class Manual(lightning_fit.Net):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="configure_optimizers: .*Adagrad"):
        trainer(ZfuncStrategy(stage=0), 1, tmp_path).fit(Adagrad(), loader(1))
    with pytest.raises(NotImplementedError, match="lr scheduler .StepLR."):
        trainer(ZfuncStrategy(stage=0), 1, tmp_path).fit(Scheduled(), loader(1))
    with pytest.raises(NotImplementedError, match="automatic_optimization = False"):
        trainer(ZfuncStrategy(stage=0), 1, tmp_path, gradient_clip_val=None, accumulate_grad_batches=1).fit(Manual(),
                                                                                                           loader(1))
    with pytest.raises(NotImplementedError, match="gradient_clip_algorithm='value'"):
        trainer(ZfuncStrategy(stage=0), 1, tmp_path, gradient_clip_algorithm="value").fit(lightning_fit.Net(),
                                                                                           loader(1))
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        trainer(ZfuncStrategy({"gradient_accumulation_steps": 3}), 1, tmp_path).fit(lightning_fit.Net(), loader(1))
    with pytest.raises(ValueError, match="give the layout once"):
        ZfuncStrategy({}, stage=3)


def test_partial_accumulation_window_is_refused(tmp_path):
    g = torch.Generator().manual_seed(1)
    odd = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 8, generator=g),
                                                                     torch.randn(12, 4, generator=g)), batch_size=4)
    with pytest.raises(NotImplementedError, match="accumulate_grad_batches=2 with 3 batches an epoch"):
        trainer(ZfuncStrategy(stage=0), 1, tmp_path).fit(lightning_fit.Net(), odd)


def test_configure_model_builds_on_the_meta_device(tmp_path):
    """``model_sharded_context``: layers made in ``configure_model`` are meta until the engine makes their
    values; from those values the fit equals Lightning's own on an eager module."""
    import lightning as L

    import zfunc as zf

    seen = {}

    class Late(lightning_fit.Net):
        def __init__(self):
            super().__init__()
            del self.net

        def configure_model(self):
            if not hasattr(self, "net"):
                self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
                seen["meta"] = all(p.is_meta for p in self.parameters())

    class Initial(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["init"] = {n: t.clone() for n, t in zf.checkpoint.full_params(trainer.strategy.engine.state).items()}

    model = Late()
    trainer(ZfuncStrategy(stage=3), 1, tmp_path, callbacks=[Initial()], use_distributed_sampler=False).fit(model,
                                                                                                          loader(1))
    assert seen["meta"] and not any(p.is_meta for p in model.parameters())
    eager = lightning_fit.Net()
    eager.load_state_dict(seen["init"])
    trainer("auto", 1, tmp_path, use_distributed_sampler=False).fit(eager, loader(1))
    got = {"losses": model.losses, "params": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}}
    want = {"losses": eager.losses, "params": {n: p.detach().flatten().tolist() for n, p in eager.named_parameters()}}
    assert_same(got, want, "built on the meta device, ZeRO-3")



def test_trainer_precision_is_the_plans(tmp_path):
    strategy = ZfuncStrategy(stage=0)
    trainer(strategy, 1, tmp_path, steps=1, precision="bf16-mixed").fit(lightning_fit.Net(), loader(1))
    assert strategy.plan.precision == "bf16"
    with pytest.raises(NotImplementedError, match="Trainer.precision='64-true'"):
        trainer(ZfuncStrategy(stage=0), 1, tmp_path, precision="64-true").fit(lightning_fit.Net(), loader(1))


def test_resume_from_an_epoch_end_checkpoint_is_refused(tmp_path):
    """Lightning restarts an epoch-end checkpoint's epoch one batch late: the windows would disagree."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    t = trainer(ZfuncStrategy(stage=0), 1, tmp_path, steps=2 * UPDATES_PER_EPOCH, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1)])
    t.fit(lightning_fit.Net(), loader(1))
    with pytest.raises(NotImplementedError, match="every_n_train_steps"):
        fit(ZfuncStrategy(stage=0), 1, tmp_path / "r", ckpt_path=str(tmp_path / "epoch=1-step=4.ckpt"))
