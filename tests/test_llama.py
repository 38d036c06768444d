"""recipes/llama.py: the model is Llama (equal to transformers' on the same weights), and it trains
through zfunc unchanged: as torch's AdamW in one process, and over 2 ranks under ZeRO-3 + CPU offload."""
import copy

import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from recipes import llama
from tests.models import assert_same_training, recipe_step, train_on
from zfunc.offloading.placement import in_ram
from zfunc.checkpoint import full_params

STEPS = 4


def batches(world, n=STEPS, b=2, T=16, vocab=256):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        chunk = torch.randint(0, vocab, (world * b, T + 1), generator=g)
        out.append((chunk[:, :-1], chunk[:, 1:]))
    return out


def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def test_forward_is_causal_and_shaped():
    torch.manual_seed(0)
    model = llama.Llama(llama.flavor("debug"))
    x = torch.randint(0, 256, (2, 12))
    logits = model(x)
    assert logits.shape == (2, 12, 256)
    x2 = x.clone()
    x2[:, 8:] = (x2[:, 8:] + 1) % 256  # the future changes; the past's logits must not
    torch.testing.assert_close(model(x2)[:, :8], logits[:, :8])
    with pytest.raises(ValueError, match="sequence length 129 exceeds max_seq_len=128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_tied_flavors_share_the_head_with_the_embedding():
    tied = llama.Llama(llama.flavor("debug", tie_embeddings=True))
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.num_params(non_embedding=True) == tied.num_params(non_embedding=False)
    untied = llama.Llama(llama.flavor("debug"))
    assert untied.num_params(False) - untied.num_params(True) == 256 * 64


HF_NAMES = [("embed.", "model.embed_tokens."), ("layers.", "model.layers."), ("attn_norm", "input_layernorm"),
            ("mlp_norm", "post_attention_layernorm"), ("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"),
            ("attn.v", "self_attn.v_proj"), ("attn.o", "self_attn.o_proj"), ("mlp.gate", "mlp.gate_proj"),
            ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj")]


def to_hf(state_dict):
    out = {}
    for name, value in state_dict.items():
        for ours, theirs in HF_NAMES:
            name = name.replace(ours, theirs)
        out["model.norm.weight" if name == "norm.weight" else name] = value
    return out


# Llama 3.2's rope scaling, with its original context shrunk to 16 so that a 40-token input spans all
# three frequency bands (kept, smoothed, slowed).
SCALED = dict(llama._LLAMA3_ROPE_SCALING, original_max_position_embeddings=16)


@pytest.mark.parametrize("overrides", [dict(), dict(rope_scaling=SCALED, tie_embeddings=True), dict(n_kv_heads=None)],
                         ids=["gqa", "llama3-rope-tied", "mha"])
def test_logits_equal_transformers_llama_on_the_same_weights(overrides):
    transformers = pytest.importorskip("transformers")
    cfg = llama.flavor("debug", rope_theta=10000.0, **overrides)
    torch.manual_seed(0)
    ours = llama.Llama(cfg).eval()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_scaling=None if cfg.rope_scaling is None else dict(cfg.rope_scaling, rope_type="llama3"))
    theirs = transformers.LlamaForCausalLM(hf_cfg).eval()
    theirs.load_state_dict(to_hf(ours.state_dict()), strict=True)
    x = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits, rtol=1e-5, atol=1e-5)
    if cfg.rope_scaling:  # the scaling is in force: without it the logits differ
        plain = llama.Llama(llama.flavor("debug", rope_theta=10000.0, tie_embeddings=True)).eval()
        plain.load_state_dict(ours.state_dict())
        assert not torch.allclose(plain(x), ours(x), atol=1e-4)


def test_zfunc_train_step_equals_torch_adamw():
    torch.manual_seed(0)
    model = llama.Llama(llama.flavor("debug"))
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    apply, params = zf.functionalize(model)
    step = zf.train_step(lambda p, b: lm_loss(apply(p, b[0]), b[1]), zf.optim.adamw(3e-3, weight_decay=0.1))
    state = step.init(params)
    for x, y in batches(1):
        opt.zero_grad(set_to_none=True)
        want = lm_loss(ref(x), y)
        want.backward()
        opt.step()
        state, metrics = step(state, (x, y))
        torch.testing.assert_close(metrics["loss"], want.detach(), rtol=1e-5, atol=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)


def make(mesh=None):
    """The debug Llama's step: plain, or ZeRO-3 (a unit per Block) with the optimizer state in CPU RAM."""
    def loss_of(apply):
        return lambda p, b: lm_loss(apply(p, b[0]), b[1])

    return recipe_step(lambda: llama.Llama(llama.flavor("debug")), loss_of, llama.Block, mesh)


def run(step, state, world, rank=0, shards=1):
    return train_on(step, state, batches(world), rank, shards)


def zero3_offload_worker(rank, world):
    mesh = zf.Mesh(dp=world)
    state, losses, norms = run(*make(mesh), world, rank, shards=world)
    return losses, norms, full_params(in_ram(state), mesh)


@pytest.mark.multiprocess
def test_zero3_with_cpu_offload_on_2_ranks_equals_one_process():
    ref_state, ref_losses, ref_norms = run(*make(), world=2)
    for rank, got in enumerate(zf.dist.spawn(zero3_offload_worker, 2, 2)):
        assert_same_training(got, (ref_losses, ref_norms, ref_state.params), f"llama debug, rank {rank}")


@pytest.mark.parametrize("tied", [False, True])
def test_a_tiles_rows_are_the_rows_of_the_untiled_head(tied):
    """--tile-lm-head starts from the untiled model's weights: each tile's init is its rows of lm_head's."""
    cfg = llama.flavor("debug", tie_embeddings=tied)
    with torch.device("meta"):
        model = llama.Llama(cfg)
    head = "embed.weight" if tied else "lm_head.weight"
    whole = llama.materializer(cfg, 5)(head, model.lm_head.weight)
    zf.tile(model, tiles=3, modules=["lm_head"])
    materialize = zf.tiling.materializer(llama.materializer(cfg, 5), model)  # what the recipe's loop asks
    tiles = [(name, p) for name, p in model.named_parameters() if ".tiles." in name]
    assert [name for name, _ in tiles] == [f"{head.split('.')[0]}.tiles.{i}.weight" for i in range(3)]
    assert torch.equal(torch.cat([materialize(name, p) for name, p in tiles]), whole)
    name, p = tiles[1]
    assert torch.equal(materialize(name, p, slice(1, 3)), materialize(name, p)[1:3])
    assert torch.equal(materialize("layers.0.attn.o.weight", model.layers[0].attn.o.weight),
                       llama.materializer(cfg, 5)("layers.0.attn.o.weight", model.layers[0].attn.o.weight))
