"""An explicit tensor-parallel plan: module-name glob patterns -> styles, and the head counts it patches.

``plan`` maps ``fnmatch`` patterns over ``model.named_modules()`` names to a style: "colwise",
"colwise:k" (a projection of ``k`` fused equal outputs, each sliced: GPT-2's ``c_attn`` is
"colwise:3"), "rowwise", "vocab" or "replicate" (``zfunc.tensor.layers``). A module takes the style
of the first pattern it matches; modules no pattern matches are replicated; a pattern that matches
no module is an error naming it (a typo would otherwise train replicated).

Head counts: the module that owns a colwise projection (the attention block) runs its heads on this
rank's slice, so its integer attributes named in ``HEAD_ATTRS`` (head counts) and ``WIDTH_ATTRS``
(widths its forward reshapes or splits by) are divided by tp; a count that tp does not divide is an
error naming the module, the attribute and the sizes. Grouped-query attention: its kv heads are split
like its query heads, so tp must divide the kv head count too.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

STYLES = ("colwise", "rowwise", "vocab", "replicate")
HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_head", "n_kv_heads",
              "num_key_value_heads", "num_kv_heads")
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


def head_patches(owner: nn.Module, where: str, tp: int) -> dict[str, tuple[int, int]]:
    """``{attribute: (whole, per rank)}``: ``owner``'s head-count and width attributes divided by
    ``tp`` (see the module docstring), checked, not yet set (``patch``)."""
    patched = {}
    for attr in (*HEAD_ATTRS, *WIDTH_ATTRS):
        value = owner.__dict__.get(attr)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % tp:
                raise ValueError(f"tensor_parallel: module '{where}': {attr}={value} does not split over tp={tp} "
                                 "(heads are split over the tp ranks); pick a tp that divides it")
            patched[attr] = (value, value // tp)
    return patched


def patch(owner: nn.Module, patched: dict[str, tuple[int, int]]) -> None:
    """Set ``owner``'s attributes to their per-rank values (``head_patches``)."""
    for attr, (_, per) in patched.items():
        setattr(owner, attr, per)
