"""Where a module's tensors sit, found once, so a functional call swaps tensors in and out without
walking the module tree.

``Slots(module)`` maps each name ``named_parameters()`` / ``named_buffers()`` give to every
``(slot dict, key)`` holding that tensor: its own slot first, then its ties (GPT's
``lm_head.weight`` slot for ``wte.weight``). ``swapped(tensors, args, kwargs)`` runs the module
with ``tensors`` in those slots and puts the module's own tensors back after, writing into
``tensors`` what each name's own slot held when the forward ended (a buffer the forward
reassigned), as ``torch.func.functional_call(module, tensors, args, kwargs)`` does with its
default ``tie_weights=True``.

**Law.** ``swapped`` equals ``functional_call`` for a module whose slots are those ``Slots`` found
(``zfunc.model.functional``'s ``_Held`` checks that before each call) and names among the
module's. **Cost.** Two assignments per slot per call: ``functional_call`` walks the module tree
to untie and resolves each dotted name, about 0.8 ms per call on a 4-block GPT; this is ~20 us.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Slots:
    """The slots of ``module``'s parameters and buffers, ties included (module docstring)."""

    def __init__(self, module: nn.Module):
        by_id: dict[int, list[tuple[dict, str]]] = {}
        seen: set[tuple[int, str]] = set()
        for _, m in module.named_modules(remove_duplicate=False):
            for d in (m._parameters, m._buffers):
                for key, t in d.items():
                    if t is not None and (id(d), key) not in seen:
                        seen.add((id(d), key))
                        by_id.setdefault(id(t), []).append((d, key))
        self.module = module
        self.of: dict[str, list[tuple[dict, str]]] = {}
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            prefix, _, key = name.rpartition(".")
            sub = module.get_submodule(prefix)
            own = (sub._parameters if key in sub._parameters else sub._buffers, key)
            self.of[name] = [own] + [(d, k) for d, k in by_id[id(t)] if d is not own[0] or k != key]

    def covers(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether every name of ``tensors`` is one of the module's parameters or buffers."""
        return all(n in self.of for n in tensors)

    def swapped(self, tensors: dict[str, torch.Tensor], args: tuple, kwargs: dict[str, Any]) -> Any:
        """The module's output on ``args``/``kwargs`` with ``tensors`` in its slots (module docstring)."""
        saved: list[tuple[str, dict, str, Any]] = []
        try:
            for name, t in tensors.items():
                for d, key in self.of[name]:
                    saved.append((name, d, key, d[key]))
                    d[key] = t
            return self.module(*args, **kwargs)
        finally:
            for name, d, key, original in reversed(saved):  # a name's own slot is restored last: its value wins
                tensors[name] = d[key]
                d[key] = original
