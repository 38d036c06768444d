"""What a recipe trains on its windows and how it is judged: a ``Task`` (the batch, the loss, the eval,
the baseline to beat, the closing words), the causal LM task every recipe but BERT's uses, and
sampling from a model.

The law a task keeps: its batch depends on the generator alone (``(--seed, step)``) and is split over
the ranks by rows, so the same flags train the same on any layout (a masked task's loss is normalized by
the global batch's count of masked tokens for that reason).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from recipes import data as data_mod


@dataclass(frozen=True)
class Task:
    """What is trained on the windows: the batch made of them, its loss, the eval and the closing words.

    ``batch(data, batch_size, block_size, generator, vocab_size)``: the global batch (a tuple of tensors
    split by rows; ``vocab_size``: the data's); its first ``inputs`` tensors are the model's arguments.
    ``loss(out, batch)``: the loss of the model's output ``out``. ``evaluate(forward, val, args,
    generator, vocab_size)``: {"val_loss": ..., and more}; ``forward(batch)`` is the loss,
    ``forward.logits(batch)`` the logits, ``forward.outputs(batch)`` the model's whole output.
    ``baseline(val, vocab_size)``: {name: value} of the guesses to beat.
    """

    name: str
    batch: Callable
    loss: Callable
    evaluate: Callable
    baseline: Callable
    report: Callable[[dict, dict, str], str]  # (eval metrics, baseline, unit) -> the final numbers in words
    sample: bool = True
    hf_task: str = "causal-lm"
    inputs: int = 1  # leading batch tensors the model takes (BERT with NSP: the ids and the token types)
    # (out, batch, layout) -> a sequence-parallel rank's share (--sp: its tokens' outputs), whose mean over the
    # sp ranks is ``loss``; None: zf.sequence.cross_entropy of ``batch[1]``, a causal LM's pre-shifted labels
    sequence_loss: Callable | None = None


def logits_of(out):
    """A model's logits: our models return them (BERT: with the NSP logits beside them)."""
    return out[0] if isinstance(out, tuple) else out


def token_counts(data, vocab_size: int, piece: int = 1 << 24) -> torch.Tensor:
    """How often each id occurs in ``data`` (a tensor, or an array / np.memmap), float64, at least
    ``vocab_size`` long; counted ``piece`` ids at a time, so it needs 8 bytes per id of a piece, not
    of the whole split (a memmap's pages are read once)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for i in range(0, len(data), piece):
        part = data[i:i + piece]
        values = part.long() if isinstance(part, torch.Tensor) else torch.from_numpy(np.asarray(part, dtype=np.int64))
        c = torch.bincount(values, minlength=vocab_size).double()
        counts = F.pad(counts, (0, len(c) - len(counts))) if len(c) > len(counts) else counts  # ids past vocab_size
        counts[:len(c)] += c
    return counts


def unigram_entropy(data, vocab_size: int = 256) -> dict:
    """Entropy of the token histogram in nats/token: the loss of a model that ignores context."""
    p = token_counts(data, vocab_size)
    p = p[p > 0] / p.sum()
    return {"unigram_entropy": float(-(p * p.log()).sum())}


def _causal_loss(out, batch):
    return F.cross_entropy(logits_of(out).flatten(0, 1).float(), batch[1].flatten())


def _causal_eval(forward, val, args, gen, vocab_size) -> dict:
    total = 0.0
    for _ in range(args.eval_batches):
        batch = data_mod.get_batch(val, args.batch_size, args.block_size, gen)
        total += forward(batch).item()
    return {"val_loss": total / args.eval_batches}


def _causal_report(metrics: dict, baseline: dict, unit: str) -> str:
    return f"val loss {metrics['val_loss']:.3f} nats/{unit} (unigram baseline {baseline['unigram_entropy']:.3f})"


def _causal_batch(data, batch_size, block_size, generator, vocab_size):
    return data_mod.get_batch(data, batch_size, block_size, generator)


CAUSAL = Task("causal-lm", _causal_batch, _causal_loss, _causal_eval, unigram_entropy, _causal_report)


@torch.no_grad()
def generate(model_fn, prompt: list[int], length: int, block_size: int, temperature=0.8, top_k=40,
                 generator=None, device="cpu") -> list[int]:
    """Sample ``length`` ids after ``prompt`` (``[10]``, a newline, when empty): each drawn from the
    ``top_k`` likeliest of the last position's logits at ``temperature``, the window the last
    ``block_size`` ids; model_fn(idx) -> logits (a model, a closure, or a model returning them first
    in a tuple). Cost: ``length`` forwards of at most ``block_size`` positions (no key/value cache)."""
    idx = torch.tensor(prompt or [10], dtype=torch.long, device=device)[None]
    for _ in range(length):
        logits = logits_of(model_fn(idx[:, -block_size:]))[:, -1, :].float() / max(temperature, 1e-6)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(F.softmax(logits, dim=-1).cpu(), 1, generator=generator).to(device)
        idx = torch.cat([idx, nxt], dim=1)
    return idx[0, -length:].tolist() if length else []
