"""One module made tensor-parallel in place: its params sliced (``Layout``) and its forward replaced.

Styles (Megatron's layers, on the module's own class):

- ``colwise`` (a ``Linear`` or transformers' ``Conv1D``): output features sliced; the input enters
  through ``copy_to`` (whole in forward, grads all-reduced in backward); the output stays sliced.
  ``colwise`` with ``parts=k`` slices each of ``k`` fused outputs (q, k and v of one projection).
- ``replicated_kv``: a grouped-query key or value projection whose kv heads tp does not divide: whole on
  every rank, its output cut to one kv head per local query head, its grads summed over the group.
- ``rowwise``: input features sliced (the input arrives sliced, from a colwise layer); the output is
  the all-reduce of the partial products (``reduce_from``), then the bias, which is replicated.
- ``vocab`` on an ``Embedding``: rows (tokens) sliced, padded to a multiple of tp; each rank looks up
  the tokens it holds, zeros the others', and the outputs are all-reduced.
- ``vocab`` on a ``Linear`` (an LM head, tied to the embedding or not): output rows sliced as the
  embedding's; its logits are gathered (``gather_from``) and the padding dropped, so the model's
  output keeps its meaning; with ``gather=False`` each rank returns its vocab slice, padded columns
  at -inf, for ``zf.tensor_parallel.cross_entropy``.

A param tied to another (an LM head's weight) is sliced once: both modules hold the same new
``Parameter``; two modules slicing one tied param differently is an error naming both.
"""
from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zfunc.tensor.collectives import Group
from zfunc.tensor.layout import Layout, Slicing


def matmul_kind(module: nn.Module) -> str | None:
    """"linear" for ``nn.Linear``, "conv1d" for transformers' ``Conv1D`` (weight ``(in, out)``), else None."""
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None:
        return "conv1d"
    return None


def _matmul(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight if kind == "linear" else weight.t(), bias)


class Slicer:
    """Slices params in place, keeping ties: one per ``tensor_parallel`` call."""

    def __init__(self, layout: Layout, model: nn.Module):
        self.layout, self.done = layout, {}
        self.names = {id(p): n for n, p in model.named_parameters()}  # tied params: their first name

    def slice(self, module: nn.Module, where: str, attr: str, slicing: Slicing) -> None:
        old = module._parameters[attr]
        name = self.names[id(old)]
        if id(old) in self.done:
            new, first, by, _ = self.done[id(old)]
            if first != slicing:
                raise ValueError(f"plan: param '{name}' is tied between '{by}' and '{where}', which slice it "
                                 f"differently ({first} vs {slicing}); give both the same style")
        else:
            new = nn.Parameter(slicing.piece(old.detach(), self.layout.rank), requires_grad=old.requires_grad)
            self.done[id(old)] = (new, slicing, where, old)  # old kept alive: its id stays its own
            self.layout.slicings[name] = slicing
        module._parameters[attr] = new

    def retie(self, model: nn.Module) -> None:
        """Point every module slot still holding a sliced param's old ``Parameter`` at the new one
        (a param tied between modules, e.g. an MLM head's bias, is held by both)."""
        for module in model.modules():
            for attr, p in module._parameters.items():
                if p is not None and id(p) in self.done:
                    module._parameters[attr] = self.done[id(p)][0]


def _split(where: str, what: str, size: int, tp: int, parts: int = 1) -> None:
    if size % (tp * parts):
        of = f"{parts} fused parts of {size // parts}" if parts > 1 else str(size)
        raise ValueError(f"tensor_parallel: module '{where}': its {what} ({of}) do not split over tp={tp}; give it "
                         "\"replicate\" in the plan, or pick a tp that divides them")


def colwise(module: nn.Module, where: str, group: Group, slicer: Slicer, parts: int = 1) -> None:
    kind = _need(module, where, "colwise")
    dim = 0 if kind == "linear" else 1
    out = module.weight.shape[dim]
    _split(where, "output features", out, group.world, parts)
    slicer.slice(module, where, "weight", Slicing(dim, group.world, out, out, parts))
    if module.bias is not None:
        slicer.slice(module, where, "bias", Slicing(0, group.world, out, out, parts))
    if kind == "linear":
        module.out_features = out // group.world
    else:
        module.nf = out // group.world

    def forward(self, x):
        return _matmul(kind, group.copy_to(x), self.weight, self.bias)

    module.forward = types.MethodType(forward, module)


def rowwise(module: nn.Module, where: str, group: Group, slicer: Slicer) -> None:
    kind = _need(module, where, "rowwise")
    dim = 1 if kind == "linear" else 0
    width = module.weight.shape[dim]
    _split(where, "input features", width, group.world)
    slicer.slice(module, where, "weight", Slicing(dim, group.world, width, width))
    if kind == "linear":
        module.in_features = width // group.world

    def forward(self, x):
        y = group.reduce_from(_matmul(kind, x, self.weight, None))
        return y if self.bias is None else y + self.bias

    module.forward = types.MethodType(forward, module)

def replicated_kv(module: nn.Module, where: str, group: Group, heads: int, head_dim: int, keep: list[int]) -> None:
    """A grouped-query key or value projection of ``heads`` kv heads that tp does not divide, replicated:
    its weight stays whole on every rank, and its output keeps, for each of this rank's query heads, the
    kv head that query head reads (``keep``), so the attention runs one kv head per query head here.

    Law: each rank's grads of the weight are partial (its query heads' share); they are all-reduced
    over the group in backward (``Group.sum_grad``; sequence-parallel: the step sums the replicated
    params' grads itself), so the grads are the whole ones on every rank, as for any replicated param.
    Cost: the whole projection computed on every rank, one all-reduce of the weight's (and bias')
    grads per microbatch (``2 * 4 * numel`` bytes), and key/value activations of one head per local
    query head."""
    kind = _need(module, where, "colwise")
    index = torch.tensor(keep)

    def forward(self, x):
        w, b = self.weight, self.bias
        if not group.sequence_parallel:
            w, b = group.sum_grad(w), (None if b is None else group.sum_grad(b))
        y = _matmul(kind, group.copy_to(x), w, b)
        return y.unflatten(-1, (heads, head_dim)).index_select(-2, index.to(y.device)).flatten(-2)

    module.forward = types.MethodType(forward, module)


def vocab(module: nn.Module, where: str, group: Group, slicer: Slicer, gather: bool = True) -> None:
    tp, rank = group.world, group.rank
    if isinstance(module, nn.Embedding):
        if module.max_norm is not None or module.sparse:
            raise ValueError(f"tensor_parallel: module '{where}': a vocab-parallel Embedding needs max_norm=None and "
                             f"sparse=False, got max_norm={module.max_norm}, sparse={module.sparse}")
        size = module.num_embeddings
        padded = -(-size // tp) * tp
        per, lo = padded // tp, rank * (padded // tp)
        slicer.slice(module, where, "weight", Slicing(0, tp, size, padded))
        pad = module.padding_idx
        local_pad = pad - lo if pad is not None and lo <= pad < lo + per else None

        def embed(self, ids):
            local = ids - lo
            outside = (local < 0) | (local >= per)
            out = F.embedding(local.masked_fill(outside, 0), self.weight, local_pad, None, 2.0,
                              self.scale_grad_by_freq, False)
            return group.reduce_from(out.masked_fill(outside.unsqueeze(-1), 0.0))

        module.forward = types.MethodType(embed, module)
        return
    if matmul_kind(module) != "linear":
        raise ValueError(f"tensor_parallel: module '{where}': style \"vocab\" takes an nn.Embedding or an nn.Linear "
                         f"(an LM head), got {type(module).__name__}")
    size = module.out_features
    padded = -(-size // tp) * tp
    per = padded // tp
    slicer.slice(module, where, "weight", Slicing(0, tp, size, padded))
    if module.bias is not None:
        slicer.slice(module, where, "bias", Slicing(0, tp, size, padded))
    real = max(0, min(per, size - rank * per))  # this rank's columns that are vocabulary, not padding

    def head(self, x):
        logits = F.linear(group.copy_to(x), self.weight, self.bias)
        if gather:
            return group.gather_from(logits)[..., :size] if padded > size else group.gather_from(logits)
        return logits if real == per else logits.masked_fill(_padding(per, real, logits.device), float("-inf"))

    module.forward = types.MethodType(head, module)


def sequence_split(module: nn.Module, group: Group) -> None:
    """A replicated lookup (position or token-type embedding) made to return this rank's tokens
    only (``Group.split_seq``), so that it adds to the sequence-parallel stream."""
    whole = module.forward
    module.forward = lambda *args, **kwargs: group.split_seq(whole(*args, **kwargs))


def _padding(per: int, real: int, device: Any) -> torch.Tensor:
    return torch.arange(per, device=device) >= real


def _need(module: nn.Module, where: str, style: str) -> str:
    kind = matmul_kind(module)
    if kind is None:
        raise ValueError(f"tensor_parallel: module '{where}': style \"{style}\" takes an nn.Linear or transformers' "
                         f"Conv1D, got {type(module).__name__}")
    return kind
