"""Pretrain BERT (masked LM) with zfunc: `python -m recipes.bert` (`--help` for flags).

The flavors, the config, the model (post-LN encoder, learned positions, optional token types, an MLM
head tied to the word embeddings, an optional NSP head), the 15% / 80-10-10 masking and the loss in
plain torch (the model knows nothing of zfunc), then the recipe: recipes/loop.py's loop, every flag of
the front door, with the masked task (eval: MLM loss and masked-token accuracy). Its default layout is
ZeRO stage 1, in the machine's precision (recipes/precision.py: bf16 on CUDA and on a CPU
with native bf16 units, fp32 elsewhere). `python -m recipes.bert --scaling 1,2` prints the weak-scaling table.
`--nsp` adds next-sentence prediction (``sentence_pairs``: [CLS] A [SEP] B [SEP], B the window after
A or, half the time, a random one; the NSP loss added to the MLM loss; eval: NSP accuracy too).

The default run (no flags) beats the unigram guess by far in ~5 minutes on 2 cores (README, Results)
because of two choices, both found by short runs (the same model stayed on the MLM plateau, ~35%
masked-token accuracy against the guess's 29%, for 600 steps of 32 windows x 128 bytes): 32-byte windows,
128 of them a step (the same bytes a step; attention spread over 32 positions, not 128, finds the
neighbours that predict a masked byte sooner), and matrices drawn N(0, 0.05) (``--init-std``;
BERT's 0.02 escapes the plateau later). Post-LN, lr 1e-3 -> 1e-4 and ZeRO-1.

Why one module over 400 lines: BERT, its two pretraining tasks (masked LM, next-sentence prediction)
and the recipe read top to bottom in one file, as nanoGPT's model and training do; each part is small.

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
(pooler + classifier); pass ``nsp=False`` to drop it (the recipe trains it only with ``--nsp``).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from recipes import data as data_mod
from recipes import hf, layout, loop, recipe, scaling
from recipes import task as task_mod
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
    init_std: float = 0.02  # std of every matrix at init (HF: initializer_range; BERT's 0.02)

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
        if not self.init_std > 0:
            raise ValueError(f"BertConfig.init_std: expected a number > 0, got {self.init_std!r}")


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

    forward(idx, token_types=None, pad_mask=None, position_ids=None) -> (mlm_logits (B, T, vocab_size),
    nsp_logits (B, 2) or None without the NSP head). ``pad_mask`` (B, T): True (or 1) where a real token is;
    ``position_ids`` (T,) or (B, T): each token's position (default ``0..T-1``; ``zf.sequence_parallel``
    passes a rank's own).
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
        for m in self.modules():  # BERT's init: N(0, init_std) matrices, zero biases, unit LayerNorms
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, cfg.init_std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, token_types=None, pad_mask=None, position_ids=None):
        B, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}")
        x = self.word(idx) + self.pos(torch.arange(T, device=idx.device) if position_ids is None else position_ids)
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


# ----------------------------------------------------------------------------- the masked task
# The data's ids come first; PAD, CLS, SEP, MASK follow them (bytes: 256..259, as above).
def specials(data_vocab: int) -> tuple[int, int, int, int]:
    return data_vocab, data_vocab + 1, data_vocab + 2, data_vocab + 3


def masked_batch(data, batch_size: int, block_size: int, generator, vocab_size: int):
    """(inputs, labels, scale): random windows masked by ``mask_tokens``. ``scale`` (one value per
    row) is batch_size / (masked tokens in the whole batch), so that the mean over any split of the
    rows of sum(CE) * scale / rows is the global batch's mean MLM loss: the same on any layout."""
    x, _ = data_mod.get_batch(data, batch_size, block_size, generator)
    ids = specials(vocab_size)
    inputs, labels = mask_tokens(x, generator, mask_id=ids[3], vocab_size=vocab_size + 4, special_ids=ids)
    scale = batch_size / labels.ne(IGNORE).sum().clamp(min=1).double()
    return inputs, labels, torch.full((batch_size,), float(scale))


def masked_loss(out, batch):
    logits, labels, scale = task_mod.logits_of(out), batch[1], batch[2]
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return total * scale[0] / labels.shape[0]


def masked_sequence_loss(out, batch, layout):
    """``masked_loss`` of a sequence-parallel rank's tokens (--sp) times ``sp``: the sum over its tokens
    scaled by the global batch's count of masked tokens, so the mean over the sp ranks (and over any split
    of the rows) is the global batch's mean MLM loss."""
    return masked_loss(out, (None, layout.take(batch[1]), batch[2])) * layout.sp


def masked_eval(forward, val, args, generator, vocab_size) -> dict:
    """MLM loss (mean over every masked token) and masked-token accuracy over --eval-batches."""
    loss, correct, selected = 0.0, 0, 0
    for _ in range(args.eval_batches):
        inputs, labels, _ = masked_batch(val, args.batch_size, args.block_size, generator, vocab_size)
        logits = forward.logits((inputs,)).float().cpu()
        n = int(labels.ne(IGNORE).sum())
        loss += mlm_loss(logits, labels).item() * n
        c, s = masked_accuracy(logits, labels)
        correct, selected = correct + c, selected + s
    return {"val_loss": loss / max(selected, 1), "val_accuracy": correct / max(selected, 1)}


# ----------------------------------------------------------------------------- next-sentence prediction
def _windows(data, starts: torch.Tensor, length: int) -> torch.Tensor:
    """data[s:s + length] for each start, int64 (rows, length); ``data``: a tensor or an array / memmap."""
    offsets = starts[:, None] + torch.arange(length)
    if isinstance(data, torch.Tensor):
        return data[offsets].long()
    return torch.from_numpy(np.asarray(data)[offsets.numpy()].astype(np.int64))


def sentence_pairs(data, batch_size: int, block_size: int, generator, vocab_size: int):
    """(tokens, token_types, is_random): BERT's NSP pairs ``[CLS] A [SEP] B [SEP]``, ``block_size`` long.

    A is a window of (block_size - 3) // 2 tokens; B, the rest, is the window that follows A (label 0,
    "IsNext") or, with probability 1/2, a window drawn anywhere in ``data`` (label 1, "NotNext"). On
    a corpus without sentence marks the "sentences" are these windows (bytes: cut mid-line). Types:
    0 for [CLS] A [SEP], 1 for B [SEP]. A pure function of the generator (a fixed amount of
    randomness per row: 3 numbers)."""
    n_a = (block_size - 3) // 2
    n_b = block_size - 3 - n_a
    if n_a < 1 or len(data) <= n_a + n_b:
        raise ValueError(f"--block-size: NSP pairs need at least 5 tokens and a split longer than the pair, "
                         f"got {block_size} over {len(data)}")
    a_start = torch.randint(len(data) - n_a - n_b, (batch_size,), generator=generator)
    other = torch.randint(len(data) - n_b, (batch_size,), generator=generator)
    is_random = (torch.rand(batch_size, generator=generator) < 0.5).long()
    b_start = torch.where(is_random.bool(), other, a_start + n_a)
    _, cls, sep, _ = specials(vocab_size)
    column = lambda v: torch.full((batch_size, 1), v, dtype=torch.long)  # noqa: E731
    tokens = torch.cat([column(cls), _windows(data, a_start, n_a), column(sep), _windows(data, b_start, n_b),
                        column(sep)], dim=1)
    types = torch.zeros_like(tokens)
    types[:, n_a + 2:] = 1
    return tokens, types, is_random


def nsp_batch(data, batch_size: int, block_size: int, generator, vocab_size: int):
    """(inputs, token_types, labels, scale, is_random): ``sentence_pairs`` masked by ``mask_tokens``
    ([CLS] and [SEP] never selected); ``scale`` as ``masked_batch``'s."""
    tokens, types, is_random = sentence_pairs(data, batch_size, block_size, generator, vocab_size)
    ids = specials(vocab_size)
    inputs, labels = mask_tokens(tokens, generator, mask_id=ids[3], vocab_size=vocab_size + 4, special_ids=ids)
    scale = batch_size / labels.ne(IGNORE).sum().clamp(min=1).double()
    return inputs, types, labels, torch.full((batch_size,), float(scale)), is_random


def nsp_loss(out, batch):
    """MLM loss (``masked_loss``'s normalization) + the mean NSP cross-entropy over the rows."""
    mlm, nsp = out
    _, _, labels, scale, is_random = batch
    return masked_loss(mlm, (None, labels, scale)) + F.cross_entropy(nsp.float(), is_random)


def nsp_eval(forward, val, args, generator, vocab_size) -> dict:
    """``masked_eval``'s MLM loss and accuracy on NSP pairs, with the NSP loss and accuracy (chance: 1/2)."""
    loss, correct, selected, nsp_loss_sum, nsp_correct, rows = 0.0, 0, 0, 0.0, 0, 0
    for _ in range(args.eval_batches):
        batch = nsp_batch(val, args.batch_size, args.block_size, generator, vocab_size)
        mlm, nsp = (t.float().cpu() for t in forward.outputs(batch))
        labels, is_random = batch[2], batch[4]
        n = int(labels.ne(IGNORE).sum())
        loss += mlm_loss(mlm, labels).item() * n
        c, s = masked_accuracy(mlm, labels)
        correct, selected = correct + c, selected + s
        nsp_loss_sum += F.cross_entropy(nsp, is_random, reduction="sum").item()
        nsp_correct, rows = nsp_correct + int(nsp.argmax(-1).eq(is_random).sum()), rows + len(is_random)
    return {"val_loss": loss / max(selected, 1), "val_accuracy": correct / max(selected, 1),
            "val_nsp_loss": nsp_loss_sum / rows, "val_nsp_accuracy": nsp_correct / rows}


def unigram_guess(data, vocab_size: int) -> dict:
    """The guesses to beat: always the most common token (accuracy), and the unigram entropy (loss)."""
    counts = task_mod.token_counts(data, vocab_size)
    return {"unigram_accuracy": float(counts.max() / counts.sum()), **task_mod.unigram_entropy(data, vocab_size)}


def masked_report(metrics: dict, baseline: dict, unit: str) -> str:
    nsp = f", NSP accuracy {metrics['val_nsp_accuracy']:.1%} (chance 50%)" if "val_nsp_accuracy" in metrics else ""
    return (f"val MLM loss {metrics['val_loss']:.3f} nats/{unit} (unigram {baseline['unigram_entropy']:.3f}), "
            f"masked-token accuracy {metrics['val_accuracy']:.1%} (unigram guess {baseline['unigram_accuracy']:.1%})"
            + nsp)


MASKED = task_mod.Task("masked-lm", masked_batch, masked_loss, masked_eval, unigram_guess, masked_report, sample=False,
                   hf_task="masked-lm", sequence_loss=masked_sequence_loss)
MASKED_NSP = task_mod.Task("masked-lm+nsp", nsp_batch, nsp_loss, nsp_eval, unigram_guess, masked_report, sample=False,
                       hf_task="masked-lm", inputs=2)


# ----------------------------------------------------------------------------- the recipe
# Sized for ~5 minutes on a 2-core CPU (README, Results): a step (128 x 32 bytes) runs at about twice
# the GPT recipe's tokens/s, so 1200 steps take about the time of GPT's 600. Layout: ZeRO-1, in the
# machine's precision (recipes/precision.py), as every recipe.
MODEL_DEFAULTS = dict(n_layer=4, n_head=4, n_embd=192, ffn_dim=768, block_size=32, dropout=0.0, init_std=0.05)
DEFAULTS = dict(**MODEL_DEFAULTS, nsp=False, **recipe.MODEL_SOURCE_DEFAULTS,
                **{**recipe.TRAIN_DEFAULTS, "out": "out/bert", "lr": 1e-3, "end_lr": 1e-4,
                   "weight_decay": 0.01, "batch_size": 128, "steps": 1200},
                **{**layout.LAYOUT_DEFAULTS, "zero": 1})
UNITS = "class:Layer"
HELP = {**recipe.TRAIN_HELP, "block_size": "sequence length in bytes (tokens with --tokenizer)",
        "init_std": "std of every matrix at init (BERT's initializer_range: 0.02; the flavors keep it)",
        "ffn_dim": "MLP hidden width",
        "zero": "ZeRO stage (default 1, the seed's): " + layout.LAYOUT_HELP["zero"],
        "nsp": "also train next-sentence prediction: [CLS] A [SEP] B [SEP] pairs, B the next window or (1/2) a "
               "random one, a classifier on [CLS]; eval adds the NSP accuracy",
        "flavor": "a published BERT size (module docstring): " + ", ".join(FLAVORS) + "; its NSP head only with --nsp"}
RULES = dict(n_layer=recipe.AT_LEAST_1, n_head=recipe.AT_LEAST_1, n_embd=recipe.AT_LEAST_1,
             ffn_dim=recipe.AT_LEAST_1, dropout=(lambda v: 0 <= v < 1, "a number in [0, 1)"),
             init_std=(lambda v: math.isfinite(v) and v > 0, "a finite number > 0"), **recipe.TRAIN_RULES)
FLAG_TO_FIELD = dict(n_layer="n_layers", n_head="n_heads", n_embd="dim", ffn_dim="ffn_dim",
                     dropout="dropout", init_std="init_std")


def _check_model_flags(args: argparse.Namespace, nsp: bool = False) -> list[str]:
    """The model flags' cross-checks, and --nsp's: ``nsp`` is whether the recipe trains the NSP task."""
    errors = []
    if args.tile_mlp:
        errors.append(f"--tile-mlp: token tiles serve the causal LM recipes (gpt, llama); expected 0 for BERT, got "
                      f"{args.tile_mlp}")
    if args.sp != 1 and (nsp or args.hf_config is not None):
        errors.append(f"--sp {args.sp}: BERT splits its tokens over the ranks for the masked loss alone, on the "
                      f"recipe's own model: "
                      + ("next-sentence prediction reads [CLS], which one rank holds (drop --nsp)" if nsp else
                         "a transformers BERT takes an attention mask it builds (drop --hf-config)"))
    if args.n_head >= 1 and args.n_embd % args.n_head:
        errors.append(f"--n-embd: expected a multiple of --n-head {args.n_head}, got {args.n_embd}")
    if args.nsp != nsp:  # bert.main picks the recipe by --nsp; a caller of loop.main must too
        errors.append(f"--nsp: {args.nsp}, but this Recipe trains {'MLM + NSP' if nsp else 'MLM alone'} "
                      f"(expected bert.{'RECIPE_NSP' if args.nsp else 'RECIPE'}, as bert.main picks)")
    if args.nsp and args.hf_config is not None:
        errors.append("--nsp: trains the recipe's own BERT; --hf-config builds a transformers masked LM, which has "
                      "no NSP head (expected one of the two)")
    if args.nsp and args.block_size < 5:
        errors.append(f"--block-size: --nsp needs [CLS] A [SEP] B [SEP], at least 5 tokens, got {args.block_size}")
    return errors


def materializer(seed: int, std: float = 0.02):
    """BERT's init as zf.materialize rules: LayerNorms 1 and 0, biases 0, every matrix N(0, std)."""
    import zfunc as zf

    zero = zf.materialize.constant(0.0)
    return zf.materialize.by_name({"*norm.weight": zf.materialize.constant(1.0), "*norm.bias": zero, "*bias": zero,
                                   "*": zf.materialize.normal(std, seed)})


def build(args: argparse.Namespace, vocab_size: int) -> recipe.Built:
    """The BERT the flags (or --flavor, or --hf-config) ask for, on the current (meta) device;
    ``vocab_size``: the data's ids and the 4 special ones."""
    if args.hf_config is not None:
        return hf.built(args, vocab_size, "masked-lm")
    flavor = lookup(FLAVORS, args.flavor, "bert") if args.flavor else {}
    kwargs = recipe.model_kwargs(args, flavor, FLAG_TO_FIELD, "max_seq_len", vocab_size,
                                 special=len((PAD, CLS, SEP, MASK)))
    kwargs["nsp"] = args.nsp  # the head, and sentence A / B embeddings, only when the task trains them
    if args.nsp:
        kwargs["type_vocab_size"] = max(2, kwargs.get("type_vocab_size", 0))
    cfg = BertConfig(**kwargs)
    model = Bert(cfg)
    flops = 6 * model.num_params() + 12 * cfg.n_layers * args.block_size * cfg.dim
    return recipe.Built(model, asdict(cfg), cfg.max_seq_len,
                        materialize=lambda seed: materializer(seed, cfg.init_std), units=UNITS, flops_per_token=flops)


RECIPE = recipe.Recipe("bert", __doc__.split("\n\n")[0], DEFAULTS, HELP, RULES, build, task=MASKED, units=UNITS,
                       check=_check_model_flags, extra_vocab=4, flavors=lambda name: lookup(FLAVORS, name, "bert"))
RECIPE_NSP = replace(RECIPE, task=MASKED_NSP, check=lambda args: _check_model_flags(args, nsp=True))


def main(argv=None):
    """The command line (recipes/loop.py); ``--scaling 1,2`` runs the weak-scaling table instead
    (recipes/scaling.py, with the other flags given). Flags that cannot work exit with status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--scaling", type=str, default=None)
    known, rest = first.parse_known_args(argv)
    task = argparse.ArgumentParser(add_help=False)
    task.add_argument("--nsp", action="store_true")
    chosen = RECIPE_NSP if task.parse_known_args(argv)[0].nsp else RECIPE
    if known.scaling is not None:
        return scaling.weak_scaling(chosen, known.scaling, rest)
    return loop.main(chosen, argv)


if __name__ == "__main__":
    loop.script(main)
