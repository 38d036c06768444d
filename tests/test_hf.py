"""recipes/hf.py: a transformers causal or masked LM from a config alone trains (plain torch for now)."""
import json
import re

import pytest
import torch
import torch.nn.functional as F

from recipes import bert, hf
from zfunc.config import json_file

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
    with pytest.raises(ValueError, match=re.escape("--hf-config: not valid JSON: Expecting property name enclosed in "
                                                   "double quotes at line 1 column 23 (in the JSON string")):
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


# ----------------------------------------------------------------------------- a config from someone else


def write(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


# Published configs as the Hub has them (Llama 3.2 1B, GPT-2, BERT base, Mistral 7B v0.3, Qwen2 0.5B
# Instruct): extra keys, lists of eos ids, rope scaling, a bf16 dtype; each must pass the checks.
LLAMA3 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
GPT2 = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
    "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
    "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}, "vocab_size": 50257}
BERT = {"architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1, "gradient_checkpointing": False,
    "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02,
    "intermediate_size": 3072, "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 0, "position_embedding_type": "absolute",
    "transformers_version": "4.6.0.dev0", "type_vocab_size": 2, "use_cache": True, "vocab_size": 30522}
MISTRAL = {"architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0", "use_cache": True,
    "vocab_size": 32768}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("cfg", [LLAMA3, GPT2, BERT, MISTRAL, QWEN2], ids=lambda c: c["model_type"])
def test_published_configs_pass_the_checks(cfg):
    assert hf.read_config(cfg) == cfg


BAD_VALUES = [  # (model, key, value, what is expected): keys as each model type spells them
    ("gpt2", "n_layer", -1, "an int >= 1"),
    ("gpt2", "n_layer", 0, "an int >= 1"),
    ("gpt2", "n_layer", True, "an int"),
    ("gpt2", "n_layer", "2", "an int"),
    ("gpt2", "n_head", 0, "an int >= 1"),
    ("gpt2", "n_embd", 2.5, "an int"),
    ("gpt2", "n_positions", -3, "an int >= 1"),
    ("gpt2", "n_inner", -5, "an int >= 1"),
    ("gpt2", "vocab_size", 0, "an int >= 1"),
    ("gpt2", "attn_pdrop", 2.0, "a number in [0, 1]"),
    ("gpt2", "layer_norm_epsilon", -1e-5, "a number > 0"),
    ("gpt2", "activation_function", "nope", "one of transformers' activations"),
    ("gpt2", "tie_word_embeddings", "yes", "true or false"),
    ("llama", "num_hidden_layers", -1, "an int >= 1"),
    ("llama", "intermediate_size", 0, "an int >= 1"),
    ("llama", "num_key_value_heads", -2, "an int >= 1"),
    ("llama", "head_dim", 0, "an int >= 1"),
    ("llama", "max_position_embeddings", 0, "an int >= 1"),
    ("llama", "rms_norm_eps", 0.0, "a number > 0"),
    ("llama", "pad_token_id", -1, "an int >= 0"),
    ("llama", "rope_theta", -10000.0, "a number > 0"),
    ("bert", "num_attention_heads", -2, "an int >= 1"),
    ("bert", "hidden_size", 0, "an int >= 1"),
    ("bert", "type_vocab_size", 0, "an int >= 1"),
    ("bert", "hidden_dropout_prob", 1.5, "a number in [0, 1]"),
    ("bert", "torch_dtype", "load", "one of [None, 'float32', 'float16', 'bfloat16']"),
]


@pytest.mark.parametrize("kind, key, value, expected", BAD_VALUES, ids=[f"{k}-{key}={v!r}" for k, key, v, _ in
                                                                        BAD_VALUES])
def test_every_value_is_checked_naming_the_flag_file_key_value_and_what_was_expected(tmp_path, kind, key, value,
                                                                                     expected):
    path = write(tmp_path, dict(TINY[kind], **{key: value}))
    for read in (hf.read_config, hf.build):  # the recipes check before anything is built, then build
        with pytest.raises(ValueError) as e:
            read(path)
        message = str(e.value)
        assert message.startswith(f"--hf-config: {key}: expected {expected}"), message
        assert f"got {value!r}" in message and repr(str(path)) in message


@pytest.mark.parametrize("changes, message", [
    (dict(n_embd=30, n_head=4), "n_embd, n_head: expected heads that divide the hidden size (or an explicit head_dim), "
                                "got 30 and 4"),
    (dict(n_layer=2, n_embd=32, n_head=2, vocab_size=None), "vocab_size: expected an int >= 1, got None"),
])
def test_gpt2_values_that_do_not_fit_together_are_named(tmp_path, changes, message):
    path = write(tmp_path, dict(TINY["gpt2"], **changes))
    with pytest.raises(ValueError, match=re.escape(f"--hf-config: {message} (in {str(path)!r})")):
        hf.read_config(path)


def test_llama_and_bert_values_that_do_not_fit_together_are_named(tmp_path):
    path = write(tmp_path, dict(TINY["llama"], num_key_value_heads=3))
    with pytest.raises(ValueError, match=re.escape("--hf-config: num_key_value_heads: expected a divisor of "
                                                   "num_attention_heads = 4")):
        hf.read_config(path)
    with pytest.raises(ValueError, match=re.escape("--hf-config: hidden_size, num_attention_heads: expected heads that "
                                                   "divide the hidden size (or an explicit head_dim), got 30 and 4")):
        hf.read_config(dict(TINY["llama"], hidden_size=30))
    with pytest.raises(ValueError, match=re.escape("--hf-config: pad_token_id: expected an id inside the vocabulary, "
                                                   "below vocab_size = 64, got 64")):
        hf.read_config(dict(TINY["bert"], pad_token_id=64))
    with pytest.raises(ValueError, match=re.escape("--hf-config: num_hidden_layers: expected an int >= 1, got 0")):
        hf.build(TINY["bert"], "masked-lm", num_hidden_layers=0)  # overrides are checked too


def test_a_key_left_out_takes_its_default_which_is_checked_too():
    llama = {k: v for k, v in TINY["llama"].items() if k != "num_key_value_heads"}
    assert hf.build(llama).config.num_key_value_heads == 4  # llama's default: one kv head per head
    with pytest.raises(ValueError, match=re.escape("--hf-config: num_key_value_heads (the default): expected a divisor "
                                                   "of num_attention_heads = 4 (each kv head serves a whole group of "
                                                   "heads), got 8")):
        hf.read_config(dict(llama, model_type="mistral"))  # mistral's default: 8 kv heads


def test_the_config_dtype_does_not_change_the_model():
    model = hf.build(dict(TINY["llama"], torch_dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the trainer's --precision decides


def test_a_deeply_nested_config_is_refused_naming_the_flag_file_and_limit(tmp_path):
    limit = f"nested more than {json_file.MAX_DEPTH} levels deep"
    for levels in (json_file.MAX_DEPTH, 100_000):  # past the limit; past Python's recursion limit
        deep = '{"model_type": "gpt2", "task_specific_params": ' + '{"a": ' * levels + "1" + "}" * (levels + 1)
        path = tmp_path / "config.json"
        path.write_text(deep)
        for spec in (path, tmp_path, deep):
            with pytest.raises(ValueError) as e:
                hf.read_config(spec)
            assert str(e.value).startswith(f"--hf-config: {limit}") and "RecursionError" not in str(e.value)
            assert (repr(str(path)) if spec != deep else "(in the JSON string") in str(e.value)


class _Ran(Exception):
    """Raised by the module of tests/fixtures that a config must never import."""


@pytest.mark.parametrize("key, value", [
    ("auto_map", {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}),
    ("auto_map", {"AutoModelForCausalLM": "someone/repo--modeling_evil.EvilModel"}),
    ("trust_remote_code", True),
    ("attn_implementation", "kernels-community/flash-attn"),
    ("_attn_implementation", "someone/kernel"),
    ("experts_implementation", "someone/moe-kernel"),
])
def test_a_config_never_runs_code(tmp_path, monkeypatch, key, value):
    """Neither a folder's own Python (auto_map), nor the Hub's (auto_map with a repo, a hub kernel)."""
    ran = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, dict(TINY["gpt2"], **{key: value}))
    for spec in (path, tmp_path, json.dumps(dict(TINY["gpt2"], **{key: value}))):
        for read in (hf.read_config, hf.build):
            with pytest.raises(ValueError, match=re.escape(f"--hf-config: {key}: ")):
                read(spec)
    nested = dict(TINY["gpt2"], task_specific_params={"text-generation": {key: value}})
    with pytest.raises(ValueError, match=re.escape(f"--hf-config: task_specific_params.text-generation.{key}: ")):
        hf.read_config(nested)
    assert not ran.exists()


def test_models_are_built_with_trust_remote_code_false(monkeypatch):
    seen = []
    original = transformers.AutoModelForCausalLM.from_config

    def spy(config, **kwargs):
        seen.append(kwargs)
        return original(config, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", spy)
    hf.build(dict(TINY["gpt2"], trust_remote_code=False))  # false is no request to run code: accepted
    assert seen and seen[0].get("trust_remote_code") is False
