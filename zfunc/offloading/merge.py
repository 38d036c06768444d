"""One optimizer state for several offloaded leaves, and each leaf's back from it.

An offloaded state keeps one optimizer state per param leaf (``optimizer.init({name: piece})``),
so a leaf can be updated alone. A group of leaves updated together (``LeafUpdate``'s batches) goes
through the optimizer's kernel in one call on ``merge_states`` of their states, and each leaf
takes its own back with ``split_state``. **Law:** for an elementwise optimizer (Adam, SGD,
Lion; their per-param state in ``{name: tensor}`` dicts), one call on the merged state gives each
leaf the values its own call gives; states that do not merge so (a tensor keyed by no param,
counts that differ) are ``NO_MERGE``, and the leaves are then updated one by one. **Cost:** a
walk of each state's tree, no tensor copied.
"""
from __future__ import annotations

from typing import Any

import torch

from zfunc.offloading.store import OnDisk

__all__ = ["NO_MERGE", "merge_states", "split_state"]

NO_MERGE = object()


def merge_states(states: list, names: list[str]) -> Any:
    """One optimizer state for the params ``names`` together, from each one's own state
    (``optimizer.init({name: piece})``): the per-param dicts (``{name: ...}``) joined, anything
    else (a count, a hyperparameter) equal in all and kept once. ``NO_MERGE`` where they do not
    merge so (a tensor not keyed by a param, counts that differ): then they are updated apart."""
    first = states[0]
    if isinstance(first, dict):
        if all(isinstance(s, dict) and list(s) == [n] for s, n in zip(states, names)):
            return {n: s[n] for s, n in zip(states, names)}
        if not all(isinstance(s, dict) and s.keys() == first.keys() for s in states):
            return NO_MERGE
        parts = {k: merge_states([s[k] for s in states], names) for k in first}
        return NO_MERGE if any(v is NO_MERGE for v in parts.values()) else parts
    if isinstance(first, (tuple, list)):
        if not all(type(s) is type(first) and len(s) == len(first) for s in states):
            return NO_MERGE
        parts = [merge_states([s[k] for s in states], names) for k in range(len(first))]
        if any(p is NO_MERGE for p in parts):
            return NO_MERGE
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    if isinstance(first, torch.Tensor) or isinstance(first, OnDisk):
        return NO_MERGE
    try:
        return first if all(type(s) is type(first) and s == first for s in states) else NO_MERGE
    except (TypeError, ValueError, RuntimeError):
        return NO_MERGE


def split_state(merged: Any, like: Any, name: str) -> Any:
    """Param ``name``'s own state, shaped as ``like`` (its state before), from ``merged`` (the new
    state of several params, ``merge_states``)."""
    if isinstance(like, dict):
        if list(like) == [name]:
            return {name: merged[name]}
        return {k: split_state(merged[k], like[k], name) for k in like}
    if isinstance(like, (tuple, list)):
        parts = [split_state(merged[k], like[k], name) for k in range(len(like))]
        return type(like)(*parts) if hasattr(like, "_fields") else type(like)(parts)
    return merged
