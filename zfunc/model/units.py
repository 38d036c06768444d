"""Units: the groups of parameters that ZeRO-3 gathers, frees and reduces together.

A unit is a submodule (named by its qualified name) and the parameters under it. A *selector*
(``by_class``, ``by_names``, ``auto``) is called with the model when the sharded step first runs it
and returns a ``list[Unit]``. Every parameter must belong to exactly one unit: ``by_class`` and
``auto`` give each parameter left over its own small unit, named after the module that owns it;
``by_names`` checks coverage and names what is missing. A module that uses a unit's parameter
outside the unit's subtree (a tied output head) is listed in the unit's ``users``, so its forward
gathers the unit too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Unit:
    """``name``: the unit's module; ``params``: canonical names of its parameters (trainable or
    not, tied ones once); ``users``: qualified names of every module whose forward reads them."""

    name: str
    params: tuple[str, ...]
    users: tuple[str, ...]


Selector = Callable[[nn.Module], list[Unit]]


def _canonical_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _owners(model: nn.Module) -> dict[str, list[str]]:
    """Canonical parameter name -> modules that hold it directly (tied aliases included)."""
    canon = _canonical_names(model)
    owners: dict[str, list[str]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p in mod._parameters.values():
            if p is not None:
                owners.setdefault(canon[id(p)], []).append(mod_name)
    return owners


def _within(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _build(model: nn.Module, unit_names: Iterable[str], cover_rest: bool) -> list[Unit]:
    owners = _owners(model)
    members: dict[str, list[str]] = {u: [] for u in unit_names}
    # Deepest enclosing unit wins, so nested selections are allowed.
    for param in owners:
        enclosing = [u for u in members if _within(param, u)]
        if enclosing:
            members[max(enclosing, key=len)].append(param)
        elif cover_rest:
            members.setdefault(param.rpartition(".")[0], []).append(param)
    uncovered = sorted(set(owners) - {p for ps in members.values() for p in ps})
    if uncovered:
        raise ValueError(f"units: parameters {uncovered[:5]}{'...' if len(uncovered) > 5 else ''} are in no unit; "
                         "add their modules (or '' for the root) to the units")
    units = []
    for name, params in members.items():
        if not params:
            continue
        users = {name}
        for p in params:  # tied aliases held by modules outside the unit
            users.update(o for o in owners[p] if not _within(o, name))
        units.append(Unit(name, tuple(params), tuple(sorted(users))))
    return units


def by_class(*classes: type) -> Selector:
    """One unit per module that is an instance of ``classes`` (outermost wins), plus one small unit
    per module owning parameters left over (embeddings, final norm, ...)."""
    if not classes or not all(isinstance(c, type) for c in classes):
        raise TypeError(f"by_class: expected module classes, got {classes!r}")

    def select(model: nn.Module) -> list[Unit]:
        names = [n for n, m in model.named_modules() if isinstance(m, classes)]
        if not names:
            raise ValueError(f"units: the model has no module of class {', '.join(c.__name__ for c in classes)}")
        outer = [n for n in names if not any(o != n and _within(n, o) for o in names)]
        return _build(model, outer, cover_rest=True)

    return select


def by_names(names: Iterable[str]) -> Selector:
    """The units named (qualified module names; ``""`` is the root, taking what no other has)."""
    names = list(names)

    def select(model: nn.Module) -> list[Unit]:
        known = dict(model.named_modules())
        missing = [n for n in names if n not in known]
        if missing:
            raise ValueError(f"units: no modules named {missing} in the model")
        return _build(model, names, cover_rest=False)

    return select


def auto(max_params: int = 10_000_000) -> Selector:
    """The largest subtrees holding at most ``max_params`` parameters each, plus leftovers."""

    def select(model: nn.Module) -> list[Unit]:
        sizes = {n: sum(p.numel() for p in m.parameters()) for n, m in model.named_modules()}
        chosen = [n for n, s in sizes.items() if 0 < s <= max_params
                  and not any(o != n and _within(n, o) and 0 < sizes[o] <= max_params for o in sizes)]
        return _build(model, chosen, cover_rest=True)

    return select
