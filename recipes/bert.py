"""BERT for masked-LM pretraining in plain torch, and the 15% / 80-10-10 masking that feeds it.

The model part of the BERT recipe: the flavors, the config, the model (post-LN encoder, learned
positions, optional token types, an MLM head tied to the word embeddings, an optional NSP head), the
masking function and the loss. It knows nothing of zfunc.

Flavors (``--flavor``), each a published config:
  debug  not a published model: the smallest shape with every part (bytes + 4 special tokens).
  small  BERT-Small, L=4 H=512 A=8 (Turc et al. 2019, arXiv:1908.08962; google/bert_uncased_L-4_H-512_A-8)
  base   BERT-Base, L=12 H=768 A=12 (Devlin et al. 2019; bert-base-uncased config.json)   alias: 125M
  large  BERT-Large, L=24 H=1024 A=16 (Devlin et al. 2019; bert-large-uncased config.json) alias: 350M
  1.5B   BERT-1.5B, L=48 H=1600 A=25, intermediate 6400 (Habana Model-References, DeepSpeed BERT-1.5B:
         scripts/bert_1.5b_config.json; the seed's ZeRO-1 + bf16 model). Its "layer_norm_large_model"
         moves the LayerNorms off the residual stream: ``pre_ln=True`` here.    alias: 1B
No BERT was published at 7B, 13B or 70B: those names are refused with the list of flavors.
The published ones were pretrained with next-sentence prediction, so their flavors carry the NSP head
(pooler + classifier); pass ``nsp=False`` to drop it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes.flavors import lookup

# Byte-level vocabulary: 256 bytes, then the special tokens (none of them a byte).
PAD, CLS, SEP, MASK = 256, 257, 258, 259
BYTE_VOCAB = 260
IGNORE = -100  # label of a token the MLM loss skips (torch's cross_entropy default ignore_index)

_WORDPIECE = dict(vocab_size=30522, max_seq_len=512, type_vocab_size=2, dropout=0.1, nsp=True)  # uncased

FLAVORS: dict[str, Any] = {
    "debug": dict(vocab_size=BYTE_VOCAB, dim=64, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=128),
    "small": dict(_WORDPIECE, dim=512, n_layers=4, n_heads=8, ffn_dim=2048),
    "base": dict(_WORDPIECE, dim=768, n_layers=12, n_heads=12, ffn_dim=3072),
    "large": dict(_WORDPIECE, dim=1024, n_layers=24, n_heads=16, ffn_dim=4096),
    "1.5B": dict(_WORDPIECE, dim=1600, n_layers=48, n_heads=25, ffn_dim=6400, pre_ln=True),
    "125M": "base",
    "350M": "large",
    "1B": "1.5B",
}


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = BYTE_VOCAB
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 256  # HF: intermediate_size
    max_seq_len: int = 128  # learned positions (HF: max_position_embeddings)
    type_vocab_size: int = 0  # segment embeddings; 0: none (BERT: 2, sentence A and B)
    norm_eps: float = 1e-12
    dropout: float = 0.0  # hidden and attention dropout (BERT: 0.1)
    nsp: bool = False  # next-sentence prediction head: pooler (dense + tanh on [CLS]) and a 2-way classifier
    pre_ln: bool = False  # Habana's layer_norm_large_model: residual stream kept un-normalized

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BertConfig.{name}: expected an int >= 1, got {value!r}")
        if not isinstance(self.type_vocab_size, int) or self.type_vocab_size < 0:
            raise ValueError(f"BertConfig.type_vocab_size: expected an int >= 0, got {self.type_vocab_size!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"BertConfig.dim: expected a multiple of n_heads={self.n_heads}, got {self.dim}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"BertConfig.dropout: expected a number in [0, 1), got {self.dropout!r}")


def flavor(name: str, **overrides) -> BertConfig:
    """The ``BertConfig`` of flavor ``name`` (module docstring), with ``overrides`` applied.

    Raises ValueError naming an unknown flavor or override, or a config that cannot work.
    """
    kwargs = lookup(FLAVORS, name, "bert")
    unknown = sorted(set(overrides) - {f.name for f in fields(BertConfig)})
    if unknown:
        raise ValueError(f"bert flavor {name!r}: no config field {', '.join(unknown)}")
    return BertConfig(**{**kwargs, **overrides})


# ----------------------------------------------------------------------------- model
class SelfAttention(nn.Module):
    """Bidirectional multi-head attention; ``pad_mask`` (B, T), True where a token may be attended to."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.n_heads, self.dropout = cfg.n_heads, cfg.dropout
        self.q, self.k, self.v = (nn.Linear(cfg.dim, cfg.dim) for _ in range(3))
        self.o = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        q, k, v = (f(x).view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        mask = None if pad_mask is None else pad_mask[:, None, None, :].bool()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class Layer(nn.Module):
    """One encoder layer. Post-LN (BERT): h = LN(h + f(h)) after attention and after the MLP.
    Pre-LN (``pre_ln``): the residual stream r adds f(LN(r)); the LN sits on the branch, not the sum.
    Habana's layer_norm_large_model wires its LayerNorms so, with the same parameters; its stream starts
    at 0 in the first layer, ours at the (normalized) embeddings, as pre-LN transformers do."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.pre_ln = cfg.pre_ln
        self.attn, self.attn_norm = SelfAttention(cfg), nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn_dim), nn.GELU(), nn.Linear(cfg.ffn_dim, cfg.dim))
        self.mlp_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h, r, pad_mask=None):
        """(h, r): the normalized hidden state and the residual stream (the same tensor in post-LN)."""
        if self.pre_ln:
            r = r + self.drop(self.attn(h, pad_mask))
            h = self.attn_norm(r)
            r = r + self.drop(self.mlp(h))
            return self.mlp_norm(r), r
        h = self.attn_norm(h + self.drop(self.attn(h, pad_mask)))
        h = self.mlp_norm(h + self.drop(self.mlp(h)))
        return h, h


class Bert(nn.Module):
    """BERT encoder with pretraining heads.

    forward(idx, token_types=None, pad_mask=None) -> (mlm_logits (B, T, vocab_size), nsp_logits (B, 2) or
    None without the NSP head). ``pad_mask`` (B, T): True (or 1) where a real token is.
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.types = nn.Embedding(cfg.type_vocab_size, cfg.dim) if cfg.type_vocab_size else None
        self.embed_norm, self.drop = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps), nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        # MLM head: dense + GELU + LN, then the word embeddings transposed, plus a bias per token.
        self.mlm_dense, self.mlm_norm = nn.Linear(cfg.dim, cfg.dim), nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlm_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        if cfg.nsp:
            self.pooler, self.nsp_head = nn.Linear(cfg.dim, cfg.dim), nn.Linear(cfg.dim, 2)
        for m in self.modules():  # BERT's init: N(0, 0.02) matrices, zero biases, unit LayerNorms
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, token_types=None, pad_mask=None):
        B, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}")
        x = self.word(idx) + self.pos(torch.arange(T, device=idx.device))
        if self.types is not None:
            x = x + self.types(torch.zeros_like(idx) if token_types is None else token_types)
        elif token_types is not None:
            raise ValueError("token_types given, but the model has no token type embeddings (type_vocab_size=0)")
        h = self.drop(self.embed_norm(x))
        r = h
        for layer in self.layers:
            h, r = layer(h, r, pad_mask)
        mlm = self.mlm_norm(F.gelu(self.mlm_dense(h))) @ self.word.weight.t() + self.mlm_bias
        nsp = self.nsp_head(torch.tanh(self.pooler(h[:, 0]))) if self.cfg.nsp else None
        return mlm, nsp

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; ``non_embedding`` leaves out the position and type tables (lookups). The word
        table stays: it is also the MLM head's matmul."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.pos.weight.numel() + (self.types.weight.numel() if self.types is not None else 0)
        return n


# ----------------------------------------------------------------------------- masking and loss
def mask_tokens(tokens: torch.Tensor, generator: torch.Generator | None = None, *, mask_id: int = MASK,
                vocab_size: int = BYTE_VOCAB, special_ids: Sequence[int] = (PAD, CLS, SEP, MASK),
                prob: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: (inputs, labels) for masked-LM, a pure function of ``tokens`` and ``generator``.

    Each token that is not special is selected with probability ``prob``; a selected token becomes
    ``mask_id`` with probability 0.8, a uniformly drawn non-special token with 0.1, and stays itself
    with 0.1. ``labels`` holds the original token where selected and IGNORE (-100) elsewhere; special
    tokens are never selected. Draws a fixed amount of randomness per token (3 numbers), so the
    outcome at a position depends only on the generator's state and that position, not on the content.
    ``tokens`` is not modified.
    """
    if not 0 <= prob <= 1:
        raise ValueError(f"prob: expected a number in [0, 1], got {prob!r}")
    bad = [i for i in special_ids if not 0 <= i < vocab_size]
    if bad or not 0 <= mask_id < vocab_size:
        raise ValueError(f"special_ids {list(special_ids)} and mask_id {mask_id}: expected ids in [0, {vocab_size})")
    special = torch.zeros(vocab_size, dtype=torch.bool)
    special[torch.as_tensor(list(special_ids), dtype=torch.long)] = True
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"tokens: expected ids in [0, {vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]")
    candidates = (~special).nonzero().flatten()  # what a random replacement may be
    if len(candidates) == 0:
        raise ValueError(f"special_ids: every id of the vocabulary ({vocab_size}) is special; nothing to mask")
    select_u = torch.rand(tokens.shape, generator=generator)
    action_u = torch.rand(tokens.shape, generator=generator)
    random_ix = torch.randint(len(candidates), tokens.shape, generator=generator)
    tokens_cpu = tokens.cpu()
    selected = (select_u < prob) & ~special[tokens_cpu]
    labels = torch.where(selected, tokens_cpu, torch.full_like(tokens_cpu, IGNORE))
    inputs = torch.where(selected & (action_u < 0.8), torch.full_like(tokens_cpu, mask_id), tokens_cpu)
    inputs = torch.where(selected & (action_u >= 0.8) & (action_u < 0.9), candidates[random_ix].to(tokens_cpu.dtype),
                         inputs)
    return inputs.to(tokens.device), labels.to(tokens.device)


def mlm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the selected tokens (labels != IGNORE); 0 when none is selected."""
    flat = labels.flatten()
    total = F.cross_entropy(logits.flatten(0, 1).float(), flat, ignore_index=IGNORE, reduction="sum")
    return total / flat.ne(IGNORE).sum().clamp(min=1)


@torch.no_grad()
def masked_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(correct, selected): argmax predictions that equal the original token, over selected tokens."""
    selected = labels.ne(IGNORE)
    return int((logits.argmax(-1).eq(labels) & selected).sum()), int(selected.sum())
