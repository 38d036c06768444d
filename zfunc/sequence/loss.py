"""The loss of a rank's tokens such that the mean over a sequence group is the whole sequences' loss.

A sequence-parallel model returns the outputs of its rank's tokens only. ``cross_entropy(logits,
labels, layout)`` takes the same tokens of the whole ``(B, T)`` labels (pre-shifted: ``labels[:, t]``
is the target of token ``t``, ``ignore_index`` where there is none), sums their cross-entropy and
divides by the valid labels of the *whole* batch (counted from the labels every rank is given: no
communication), times ``sp``. ``lm_head_loss`` does the same from the final hidden states and the
head's weight, over token tiles (``zf.tiling.lm_head_loss``: never the whole logits).

**Law.** The mean over the ``sp`` ranks of the group is ``F.cross_entropy`` (mean over the valid
labels) of the whole sequences, and so are the grads once averaged over the ranks -- what
``zf.shard`` over ``mesh.dp_sp`` does; ranks holding few valid labels weigh less, as in the plain
mean. With ``sp = 1`` it is ``F.cross_entropy``. Cost: the cross-entropy of ``T / sp`` tokens per
rank and a count over ``B T`` labels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zfunc.model.tiling import lm_head_loss as tiled_lm_head_loss
from zfunc.sequence.layout import SequenceLayout


def _check(labels: torch.Tensor, tokens: int, layout: SequenceLayout) -> None:
    if labels.dim() != 2 or labels.is_floating_point():
        raise ValueError(f"labels: expected the whole batch's (B, T) integer labels, got {labels.dtype} "
                         f"{tuple(labels.shape)}")
    if labels.shape[1] != tokens * layout.sp:
        raise ValueError(f"labels: {labels.shape[1]} labels per sequence, but the outputs hold {tokens} tokens "
                         f"on each of sp={layout.sp} ranks; give the whole sequences' labels")


def _scaled(total: torch.Tensor, labels: torch.Tensor, layout: SequenceLayout, ignore_index: int) -> torch.Tensor:
    count = (labels != ignore_index).sum()
    return total * layout.sp / count.to(total.dtype)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, layout: SequenceLayout | None = None,
                  ignore_index: int = -100) -> torch.Tensor:
    """This rank's share of the mean cross-entropy of the whole sequences, scaled by ``sp``.

    Args:
      logits: ``(B, T/sp, V)``, this rank's tokens (a sequence-parallel model's output).
      labels: ``(B, T)``, the whole sequences' pre-shifted labels.
      layout: the model's (``zfunc.sequence.layout_of(model)``); None: one rank holds everything.
    Law and cost: the module docstring.
    """
    layout = layout or SequenceLayout()
    _check(labels, logits.shape[1], layout)
    mine = layout.take(labels)
    total = F.cross_entropy(logits.flatten(0, 1).float(), mine.flatten(), ignore_index=ignore_index, reduction="sum")
    return _scaled(total, labels, layout, ignore_index)


def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 layout: SequenceLayout | None = None, *, tiles: int, ignore_index: int = -100) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, labels, layout)`` over ``tiles`` token tiles, never holding the
    ``(B T/sp, V)`` logits (``zf.tiling.lm_head_loss``'s law and cost). ``hidden``: ``(B, T/sp, d)``."""
    layout = layout or SequenceLayout()
    _check(labels, hidden.shape[1], layout)
    mine = layout.take(labels)
    total = tiled_lm_head_loss(hidden, weight, mine, tiles=tiles, ignore_index=ignore_index, reduction="sum")
    return _scaled(total, labels, layout, ignore_index)
