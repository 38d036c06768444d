"""Train a small byte-level GPT with zfunc: `python -m recipes.gpt` (`--help` for flags).

nanoGPT-style: the config and the model (plain torch, no zfunc) here; the flat training loop driven
by a zfunc Step, its flags and the data are shared with the Llama and BERT recipes (recipes/loop.py,
recipes/cli.py, recipes/data.py). With no flags it trains on the Python standard library's own source
(bytes, vocab 256) and reaches val loss <= 2.4 nats/byte in about 5 minutes on a 2-core CPU.
On a GPU the same command uses it and reports MFU.

At scale, the same command under torchrun (`torchrun --nproc_per_node 4 -m recipes.gpt --zero 3
--offload-optimizer cpu`, or `--deepspeed ds_config.json`): the layout flags (recipes/layout.py)
make a `zf.config.Plan` that `zf.parallelize` applies; `--batch-size` is the global batch, so the
same flags train the same on any layout, and `--resume` continues in another one. Rank 0 writes
OUT/metrics.jsonl and OUT/loss.png (recipes/watch.py).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes import flavors, hf, layout, loop, recipe

# ----------------------------------------------------------------------------- config
# Tuned for ~5 minutes on a 2-core CPU; every key is also a flag (n_layer -> --n-layer).
MODEL_DEFAULTS = dict(n_layer=4, n_head=4, n_embd=192, block_size=128, dropout=0.0, vocab_multiple=1)  # 1.85M params
DEFAULTS = dict(
    **MODEL_DEFAULTS, **recipe.MODEL_SOURCE_DEFAULTS,
    **{**recipe.TRAIN_DEFAULTS, "out": "out/gpt"},  # 600 steps x 32 x 128 tokens; AdamW(0.9, 0.95), cosine 3e-3 -> 3e-4
    **recipe.SAMPLE_DEFAULTS,
    **layout.LAYOUT_DEFAULTS,  # --zero, --offload-*, --remat, --pp, --deepspeed, ...: how, not what
)
UNITS = "class:Block"  # ZeRO-3 gathers, remat and pipeline stages go block by block
HELP = {**recipe.TRAIN_HELP, **recipe.SAMPLE_HELP, "block_size": "context length in bytes (tokens with --tokenizer)",
        "flavor": "a published GPT-2/3 size (recipes/flavors.py): " + ", ".join(flavors.GPT_FLAVORS),
        "vocab_multiple": "pad the embedding's rows to a multiple of this (Megatron's make-vocab-size-divisible-by: "
                          "128 makes the output matmul's rows aligned on a GPU); the logits keep the vocabulary's size"}
RULES = dict(n_layer=recipe.AT_LEAST_1, n_head=recipe.AT_LEAST_1, n_embd=recipe.AT_LEAST_1, **recipe.TRAIN_RULES,
             dropout=(lambda v: 0 <= v < 1, "a number in [0, 1)"), vocab_multiple=recipe.AT_LEAST_1,
             **recipe.SAMPLE_RULES)
FLAG_TO_FIELD = dict(n_layer="n_layer", n_head="n_head", n_embd="n_embd", dropout="dropout",
                     vocab_multiple="vocab_multiple")


# ----------------------------------------------------------------------------- model
@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 192
    dropout: float = 0.0
    vocab_multiple: int = 1  # embedding rows padded to a multiple of this; logits stay vocab_size wide

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim, self.dropout = cfg.n_head, cfg.n_embd // cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        # Heads from attributes and tokens from qkv's output, not from x: zf.tensor_parallel runs n_head / tp
        # heads, and with sequence parallelism x holds T / tp tokens while qkv's output holds all T.
        q, k, v = self.qkv(x).unflatten(-1, (3, self.n_head, self.head_dim)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Pre-LN GPT: learned positions, tied input/output embeddings; forward(idx) -> logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx, position_ids=None):
        """``position_ids``: ``(T,)`` or ``(1, T)`` positions of the tokens (default ``0..T-1``)."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device) if position_ids is None else position_ids.reshape(-1)
        if T > self.cfg.block_size or (position_ids is not None and int(pos.max()) >= self.cfg.block_size):
            raise ValueError(f"sequence length {T} exceeds block_size={self.cfg.block_size}")
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits if self.cfg.padded_vocab == self.cfg.vocab_size else logits[..., : self.cfg.vocab_size]

    def initial_value(self, name: str, like: torch.Tensor, seed: int, rows: slice | None = None) -> torch.Tensor:
        """The initial value of param ``name`` (GPT-2's init, as ``__init__`` draws it), whole or its
        dim-0 ``rows``: a ``zf.materialize`` materializer. Values depend only on ``(seed, name, row)``
        (``zf.materialize.normal``'s law): the same whatever the layout, the number of processes or the
        order leaves are made in, so a model built on the meta device can be materialized rank by rank
        (ZeRO-3: each rank draws only its rows; offload: leaf by leaf) and train exactly as one built
        whole. Cost: the rows asked for (plus at most two 1 MiB blocks being drawn)."""
        import zfunc as zf

        owner, _, kind = name.rpartition(".")
        return zf.materialize.leaf(self._rule(owner, kind, seed), name, like, rows)

    def materializer(self, seed: int):
        """``initial_value`` for ``seed`` as a ``zf.materialize`` materializer ``(name, like, rows=None)``."""
        def materialize(name: str, like: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
            return self.initial_value(name, like, seed, rows)

        return materialize

    def _rule(self, owner: str, kind: str, seed: int):
        """The materializer of a param of submodule ``owner`` (GPT-2's init)."""
        import zfunc as zf

        if isinstance(self.get_submodule(owner), nn.LayerNorm):
            return zf.materialize.constant(1.0 if kind == "weight" else 0.0)
        if kind == "bias":
            return zf.materialize.constant(0.0)
        residual = owner.endswith("proj") or owner.endswith("mlp.2")
        return zf.materialize.normal(0.02 / math.sqrt(2 * self.cfg.n_layer) if residual else 0.02, seed)

    def num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, context: int) -> int:
        """Training FLOPs per token at ``context`` tokens (6 per param and token, the padded vocabulary's
        rows left out; attention's 12 * layers * context * width), as Megatron and PaLM count MFU."""
        cfg = self.cfg
        padding = (cfg.padded_vocab - cfg.vocab_size) * cfg.n_embd
        return 6 * (self.num_params() - padding) + 12 * cfg.n_layer * context * cfg.n_embd


# ----------------------------------------------------------------------------- the recipe


def _check_model_flags(args: argparse.Namespace) -> list[str]:
    if args.n_head >= 1 and args.n_embd % args.n_head:
        return [f"--n-embd: expected a multiple of --n-head {args.n_head}, got {args.n_embd}"]
    return []


def build(args: argparse.Namespace, vocab_size: int) -> recipe.Built:
    """The GPT the flags (or --flavor, or --hf-config) ask for, on the current (meta) device."""
    if args.hf_config is not None:
        return hf.built(args, vocab_size, "causal-lm")
    kwargs = recipe.model_kwargs(args, flavors.gpt_flavor(args.flavor) if args.flavor else {}, FLAG_TO_FIELD,
                                 "block_size", vocab_size)
    cfg = GPTConfig(**kwargs)
    model = GPT(cfg)
    return recipe.Built(model, asdict(cfg), cfg.block_size, materialize=model.materializer, units=UNITS,
                        flops_per_token=model.flops_per_token(args.block_size))


RECIPE = recipe.Recipe("gpt", __doc__.split("\n\n")[0], DEFAULTS, HELP, RULES, build, units=UNITS,
                       check=_check_model_flags, flavors=flavors.gpt_flavor)


def main(argv=None) -> dict:
    """The command line (recipes/loop.py); flags that cannot work exit with status 2, naming each."""
    return loop.main(RECIPE, argv)


if __name__ == "__main__":
    loop.script(main)
