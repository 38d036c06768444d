"""zfunc.deepspeed in one process: the engine trains as torch's own loop, checkpoints resume, refusals name the call.

The law: DeepSpeed's loop (forward, ``engine.backward(loss)`` or ``loss.backward()``, ``engine.step()``)
with accumulation k equals torch's loop with the loss divided by k and ``optimizer.step()`` every k
microbatches, fp32, within 1e-5, under ZeRO stages 0, 2 (+ CPU offload) and 3 on one process.
"""
import pytest
import torch
from torch import nn

import zfunc.deepspeed as deepspeed

ACCUM = 2


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def config(stage=0, offload=False, **extra):
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": zero, **extra}


def data(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def torch_losses(batches, wd=0.1, groups=None):
    model = net()
    opt = torch.optim.AdamW(groups(model) if groups else model.parameters(), lr=1e-2, weight_decay=wd)
    out = []
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        (loss / ACCUM).backward()
        out.append(loss.item())
        if (i + 1) % ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    return out


def engine_losses(engine, batches, plain_backward=()):
    out = []
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(engine(x), y)
        if i in plain_backward:
            loss.backward()
        else:
            engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("stage,offload", [(0, False), (2, True), (3, False)])
def test_engine_trains_as_torchs_loop(stage, offload):
    model = net()
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                config=config(stage, offload))
    assert loader is None and scheduler is None and engine.zero_optimization_stage() == stage
    batches = data()
    got = engine_losses(engine, batches, plain_backward={1, 4})
    torch.testing.assert_close(torch.tensor(got), torch.tensor(torch_losses(batches)), rtol=1e-5, atol=1e-6)
    assert engine.global_steps == len(batches) // ACCUM and engine.micro_steps == len(batches)
    assert engine.get_global_grad_norm() > 0 and optimizer.param_groups[0]["lr"] == 1e-2


def test_boundary_counts_as_deepspeed():
    model = net()
    engine, *_ = deepspeed.initialize(model=model, config=config())
    seen = []
    for x, y in data(4):
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        seen.append(engine.was_step_applied())
    assert seen == [False, False, True, True, False, False, True, True]
    assert engine.gradient_accumulation_steps() == ACCUM


def test_client_torch_optimizer_with_param_groups():
    """A torch AdamW whose second group turns weight decay off (biases) trains as torch's own."""
    def groups(model):
        return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
                {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]

    model = net()
    cfg = config()
    del cfg["optimizer"]
    opt = torch.optim.AdamW(groups(model), lr=1e-2, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    batches = data()
    torch.testing.assert_close(torch.tensor(engine_losses(engine, batches)),
                               torch.tensor(torch_losses(batches, groups=groups)), rtol=1e-5, atol=1e-6)


def test_checkpoint_resumes_and_returns_client_state(tmp_path):
    batches = data(8)
    whole = engine_losses(deepspeed.initialize(model=net(), config=config(2))[0], batches)
    engine, *_ = deepspeed.initialize(model=net(), config=config(2))
    engine_losses(engine, batches[:4])
    engine.save_checkpoint(tmp_path, client_state={"step": 3, "epoch": [1, 2]})
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    fresh, *_ = deepspeed.initialize(model=net(), config=config(3))  # another layout
    path, client = fresh.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "global_step2") and client == {"step": 3, "epoch": [1, 2]}
    assert fresh.global_steps == 2 and fresh.micro_steps == 4
    torch.testing.assert_close(torch.tensor(engine_losses(fresh, batches[4:])), torch.tensor(whole[4:]),
                               rtol=1e-5, atol=1e-6)
    assert fresh.load_checkpoint(tmp_path / "nothing") == (None, None)


def test_close_ends_the_step_thread_and_keeps_the_state():
    """Between steps ``close`` ends the engine's thread; training goes on where it was, on a new one."""
    import threading

    def step_threads():
        return sum(t.name == "zfunc-step" and t.is_alive() for t in threading.enumerate())

    before = step_threads()
    batches = data()
    engine, *_ = deepspeed.initialize(model=net(), config=config())
    got = engine_losses(engine, batches[:4])
    assert step_threads() == before + 1
    engine.close()
    assert step_threads() == before
    got += engine_losses(engine, batches[4:])
    engine.close()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(torch_losses(batches)), rtol=1e-5, atol=1e-6)


def test_callers_random_stream_is_its_own():
    """Draws between forward and step are what they would be without the engine: the step's
    seeded generator is swapped out at each turn."""
    torch.manual_seed(5)
    want = [torch.rand(3) for _ in range(6)]
    engine, *_ = deepspeed.initialize(model=net(), config=config())
    torch.manual_seed(5)
    got = []
    for x, y in data(3):
        got.append(torch.rand(3))
        loss = nn.functional.mse_loss(engine(x), y)
        got.append(torch.rand(3))
        engine.backward(loss)
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_eval_forward_and_gathered_parameters():
    model = net()
    engine, *_ = deepspeed.initialize(model=model, config=config(3))
    engine_losses(engine, data(4))
    x = torch.randn(2, 8)
    engine.eval()
    with torch.no_grad():
        out = engine(x)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        torch.testing.assert_close(out, model(x))
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert not torch.equal(trained["0.weight"], net()[0].weight.detach())
    with deepspeed.zero.GatheredParameters([model[0].bias], modifier_rank=0):
        model[0].bias.data.fill_(0.5)
    with torch.no_grad():
        torch.testing.assert_close(engine(x), torch.tanh(x @ trained["0.weight"].T + 0.5) @ trained["2.weight"].T
                                   + trained["2.bias"])


def test_zero_init_builds_on_meta_and_trains():
    with deepspeed.zero.Init():
        model = net()
    assert all(p.is_meta for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config=config(3))
    losses = engine_losses(engine, data(4))
    assert all(torch.isfinite(torch.tensor(losses)))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):  # meta params take the whole values
        assert not any(p.is_meta for p in model.parameters())
        for name, p in model.named_parameters():
            assert torch.equal(p, engine.state.params[name])
    with deepspeed.zero.GatheredParameters([model[0].bias], modifier_rank=0):
        model[0].bias.data.fill_(0.5)
    assert torch.equal(engine.state.params["0.bias"], torch.full((16,), 0.5))
    with deepspeed.zero.Init():
        fresh = net()
    with pytest.raises(RuntimeError, match="call deepspeed.initialize first"):
        with deepspeed.zero.GatheredParameters([fresh[0].bias], modifier_rank=0):
            fresh[0].bias.data.fill_(0.5)  # would be lost: no engine holds these params yet


def test_scheduler_and_lr_as_deepspeed():
    cfg = config(scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                           "warmup_num_steps": 3}})
    engine, _, _, scheduler = deepspeed.initialize(model=net(), config=cfg)
    lrs = []
    for x, y in data(6):
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        lrs.append(scheduler.get_last_lr()[0])
    torch.testing.assert_close(torch.tensor(lrs), torch.tensor([0.0, 0.0, 0.0, 0.0063092975, 0.0063092975, 0.01]))
    with pytest.raises(NotImplementedError, match=r"lr_scheduler.step\(\)"):
        scheduler.step()


def test_refusals_name_the_call():
    model = net()
    with pytest.raises(NotImplementedError, match=r"initialize\(lr_scheduler=...\)"):
        deepspeed.initialize(model=model, config=config(), lr_scheduler=object())
    with pytest.raises(NotImplementedError, match=r"initialize\(mpu=...\)"):
        deepspeed.initialize(model=model, config=config(), mpu=object())
    with pytest.raises(ValueError, match="optimizer.type: Adagrad"):
        deepspeed.initialize(model=model, config={**config(), "optimizer": {"type": "Adagrad"}})
    with pytest.raises(ValueError, match="the config has an 'optimizer' section too"):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config())
    with pytest.raises(ValueError, match="zfunc maps torch.optim.Adam, AdamW and SGD"):
        cfg = config()
        del cfg["optimizer"]
        deepspeed.initialize(model=model, optimizer=torch.optim.Adagrad(model.parameters()), config=cfg)
    engine, *_ = deepspeed.initialize(model=model, config=config())
    with pytest.raises(NotImplementedError, match="engine.no_sync"):
        engine.no_sync()
    with pytest.raises(NotImplementedError, match="engine.save_16bit_model"):
        engine.save_16bit_model("x")
    assert engine.named_parameters is not None and engine.training  # nn.Module's calls fall through to the module
    (x, y), = data(1)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    with pytest.raises(ValueError, match="called twice in one microbatch"):
        engine.backward(loss)
    with pytest.raises(ValueError, match="a forward after this microbatch's backward"):
        engine(x)
    engine.step()
    with pytest.raises(ValueError, match="in the middle of an accumulation window"):
        engine.save_checkpoint("unused")


def test_client_state_must_be_json(tmp_path):
    engine, *_ = deepspeed.initialize(model=net(), config=config())
    with pytest.raises(TypeError, match=r"engine.save_checkpoint\(client_state=...\)"):
        engine.save_checkpoint(tmp_path, client_state={"t": torch.zeros(1)})


def test_training_data_gives_deepspeeds_loader():
    dataset = torch.utils.data.TensorDataset(torch.randn(12, 8), torch.randn(12, 4))
    engine, _, loader, _ = deepspeed.initialize(model=net(), config=config(), training_data=dataset)
    assert isinstance(loader.sampler, torch.utils.data.RandomSampler) and loader.batch_size == 4
    for x, y in loader:
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert engine.micro_steps == 3 and engine.global_steps == 1
