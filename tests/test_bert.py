"""recipes/bert.py: BERT's masking (15%, 80/10/10, specials untouched), the model (equal to transformers'
BERT on the same weights), and training through zfunc unchanged, in one process and over 2 ranks."""
import copy
import json

import pytest
import torch

import zfunc as zf
from recipes import bert, loop
from recipes.bert import CLS, IGNORE, MASK, PAD, SEP
from tests.models import assert_same_training, recipe_step, train_on
from zfunc.offloading.placement import in_ram
from zfunc.checkpoint import full_params

STEPS = 4


def sequences(n, T, vocab=256, seed=0):
    """Byte sequences framed as BERT's: [CLS] ... [SEP], a few trailing [PAD]s on odd rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, T), generator=g)
    x[:, 0], x[:, -1] = CLS, SEP
    x[1::2, -4:-1] = PAD
    return x


# ----------------------------------------------------------------------------- masking
def test_masking_follows_bert_statistics():
    tokens = sequences(64, 512)
    inputs, labels = bert.mask_tokens(tokens, torch.Generator().manual_seed(0))
    special = (tokens == CLS) | (tokens == SEP) | (tokens == PAD)
    selected = labels != IGNORE
    assert not (selected & special).any() and torch.equal(inputs[special], tokens[special])
    assert torch.equal(labels[selected], tokens[selected])  # labels: the original token, where selected
    assert torch.equal(inputs[~selected], tokens[~selected])  # nothing else changes
    # ~29,000 candidates: 4 standard deviations of the selection rate are 0.008, of the 80/10/10 split
    # over ~4,300 selected 0.024 and 0.018. Fixed seed: these hold, and a wrong rule misses by far more.
    rate = selected.sum() / (~special).sum()
    assert abs(rate - 0.15) < 0.008
    masked = selected & (inputs == MASK)
    kept = selected & (inputs == tokens)
    replaced = selected & ~masked & ~kept  # a random draw equal to the token itself counts as kept (1/256)
    n = selected.sum()
    assert abs(masked.sum() / n - 0.8) < 0.024
    assert abs(replaced.sum() / n - 0.1) < 0.018 and abs(kept.sum() / n - 0.1) < 0.018
    assert inputs[replaced].max() < 256  # random replacements are never special tokens
    assert len(inputs[replaced].unique()) > 200  # and drawn over the whole (byte) vocabulary


def test_masking_is_a_pure_function_of_tokens_and_generator():
    tokens = sequences(4, 64)
    before = tokens.clone()
    a = bert.mask_tokens(tokens, torch.Generator().manual_seed(7))
    b = bert.mask_tokens(tokens, torch.Generator().manual_seed(7))
    c = bert.mask_tokens(tokens, torch.Generator().manual_seed(8))
    assert torch.equal(tokens, before)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])
    with pytest.raises(ValueError, match=r"tokens: expected ids in \[0, 260\), got \[0, 300\]"):
        bert.mask_tokens(torch.tensor([0, 300]))
    with pytest.raises(ValueError, match=r"special_ids \[5\] and mask_id 3: expected ids in \[0, 4\)"):
        bert.mask_tokens(torch.tensor([0, 1]), vocab_size=4, mask_id=3, special_ids=[5])


def test_mlm_loss_and_accuracy_count_only_selected_tokens():
    logits = torch.zeros(1, 3, 5)
    logits[0, :, 2] = 10.0
    labels = torch.tensor([[2, IGNORE, 4]])
    assert bert.masked_accuracy(logits, labels) == (1, 2)
    loss = bert.mlm_loss(logits, labels)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits[0, [0, 2]], torch.tensor([2, 4])))
    assert bert.mlm_loss(logits, torch.full((1, 3), IGNORE)) == 0  # nothing selected: 0, not nan


# ----------------------------------------------------------------------------- model
def test_attention_is_bidirectional_and_padding_is_invisible():
    torch.manual_seed(0)
    model = bert.Bert(bert.flavor("debug")).eval()
    x = sequences(2, 16)
    pad = x != PAD
    mlm, nsp = model(x, pad_mask=pad)
    assert mlm.shape == (2, 16, bert.BYTE_VOCAB) and nsp is None
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256
    assert not torch.allclose(model(x2, pad_mask=pad)[0][:, :5], mlm[:, :5])  # the future is seen
    x3 = x.clone()
    x3[1, -4:-1] = 65  # other content under the padding: no real position changes
    torch.testing.assert_close(model(x3, pad_mask=pad)[0][pad], mlm[pad])
    with pytest.raises(ValueError, match="no token type embeddings"):
        model(x, token_types=torch.zeros_like(x))


LAYER_NAMES = {"attn.q": "attention.self.query", "attn.k": "attention.self.key", "attn.v": "attention.self.value",
               "attn.o": "attention.output.dense", "attn_norm": "attention.output.LayerNorm",
               "mlp.0": "intermediate.dense", "mlp.2": "output.dense", "mlp_norm": "output.LayerNorm"}
TOP_NAMES = {"word": "bert.embeddings.word_embeddings", "pos": "bert.embeddings.position_embeddings",
             "types": "bert.embeddings.token_type_embeddings", "embed_norm": "bert.embeddings.LayerNorm",
             "mlm_dense": "cls.predictions.transform.dense", "mlm_norm": "cls.predictions.transform.LayerNorm",
             "pooler": "bert.pooler.dense", "nsp_head": "cls.seq_relationship"}


def to_hf(state_dict):
    out = {"cls.predictions.bias": state_dict["mlm_bias"]}
    for name, value in state_dict.items():
        top, *rest = name.split(".")
        if top == "layers":
            out[f"bert.encoder.layer.{rest[0]}.{LAYER_NAMES['.'.join(rest[1:-1])]}.{rest[-1]}"] = value
        elif top != "mlm_bias":
            out[f"{TOP_NAMES[top]}.{rest[-1]}"] = value
    out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]  # tied, as ours
    return out


def test_logits_equal_transformers_bert_on_the_same_weights():
    transformers = pytest.importorskip("transformers")
    cfg = bert.flavor("debug", type_vocab_size=2, nsp=True)
    torch.manual_seed(0)
    ours = bert.Bert(cfg).eval()
    with torch.no_grad():  # away from init's zero biases and unit norms, so every parameter matters
        for p in ours.parameters():
            p.normal_(0.0, 0.1)
    theirs = transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=cfg.ffn_dim, max_position_embeddings=cfg.max_seq_len,
        type_vocab_size=cfg.type_vocab_size, layer_norm_eps=cfg.norm_eps, hidden_act="gelu")).eval()
    missing, unexpected = theirs.load_state_dict(to_hf(ours.state_dict()), strict=False)
    assert not unexpected and set(missing) <= {"cls.predictions.decoder.bias"}  # tied to cls.predictions.bias
    x = sequences(2, 40)
    types = (torch.arange(40) >= 20).long().expand(2, 40)
    pad = x != PAD
    with torch.no_grad():
        want = theirs(x, token_type_ids=types, attention_mask=pad.long())
        mlm, nsp = ours(x, types, pad)
    torch.testing.assert_close(mlm[pad], want.prediction_logits[pad], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nsp, want.seq_relationship_logits, rtol=1e-5, atol=1e-5)


def test_pre_ln_rewires_the_same_parameters():
    post, pre = bert.Bert(bert.flavor("debug")), bert.Bert(bert.flavor("debug", pre_ln=True))
    pre.load_state_dict(post.state_dict())  # the same names and shapes
    x = sequences(2, 16)
    assert not torch.allclose(pre(x)[0], post(x)[0])


# ----------------------------------------------------------------------------- through zfunc
def mlm_batches(world, n=STEPS, b=2, T=24):
    g = torch.Generator().manual_seed(3)
    return [bert.mask_tokens(sequences(world * b, T, seed=i), g) for i in range(n)]


def mlm_loss_fn(apply):
    return lambda p, batch: bert.mlm_loss(apply(p, batch[0])[0], batch[1])


def test_zfunc_train_step_equals_torch_adamw():
    torch.manual_seed(0)
    model = bert.Bert(bert.flavor("debug"))
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    apply, params = zf.functionalize(model)
    step = zf.train_step(mlm_loss_fn(apply), zf.optim.adamw(3e-3, weight_decay=0.1))
    state = step.init(params)
    for x, labels in mlm_batches(1):
        opt.zero_grad(set_to_none=True)
        want = bert.mlm_loss(ref(x)[0], labels)
        want.backward()
        opt.step()
        state, metrics = step(state, (x, labels))
        torch.testing.assert_close(metrics["loss"], want.detach(), rtol=1e-5, atol=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state.params[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)


def make(mesh=None, accum=1):
    """The debug BERT's step: plain, or ZeRO-3 (a unit per Layer) with the optimizer state in CPU RAM."""
    return recipe_step(lambda: bert.Bert(bert.flavor("debug")), mlm_loss_fn, bert.Layer, mesh, accum, weight_decay=0.01)


def run(step, state, world, rank=0, shards=1):
    return train_on(step, state, mlm_batches(world), rank, shards)


def zero3_offload_worker(rank, world):
    mesh = zf.Mesh(dp=world)
    state, losses, norms = run(*make(mesh), world, rank, shards=world)
    return losses, norms, full_params(in_ram(state), mesh)


@pytest.mark.multiprocess
def test_zero3_with_cpu_offload_on_2_ranks_equals_one_process():
    # The MLM loss averages over each rank's selected tokens, and ranks select different numbers of them:
    # the 2-rank step averages 2 such means. One process computes the same with accum=2 (a microbatch
    # per rank's half of the batch, their losses and grads averaged).
    ref_state, ref_losses, ref_norms = run(*make(accum=2), world=2)
    for rank, got in enumerate(zf.dist.spawn(zero3_offload_worker, 2, 2)):
        assert_same_training(got, (ref_losses, ref_norms, ref_state.params), f"bert debug, rank {rank}")


# ----------------------------------------------------------------------------- next-sentence prediction
def test_sentence_pairs_are_cls_a_sep_b_sep_with_half_of_b_random():
    data = torch.arange(10_000) % 256  # B follows A exactly when its first byte is A's last + 1 (mod 256)
    tokens, types, is_random = bert.sentence_pairs(data, 400, 21, torch.Generator().manual_seed(0), 256)
    n_a = (21 - 3) // 2
    assert tokens.shape == types.shape == (400, 21) and is_random.shape == (400,)
    assert (tokens[:, 0] == CLS).all() and (tokens[:, n_a + 1] == SEP).all() and (tokens[:, -1] == SEP).all()
    assert (types[:, :n_a + 2] == 0).all() and (types[:, n_a + 2:] == 1).all()
    a, b = tokens[:, 1:n_a + 1], tokens[:, n_a + 2:-1]
    assert torch.equal((a[:, 1:] - a[:, :-1]) % 256, torch.ones(400, n_a - 1, dtype=torch.long))  # windows
    follows = (b[:, 0] - a[:, -1]) % 256 == 1
    assert torch.equal(follows[is_random == 0], torch.ones(int((is_random == 0).sum()), dtype=torch.bool))
    assert follows[is_random == 1].float().mean() < 0.05  # a random window follows A by chance: 1/256
    assert abs(is_random.float().mean() - 0.5) < 0.1  # 4 standard deviations over 400 rows
    again = bert.sentence_pairs(data, 400, 21, torch.Generator().manual_seed(0), 256)
    assert all(torch.equal(x, y) for x, y in zip((tokens, types, is_random), again))
    inputs, types2, labels, scale, is_random2 = bert.nsp_batch(data, 400, 21, torch.Generator().manual_seed(0), 256)
    assert torch.equal(types2, types) and torch.equal(is_random2, is_random)
    assert not (labels[:, [0, n_a + 1, -1]] != IGNORE).any()  # [CLS] and [SEP] are never masked
    with pytest.raises(ValueError, match="--block-size: NSP pairs need at least 5 tokens"):
        bert.sentence_pairs(data, 2, 4, torch.Generator(), 256)


def test_nsp_trains_and_evaluates_through_the_recipe(tmp_path, capsys):
    """--nsp: the model gets the NSP head and segment embeddings, the loss (MLM + NSP) falls, and eval
    logs the NSP accuracy; --nsp on the MLM-only Recipe, or with --hf-config or --sp, exits 2 naming it."""
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog.\n" * 400)
    argv = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--ffn-dim", "64", "--block-size", "32",
            "--batch-size", "8", "--lr", "1e-2", "--warmup", "2", "--eval-batches", "2", "--seed", "0",
            "--precision", "fp32", "--data", str(text), "--steps", "12", "--eval-every", "4", "--log-every", "1",
            "--out", str(tmp_path / "out"), "--nsp"]
    result = bert.main(argv)
    assert result["history"][-1][1] < result["history"][0][1]  # val MLM loss
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3])  # MLM + NSP
    assert 0 <= result["val_nsp_accuracy"] <= 1 and rows[-1]["val_nsp_accuracy"] == result["val_nsp_accuracy"]
    assert result["val_nsp_loss"] > 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        loop.main(bert.RECIPE, argv)
    assert "--nsp: True, but this Recipe trains MLM alone" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bert.main(argv + ["--hf-config", '{"model_type": "bert"}'])
    assert "--nsp: trains the recipe's own BERT; --hf-config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bert.main(argv + ["--sp", "2"])
    assert "--sp 2: BERT splits its tokens over the ranks for the masked loss alone" in capsys.readouterr().err


def test_init_std_sets_every_matrix_in_the_model_and_the_materializer():
    cfg = bert.flavor("debug", init_std=0.05)
    model = bert.Bert(cfg)
    assert abs(float(model.layers[0].mlp[0].weight.detach().std()) - 0.05) < 0.005
    like = torch.empty(256, 64, device="meta")
    drawn = bert.materializer(0, cfg.init_std)("layers.0.mlp.0.weight", like)
    assert abs(float(drawn.std()) - 0.05) < 0.005 and bert.flavor("base").init_std == 0.02
    with pytest.raises(ValueError, match="BertConfig.init_std: expected a number > 0, got 0"):
        bert.flavor("debug", init_std=0)
