"""One token tile of ``zf.tiling.lm_head_loss`` over a vocab-sliced head (``mesh=``: tensor parallelism).

Each rank of the tp group holds rows ``[rank * per, (rank + 1) * per)`` of the head's weight, the
vocabulary padded to ``tp * per`` (``zf.tensor_parallel``'s "vocab" slicing: padded rows are zeros, their
logits masked to -inf here). A tile's cross-entropy is Megatron's vocab-parallel one: the tile's
logits ``(n, per)`` stay on their rank; the maximum per token is all-gathered, the sums of exponentials
and the targets' logits (whichever rank holds each target) all-reduced, as one ``(2, n)`` tensor.

Law: the summed loss, this rank's rows of the weight's grad and (once ``hidden``'s partial grads are
summed over the group, ``sum_hidden_grads``) the hidden states' grad equal those of the whole head's
tile (fp32 rounding). Cost per tile of ``n`` tokens: the local matmuls of ``1/tp`` of the vocabulary, an
all-gather of ``n`` floats and an all-reduce of ``2n``; per call, one all-reduce of the hidden states'
grad (``N * d`` floats).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class VocabSlice:
    """This rank's slice of the vocabulary: ``rank`` of ``tp`` over ``comm`` (a ``zf.Mesh``'s ``tp_comm``),
    ``per`` rows each, ``size`` the real vocabulary (the rest padding)."""

    comm: Any
    tp: int
    rank: int
    per: int
    size: int

    @property
    def real(self) -> int:
        """This rank's rows that are vocabulary, not padding."""
        return max(0, min(self.per, self.size - self.rank * self.per))


def of_mesh(mesh: Any, rows: int, vocab_size: int | None) -> VocabSlice:
    """The ``VocabSlice`` of ``mesh``'s tp rank for a weight slice of ``rows`` rows (``vocab_size``: the whole
    vocabulary; None: ``rows * tp``, no padding). ValueError for a vocabulary these rows cannot hold."""
    tp, rank = getattr(mesh, "tp", None), getattr(mesh, "tp_rank", None)
    if not isinstance(tp, int) or not isinstance(rank, int):
        raise TypeError(f"mesh: expected a zf.Mesh, got {type(mesh).__name__}")
    size = rows * tp if vocab_size is None else vocab_size
    if isinstance(size, bool) or not isinstance(size, int) or not (tp - 1) * rows < size <= tp * rows:
        raise ValueError(f"vocab_size: a weight slice of {rows} rows on each of tp={tp} ranks holds a vocabulary of "
                         f"{(tp - 1) * rows + 1} to {tp * rows}, got {vocab_size!r}")
    return VocabSlice(mesh.tp_comm, tp, rank, rows, size)


def tile_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, denom: torch.Tensor,
              dh: torch.Tensor | None, dw: torch.Tensor | None, vocab: VocabSlice) -> torch.Tensor:
    """Summed CE of one token tile over the vocab slices; writes this rank's partial grads of its rows
    into ``dh`` (summed over tp by ``sum_hidden_grads``) and adds its rows' grad into ``dw``."""
    logits = (h @ w.T).float()
    if vocab.real < vocab.per:
        logits[:, vocab.real:] = float("-inf")
    n = len(y)
    top = torch.empty((vocab.tp, n), dtype=logits.dtype, device=logits.device)
    vocab.comm.all_gather(top, logits.amax(-1).contiguous(), label="zf.tiling.lm_head_loss: a tile's maxima")
    shifted = logits.sub_(top.amax(0)[:, None])
    local = y - vocab.rank * vocab.per
    inside = (local >= 0) & (local < vocab.per)
    rows = torch.arange(n, device=y.device)
    sums = torch.stack([shifted.exp().sum(-1), torch.where(inside, shifted[rows, local.clamp(0, vocab.per - 1)], 0.0)])
    vocab.comm.all_reduce(sums, label="zf.tiling.lm_head_loss: a tile's sums of exponentials and target logits")
    loss = ((sums[0].log() - sums[1]) * valid).sum()
    if dh is None and dw is None:
        return loss
    grad = shifted.exp_().div_(sums[0][:, None])  # this rank's columns of the softmax
    grad[rows[inside], local[inside]] -= 1.0
    grad.mul_((valid / denom).to(grad.dtype)[:, None]).nan_to_num_(0.0)
    head_grads(grad, w, h, dh, dw)
    return loss


def head_grads(grad: torch.Tensor, w: torch.Tensor, h: torch.Tensor, dh: torch.Tensor | None,
               dw: torch.Tensor | None) -> None:
    """From a tile's logits grad ``grad`` (fp32): the hidden states' grad written into ``dh`` and the
    head weight's added to ``dw`` (either None: not wanted), in ``w``'s dtype. Two GEMMs."""
    grad = grad.to(w.dtype)
    if dh is not None:
        torch.mm(grad, w, out=dh)
    if dw is not None:
        dw.addmm_(grad.T, h) if dw.dtype == grad.dtype else dw.add_(grad.T @ h)


def sum_hidden_grads(dh: torch.Tensor, vocab: VocabSlice) -> None:
    """Each rank's grad of the hidden states is its vocab rows' part: sum them over the group, in place."""
    vocab.comm.all_reduce(dh, label="zf.tiling.lm_head_loss: the hidden states' grad over the vocab slices")
