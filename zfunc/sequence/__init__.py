"""Sequence parallelism (``zf.sequence_parallel``): each rank of an ``sp`` group computes ``T / sp`` tokens of
every sequence; attention sees the whole sequence by Ulysses' all-to-all (ulysses.py) or ring attention (ring.py).
Which tokens a rank holds (layout.py), the model transformation (parallel.py) and the loss whose mean over the
group is the whole sequences', and a head computing it over token tiles (loss.py)."""
from zfunc.sequence.layout import SequenceLayout
from zfunc.sequence.loss import HeadLoss, cross_entropy, lm_head_loss, loss_head, targets
from zfunc.sequence.parallel import KINDS, layout_in_force, layout_of, sequence_parallel, whole
from zfunc.sequence import ring, ulysses
from zfunc.sequence.ring import ring_attention
from zfunc.sequence.ulysses import heads_to_tokens, tokens_to_heads, ulysses_attention

__all__ = ["HeadLoss", "KINDS", "SequenceLayout", "cross_entropy", "heads_to_tokens", "layout_in_force", "layout_of",
           "lm_head_loss", "loss_head", "ring", "ring_attention", "sequence_parallel", "targets", "tokens_to_heads",
           "ulysses", "ulysses_attention", "whole"]
