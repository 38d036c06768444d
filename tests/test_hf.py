"""recipes/hf.py: a transformers causal or masked LM from a config alone trains (plain torch for now)."""
import json

import pytest
import torch
import torch.nn.functional as F

from recipes import bert, hf

transformers = pytest.importorskip("transformers")

VOCAB = 64
TINY = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=VOCAB,
                 bos_token_id=0, eos_token_id=0),
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, vocab_size=VOCAB,
                  bos_token_id=0, eos_token_id=0),
    "bert": dict(model_type="bert", num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=0),
}


def lm_batch(T=16, B=4):
    """A learnable pattern: every sequence counts up by one, mod VOCAB."""
    start = torch.arange(B)[:, None] * 7
    seq = (start + torch.arange(T + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def train(model, loss_fn, steps=8):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_causal_lm_from_a_config_trains(kind, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY[kind]))
    for spec in (path, tmp_path, json.dumps(TINY[kind]), TINY[kind]):  # file, folder, JSON string, dict
        model = hf.build(spec, "causal-lm")
        assert type(model.model).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[kind]
    torch.manual_seed(0)
    model = hf.build(TINY[kind], "causal-lm")
    x, y = lm_batch()
    assert model(x).shape == (4, 16, VOCAB)
    losses = train(model, lambda: F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    assert losses[-1] < 0.7 * losses[0]
    assert [c.__name__ for c in model.layer_classes()] == [{"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}[kind]]


def test_a_masked_lm_from_a_config_trains():
    torch.manual_seed(0)
    model = hf.build(TINY["bert"], "masked-lm")
    assert type(model.model).__name__ == "BertForMaskedLM"
    x = lm_batch(T=16, B=8)[0]
    x[:, 0] = 1  # a [CLS]-like token, never masked
    inputs, labels = bert.mask_tokens(x, torch.Generator().manual_seed(0), mask_id=2, vocab_size=VOCAB,
                                      special_ids=(0, 1, 2), prob=0.3)
    pad = torch.ones_like(x)
    losses = train(model, lambda: bert.mlm_loss(model(inputs, pad_mask=pad), labels))
    assert losses[-1] < 0.7 * losses[0]
    assert model.config.vocab_size == VOCAB


def test_overrides_are_set_on_the_config():
    model = hf.build(TINY["gpt2"], vocab_size=256)
    assert model.config.vocab_size == 256 and model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 256)


def test_bad_configs_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="--hf-config: expected a config.json path, a folder holding one"):
        hf.build(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="--hf-config: the JSON string does not parse"):
        hf.build('{"model_type": "gpt2",')
    with pytest.raises(ValueError, match='the config has no "model_type"'):
        hf.build({"n_layer": 2})
    with pytest.raises(ValueError, match="knows no model_type 'no-such-model'"):
        hf.build({"model_type": "no-such-model"})
    with pytest.raises(ValueError, match="has no masked-lm model for model_type 'gpt2'"):
        hf.build(TINY["gpt2"], "masked-lm")
    with pytest.raises(ValueError, match="task: expected one of"):
        hf.build(TINY["gpt2"], "seq2seq")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object, got a list"):
        hf.build(tmp_path)
