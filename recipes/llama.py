"""Train a Llama-3-style decoder with zfunc: `python -m recipes.llama` (`--help` for flags).

RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, an untied head, in plain torch, read top
to bottom like nanoGPT: the flavors (published sizes), the config, the model, then the recipe. The
model knows nothing of zfunc; the recipe (the last section) hands it to recipes/loop.py, the loop
the GPT recipe runs, with every flag of the front door (--zero, --offload-*, --remat, --pp,
--deepspeed, --flavor, --hf-config, --tokenizer, --resume, ...). With no flags it trains on the
Python standard library's source (bytes) in about 5 minutes on a 2-core CPU (README, Results).

Flavors (``--flavor``), each a published config (HF config.json of the named checkpoint):
  debug  not a published model: the smallest shape with every part (GQA 4 heads over 2 kv heads).
  125M   SmolLM-135M (HuggingFaceTB, LlamaForCausalLM; tied embeddings)         alias: small
  350M   SmolLM-360M (HuggingFaceTB, LlamaForCausalLM; tied embeddings)
  1B     Llama 3.2 1B (meta-llama/Llama-3.2-1B; tied embeddings, llama3 rope scaling)
  3B     Llama 3.2 3B (meta-llama/Llama-3.2-3B; tied embeddings, llama3 rope scaling)
  7B     Llama 2 7B (meta-llama/Llama-2-7b-hf): Llama 3 has no 7B; same architecture, MHA, vocab 32000
  8B     Llama 3 8B (meta-llama/Meta-Llama-3-8B)
  13B    Llama 2 13B (meta-llama/Llama-2-13b-hf): Llama 3 has no 13B
  70B    Llama 3 70B (meta-llama/Meta-Llama-3-70B)
Llama 3 has no model under 1B; SmolLM is the published Llama-architecture model at 135M and 360M.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes import hf, layout, loop, recipe
from recipes.flavors import lookup

_LLAMA3 = dict(vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0)
# Llama 3.1/3.2's long-context frequency scaling ("rope_type": "llama3" in their configs).
_LLAMA3_ROPE_SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
_SMOLLM = dict(vocab_size=49152, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=2048, tie_embeddings=True)
_LLAMA2 = dict(vocab_size=32000, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096)

FLAVORS: dict[str, Any] = {
    "debug": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=128),
    # HuggingFaceTB/SmolLM-135M config.json: hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate 1536.
    "125M": dict(_SMOLLM, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536),
    # HuggingFaceTB/SmolLM-360M config.json: hidden 960, 32 layers, 15 heads, 5 kv heads, intermediate 2560.
    "350M": dict(_SMOLLM, dim=960, n_layers=32, n_heads=15, n_kv_heads=5, ffn_dim=2560),
    # meta-llama/Llama-3.2-1B config.json: hidden 2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192,
    # max positions 131072, tie_word_embeddings true.
    "1B": dict(_LLAMA3, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=131072,
               tie_embeddings=True, rope_scaling=_LLAMA3_ROPE_SCALING),
    # meta-llama/Llama-3.2-3B config.json: hidden 3072, 28 layers, 24 heads, 8 kv heads, intermediate 8192.
    "3B": dict(_LLAMA3, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, max_seq_len=131072,
               tie_embeddings=True, rope_scaling=_LLAMA3_ROPE_SCALING),
    # meta-llama/Llama-2-7b-hf config.json: hidden 4096, 32 layers, 32 heads (no GQA), intermediate 11008.
    "7B": dict(_LLAMA2, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
    # meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, 32 heads, 8 kv heads, intermediate 14336,
    # max positions 8192, untied.
    "8B": dict(_LLAMA3, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=8192),
    # meta-llama/Llama-2-13b-hf config.json: hidden 5120, 40 layers, 40 heads (no GQA), intermediate 13824.
    "13B": dict(_LLAMA2, dim=5120, n_layers=40, n_heads=40, ffn_dim=13824),
    # meta-llama/Meta-Llama-3-70B config.json: hidden 8192, 80 layers, 64 heads, 8 kv heads, intermediate 28672.
    "70B": dict(_LLAMA3, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, max_seq_len=8192),
    "small": "125M",
}


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: one kv head per query head (multi-head attention)
    ffn_dim: int = 176  # SwiGLU hidden width (HF: intermediate_size)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None  # Llama 3.1's: factor, low/high_freq_factor, original_max_position_embeddings
    max_seq_len: int = 128
    tie_embeddings: bool = False  # Llama 3 8B/70B: untied; 3.2 1B/3B and SmolLM: tied

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name}: expected an int >= 1, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig.dim: expected a multiple of n_heads={self.n_heads}, got {self.dim}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: rotary embeddings need an even head dim (dim / n_heads), "
                             f"got {self.dim} / {self.n_heads} = {self.head_dim}")
        kv = self.n_kv_heads
        if kv is not None and (not isinstance(kv, int) or kv < 1 or self.n_heads % kv):
            raise ValueError(f"LlamaConfig.n_kv_heads: expected None or an int >= 1 dividing n_heads="
                             f"{self.n_heads}, got {kv!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


def flavor(name: str, **overrides) -> LlamaConfig:
    """The ``LlamaConfig`` of flavor ``name`` (module docstring), with ``overrides`` applied.

    Raises ValueError naming an unknown flavor or override, or a config that cannot work.
    """
    kwargs = lookup(FLAVORS, name, "llama")
    unknown = sorted(set(overrides) - {f.name for f in fields(LlamaConfig)})
    if unknown:
        raise ValueError(f"llama flavor {name!r}: no config field {', '.join(unknown)}")
    return LlamaConfig(**{**kwargs, **overrides})


# ----------------------------------------------------------------------------- model
class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_frequencies(cfg: LlamaConfig, device=None) -> torch.Tensor:
    """Rotation speed of each pair of head dims: theta^(-2i/d), with Llama 3.1's scaling if any
    (wavelengths longer than the original context slowed by `factor`, a smooth ramp in between)."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    s = cfg.rope_scaling
    if not s:
        return inv_freq
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / s["low_freq_factor"], old_len / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, H, T, D): dims i and i + D/2 rotate together (HF's layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    """Causal self-attention; n_kv_heads < n_heads shares each key/value head among a group of query heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        # Tokens from the projections' outputs, not from x: with zf.tensor_parallel's sequence parallelism x
        # holds T / tp tokens and the projections' outputs all T.
        q = self.q(x).unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k(x).unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v(x).unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o(y.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim, cfg.norm_eps), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim, cfg.norm_eps), FeedForward(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Pre-RMSNorm decoder with rotary positions; forward(idx) -> logits (B, T, vocab_size)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)  # the name zf.tile's --tile-lm-head tiles
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:  # every matrix N(0, 0.02); residual outputs scaled by depth (GPT-2's rule)
                deep = name.endswith(("attn.o.weight", "mlp.down.weight"))
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layers) if deep else 0.02)

    def forward(self, idx, position_ids=None):
        """``position_ids``: ``(T,)`` or ``(1, T)`` positions of the tokens (default ``0..T-1``)."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device) if position_ids is None else position_ids.reshape(-1)
        if T > self.cfg.max_seq_len or (position_ids is not None and int(pos.max()) >= self.cfg.max_seq_len):
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}")
        # Recomputed per call (T x head_dim/2, cheap): no buffer to shard, offload or materialize.
        angles = torch.outer(pos.to(torch.float32), rope_frequencies(self.cfg, idx.device))
        x = self.embed(idx)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; ``non_embedding`` leaves out the input table (a lookup, not a matmul) unless it is
        also the head: the count FLOPs per token are 6x of."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding and not self.cfg.tie_embeddings else n


# ----------------------------------------------------------------------------- the recipe
# Sized, like the GPT recipe's default, for ~5 minutes on a 2-core CPU (README, Results).
MODEL_DEFAULTS = dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=192, ffn_dim=512, block_size=128)
# A step costs ~1.2x the GPT recipe's on CPU: 0.81 of its tokens/s (1,037 vs 1,285, medians over the first
# 50-80 steps) with both default runs side by side, one thread each, on a loaded machine; so 490 steps take
# the time of its 600. (Two threads each on a loaded machine gave 0.51-0.61: OpenMP waits hit Llama's many
# small elementwise ops harder; the lead re-times on a quiet machine.)
DEFAULTS = dict(**MODEL_DEFAULTS, **recipe.MODEL_SOURCE_DEFAULTS,
                **{**recipe.TRAIN_DEFAULTS, "out": "out/llama", "steps": 490},
                **recipe.SAMPLE_DEFAULTS, **layout.LAYOUT_DEFAULTS)
UNITS = "class:Block"
HELP = {**recipe.TRAIN_HELP, **recipe.SAMPLE_HELP, "block_size": "context length in bytes (tokens with --tokenizer)",
        "n_kv_head": "key/value heads (grouped-query attention; a divisor of --n-head)",
        "ffn_dim": "SwiGLU hidden width", "flavor": "a published Llama size (module docstring): " + ", ".join(FLAVORS)}
RULES = dict(n_layer=recipe.AT_LEAST_1, n_head=recipe.AT_LEAST_1, n_kv_head=recipe.AT_LEAST_1,
             n_embd=recipe.AT_LEAST_1, ffn_dim=recipe.AT_LEAST_1, **recipe.TRAIN_RULES, **recipe.SAMPLE_RULES)
FLAG_TO_FIELD = dict(n_layer="n_layers", n_head="n_heads", n_kv_head="n_kv_heads", n_embd="dim", ffn_dim="ffn_dim")


def _check_model_flags(args: argparse.Namespace) -> list[str]:
    errors = []
    if args.n_head >= 1 and args.n_embd % args.n_head:
        errors.append(f"--n-embd: expected a multiple of --n-head {args.n_head}, got {args.n_embd}")
    elif args.n_head >= 1 and (args.n_embd // args.n_head) % 2:
        errors.append(f"--n-embd: rotary embeddings need an even head dim (--n-embd / --n-head), got "
                      f"{args.n_embd} / {args.n_head}")
    if args.n_kv_head >= 1 and args.n_head % args.n_kv_head:
        errors.append(f"--n-kv-head: expected a divisor of --n-head {args.n_head}, got {args.n_kv_head}")
    return errors


def materializer(cfg: LlamaConfig, seed: int):
    """The init ``Llama.__init__`` draws, as zf.materialize rules (row-deterministic, any layout):
    norms 1, residual outputs N(0, 0.02 / sqrt(2 n_layers)), every other matrix N(0, 0.02)."""
    import zfunc as zf

    return zf.materialize.by_name({
        "*norm.weight": zf.materialize.constant(1.0),
        "*attn.o.weight": zf.materialize.normal(0.02 / math.sqrt(2 * cfg.n_layers), seed),
        "*mlp.down.weight": zf.materialize.normal(0.02 / math.sqrt(2 * cfg.n_layers), seed),
        "*": zf.materialize.normal(0.02, seed),
    })


def build(args: argparse.Namespace, vocab_size: int) -> recipe.Built:
    """The Llama the flags (or --flavor, or --hf-config) ask for, on the current (meta) device."""
    if args.hf_config is not None:
        return hf.built(args, vocab_size, "causal-lm")
    flavor = lookup(FLAVORS, args.flavor, "llama") if args.flavor else {}
    kwargs = recipe.model_kwargs(args, flavor, FLAG_TO_FIELD, "max_seq_len", vocab_size)
    cfg = LlamaConfig(**kwargs)
    model = Llama(cfg)
    flops = 6 * model.num_params() + 12 * cfg.n_layers * args.block_size * cfg.dim
    return recipe.Built(model, asdict(cfg), cfg.max_seq_len, materialize=lambda seed: materializer(cfg, seed),
                        units=UNITS, flops_per_token=flops)


RECIPE = recipe.Recipe("llama", __doc__.split("\n\n")[0], DEFAULTS, HELP, RULES, build, units=UNITS,
                       check=_check_model_flags, flavors=lambda name: lookup(FLAVORS, name, "llama"))


def main(argv=None) -> dict:
    """The command line (recipes/loop.py); flags that cannot work exit with status 2, naming each."""
    return loop.main(RECIPE, argv)


if __name__ == "__main__":
    loop.script(main)
