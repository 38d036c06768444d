"""The cross-entropy of vocab-sliced logits, without gathering them (Megatron's vocab-parallel loss,
torch's ``loss_parallel``).

Each rank holds the logits of its slice of the vocabulary (``zf.tensor_parallel(...,
gather_logits=False)``: padded columns at -inf). Law: the loss equals ``F.cross_entropy`` of the
gathered logits (mean over the targets that are not ``ignore_index``), and so do the grads of each
rank's slice, to fp32 rounding. Cost: for ``N`` tokens, an all-gather of the ``N`` local maxima and
two all-reduces of ``N`` floats (the sums of exponentials and the target logits), instead of
gathering ``N * V`` logits; the grads need no collective (the all-reduces' backward is the identity).
"""
from __future__ import annotations

import torch

from zfunc.dist.mesh import Mesh
from zfunc.tensor.collectives import Group


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mesh: Mesh, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (``(..., V / tp)``: this rank's vocab slice) against
    ``targets`` (``(...)``, ids in the whole vocabulary), computed over ``mesh``'s tp group."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets: expected shape {tuple(logits.shape[:-1])} (the logits' without the vocab dim), "
                         f"got {tuple(targets.shape)}")
    group = Group(mesh.tp_comm, mesh.tp, mesh.tp_rank)
    logits = logits.float()
    per = logits.shape[-1]
    top = group.all_gather_max(logits.amax(-1))
    shifted = logits - top.unsqueeze(-1)
    sum_exp = group.reduce_from(shifted.exp().sum(-1))
    local = targets - mesh.tp_rank * per
    inside = (local >= 0) & (local < per)
    picked = shifted.gather(-1, local.clamp(0, per - 1).unsqueeze(-1)).squeeze(-1)
    target = group.reduce_from(torch.where(inside, picked, torch.zeros_like(picked)))
    losses = sum_exp.log() - target
    valid = targets != ignore_index
    return torch.where(valid, losses, torch.zeros_like(losses)).sum() / valid.sum().clamp(min=1)
