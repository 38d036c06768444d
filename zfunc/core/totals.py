"""A step's totals over the ranks: its scalars summed in one all-reduce (``sum_over_ranks``), and its
grads without the params no rank produced a grad for (``without_missing_grads``)."""
from __future__ import annotations

from typing import Any

import torch

from zfunc.core import tree
from zfunc.core.roles import SumAcross

PyTree = Any


def sum_over_ranks(sum_across: SumAcross, sq_norm: torch.Tensor | None, loss: torch.Tensor | None,
                   produced: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The step's scalars summed over the ranks in one call of ``sum_across`` (one all-reduce):
    this rank's squared grad norm (its parts: the sum of its grads' squares), its loss and, per
    leaf, whether it produced a grad; each None where there is none to sum. Returns the totals
    ``(norm, loss, produced)``: the global grad norm (the square root of the summed squares), the
    summed loss and the number of ranks that produced a grad for each leaf (None where not given).
    Cost: one all-reduce of ``1 + 1 + leaves`` fp32 numbers at most, on the device of the norm
    (else of the loss)."""
    given = [(what, x) for what, x in (("grad-norm", sq_norm), ("loss", loss), ("grads-produced", produced))
             if x is not None]
    ref = given[0][1]
    flat = torch.cat([x.reshape(-1).to(ref.device, torch.float32) for _, x in given])
    names = [what for what, _ in given]
    label = (", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]) + " all-reduce"
    flat = sum_across(flat, label)
    k = int(sq_norm is not None)
    norm = flat[0].sqrt() if k else None
    if loss is not None:
        loss, k = flat[k], k + 1
    return norm, loss, (None if produced is None else flat[k:])


def without_missing_grads(grads: PyTree, produced: torch.Tensor) -> PyTree:
    """``grads`` with ``None`` for the params no rank produced a grad for (``produced``: per leaf,
    the ranks that did; their grads are zeros): the optimizer leaves those alone, as DDP does."""
    leaves, treespec = tree.flatten(grads)
    return tree.unflatten(treespec, [g if n > 0 else None for g, n in zip(leaves, produced.tolist())])
