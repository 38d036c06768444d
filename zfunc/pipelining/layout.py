"""Which stage runs and owns what: a pipeline's ``Layout`` (made once, from the model, by
``make_layout``) and ``PipelineSpec``, the static metadata of one stage's state.

``make_layout`` assigns consecutive pipeline units to stages; every param outside the units is
shared (owned by stage 0, lent to the last stage); the rules are in ``zfunc.pipelining.step``'s
docstring. Cost: one walk over the model's modules and params.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from zfunc.model.units import Selector


@dataclass(frozen=True)
class Layout:
    """Which stage runs and owns what: ``units`` (pipeline units' module names, in order),
    ``bounds[s]`` (first and last unit index of stage s), ``owner`` (param name -> stage; shared
    params -> 0) and ``shared`` (params outside the units, lent to the last stage)."""

    units: tuple[str, ...]
    bounds: tuple[tuple[int, int], ...]
    owner: dict[str, int]
    shared: frozenset[str]


def _pipeline_units(model: nn.Module, units: Selector | Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """``(module name, canonical param names)`` of the pipeline units, in module order."""
    modules = dict(model.named_modules())
    if callable(units):
        found = units(model)
        blocks = [u for u in found if not all(p.rpartition(".")[0] == u.name for p in u.params)]
        chosen = [(u.name, tuple(u.params)) for u in (blocks or found)]
    else:
        missing = [n for n in units if n not in modules]
        if isinstance(units, str) or missing:
            raise ValueError(f"units: expected a zf.units selector or module names of the model, got {units!r}")
        canonical = {id(p): n for n, p in model.named_parameters()}
        chosen = [(n, tuple(dict.fromkeys(canonical[id(p)] for p in modules[n].parameters()))) for n in units]
    order = {name: k for k, name in enumerate(modules)}
    return sorted(chosen, key=lambda u: order[u[0]])


def _split_counts(n: int, stages: int, split: Sequence[int] | None) -> list[int]:
    if split is None:  # even; the first n % stages stages take one more
        base, extra = divmod(n, stages)
        return [base + (s < extra) for s in range(stages)]
    split = list(split)
    if len(split) != stages or any(not isinstance(c, int) or c < 1 for c in split) or sum(split) != n:
        raise ValueError(f"split: expected {stages} ints >= 1 (units per stage) summing to the model's {n} pipeline "
                         f"units, got {split!r}")
    return split


def make_layout(model: nn.Module, units: Selector | Sequence[str], stages: int, split: Sequence[int] | None) -> Layout:
    """Assign consecutive pipeline units to stages; everything else is shared (see the module docstring)."""
    trunk = _pipeline_units(model, units)
    if stages > len(trunk):
        raise ValueError(f"stages: {stages} stages need at least {stages} pipeline units, the model has {len(trunk)}: "
                         f"{[name for name, _ in trunk]}")
    bounds, start = [], 0
    for count in _split_counts(len(trunk), stages, split):
        bounds.append((start, start + count - 1))
        start += count
    owner = {n: 0 for n, _ in model.named_parameters()}
    in_units = set()
    for s, (first, last) in enumerate(bounds):
        for _, params in trunk[first : last + 1]:
            owner.update(dict.fromkeys(params, s))
            in_units.update(params)
    return Layout(tuple(name for name, _ in trunk), tuple(bounds), owner, frozenset(owner.keys() - in_units))
