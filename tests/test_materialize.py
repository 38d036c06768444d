"""materialize: values depend only on (seed, name, row), so a sharded init from the meta device
equals the 1-process one at any world size, and no rank ever holds the whole model."""
import ctypes
import math
import resource
import sys

import pytest
import torch
from torch import nn

import zfunc as zf
from tests.models import Block, Tiny, adamw, assert_same_training, batches, local, token_loss
from zfunc.model import materialize as M


# ---------------------------------------------------------------- the law, one process
SHAPES = [(), (1,), (7,), (1000, 300), (3, M.BLOCK_ELEMS + 5), (2 * M.BLOCK_ELEMS + 3,), (5, 0), (4, 3, 2)]
DRAWN = {"normal": M.normal(0.02, 0), "uniform": M.uniform(-0.5, 0.5, 0), "constant": M.constant(1.5)}


@pytest.mark.parametrize("kind", DRAWN)
@pytest.mark.parametrize("shape", SHAPES)
def test_any_row_range_equals_those_rows_of_the_whole_leaf(kind, shape):
    fn, like = DRAWN[kind], torch.empty(shape, device="meta")
    whole = fn("blocks.0.w", like)
    assert whole.shape == like.shape and whole.dtype == torch.float32 and torch.isfinite(whole).all()
    rows = shape[0] if shape else 1
    flat = whole.reshape(rows, *shape[1:]) if shape else whole.reshape(1)
    for world in (1, 2, 3, 4, 7):  # torch.chunk splits, as zf.shard's layout
        chunk = -(-rows // world)
        for r in range(world):
            start = min(r * chunk, rows)
            s = slice(start, min(start + chunk, rows))
            assert torch.equal(M.leaf(fn, "blocks.0.w", like, s), flat[s]), (world, r)


def test_values_depend_on_seed_and_name_and_follow_the_distribution():
    like = torch.empty(512, 512, device="meta")
    a = M.normal(0.02, 0)("a", like)
    assert torch.equal(a, M.normal(0.02, 0)("a", like))  # a fresh materializer, the same values
    assert not torch.equal(a, M.normal(0.02, 0)("b", like))
    assert not torch.equal(a, M.normal(0.02, 1)("a", like))
    assert abs(a.mean().item()) < 1e-3 and abs(a.std().item() - 0.02) < 1e-3
    u = M.uniform(-0.5, 0.5, 0)("a", like)
    assert u.min() >= -0.5 and u.max() < 0.5 and abs(u.mean().item()) < 5e-3
    assert M.normal(0.02, 0)("a", torch.empty(3, device="meta", dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_from_module_runs_each_submodules_own_init_and_by_name_picks_by_pattern():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Embedding(5, 4))
    apply, params = zf.functionalize(model)
    fm = M.from_module(model, 0)
    got = {n: fm(n, p) for n, p in params.items()}
    assert torch.equal(got["1.weight"], torch.ones(3)) and torch.equal(got["1.bias"], torch.zeros(3))
    bound = 1 / math.sqrt(4)  # nn.Linear's reset_parameters: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert got["0.weight"].abs().max() <= bound and got["0.bias"].abs().max() <= bound
    assert got["2.weight"].std() > 0.5  # nn.Embedding: N(0, 1)
    assert all(torch.equal(got[n], M.from_module(model, 0)(n, p)) for n, p in params.items())
    assert not torch.equal(got["0.weight"], M.from_module(model, 1)("0.weight", params["0.weight"]))
    assert torch.equal(M.leaf(fm, "2.weight", params["2.weight"], slice(1, 4)), got["2.weight"][1:4])
    assert all(p.device.type == "meta" for p in model.parameters())  # the model is untouched

    scaled = M.from_module(model, 0, init=lambda m: isinstance(m, nn.Linear) and nn.init.normal_(m.weight, 0, 0.02))
    assert scaled("0.weight", params["0.weight"]).std() < 0.1
    rules = M.by_name({"2.*": M.constant(0.0), "*.bias": M.constant(3.0), "*": fm})
    assert torch.equal(rules("2.weight", params["2.weight"]), torch.zeros(5, 4))
    assert torch.equal(rules("0.bias", params["0.bias"]), torch.full((3,), 3.0))
    assert torch.equal(M.leaf(rules, "0.weight", params["0.weight"], slice(1, 3)), got["0.weight"][1:3])


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.lin = nn.Linear(3, 3)


def test_bad_materializers_are_named():
    with torch.device("meta"):
        model = Custom()
    like = torch.empty(4, 2, device="meta")
    with pytest.raises(ValueError, match="materialize: returned shape \\(2, 2\\) for w rows 0:3, expected \\(3, 2\\)"):
        M.leaf(lambda name, like, rows: torch.zeros(2, 2), "w", like, slice(0, 3))
    with pytest.raises(ValueError, match="materialize: returned shape \\(3, 2\\) for w, expected \\(4, 2\\)"):
        M.leaf(lambda name, like: torch.zeros(3, 2), "w", like, slice(0, 3))
    with pytest.raises(TypeError, match="returned list for w"):
        M.leaf(lambda name, like: [], "w", like)
    with pytest.raises(ValueError, match="rows: expected slice"):
        M.leaf(M.constant(0.0), "w", like, slice(2, 9))
    with pytest.raises(TypeError, match="materialize: expected a callable"):
        M.leaf(0.02, "w", like)
    with pytest.raises(ValueError, match="no rule of by_name matches 'w'"):
        M.by_name({"x*": M.constant(0.0)})("w", like)
    with pytest.raises(ValueError, match="Custom\\) has no reset_parameters"):
        M.from_module(model, 0)("scale", model.scale)
    with pytest.raises(ValueError, match="'scale' is not set by Custom"):
        M.from_module(model, 0, init=lambda m: None)("scale", model.scale)
    with pytest.raises(ValueError, match="std: expected a finite number >= 0.0, got -1"):
        M.normal(-1, 0)
    with pytest.raises(TypeError, match="seed: expected an int"):
        M.normal(0.02, "0")


class Headed(nn.Module):
    """An embedding, a biased hidden layer and a head: the layers ``zf.tile`` splits."""

    def __init__(self):
        super().__init__()
        self.emb, self.hidden, self.head = nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 10)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("layer", ["emb", "hidden", "head"])
def test_tiled_makes_each_tile_its_part_of_the_untiled_layers_value(layer, dim):
    """An init rule written for the plain model gives the tiled one the same values: a tile along
    dim 0 is its rows of the whole layer's leaf, along dim 1 its columns (tile 0 holds the whole bias)."""
    with torch.device("meta"):
        model = Headed()
    rule = M.by_name({"*.bias": M.uniform(-1.0, 1.0, 4), "*": M.normal(0.02, 4)})
    whole = {n: rule(n, p) for n, p in model.named_parameters()}
    zf.tile(model, tiles=3, modules=[layer], dim=dim)
    made = zf.tiling.materializer(rule, model)
    parts = {n: made(n, p) for n, p in model.named_parameters()}
    assert all(".tiles." in n for n in parts if n.startswith(f"{layer}."))
    for kind in ("weight", "bias"):
        tiles = [parts[n] for n in parts if n.startswith(f"{layer}.tiles.") and n.endswith(kind)]
        if not tiles:
            continue
        joined = torch.cat(tiles, dim) if kind == "weight" or dim == 0 else tiles[0]
        assert torch.equal(joined, whole[f"{layer}.{kind}"]), kind
    for name, value in parts.items():
        if not name.startswith(f"{layer}."):
            assert torch.equal(value, whole[name]), name  # every other leaf as the rule makes it
        like = dict(model.named_parameters())[name]
        if like.shape[0] >= 3:  # any rows of a tile are those rows of the whole tile
            assert torch.equal(M.leaf(made, name, like, slice(1, 3)), value[1:3]), name


def test_tiled_gives_a_tied_head_and_embedding_one_value_and_passes_other_tiles_names_through():
    with torch.device("meta"):
        model = Headed()
        model.head.weight = model.emb.weight
    rule = M.normal(0.02, 9)
    whole = rule("emb.weight", model.emb.weight)
    zf.tile(model, tiles=4, modules=["head"])
    apply, params = zf.functionalize(model)
    made = zf.tiling.materializer(rule, model)
    assert torch.equal(torch.cat([made(f"emb.tiles.{i}.weight", params[f"emb.tiles.{i}.weight"]) for i in range(4)]),
                       whole)
    with torch.device("meta"):  # a submodule that happens to be called "tiles" is no tile: its own name
        plain = nn.Module()
        plain.tiles = nn.ModuleList([nn.Linear(2, 2)])
    assert torch.equal(zf.tiling.materializer(rule, plain)("tiles.0.weight", plain.tiles[0].weight),
                       rule("tiles.0.weight", plain.tiles[0].weight))


# ---------------------------------------------------------------- sharded init: N ranks == 1 process
def meta_make(stage, mesh, materialize=None, seed=3):
    """Tiny (tied embedding, LayerNorms) built on the meta device, shard-initialized by ``materialize``
    (default: the embedding drawn row-wise, the rest by the modules' own init)."""
    with torch.device("meta"):
        model = Tiny()
    apply, params = zf.functionalize(model)
    materialize = materialize or M.by_name({"emb.weight": M.normal(0.02, seed), "*": M.from_module(model, seed)})

    step = zf.train_step(token_loss(apply), adamw(clip=False))
    if stage:
        step = zf.shard(step, mesh, stage, units=zf.units.by_class(Block) if stage == 3 else None)
        return step, step.init(params, materialize=materialize)
    return step, step.init({n: M.leaf(materialize, n, like) for n, like in params.items()})


def train(step, state, rank, world, ranks=None, n=2):
    """``n`` steps on rank ``rank``'s part of batches made for ``world`` ranks (all of them for a
    reference trained alone: ``ranks=1``)."""
    losses, norms = [], []
    for batch in batches(world, n=n):
        state, m = step(state, local(batch, rank, ranks or world))
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    return state, losses, norms


def meta_worker(rank, world):
    mesh = zf.Mesh(dp=world)
    out = []
    for stage in (1, 2, 3):
        step, state = meta_make(stage, mesh)
        assert all(p.device.type == "cpu" for p in state.params.values())
        first = zf.checkpoint.full_params(state, mesh)
        state, losses, norms = train(step, state, rank, world)
        out.append((first, (losses, norms, zf.checkpoint.full_params(state, mesh))))
    torch.manual_seed(0)
    values = dict(zf.functionalize(Tiny())[1])
    asked = []
    step, state = meta_make(3, mesh, lambda name, like: asked.append(name) or values[name].clone())
    return out, sorted(asked), zf.checkpoint.full_params(state, mesh), values


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2])
def test_sharded_init_from_meta_is_the_same_model_at_any_world_size(world):
    ref_step, ref_state = meta_make(None, None)
    ref_first = zf.tree.clone(ref_state.params)
    ref_state, ref_losses, ref_norms = train(ref_step, ref_state, 0, world, ranks=1)
    results = zf.dist.spawn(meta_worker, world, world)
    for rank, (out, asked, whole_callable, values) in enumerate(results):
        for stage, (first, trained) in zip((1, 2, 3), out):
            assert first.keys() == ref_first.keys()
            for name in ref_first:  # bit for bit: every rank drew only its rows, the same values
                assert torch.equal(first[name], ref_first[name]), f"stage {stage}, rank {rank}: {name}"
            assert_same_training(trained, (ref_losses, ref_norms, ref_state.params), f"stage {stage}, rank {rank}")
        assert asked == sorted(values)  # a plain (name, like) callable: each leaf once, then sliced
        for name in values:
            assert torch.equal(whole_callable[name], values[name])


def test_meta_params_without_materialize_give_a_template_and_bad_input_is_named():
    with torch.device("meta"):
        model = Tiny()
    apply, params = zf.functionalize(model)
    step = zf.shard(zf.train_step(lambda p, b: apply(p, b).sum(), zf.optim.adamw(1e-2)), zf.Mesh(), 3,
                    units=zf.units.by_class(Block))
    assert all(p.device.type == "meta" for p in step.init(params).params.values())  # zf.checkpoint.load's use
    with pytest.raises(ValueError, match="materialize: returned shape \\(1,\\) for blocks.0.fc.bias"):
        step.init(params, materialize=lambda name, like: torch.zeros(1))
    with pytest.raises(TypeError, match="materialize: expected a callable"):
        step.init(params, materialize="normal")


def test_every_step_init_takes_params_and_materialize_and_holds_the_same_model():
    """One signature, ``init(params, materialize=None)``: the plain, sharded, offloaded and pipelined
    steps start from the same meta params and materializer, each holding the model made whole."""
    with torch.device("meta"):
        model = Tiny()
    apply, params = zf.functionalize(model)
    materialize = M.normal(0.02, 5)
    want = {n: M.leaf(materialize, n, like) for n, like in params.items()}
    plain = zf.train_step(lambda p, b: apply(p, b).sum(), zf.optim.adamw(1e-2))
    steps = {"plain": plain, "shard": zf.shard(plain, zf.Mesh(), 2), "offload": zf.offload(plain),
             "pipeline": zf.pipeline(plain, stages=1, microbatches=1, model=model, units=zf.units.by_class(Block))}
    for name, step in steps.items():
        state = step.init(params, materialize=materialize)
        got = zf.checkpoint.full_params(state)
        assert got.keys() == want.keys(), name
        for n in want:
            assert torch.equal(got[n], want[n]), f"{name}: {n}"


# ---------------------------------------------------------------- memory: only one rank's share
LAYERS, WIDTH = 24, 1024  # 25.2M params: 100 MB of fp32 params, 300 MB with Adam's moments
PSI = LAYERS * WIDTH * WIDTH


def _vm_data() -> int:
    """Private writable memory of this process (what RLIMIT_DATA limits), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData"))


def capped_worker(rank, world, init_cap, step_cap):
    """Stage 3 from the meta device with RLIMIT_DATA at baseline + ``init_cap`` bytes for init and
    + ``step_cap`` for 2 steps; returns where the first allocation failure happened, or "trained"."""
    # glibc: serve every block over 128 KiB by its own mmap, given back when freed (else the heap
    # keeps freed memory, and what RLIMIT_DATA counts grows with fragmentation, not with use)
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    mesh = zf.Mesh(dp=world)
    mesh.comm.all_reduce(torch.zeros(1), label="warm-up")  # the process group's threads and buffers
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    apply, params = zf.functionalize(model)
    step = zf.shard(zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-3)), mesh, 3,
                    units=zf.units.by_class(nn.Linear))
    # the CPU-Adam kernel's code (Numba, LLVM: tens of MB, once per process) is loaded before the
    # baseline: the caps measure the state, not the code
    warm = {"big": torch.zeros(1 << 15), "small": torch.zeros(8)}
    zf.optim.adamw(1e-3).apply(warm, zf.optim.adamw(1e-3).init(warm), warm)
    base = _vm_data()
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    where = "init"
    try:
        resource.setrlimit(resource.RLIMIT_DATA, (base + init_cap, hard))
        state = step.init(params, materialize=M.normal(0.02, 0))
        where = "step"
        resource.setrlimit(resource.RLIMIT_DATA, (base + step_cap, hard))
        for _ in range(2):
            state, _ = step(state, torch.ones(2, WIDTH))
        return "trained", (_vm_data() - base) >> 20
    except (MemoryError, RuntimeError) as e:
        if "memory" not in str(e).lower():
            raise
        return f"out of memory in {where}", (_vm_data() - base) >> 20
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA and mallopt: Linux with glibc")
def test_stage3_from_meta_trains_on_two_ranks_where_one_process_cannot_hold_the_model_and_adam():
    # init: full fp32 params + Adam moments are 12 PSI bytes; each of 2 ranks needs 6 PSI. A cap of
    # 9 PSI fits one rank's share and not the whole, so a rank that materialized the whole model,
    # or its whole state, would fail here.
    # steps: a rank also holds its fp32 grad slice (2 PSI) and, today, every unit's reduce-scatter
    # input until backward ends (GradReducer waits for them all at the end: 4 PSI in fp32); 17 PSI
    # fits that, and one process would need about 24 PSI for the same steps.
    init_cap, step_cap = 9 * PSI, 17 * PSI
    results = zf.dist.spawn(capped_worker, 2, 2, init_cap, step_cap, timeout_s=60)
    assert [r[0] for r in results] == ["trained", "trained"], results
    (alone,) = zf.dist.spawn(capped_worker, 1, 1, init_cap, step_cap, timeout_s=60)
    assert alone[0] == "out of memory in init", alone  # the control: the cap does bind
