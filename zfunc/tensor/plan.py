"""An explicit tensor-parallel plan: module-name glob patterns -> styles, and the head counts it patches.

``plan`` maps ``fnmatch`` patterns over ``model.named_modules()`` names to a style: "colwise",
"colwise:k" (a projection of ``k`` fused equal outputs, each sliced: GPT-2's ``c_attn`` is
"colwise:3"), "rowwise", "vocab" or "replicate" (``zfunc.tensor.layers``). A module takes the style
of the first pattern it matches; modules no pattern matches are replicated; a pattern that matches
no module is an error naming it (a typo would otherwise train replicated).

Head counts: the module that owns a colwise projection (the attention block) runs its heads on this
rank's slice, so its integer attributes named in ``HEAD_ATTRS`` (head counts) and ``WIDTH_ATTRS``
(widths its forward reshapes or splits by) are divided by tp; a count that tp does not divide is an
error naming the module, the attribute and the sizes.

Grouped-query attention: its kv heads are split like its query heads where tp divides them. Where it
does not (2 kv heads over tp=4, or 1 kv head over tp=2) but divides the query heads, the key and value
projections are replicated (``kv_replication``, read from the owner's ``head_dim`` and the projections'
widths): each rank computes them whole and keeps one kv head per local query head, so the owner's kv
head counts become its local query heads and its kv groups (``GROUP_ATTRS``) 1
(``layers.replicated_kv``: the law and the cost).
"""
from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

STYLES = ("colwise", "rowwise", "vocab", "replicate")
QUERY_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads")
KV_ATTRS = ("n_kv_head", "n_kv_heads", "num_key_value_heads", "num_kv_heads")
HEAD_ATTRS = (*QUERY_ATTRS, *KV_ATTRS)
GROUP_ATTRS = ("num_key_value_groups",)  # query heads per kv head (transformers' attention)
WIDTH_ATTRS = ("split_size", "all_head_size", "inner_dim")


def parse_style(style: str, pattern: str) -> tuple[str, int]:
    """``(style, parts)`` of a plan value: "colwise:3" -> ("colwise", 3)."""
    kind, _, parts = style.partition(":") if isinstance(style, str) else ("", "", "")
    if kind not in STYLES or (parts and (kind != "colwise" or not parts.isdigit() or int(parts) < 1)):
        raise ValueError(f"plan: pattern {pattern!r}: expected one of {', '.join(map(repr, STYLES))} or "
                         f"'colwise:k' (k fused outputs), got {style!r}")
    return kind, int(parts or 1)


def match(model: nn.Module, plan: Mapping[str, str]) -> dict[str, tuple[str, int]]:
    """Module name -> ``(style, parts)`` for every module the plan slices (first matching pattern)."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan: expected a dict of module-name patterns -> styles, got {type(plan).__name__}")
    styles = {p: parse_style(s, p) for p, s in plan.items()}
    used: set[str] = set()
    out = {}
    for name, _ in model.named_modules():
        for pattern, style in styles.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                used.add(pattern)
                if style[0] != "replicate":
                    out[name] = style
                break
    unused = [p for p in styles if p not in used]
    if unused:
        raise ValueError(f"plan: pattern{'s' * (len(unused) > 1)} {', '.join(map(repr, unused))} match no module "
                         f"of {type(model).__name__}")
    return out


@dataclass(frozen=True)
class KVReplication:
    """An attention block's kv projections (``names``) replicated over tp: ``kv_heads`` of ``head_dim``
    each, ``query_heads`` in all; ``keep(rank, tp)`` the kv head each of the rank's query heads reads."""

    names: tuple[str, ...]
    query_heads: int
    kv_heads: int
    head_dim: int

    def keep(self, rank: int, tp: int) -> list[int]:
        per, group = self.query_heads // tp, self.query_heads // self.kv_heads
        return [(rank * per + i) // group for i in range(per)]


def kv_replication(owner: nn.Module, widths: dict[str, int], tp: int) -> KVReplication | None:
    """The kv projections among ``owner``'s colwise projections (name -> output width) to replicate (see the
    module docstring), None where there are none: no int ``head_dim`` on the owner, kv heads that tp
    divides, or query heads it does not (refused by ``head_patches``)."""
    head_dim = owner.__dict__.get("head_dim")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        return None
    heads = {n: w // head_dim for n, w in widths.items() if w % head_dim == 0}
    if not heads:
        return None
    query = max(heads.values())
    kv = {n: h for n, h in heads.items() if h < query and query % h == 0 and h % tp}
    if not kv or query % tp or len(set(kv.values())) != 1:
        return None
    return KVReplication(tuple(sorted(kv)), query, next(iter(kv.values())), head_dim)


def head_patches(owner: nn.Module, where: str, tp: int, kv: KVReplication | None = None) -> dict[str, tuple[int, int]]:
    """``{attribute: (whole, per rank)}``: ``owner``'s head-count and width attributes divided by
    ``tp`` (see the module docstring), checked, not yet set (``patch``); with ``kv`` replicated, its kv
    head counts become the rank's query heads and its kv groups 1."""
    patched = {}
    for attr in (*HEAD_ATTRS, *WIDTH_ATTRS, *GROUP_ATTRS):
        value = owner.__dict__.get(attr)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if attr in GROUP_ATTRS:
            if kv is not None:
                patched[attr] = (value, 1)
            continue
        if kv is not None and attr in KV_ATTRS:
            patched[attr] = (value, kv.query_heads // tp)
            continue
        if value % tp:
            raise ValueError(f"tensor_parallel: module '{where}': {attr}={value} does not split over tp={tp} "
                             "(heads are split over the tp ranks); pick a tp that divides it")
        patched[attr] = (value, value // tp)
    return patched


def patch(owner: nn.Module, patched: dict[str, tuple[int, int]]) -> None:
    """Set ``owner``'s attributes to their per-rank values (``head_patches``)."""
    for attr, (_, per) in patched.items():
        setattr(owner, attr, per)
