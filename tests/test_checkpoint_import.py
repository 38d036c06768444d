"""zfunc.checkpoint.importers: DeepSpeed ZeRO and torch DCP (FSDP2) checkpoints load into any zfunc layout with
params bit-equal to the tools' own consolidation, and training continues with the tools' losses.

The DeepSpeed checkpoints are fixtures written by ``tests/fixtures/make_deepspeed_checkpoints.py``
(deepspeed on CPU, 2 gloo ranks); this file never imports deepspeed. The DCP checkpoints are written
here: by FSDP2 on 2 gloo ranks (slow: ~10 s) and by torch in this process (the fast variant).
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from fixtures.make_deepspeed_checkpoints import ADAMW, MICRO, STEPS, batches, model
from tests.models import fixtures_step as make, token_loss  # this file's step: the fixtures' model and AdamW
from zfunc.checkpoint import CheckpointError
from zfunc.checkpoint.importers import detect, load_dcp, load_deepspeed

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
MORE = 3
# (ZeRO stage, None: plain, or "pp": a 2-stage pipeline; offload) for each layout loaded into
LAYOUTS = [(None, False), (3, False), (None, True)]
ONE_PROCESS = {1: [(None, False)], 2: [(None, False), (None, True)], 3: [(None, False), (3, False)]}  # CI's share
LAYOUTS_2 = [(1, False), (2, False), (3, False), (3, True), (0, False), ("pp", False)]


def fixture(stage: int) -> dict:
    record = json.loads((FIXTURES / f"zero{stage}.json").read_text())
    params = {k: torch.tensor([float.fromhex(x) for x in v["values"]]).reshape(v["shape"])
              for k, v in record["params"].items()}
    return {"params": params, "losses": [float.fromhex(x) for x in record["losses_after"]]}


def continue_training(step, state, rank=0, world=1):
    """Losses of the MORE steps after the save, on the global batches the tools trained on."""
    losses = []
    for x, y in batches(STEPS + MORE)[STEPS:]:
        b = x.shape[0] // world
        state, metrics = step(state, (x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]))
        losses.append(float(metrics["loss"]))
    return losses


def load_and_train(rank, world, layouts, fmt, path):
    """For each layout: (whole params after the load, losses of the steps after)."""
    out = []
    for stage, offload in layouts:
        step, params = make(stage, offload, world)
        load = load_deepspeed if fmt == "deepspeed" else load_dcp
        state = load(path, step, params=params)
        full = zf.checkpoint.full_params(state)
        data_world = 1 if stage == "pp" else world
        out.append((full, state.step, continue_training(step, state, rank % data_world, data_world)))
    return out


def check(results, params, losses, what):
    for full, step, got in results:
        assert step == STEPS, what
        for name, ref in params.items():
            assert torch.equal(full[name], ref), (what, name)
        assert got == pytest.approx(losses, rel=1e-5, abs=1e-5), what


# ----------------------------------------------------------------------------- DeepSpeed


@pytest.mark.parametrize("ds_stage", [1, 2, 3])
def test_deepspeed_loads_into_one_process_layouts(ds_stage):
    ref = fixture(ds_stage)
    check(load_and_train(0, 1, ONE_PROCESS[ds_stage], "deepspeed", FIXTURES / f"zero{ds_stage}"), ref["params"],
          ref["losses"], f"zero{ds_stage} -> 1 rank")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_deepspeed_loads_into_every_layout():
    for ds_stage in (1, 2, 3):
        ref = fixture(ds_stage)
        check(load_and_train(0, 1, LAYOUTS, "deepspeed", FIXTURES / f"zero{ds_stage}"), ref["params"], ref["losses"],
              f"zero{ds_stage} -> 1 rank")
        for rank_results in zf.dist.spawn(load_and_train, 2, 2, LAYOUTS_2, "deepspeed", FIXTURES / f"zero{ds_stage}"):
            check(rank_results, ref["params"], ref["losses"], f"zero{ds_stage} -> 2 ranks")


def two_rank_worker(rank, world):
    """ZeRO-2 fixture -> zfunc ZeRO-3, ZeRO-3 fixture -> zfunc ZeRO-1; and the rows the ZeRO-3 load read."""
    from zfunc.checkpoint.importers import deepspeed_zero

    asked, read = [], deepspeed_zero.DeepSpeedSource.read
    deepspeed_zero.DeepSpeedSource.read = lambda self, n, k, a, b: asked.append((n, k, a, b)) or read(self, n, k, a, b)
    loaded = load_and_train(rank, world, [(3, False)], "deepspeed", FIXTURES / "zero2")
    rows = list(asked)
    loaded += load_and_train(rank, world, [(1, False)], "deepspeed", FIXTURES / "zero3")
    return loaded, rows


@pytest.mark.multiprocess
def test_deepspeed_loads_into_two_ranks_each_reading_its_rows():
    """Each ZeRO-3 rank of 2 reads, of each param and moment, only the rows it holds (torch.chunk style)."""
    shapes = {n: tuple(p.shape) for n, p in make()[1].items()}
    for rank, (loaded, asked) in enumerate(zf.dist.spawn(two_rank_worker, 2, 2)):
        for ds_stage, results in zip((2, 3), loaded):
            ref = fixture(ds_stage)
            check([results], ref["params"], ref["losses"], f"zero{ds_stage} -> 2 ranks")
        assert sorted((n, k) for n, k, *_ in asked) == sorted((n, k) for n in shapes
                                                              for k in ("param", "exp_avg", "exp_avg_sq"))
        for name, _, a, b in asked:
            rows = shapes[name][0]
            chunk = -(-rows // 2)
            assert (a, b) == (min(rank * chunk, rows), min((rank + 1) * chunk, rows)), (rank, name)


def test_deepspeed_tag_dir_and_detect(tmp_path):
    ref = fixture(2)
    step, params = make()
    state = load_deepspeed(FIXTURES / "zero2" / f"global_step{STEPS}", step, params=params)
    assert all(torch.equal(state.params[n], ref["params"][n]) for n in params)
    assert detect(FIXTURES / "zero2") == "deepspeed"
    assert detect(FIXTURES / "zero3" / f"global_step{STEPS}") == "deepspeed"
    state = zf.checkpoint.load(FIXTURES / "zero3", step)  # found by what the directory holds
    assert all(torch.equal(state.params[n], fixture(3)["params"][n]) for n in params)
    with pytest.raises(CheckpointError, match="not a checkpoint zfunc knows"):
        detect(tmp_path)


def test_deepspeed_run_continues_with_its_own_config():
    """The optimizer rebuilt from the ds_config the checkpoint holds (zf.config) continues the run."""
    apply, params = zf.functionalize(model())
    plan = zf.config.from_deepspeed(zf.checkpoint.deepspeed_config(FIXTURES / "zero1"), world_size=2)
    step = zf.train_step(token_loss(apply), zf.config.optimizer(plan), plan.precision)
    state = zf.checkpoint.load(FIXTURES / "zero1", step, params=params)
    assert continue_training(step, state) == pytest.approx(fixture(1)["losses"], rel=1e-5, abs=1e-5)


# ----------------------------------------------------------------------------- DeepSpeed: bad input


def test_deepspeed_model_mismatch_names_missing_unexpected_and_misshaped():
    from tests.models import Tiny

    apply, params = zf.functionalize(Tiny(vocab=13, d=5, n=3, tie=False))
    step = zf.train_step(lambda p, b: apply(p, b[0]).sum(), zf.optim.adamw(1e-2))
    with pytest.raises(CheckpointError) as e:
        load_deepspeed(FIXTURES / "zero2", step, params=params)
    msg = str(e.value)
    assert "not in the checkpoint ['blocks.2." in msg  # missing
    assert "emb.weight: (12, 5) float32 in the checkpoint, (13, 5)" in msg  # mis-shaped


def test_deepspeed_missing_rank_file_and_not_a_checkpoint(tmp_path):
    copy = tmp_path / "ds"
    shutil.copytree(FIXTURES / "zero3", copy)
    (copy / f"global_step{STEPS}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    step, params = make()
    with pytest.raises(CheckpointError, match="written by 2 data-parallel ranks but holds 1"):
        load_deepspeed(copy, step, params=params)
    (copy / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match="names 'global_step9'"):
        load_deepspeed(copy, step, params=params)
    with pytest.raises(CheckpointError, match="not a DeepSpeed checkpoint"):
        load_deepspeed(tmp_path, step, params=params)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_text("not a pickle")
    (bad / "mp_rank_00_model_states.pt").write_text("not a pickle")
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint"):
        load_deepspeed(bad, step, params=params)


def test_deepspeed_refuses_a_non_adam_optimizer_unless_asked():
    apply, params = zf.functionalize(model())
    step = zf.train_step(lambda p, b: apply(p, b[0]).sum(), zf.optim.sgd(0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match="optimizer=False"):
        load_deepspeed(FIXTURES / "zero2", step, params=params)
    state = load_deepspeed(FIXTURES / "zero2", step, params=params, optimizer=False)
    assert torch.equal(state.params["emb.weight"], fixture(2)["params"]["emb.weight"])


# ----------------------------------------------------------------------------- DCP from FSDP2


def fsdp_worker(rank, world, path):
    """FSDP2 (fully_shard per Block and the root) + torch AdamW: STEPS steps, dcp.save, MORE steps."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from tests.models import Block

    net = model()
    for m in net.modules():
        if isinstance(m, Block):
            fully_shard(m)
    fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"])

    def train(batch):
        x, y = (t[rank * MICRO:(rank + 1) * MICRO] for t in batch)
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean.item() / world

    data = batches(STEPS + MORE)
    for batch in data[:STEPS]:
        train(batch)
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    losses = [train(batch) for batch in data[STEPS:]]
    dist.barrier()  # the checkpoint is whole: zfunc loads it on the same 2 ranks
    return losses, load_and_train(rank, world, [(3, False), (2, False)], "dcp", path)


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    """An FSDP2 DCP checkpoint, the params DCP consolidates (``dcp_to_torch_save``), torch's losses,
    and what zfunc ZeRO-3 and ZeRO-2 on 2 ranks loaded and trained (per rank)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = tmp_path_factory.mktemp("dcp")
    path = root / "ckpt"
    ranks = zf.dist.spawn(fsdp_worker, 2, 2, str(path))
    dcp_to_torch_save(str(path), str(root / "whole.pt"))
    params = dict(torch.load(root / "whole.pt")["model"])
    return path, params, ranks[0][0], [zfunc for _, zfunc in ranks]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dcp_loads_into_one_process_layouts(fsdp_checkpoint):
    path, params, losses, _ = fsdp_checkpoint
    assert detect(path) == "dcp"
    check(load_and_train(0, 1, LAYOUTS, "dcp", path), params, losses, "dcp -> 1 rank")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dcp_loads_into_two_rank_layouts(fsdp_checkpoint):
    _, params, losses, ranks = fsdp_checkpoint
    for rank_results in ranks:
        check(rank_results, params, losses, "dcp -> 2 ranks")


class Wrapped(torch.nn.Module):
    """A wrapper like DDP's: every name gets a ``module.`` prefix."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


@pytest.fixture(scope="module")
def torch_dcp(tmp_path_factory):
    """One process, no process group: a wrapped module + torch AdamW, saved with dcp (no_dist), and
    its model alone at the top level; the params as saved and torch's losses after."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = tmp_path_factory.mktemp("dcp1")
    net = Wrapped(model())
    opt = torch.optim.AdamW(net.parameters(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"])

    def train(batch):
        x, y = batch
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    data = batches(STEPS + MORE)
    for batch in data[:STEPS]:
        train(batch)
    model_sd, optim_sd = get_state_dict(net, opt)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / "run"), no_dist=True)
        dcp.save(dict(net.state_dict()), checkpoint_id=str(root / "weights"), no_dist=True)  # a model alone
    saved = {k.removeprefix("module."): v.detach().clone() for k, v in net.state_dict().items()}
    return root, saved, [train(batch) for batch in data[STEPS:]]


def test_dcp_from_one_process_torch_run_with_a_wrapper_prefix(torch_dcp):
    root, saved, losses = torch_dcp
    step, params = make()
    state = load_dcp(root / "run", step, params=params)
    assert all(torch.equal(state.params[n], saved[n]) for n in params) and state.opt_state.count == STEPS
    assert continue_training(step, state) == pytest.approx(losses, rel=1e-5, abs=1e-5)

    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_dcp(root / "weights", step, params=params, model_key=None)
    state = load_dcp(root / "weights", step, params=params, model_key=None, optimizer=False)
    assert all(torch.equal(state.params[n], saved[n]) for n in params) and state.opt_state.count == 0


def test_dcp_bad_key_and_mismatch(torch_dcp, tmp_path):
    path = torch_dcp[0] / "run"
    step, params = make()
    with pytest.raises(CheckpointError, match=r"no tensors under model_key='net'.*\['model', 'optim'\]"):
        load_dcp(path, step, params=params, model_key="net")
    del params["head.weight"]
    with pytest.raises(CheckpointError, match=r"params in the checkpoint not in the model \['head.weight'\]"):
        load_dcp(path, step, params=params)
    with pytest.raises(CheckpointError, match="no .metadata"):
        load_dcp(tmp_path, step)
