"""The loss of a rank's tokens such that the mean over a sequence group is the whole sequences' loss.

A sequence-parallel model returns the outputs of its rank's tokens only. ``cross_entropy(logits,
labels, layout)`` takes the same tokens of the whole ``(B, T)`` labels (pre-shifted: ``labels[:, t]``
is the target of token ``t``, ``ignore_index`` where there is none), sums their cross-entropy and
divides by the valid labels of the *whole* batch (counted from the labels every rank is given: no
communication), times ``sp``. ``lm_head_loss`` does the same from the final hidden states and the
head's weight, over token tiles (``zf.tiling.lm_head_loss``: never the whole logits). A model whose
forward ends in its head (``return self.lm_head(h)``) computes that loss itself once
``loss_head(model, tiles=k)`` has replaced the head by a ``HeadLoss`` (same weight, same name, ties
kept): called inside ``targets(labels, layout)``, the model returns this rank's loss instead of
logits, and the head's weight is read where the model reads it (so ``zf.shard`` stage 3 gathers it
as the head's unit).

**Law.** The mean over the ``sp`` ranks of the group is ``F.cross_entropy`` (mean over the valid
labels) of the whole sequences, and so are the grads once averaged over the ranks -- what
``zf.shard`` over ``mesh.dp_sp`` does; ranks holding few valid labels weigh less, as in the plain
mean. With ``sp = 1`` it is ``F.cross_entropy``. Cost: the cross-entropy of ``T / sp`` tokens per
rank and a count over ``B T`` labels.
"""
from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

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


_targets: contextvars.ContextVar = contextvars.ContextVar("zfunc_sequence_targets", default=None)


@contextmanager
def targets(labels: torch.Tensor, layout: SequenceLayout | None = None, ignore_index: int = -100) -> Iterator[None]:
    """The labels (the whole ``(B, T)``, pre-shifted) a ``HeadLoss`` computes its loss against while this is open."""
    token = _targets.set((labels, layout, ignore_index))
    try:
        yield
    finally:
        _targets.reset(token)


class HeadLoss(nn.Module):
    """A bias-free head ``Linear`` that returns ``lm_head_loss`` of its input against the open ``targets``:
    this rank's share of the whole sequences' mean cross-entropy, over ``tiles`` token tiles."""

    def __init__(self, head: nn.Linear, tiles: int):
        super().__init__()
        self.weight, self.tiles = head.weight, tiles  # the same Parameter: a tie to the embedding stays

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        given = _targets.get()
        if given is None:
            raise RuntimeError("HeadLoss: the model's head computes the loss; call the model inside "
                               "zf.sequence.targets(labels, layout)")
        labels, layout, ignore_index = given
        return lm_head_loss(hidden, self.weight, labels, layout, tiles=self.tiles, ignore_index=ignore_index)

    def extra_repr(self) -> str:
        return f"vocab={self.weight.shape[0]}, d={self.weight.shape[1]}, tiles={self.tiles}"


def loss_head(model: nn.Module, *, tiles: int, name: str = "lm_head") -> nn.Module:
    """``model`` with its head ``name`` (a bias-free ``nn.Linear``) replaced by a ``HeadLoss`` of ``tiles`` token
    tiles; returns ``model``. The model then returns its loss, called inside ``targets(labels, layout)``."""
    head = model.get_submodule(name) if name else None
    if type(head) is not nn.Linear or head.bias is not None:
        raise ValueError(f"name: {name!r} must name a bias-free nn.Linear head of the model, got "
                         f"{type(head).__name__ if head is not None else None}")
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles: expected an int >= 1, got {tiles!r}")
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, HeadLoss(head, tiles))
    return model
