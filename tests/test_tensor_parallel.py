"""zf.tensor_parallel: the sliced model trains as the whole one (fp32, 2 gloo ranks, 5 steps: the
recipes' GPT and Llama with their explicit plans, a Llama whose one kv head is replicated; plan=None on
transformers model types; under zf.remat and zf.offload), the vocab-parallel loss equals the gathered one,
dp2 x tp2 under ZeRO 0-3 and CPU offload on 4 ranks (each checkpoint loads into one process), plan=None
finds the recipes' plans, slicing and its refusals."""
import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from models import STEPS, assert_same_training
from zfunc.tensor import Slicing

GPT_PLAN = {"wte": "vocab", "lm_head": "vocab", "*.attn.qkv": "colwise:3", "*.attn.proj": "rowwise",
            "*.mlp.0": "colwise", "*.mlp.2": "rowwise"}
LLAMA_PLAN = {"embed": "vocab", "lm_head": "vocab", "*.attn.[qkv]": "colwise", "*.attn.o": "rowwise",
              "*.mlp.gate": "colwise", "*.mlp.up": "colwise", "*.mlp.down": "rowwise"}


def recipe_model(kind):
    """A tiny model of a recipe (seed 0) and its explicit plan; vocab 61: tp=2 pads it to 62."""
    torch.manual_seed(0)
    if kind == "gpt":
        from recipes.gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32)), GPT_PLAN
    from recipes.llama import Llama, LlamaConfig

    kv = 1 if kind == "llama-kv1" else 2  # 1 kv head: tp=2 does not divide it, so k and v are replicated
    cfg = LlamaConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=kv, ffn_dim=48, max_seq_len=16)
    return Llama(cfg), LLAMA_PLAN


def token_batches(n=STEPS, b=4, t=8, vocab=61):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g))
            for _ in range(n)]


def opt():
    """AdamW after clipping at 0.5 (below every step's norm here: a wrong tp norm changes the params); eps
    1e-6: a key bias's true grad is 0 (softmax ignores it), so its grads are rounding noise, which eps 1e-8
    would turn into lr-sized steps that differ with the reduction order."""
    return zf.optim.chain(zf.optim.clip_by_global_norm(0.5),
                          zf.optim.adamw(3e-3, eps=1e-6, weight_decay=0.1, mask=zf.optim.decay_mask))


def gpt_loss(apply):
    return lambda p, b: F.cross_entropy(apply(p, b[0]).flatten(0, 1), b[1].flatten())


def train(model, batches, loss_of=gpt_loss, tp=False, optimizer=opt, wrap=None):
    """``(losses, grad norms, params)`` of 5 steps; ``tp``: over ``zf.tensor_parallel.step``, params whole;
    ``wrap``: a step transformation applied last (e.g. zf.offload)."""
    apply, params = zf.functionalize(model)
    step = zf.train_step(loss_of(apply), optimizer())
    if tp:
        step = zf.tensor_parallel.step(step, model)
    if wrap is not None:
        step = wrap(step)
    state, losses, norms = step.init(params), [], []
    for batch in batches:
        state, m = step(state, batch)
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    # before full_params, whose gathers the tp comm counts too
    memory = step.memory(state) if tp and wrap is None else None
    return losses, norms, zf.checkpoint.full_params(state), memory


def law(rank, kind):
    """Train the plain model and its tp=2 slicing on every rank; the sliced params gathered whole."""
    mesh = zf.Mesh(tp=2)
    model, plan = recipe_model(kind)
    whole = {n: tuple(p.shape) for n, p in zf.functionalize(model)[1].items()}
    ref = train(copy.deepcopy(model), token_batches())
    zf.tensor_parallel(model, mesh, plan)
    shapes = {n: tuple(p.shape) for n, p in zf.functionalize(model)[1].items()}
    got = train(model, token_batches(), tp=True)
    return got, ref, shapes, accounting(model, whole, got[3])


def accounting(model, whole, memory):
    """The step's measured bytes (params held, tp comm of the last step) and zfunc.tensor.cost's formulas
    for them (4 x 8 tokens, width 32, vocab 61 padded to 62, the grad norm on)."""
    from zfunc.tensor import cost

    layout = zf.tensor_parallel.layout_of(model)
    replicated = sum(p.numel() for n, p in zf.functionalize(model)[1].items() if n not in layout.slicings)
    kv = sum(p.numel() for n, p in zf.functionalize(model)[1].items()
             if layout.styles.get(n.rpartition(".")[0]) == "replicated-kv")
    return (memory["params"], 4 * cost.params_per_rank(whole, layout), sum(memory["comm"].values()),
            cost.comm_bytes_per_step(layout, 32, 32, 62, replicated_numel=replicated, replicated_kv_numel=kv))


def remat_law(rank):
    """tp=2 with every block rematerialized (zf.remat: its forward, collectives included, runs again in
    backward) against the plain step."""
    mesh = zf.Mesh(tp=2)
    model, plan = recipe_model("gpt")
    ref = train(copy.deepcopy(model), token_batches())
    zf.tensor_parallel(model, mesh, plan)
    for block in model.blocks:
        block.forward = zf.remat(block.forward)
    return train(model, token_batches(), tp=True), ref


def adamw():
    """AdamW without clipping (the opt() above, unclipped): zf.offload then updates each leaf during backward."""
    return zf.optim.adamw(3e-3, eps=1e-6, weight_decay=0.1, mask=zf.optim.decay_mask)


def offload_overlap_law(rank):
    """tp=2 under zf.offload(optimizer="cpu") with its updates during backward (no clip: each leaf's
    squares summed for the norm as it is updated, the sliced ones' over tp) against the plain step."""
    mesh = zf.Mesh(tp=2)
    model, plan = recipe_model("gpt")
    ref = train(copy.deepcopy(model), token_batches(), optimizer=adamw)
    zf.tensor_parallel(model, mesh, plan)
    offloaded = []
    got = train(model, token_batches(), tp=True, optimizer=adamw,
                wrap=lambda s: offloaded.append(zf.offload(s, "cpu")) or offloaded[0])
    return got, ref, offloaded[0].overlap


def untiled(params):
    """A tiled model's params under the untiled model's names: each ``X.tiles.i.P`` joined into ``X.P`` (rows)."""
    out, tiles = {}, {}
    for name, p in params.items():
        owner, sep, rest = name.partition(".tiles.")
        if sep:
            tiles.setdefault(f"{owner}.{rest.partition('.')[2]}", []).append(p)
        else:
            out[name] = p
    return {**out, **{n: torch.cat(ps) for n, ps in tiles.items()}}


def tile_law(rank):
    """tp=2 of GPT with its LM head and the embedding tied to it tiled into 3 vocab tiles (zf.tile, then
    zf.tensor_parallel with plan=None: each tile a vocab-parallel layer, 21/20/20 rows padded to 22/20/20)
    against the plain untiled, unsliced step; with the step's measured bytes and zfunc.tensor.cost's."""
    mesh = zf.Mesh(tp=2)
    model, _ = recipe_model("gpt")
    ref = train(copy.deepcopy(model), token_batches())
    zf.tile(model, tiles=3, modules=["lm_head"])
    whole = {n: tuple(p.shape) for n, p in zf.functionalize(model)[1].items()}
    zf.tensor_parallel(model, mesh)
    losses, norms, params, memory = train(model, token_batches(), tp=True)
    from zfunc.tensor import cost

    layout = zf.tensor_parallel.layout_of(model)
    replicated = sum(p.numel() for n, p in zf.functionalize(model)[1].items() if n not in layout.slicings)
    formula = (4 * cost.params_per_rank(whole, layout),
               cost.comm_bytes_per_step(layout, 32, 32, 22 + 20 + 20, replicated_numel=replicated))
    return (losses, norms, untiled(params)), ref, sorted(params), ((memory["params"], sum(memory["comm"].values())),
                                                                   formula)


class HiddenLM(torch.nn.Module):
    """An embedding and an MLP block whose output, the hidden states, a head's loss takes (``head``, vocab 61)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.up, self.down = torch.nn.Embedding(61, 32), torch.nn.Linear(32, 48), torch.nn.Linear(48, 32)
        self.head = torch.nn.Linear(32, 61, bias=False)

    def forward(self, ids):
        h = self.wte(ids)
        return h + self.down(F.gelu(self.up(h)))


def head_loss_law(rank):
    """zf.tiling.lm_head_loss in 3 token tiles over the vocab-sliced head (tp=2, 61 rows padded to 62: ``mesh=``,
    ``vocab_size=``), an ignored target in every batch, against the plain step's untiled cross-entropy of the
    whole head."""
    mesh = zf.Mesh(tp=2)
    model = HiddenLM()
    batches = [(x, y.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(-100))) for x, y in token_batches()]

    def plain(apply):
        return lambda p, b: F.cross_entropy(F.linear(apply(p, b[0]), p["head.weight"]).flatten(0, 1), b[1].flatten())

    def tiled(apply):
        return lambda p, b: zf.tiling.lm_head_loss(apply(p, b[0]), p["head.weight"], b[1], tiles=3, mesh=mesh,
                                                   vocab_size=61)

    ref = train(copy.deepcopy(model), batches, loss_of=plain)
    zf.tensor_parallel(model, mesh, {"wte": "vocab", "up": "colwise", "down": "rowwise", "head": "vocab"})
    got = train(model, batches, loss_of=tiled, tp=True)
    return got, ref, tuple(zf.functionalize(model)[1]["head.weight"].shape), got[3]["comm"]


@pytest.mark.multiprocess
def test_tiled_lm_head_loss_over_a_vocab_sliced_head_trains_as_the_untiled_whole_one(recipe_results):
    results = [r["head loss"] for r in recipe_results]
    assert_law(results, "zf.tiling.lm_head_loss, 3 tiles, tp=2")
    assert results[0][2] == (31, 32)  # this rank's half of the padded vocabulary
    a = 32 * 32 * 4  # 32 tokens a step, width 32: the loss's tiles all-gather their maxima (n floats from each
    # rank) and all-reduce 2 floats a token, the loss all-reduces the hidden states' grad (A), and the model
    # its embedding's output, its down projection's output and its up projection's input grad (A each);
    # an all-reduce counts twice its tensor, and the grad norm's scalar 8 bytes
    assert results[0][3] == {"all_gather": 2 * 32 * 4, "all_reduce": 2 * (2 * 32 * 4) + 2 * a + 3 * 2 * a + 8}


def recipe_laws(rank):
    """One spawn for the recipes' laws and the vocab-parallel loss (each spawn costs seconds)."""
    return {"gpt": law(rank, "gpt"), "llama": law(rank, "llama"), "llama-kv1": law(rank, "llama-kv1"),
            "loss": vocab_loss(rank), "tile": tile_law(rank), "head loss": head_loss_law(rank),
            "sp gpt": sequence_parallel_law(rank, "gpt"), "sp llama": sequence_parallel_law(rank, "llama"),
            "remat": remat_law(rank), "offload": offload_overlap_law(rank)}


def assert_law(results, what):
    """Each rank's tp training ``(losses, norms, whole params)`` equals the plain one (losses and norms
    rtol 1e-5, params atol 1e-5)."""
    for got, ref, *_ in results:
        assert_same_training(got[:3], ref[:3], what)
        assert got[2].keys() == ref[2].keys()


@pytest.fixture(scope="module")
def recipe_results():
    return zf.dist.spawn(recipe_laws, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["gpt", "llama", "llama-kv1"])
def test_tp2_trains_as_the_whole_model(kind, recipe_results):
    results = [r[kind] for r in recipe_results]
    assert_law(results, kind)
    for _, _, _, (held, held_formula, moved, moved_formula) in results:
        assert (held, moved) == (held_formula, moved_formula)  # zfunc.tensor.cost's formulas
    shapes = results[0][2]
    if kind == "gpt":  # vocab 61 padded to 62, 31 rows a rank; the tied head holds the same slice
        assert shapes["wte.weight"] == (31, 32) and "lm_head.weight" not in shapes
        assert shapes["blocks.0.attn.qkv.weight"] == (48, 32) and shapes["blocks.0.attn.proj.weight"] == (32, 16)
        assert shapes["blocks.0.ln1.weight"] == (32,)
    elif kind == "llama":  # untied head; 4 query and 2 kv heads: 2 and 1 a rank
        assert shapes["embed.weight"] == shapes["lm_head.weight"] == (31, 32)
        assert shapes["layers.0.attn.k.weight"] == (8, 32) and shapes["layers.0.mlp.down.weight"] == (32, 24)
    else:  # 4 query heads, 2 a rank, and 1 kv head tp=2 does not divide: k and v whole on every rank
        assert shapes["layers.0.attn.q.weight"] == (16, 32) and shapes["layers.0.attn.k.weight"] == (8, 32)


@pytest.mark.multiprocess
def test_tp2_with_remat_trains_as_the_whole_model(recipe_results):
    assert_law([r["remat"] for r in recipe_results], "gpt, tp=2, remat")


@pytest.mark.multiprocess
def test_tp2_under_cpu_offload_with_updates_during_backward_trains_as_the_whole_model(recipe_results):
    results = [r["offload"] for r in recipe_results]
    assert_law(results, "gpt, tp=2, zf.offload(optimizer='cpu'), overlapped")
    assert results[0][2]  # the overlapped path: the norm's squares summed leaf by leaf


@pytest.mark.multiprocess
def test_tp2_with_a_tiled_lm_head_trains_as_the_whole_untiled_model(recipe_results):
    results = [r["tile"] for r in recipe_results]
    assert_law(results, "gpt, lm_head (tied) in 3 tiles, tp=2")
    assert [n for n in results[0][2] if ".tiles." in n] == [f"wte.tiles.{i}.weight" for i in range(3)]
    for *_, (measured, formula) in results:
        assert measured == formula  # zfunc.tensor.cost's bytes held and moved, tiles counted as their layer


def vocab_loss(rank):
    """The vocab-parallel cross-entropy against F.cross_entropy of the whole logits: loss and grads."""
    mesh = zf.Mesh(tp=2)
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(3, 5, 61, generator=g)
    targets = torch.randint(0, 61, (3, 5), generator=g)
    targets[0, 0] = -100  # ignored
    padded = torch.cat([whole, torch.full((3, 5, 1), float("-inf"))], -1)  # 62 columns, the last padding
    mine = padded[..., rank * 31:(rank + 1) * 31].clone().requires_grad_()
    loss = zf.tensor_parallel.cross_entropy(mine, targets, mesh)
    loss.backward()
    ref = whole.clone().requires_grad_()
    ref_loss = F.cross_entropy(ref.flatten(0, 1), targets.flatten())
    ref_loss.backward()
    ref_grad = torch.cat([ref.grad, torch.zeros(3, 5, 1)], -1)[..., rank * 31:(rank + 1) * 31]
    return loss.item(), ref_loss.item(), mine.grad, ref_grad, dict(mesh.tp_comm.bytes)


@pytest.mark.multiprocess
def test_vocab_parallel_loss_equals_the_gathered_one(recipe_results):
    for loss, ref_loss, grad, ref_grad, nbytes in [r["loss"] for r in recipe_results]:
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
        n = 15 * 4  # 15 tokens' floats: an all-gather of the maxima, two all-reduces (counted twice)
        assert nbytes == {"all_gather": 2 * n, "all_reduce": 2 * (2 * n)}


def test_slicing_pieces_make_the_whole_and_pad():
    w = torch.arange(61 * 2.0).view(61, 2)
    s = Slicing(0, 2, 61, 62)
    pieces = [s.piece(w, r) for r in range(2)]
    assert pieces[1].shape == (31, 2) and pieces[1][-1].tolist() == [0.0, 0.0]  # the padding row
    assert torch.equal(s.whole(pieces), w)
    fused = Slicing(0, 2, 12, 12, parts=3)  # q, k, v of 4 rows each: 2 of each a rank
    w = torch.arange(12.0)
    assert fused.piece(w, 0).tolist() == [0, 1, 4, 5, 8, 9]
    assert torch.equal(fused.whole([fused.piece(w, r) for r in range(2)]), w)


def test_refusals_name_the_module_and_sizes():
    from models import mesh_shaped

    mesh = mesh_shaped(tp=2)
    model, plan = recipe_model("gpt")
    with pytest.raises(ValueError, match=r"plan: pattern '\*.nothing' match no module of GPT"):
        zf.tensor_parallel(copy.deepcopy(model), mesh, {**plan, "*.nothing": "colwise"})
    with pytest.raises(ValueError, match=r"plan: pattern 'wte': expected one of .* got 'columns'"):
        zf.tensor_parallel(copy.deepcopy(model), mesh, {"wte": "columns"})
    with pytest.raises(ValueError, match=r"module 'blocks.0.ln1': style \"colwise\" takes an nn.Linear .* LayerNorm"):
        zf.tensor_parallel(copy.deepcopy(model), mesh, {"blocks.0.ln1": "colwise"})
    three = mesh_shaped(tp=3)
    with pytest.raises(ValueError, match=r"module 'blocks.0.attn': n_head=4 does not split over tp=3"):
        zf.tensor_parallel(copy.deepcopy(model), three, plan)
    with pytest.raises(ValueError, match=r"module 'blocks.0.mlp.2': its input features \(128\) do not split over tp=3"):
        zf.tensor_parallel(copy.deepcopy(model), three, {"*.mlp.2": "rowwise"})
    apply, _ = zf.functionalize(model)
    with pytest.raises(ValueError, match="model: expected a model made tensor-parallel by zf.tensor_parallel"):
        zf.tensor_parallel.step(zf.train_step(gpt_loss(apply), opt()), model)
    zf.tensor_parallel(model, mesh, plan)
    with pytest.raises(ValueError, match="tensor-parallel already"):
        zf.tensor_parallel(model, mesh, plan)
    step = zf.tensor_parallel.step(zf.train_step(gpt_loss(apply), opt()), model)
    step.spec.layout.sequence_parallel = True  # what the rulebook's verdict reads (tp=1 here: no sp model to build)
    with pytest.raises(ValueError, match="zf.pipeline of a sequence-parallel zf.tensor_parallel.step is refused"):
        zf.pipeline(step, 2, 2, model=model, units=["blocks.0", "blocks.1"])


def test_tiled_layers_that_cannot_be_sliced_are_refused():
    """A tiled head or embedding slices as vocab tiles (tiled along its rows), gathered, not sequence-parallel."""
    from models import mesh_shaped

    mesh = mesh_shaped(tp=2)
    model = zf.tile(recipe_model("gpt")[0], tiles=2, modules=["lm_head"])
    with pytest.raises(ValueError, match=r"gather_logits: the tiled head 'lm_head' concatenates its tiles' logits"):
        zf.tensor_parallel(copy.deepcopy(model), mesh, GPT_PLAN, gather_logits=False)
    with pytest.raises(ValueError, match=r"sequence_parallel: the tiled embedding 'wte' looks each tile's ids up"):
        zf.tensor_parallel(copy.deepcopy(model), mesh, GPT_PLAN, sequence_parallel=True)
    columns = zf.tile(recipe_model("gpt")[0], tiles=2, dim=1, modules=["lm_head"])
    with pytest.raises(ValueError, match=r"module 'wte' is tiled by zf.tile \(dim=1\) and its style is \"vocab\""):
        zf.tensor_parallel(columns, mesh, GPT_PLAN)
    assert zfunc_plan(model) == {**{f"{n}.tiles.{i}": "vocab" for n in ("wte", "lm_head") for i in range(2)}}


def zfunc_plan(model):
    """The vocab styles plan=None gives a tiled model's layers, per tile (on a planned mesh: shapes only)."""
    with torch.device("meta"):
        sliced = zf.tensor_parallel(copy.deepcopy(model).to("meta"), zf.Mesh.planned(tp=2))
    return {n: s for n, s in zf.tensor_parallel.layout_of(sliced).styles.items() if s == "vocab"}


HF_BASE = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
               max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
# Small configs of transformers model types; dropout is zeroed (masks depend on the slicing). Mistral trains
# equal too (its modules are Llama's; left out to keep the suite short).
HF_CONFIGS = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, vocab_size=61, n_positions=32, bos_token_id=0, eos_token_id=0),
    "llama": dict(HF_BASE, num_key_value_heads=2),  # grouped-query: 4 query heads, 2 kv heads
    "llama-kv1": dict(HF_BASE, num_key_value_heads=1),  # 1 kv head that tp=2 does not divide: replicated
    "qwen2": dict(HF_BASE, num_key_value_heads=2),
    "gpt_neox": dict(HF_BASE),  # fused head-major query_key_value
    "phi": dict(HF_BASE),
    "bert": dict(HF_BASE),  # masked LM: its decoder is tied to the word embeddings
}


def hf_model(kind):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    cfg = AutoConfig.for_model(kind.split("-")[0], **HF_CONFIGS[kind])
    for key, value in cfg.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    torch.manual_seed(0)
    return (AutoModelForMaskedLM if kind == "bert" else AutoModelForCausalLM).from_config(cfg)


def hf_loss(apply):
    return lambda p, b: F.cross_entropy(apply(p, b[0]).logits.flatten(0, 1), b[1].flatten())


def hf_law(rank, kinds):
    """Per transformers model type: plan=None's tp=2 training against the plain one, or the refusal."""
    mesh = zf.Mesh(tp=2)
    out = {}
    for kind in kinds:
        model = hf_model(kind)
        ref = train(copy.deepcopy(model), token_batches(), hf_loss)
        try:
            zf.tensor_parallel(model, mesh)
        except ValueError as e:
            out[kind] = str(e)
            continue
        out[kind] = (train(model, token_batches(), hf_loss, tp=True), ref, zf.tensor_parallel.layout_of(model).styles)
    return out


@pytest.mark.multiprocess
def test_plan_none_on_transformers_model_types():
    pytest.importorskip("transformers")
    for out in zf.dist.spawn(hf_law, 2, list(HF_CONFIGS), timeout_s=300):
        assert set(out) == set(HF_CONFIGS)
        for kind, result in out.items():
            assert not isinstance(result, str), f"{kind}: refused: {result}"
            assert_law([result], kind)
        styles = out["gpt2"][2]
        assert styles["transformer.h.0.attn.c_attn"] == "colwise:3" and styles["lm_head"] == "vocab"
        assert out["gpt_neox"][2]["gpt_neox.layers.0.attention.query_key_value"] == "colwise"  # head-major
        assert out["bert"][2]["cls.predictions.decoder"] == "vocab"
        kv1 = out["llama-kv1"][2]
        assert kv1["model.layers.0.self_attn.k_proj"] == kv1["model.layers.0.self_attn.v_proj"] == "replicated-kv"


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_plan_none_on_the_recipes_finds_their_plan(kind):
    from models import mesh_shaped

    model, plan = recipe_model(kind)
    zf.tensor_parallel(model, mesh_shaped(tp=2))
    expected = {name: style for name, _ in model.named_modules() for pattern, style in plan.items()
                if name and __import__("fnmatch").fnmatchcase(name, pattern)}
    assert zf.tensor_parallel.layout_of(model).styles == expected


def dp_tp_law(rank, stage, root, key=None, **plan_kw):
    """dp2 x tp2 on 4 ranks through the front door (``zf.config.Plan(dp=2, tp=2, zero_stage=stage)``,
    ``prepare``: plan=None, ``parallelize``: tp step under ZeRO over each tp slice's dp group), against
    the plain step on the global batch (trained on every rank); its checkpoint loaded into one process."""
    model, _ = recipe_model("gpt")
    ref = train(copy.deepcopy(model), token_batches())
    whole_apply, whole_params = zf.functionalize(copy.deepcopy(model))
    plan = zf.config.Plan(dp=2, tp=2, zero_stage=stage, units="class:Block", **plan_kw)
    mesh = zf.Mesh(dp=2, tp=2)
    zf.config.prepare(model, plan, mesh)
    apply, params = zf.functionalize(model)
    step = zf.parallelize(zf.train_step(gpt_loss(apply), opt()), model, plan, mesh)
    state, losses, norms = step.init(params), [], []
    for x, y in token_batches():
        state, m = step(state, (x.chunk(2)[mesh.rank], y.chunk(2)[mesh.rank]))
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    whole = zf.checkpoint.full_params(state, mesh)  # gathered over dp, then over tp
    saved = zf.checkpoint.save(state, Path(root) / (key or f"zero{stage}"))
    one = zf.checkpoint.load(saved, zf.train_step(gpt_loss(whole_apply), opt()), params=whole_params)
    exact = one.params.keys() == whole.keys() and all(torch.equal(one.params[n], whole[n]) for n in whole)
    return (losses, norms, whole), ref, step.layers, exact


def dp_tp_laws(rank, root):
    laws = {stage: dp_tp_law(rank, stage, root) for stage in (0, 1, 2, 3)}  # one spawn: each costs seconds
    laws["offload"] = dp_tp_law(rank, 2, root, "offload", offload_optimizer="cpu")
    return laws


@pytest.mark.multiprocess
def test_dp2_x_tp2_with_zero_0_to_3_and_cpu_offload_trains_as_the_whole_model_and_loads_into_one_process(tmp_path):
    everyone = zf.dist.spawn(dp_tp_laws, 4, str(tmp_path), timeout_s=600)
    for key in (0, 1, 2, 3, "offload"):
        results = [r[key] for r in everyone]
        what = f"dp2 x tp2, ZeRO-{key}" if key != "offload" else "dp2 x tp2, ZeRO-2, optimizer offloaded to CPU"
        assert_law(results, what)
        layers = ("train_step", "tensor_parallel", "shard") + (("offload",) if key == "offload" else ())
        assert results[0][2] == layers
        assert all(r[3] for r in results), f"{what}: the checkpoint's params differ from full_params'"
        assert zf.checkpoint.read_manifest(tmp_path / (key if key == "offload" else f"zero{key}"))["world"] == 4


def sequence_parallel_law(rank, kind):
    """tp=2 with sequence_parallel against the plain step; and the activation between the regions."""
    mesh = zf.Mesh(tp=2)
    model, plan = recipe_model(kind)
    whole = {n: tuple(p.shape) for n, p in zf.functionalize(model)[1].items()}
    ref = train(copy.deepcopy(model), token_batches())
    zf.tensor_parallel(model, mesh, plan, sequence_parallel=True)
    seen = []
    norm = model.blocks[0].ln2 if kind == "gpt" else model.layers[0].mlp_norm
    norm.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    got = train(model, token_batches(), tp=True)
    return got, ref, seen[0], accounting(model, whole, got[3])


@pytest.mark.multiprocess
def test_sequence_parallel_trains_as_the_whole_model(recipe_results):
    for kind in ("gpt", "llama"):
        result = [r[f"sp {kind}"] for r in recipe_results]
        assert_law(result, f"{kind}, sequence parallel")
        assert result[0][2] == (4, 4, 32)  # between the regions: 8 tokens over 2 ranks, 4 each
        held, held_formula, moved, moved_formula = result[0][3]
        assert (held, moved) == (held_formula, moved_formula)


def test_meta_built_model_materializes_this_ranks_pieces():
    """A tp model built on the meta device: the step's init makes each rank's pieces of the whole
    model's init (values by name and row: zf.materialize), as slicing the materialized model does."""
    from models import mesh_shaped
    from recipes.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32)
    with torch.device("meta"):
        whole_model = GPT(cfg)
    whole = zf.train_step(gpt_loss(zf.functionalize(whole_model)[0]), opt()).init(
        zf.functionalize(whole_model)[1], materialize=whole_model.materializer(0))
    with torch.device("meta"):
        model = GPT(cfg)
    materialize = model.materializer(0)
    zf.tensor_parallel(model, mesh_shaped(tp=2, tp_rank=1), GPT_PLAN)
    apply, params = zf.functionalize(model)
    state = zf.tensor_parallel.step(zf.train_step(gpt_loss(apply), opt()), model).init(params, materialize=materialize)
    layout = zf.tensor_parallel.layout_of(model)
    for name, p in state.params.items():
        assert torch.equal(p, layout.piece(name, zf.checkpoint.full_params(whole)[name])), name


def dp_pp_tp_law(rank, root):
    """dp2 x pp2 x tp2 on 8 ranks: the tp step under ZeRO-1 over each slice's dp group, pipelined (1F1B, 2
    microbatches) over the GPT's 2 blocks, against the plain step on the global batch; its checkpoint
    loaded into one process."""
    from recipes.gpt import Block

    model, plan = recipe_model("gpt")
    ref = train(copy.deepcopy(model), token_batches())
    whole_apply, whole_params = zf.functionalize(copy.deepcopy(model))
    mesh = zf.Mesh(dp=2, pp=2, tp=2)
    zf.tensor_parallel(model, mesh, plan)
    apply, params = zf.functionalize(model)
    step = zf.shard(zf.tensor_parallel.step(zf.train_step(gpt_loss(apply), opt()), model), mesh, stage=1)
    step = zf.pipeline(step, 2, 2, "1f1b", model=model, units=zf.units.by_class(Block))
    state, losses, norms = step.init(params), [], []
    for x, y in token_batches():
        state, m = step(state, (x.chunk(2)[mesh.rank], y.chunk(2)[mesh.rank]))
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    whole = zf.checkpoint.full_params(state, mesh)  # gathered over dp x pp, the slices put together
    saved = zf.checkpoint.save(state, Path(root) / "3d")
    one = zf.checkpoint.load(saved, zf.train_step(gpt_loss(whole_apply), opt()), params=whole_params)
    exact = one.params.keys() == whole.keys() and all(torch.equal(one.params[n], whole[n]) for n in whole)
    return (losses, norms, whole), ref, step.layers, exact, (mesh.pp_rank, mesh.rank, mesh.tp_rank)


@pytest.mark.multiprocess
def test_dp2_x_pp2_x_tp2_trains_as_the_whole_model_and_loads_into_one_process(tmp_path):
    everyone = zf.dist.spawn(dp_pp_tp_law, 8, str(tmp_path), timeout_s=300)
    # global rank = (pp_rank * dp + dp_rank) * tp + tp_rank (zf.Mesh)
    assert [r[4] for r in everyone] == [(p, d, t) for p in (0, 1) for d in (0, 1) for t in (0, 1)]
    assert_law(everyone, "dp2 x pp2 x tp2, ZeRO-1, 1F1B")
    assert everyone[0][2] == ("train_step", "tensor_parallel", "shard", "pipeline")
    assert all(r[3] for r in everyone), "dp2 x pp2 x tp2: the checkpoint's params differ from full_params'"
    assert zf.checkpoint.read_manifest(tmp_path / "3d")["world"] == 8


def llama4():
    """The tiny Llama with 4 blocks (interleaved 1F1B: 2 virtual stages on each of 2 ranks) and its plan."""
    from recipes.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
    return Llama(cfg), LLAMA_PLAN


PP_TP_CASES = {  # name: (model, zf.config.Plan fields beside pp=2, tp=2, microbatches=2)
    "1F1B": (recipe_model, {}),
    "ZeRO-2": (recipe_model, {"zero_stage": 2}),
    "ZeRO-3": (recipe_model, {"zero_stage": 3}),
    "interleaved 1F1B": (llama4, {"pipeline_schedule": "interleaved-1f1b", "virtual_stages": 2}),
    "zero bubble": (recipe_model, {"pipeline_schedule": "zero-bubble"}),
}


def pp_tp_law(rank, make, fields, refs):
    """pp2 x tp2 on 4 ranks through the front door (``zf.config.Plan(pp=2, tp=2, **fields)``: the tp step
    pipelined, 2 microbatches), a Llama with its explicit plan, against the plain step (``refs``: by model)."""
    model, plan = make("llama") if make is recipe_model else make()
    if make not in refs:
        refs[make] = train(copy.deepcopy(model), token_batches())
    config = zf.config.Plan(pp=2, tp=2, microbatches=2, units="class:Block", **fields)
    mesh = zf.Mesh(pp=2, tp=2)
    zf.tensor_parallel(model, mesh, plan)
    apply, params = zf.functionalize(model)
    step = zf.parallelize(zf.train_step(gpt_loss(apply), opt()), model, config, mesh)
    state, losses, norms = step.init(params), [], []
    for batch in token_batches():
        state, m = step(state, batch)
        losses.append(m["loss"].item())
        norms.append(m["grad_norm"].item())
    return (losses, norms, zf.checkpoint.full_params(state, mesh)), refs[make], step.layers


def pp_tp_laws(rank):
    refs = {}  # one spawn for every case: each costs seconds
    return {name: pp_tp_law(rank, make, fields, refs) for name, (make, fields) in PP_TP_CASES.items()}


@pytest.mark.multiprocess
def test_pp2_x_tp2_trains_as_the_whole_model_at_zero_0_2_3_and_with_every_schedule():
    everyone = zf.dist.spawn(pp_tp_laws, 4, timeout_s=300)
    for name, (_, fields) in PP_TP_CASES.items():
        results = [r[name] for r in everyone]
        assert_law(results, f"pp2 x tp2, {name}")
        sharded = ("shard",) if fields.get("zero_stage") else ()
        assert results[0][2] == ("train_step", "tensor_parallel", *sharded, "pipeline"), (name, results[0][2])
