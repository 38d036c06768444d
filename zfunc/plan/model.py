"""What is trained: a transformer's shape, its parameter count, its FLOPs and its activations.

A ``ModelSpec`` is a decoder (``gpt``: learned positions, LayerNorm, GELU MLP, tied head; ``llama``:
RMSNorm, SwiGLU MLP, grouped-query attention, untied head) or an encoder (``bert``: post-LN, GELU,
biases, tied MLM head). It comes from a parameter count alone (``from_params``: a standard shape,
width/depth = 128 as GPT-3 175B's 12288/96), an explicit shape (``from_shape``), a module built on
the meta device (``from_module``: the exact leaves, which the byte accounting then uses), a
``transformers`` config (``from_hf_config``) or a recipe flavor (``from_flavor``).

FLOPs per token, with ``s`` the sequence length, ``L`` layers, ``h`` width, ``V`` vocabulary and
``P_l`` the matmul weights of one layer (Narayanan et al. 2021, eq. 3, generalised to GQA and
SwiGLU): forward ``2 L P_l + 4 L s h + 2 h V`` (GEMMs, attention scores and values, logits);
training is three forwards; full recomputation (``remat``) adds one more forward of the layers, not
of the logits (the formula DeepSpeed and Megatron report TFLOP/s with: ``96 B s L h^2 (1 + s/6h +
V/16Lh)`` for GPT). MFU counts the model FLOPs (no recomputation); TFLOP/s per GPU counts what ran.

Activations per layer and sequence (bytes, compute dtype of 2 bytes), after Korthikanti et al.
2022 ("Reducing Activation Recomputation", eq. 2 and Table 2), ``b`` sequences of ``s`` tokens:
``s b h (34 + 5 a s / h)``; tensor parallelism t divides ``24`` of the 34 (sequence parallelism the
other 10) and the attention term; fused attention (flash / memory-efficient SDPA, what
``scaled_dot_product_attention`` picks on GPU) stores no ``s x s`` matrix, so the ``5 a s / h`` term
is dropped there. SwiGLU stores ``3 f`` instead of ``2 x 4h`` for the MLP. With ``remat`` only each
layer's input (``2 s b h``) stays, plus one layer's full activations during its recomputation.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

KINDS = ("gpt", "llama", "bert")


@dataclass(frozen=True)
class ModelSpec:
    """A transformer's shape. ``params``: the exact count (None: from the shape). ``leaves``: the
    shapes of the params as ``zf.functionalize`` returns them, when known (exact accounting).
    ``fused_attention``: whether attention runs fused (False: the ``s x s`` scores are stored)."""

    kind: str = "gpt"
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    kv_heads: int | None = None
    ffn: int | None = None
    vocab: int = 50257
    max_seq: int = 2048
    tied: bool | None = None
    params: int | None = None
    leaves: tuple[tuple[int, ...], ...] | None = field(default=None, compare=False, repr=False)
    name: str = ""
    fused_attention: bool = True  # scaled_dot_product_attention's flash kernels (CUDA and CPU): no s x s matrix

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        for key in ("layers", "hidden", "heads", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}: expected an int >= 1, got {value!r}")

    # ------------------------------------------------------------------ shape
    @property
    def glu(self) -> bool:
        return self.kind == "llama"

    @property
    def ffn_dim(self) -> int:
        if self.ffn:
            return self.ffn
        if self.glu:  # Llama's 8h/3, rounded up to a multiple of 256
            return 256 * -(-int(8 * self.hidden / 3) // 256)
        return 4 * self.hidden

    @property
    def is_tied(self) -> bool:
        return self.kind != "llama" if self.tied is None else self.tied

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    def attention_weights(self) -> int:
        h = self.hidden
        return h * h * 2 + 2 * h * (h * self.kv // self.heads)  # q, o, and k, v of kv heads

    def mlp_weights(self) -> int:
        return self.hidden * self.ffn_dim * (3 if self.glu else 2)

    def layer_matmul_params(self) -> int:
        """Weights the layer multiplies by (per token: 2 FLOPs each, forward)."""
        return self.attention_weights() + self.mlp_weights()

    def layer_params(self) -> int:
        h = self.hidden
        norms = 2 * h if self.kind == "llama" else 4 * h
        biases = 0
        if self.kind == "bert":
            biases = 3 * h + h + self.ffn_dim + h  # qkv, o, fc1, fc2
        return self.layer_matmul_params() + norms + biases

    def embedding_params(self) -> int:
        pos = 0 if self.kind == "llama" else self.max_seq * self.hidden
        head = 0 if self.is_tied else self.vocab * self.hidden
        final_norm = self.hidden * (1 if self.kind == "llama" else 2)
        return self.vocab * self.hidden + pos + head + final_norm

    @property
    def total_params(self) -> int:
        if self.params is not None:
            return self.params
        return self.layers * self.layer_params() + self.embedding_params()

    def largest_unit_params(self, tiles: int = 1, max_unit: int = 10_000_000) -> int:
        """The largest stage-3 gather unit ``zf.units.auto`` makes: a layer when it holds at most
        ``max_unit`` params, else the largest single weight (split in ``tiles`` by ``zf.tile``); the
        embedding table (and an untied head) is a unit of its own."""
        layer = round(self.layer_params() * self._scale())
        if layer <= max_unit:
            biggest = layer
        else:
            qkv = self.hidden * (self.hidden + 2 * self.hidden * self.kv // self.heads)
            biggest = max(qkv, self.hidden * self.ffn_dim) * self._scale() / tiles
        return int(max(biggest, self.vocab * self.hidden / tiles))

    # ------------------------------------------------------------------ FLOPs
    def forward_flops_per_token(self, seq: int) -> dict[str, float]:
        """Forward FLOPs per token, by part: ``layers`` (GEMMs), ``attention`` (scores and values,
        full ``s x s`` as the usual convention counts them) and ``logits``."""
        scale = self._scale()
        return {"layers": 2 * self.layers * self.layer_matmul_params() * scale,
                "attention": 4 * self.layers * seq * self.hidden,
                "logits": 2 * self.hidden * self.vocab}

    def train_flops_per_token(self, seq: int, remat: bool = False) -> float:
        """FLOPs a training step runs per token (three forwards; plus one of the layers with remat)."""
        f = self.forward_flops_per_token(seq)
        total = 3 * sum(f.values())
        return total + (f["layers"] + f["attention"] if remat else 0.0)

    def model_flops_per_token(self, seq: int) -> float:
        """FLOPs per token MFU counts: three forwards, no recomputation."""
        return self.train_flops_per_token(seq, remat=False)

    def _scale(self) -> float:
        """When ``params`` is given (``--params N``), the shape is a stand-in: scale the layer GEMMs so
        6 x params is still the leading term."""
        if self.params is None:
            return 1.0
        shaped = self.layers * self.layer_params() + self.embedding_params()
        return self.params / shaped if shaped else 1.0

    # ------------------------------------------------------------------ activations
    def activation_bytes_per_layer(self, tokens: int, seq: int, tp: int = 1, sp: bool = False,
                                   fused_attention: bool = True, elem: int = 2) -> float:
        """Bytes one layer keeps for backward over ``tokens`` tokens of sequences of ``seq``.

        Per token, at 2-byte elements: ``10 h`` that tensor parallelism replicates (LayerNorm
        inputs, the QKV and first MLP inputs, two dropout masks) and ``8 h + 4 f`` it splits (Q, K, V,
        the projection input, and the MLP's GELU input and second input; ``6 f`` for SwiGLU's gate,
        up and product); unfused attention adds ``5 a s`` (softmax input, output, dropout mask).
        ``elem`` scales it to the compute dtype."""
        h, f = self.hidden, self.ffn_dim
        replicated = 10 * h
        split = 8 * h + (6 if self.glu else 4) * f
        per_token = replicated / (tp if sp else 1) + split / tp
        attention = 0.0 if fused_attention else 5 * self.heads * seq / tp
        return tokens * (per_token + attention) * elem / 2

    def logits_bytes(self, tokens: int, tp: int = 1, elem: int = 2) -> float:
        """Logits kept for the loss (compute dtype) and their fp32 softmax for its backward."""
        return tokens * self.vocab / tp * (elem + 4)


# ---------------------------------------------------------------------- constructors
def from_shape(layers: int, hidden: int, heads: int, *, kind: str = "gpt", vocab: int = 50257,
               ffn: int | None = None, kv_heads: int | None = None, max_seq: int = 2048,
               tied: bool | None = None, name: str = "") -> ModelSpec:
    """A transformer of ``layers`` layers of width ``hidden`` with ``heads`` heads."""
    return ModelSpec(kind, layers, hidden, heads, kv_heads, ffn, vocab, max_seq, tied, name=name)


def from_params(n: float, *, kind: str = "gpt", vocab: int = 50257, max_seq: int = 2048) -> ModelSpec:
    """A standard shape for ``n`` parameters: width/depth 128, heads of 128, the count kept exact."""
    n = int(n)
    if n < 1:
        raise ValueError(f"params: expected a count >= 1, got {n!r}")
    # 12 h^2 per layer (attention 4, MLP 8; SwiGLU at 8h/3 the same) and L = h / 128
    hidden = max(128, 128 * round((128 * n / 12) ** (1 / 3) / 128))
    base = from_shape(1, hidden, max(1, hidden // 128), kind=kind, vocab=vocab, max_seq=max_seq)
    layers = max(1, round((n - base.embedding_params()) / base.layer_params()))
    return replace(base, layers=layers, params=n, name=f"{n / 1e9:g}B params (standard shape)")


def _leaf_shapes(module) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """(count, shapes) of ``module``'s params as ``zf.functionalize`` sees them (tied ones once)."""
    shapes = tuple(tuple(p.shape) for _, p in module.named_parameters())
    return sum(math.prod(s) for s in shapes), shapes


_ALIASES = {
    "layers": ("n_layer", "num_hidden_layers", "n_layers", "num_layers"),
    "hidden": ("n_embd", "hidden_size", "dim", "d_model"),
    "heads": ("n_head", "num_attention_heads", "n_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "n_kv_head"),
    "ffn": ("intermediate_size", "ffn_dim", "n_inner", "hidden_dim"),
    "vocab": ("vocab_size",),
    "max_seq": ("block_size", "max_position_embeddings", "n_positions", "max_seq_len"),
    "tied": ("tie_word_embeddings", "tie_embeddings"),
}


def _shape_of(config: Any) -> dict[str, Any]:
    out = {}
    for key, names in _ALIASES.items():
        for n in names:
            value = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
            if value is not None:
                out[key] = value
                break
    return out


def _kind_of(config: Any, default: str) -> str:
    mtype = str(config.get("model_type", "") if isinstance(config, dict) else getattr(config, "model_type", ""))
    if mtype in ("llama", "mistral", "qwen2", "gemma"):
        return "llama"
    if mtype in ("bert", "roberta"):
        return "bert"
    return default


def from_module(module, *, kind: str = "gpt", config: Any = None, name: str = "") -> ModelSpec:
    """``module`` (any device, the meta device included): its exact leaves and count; the shape from
    ``config`` (or ``module.cfg`` / ``module.config``) for FLOPs and activations."""
    count, shapes = _leaf_shapes(module)
    config = config if config is not None else getattr(module, "cfg", None) or getattr(module, "config", None)
    shape = _shape_of(config) if config is not None else {}
    kind = _kind_of(config, kind) if config is not None else kind
    if {"layers", "hidden", "heads"} - set(shape):
        # no shape known: a one-layer stand-in whose GEMMs carry every param (FLOPs ~ 6 x params)
        hidden = max(64, int(math.sqrt(count / 12)))
        shape = {"layers": 1, "hidden": hidden, "heads": 1, "vocab": 1, "max_seq": 1}
    shape.setdefault("vocab", 50257)
    if not isinstance(shape.get("ffn"), int):
        shape.pop("ffn", None)
    spec = ModelSpec(kind=kind, **{k: v for k, v in shape.items()}, params=count, name=name or type(module).__name__)
    return replace(spec, leaves=shapes)


def from_hf_config(path_or_json: str | dict) -> ModelSpec:
    """A ``transformers`` model from its config (a JSON file, a folder holding one, a JSON string or
    a dict), built on the meta device: no weights, no downloads, no code from the config
    (``zfunc.config.hf``: bounded JSON, every value checked, remote code refused). Needs
    ``transformers``; a bad config is a ValueError naming the key."""
    from zfunc.config import hf as hf_config

    try:
        import torch
        import transformers
    except ImportError as e:
        raise ValueError(f"hf_config: needs the transformers package ({e})") from None
    raw = hf_config.read(path_or_json)
    config = hf_config.checked(raw, hf_config.where(path_or_json))
    auto = transformers.AutoModelForMaskedLM if _kind_of(raw, "gpt") == "bert" else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        module = auto.from_config(config, trust_remote_code=False)
    return from_module(module, config=raw, name=f"{raw['model_type']} (transformers config)")


FlavorBuilder = Callable[[str], tuple[Any, Any]]
_FLAVORS: dict[str, FlavorBuilder] = {}


def register_flavors(recipe: str, build: FlavorBuilder) -> None:
    """Make ``from_flavor(name, recipe)`` know recipe ``recipe``'s named sizes: ``build(name) ->
    (model, config)`` builds flavor ``name``'s ``nn.Module`` (on the current default device:
    ``from_flavor`` builds it on the meta device) and its config, and raises ValueError naming an
    unknown flavor. The planner knows no recipe itself; a recipe registers its flavors when it is
    imported (``recipes/gpt.py``, ``llama.py``, ``bert.py``; ``python -m recipes.plan`` imports them).
    Registering a recipe again replaces its builder."""
    if not isinstance(recipe, str) or not recipe:
        raise ValueError(f"recipe: expected a non-empty name, got {recipe!r}")
    if not callable(build):
        raise ValueError(f"build: expected a callable name -> (model, config), got {build!r}")
    _FLAVORS[recipe] = build


def from_flavor(name: str, recipe: str = "gpt") -> ModelSpec:
    """Recipe ``recipe``'s flavor ``name`` (``register_flavors``), built on the meta device: its exact
    leaves and count, its shape from its config. ValueError naming the recipes registered when
    ``recipe`` is not one of them."""
    build = _FLAVORS.get(recipe)
    if build is None:
        known = ", ".join(sorted(_FLAVORS)) or "none"
        raise ValueError(f"--recipe: no flavors registered for recipe {recipe!r} (registered: {known}); the recipes "
                         "register theirs when imported: python -m recipes.plan takes the same flags, or give "
                         "--params, --hf-config or --layers")
    import torch

    with torch.device("meta"):
        module, config = build(name)
    kind = recipe if recipe in KINDS else "gpt"
    return from_module(module, kind=kind, config=config, name=f"{recipe} {name}")
