"""ZeRO-3 parameter gathering: units gathered just in time, freed after use, prefetched in order.

A ``Gatherer`` lives for one sharded step. It hands the loss function *placeholders*: tensors of
each param's whole shape (compute dtype, ``requires_grad``) whose storage is empty. While
``zf.functionalize``'s ``apply`` runs the model (the step registers the gatherer with
``zfunc.model.functional.run_by``), forward hooks on each unit's modules fill the
unit's storages by an all-gather just before the unit's forward and empty them after it.
Autograd keeps referring to the same storages; a saved-tensor hook notices when backward is about
to use a freed one and gathers the unit again (docs/design.md, section 1: ``torch.autograd.grad`` and
``backward`` allow these hooks where ``torch.func`` does not). The grad reducer releases a unit for
good once all its grads are in.

Prefetch (ZeRO-Infinity's overlap-centric design): the first step records the order in which units
run; later steps, when unit i starts, launch the async all-gather of the next ``depth`` units
(the previous ones in backward), so communication overlaps compute. Peak whole-param bytes are
tracked in ``peak_bytes``; the bound is ``(1 + depth)`` times the largest unit plus any unit whose
params a module outside it reads (a tied head).

Divergence: before each gather the ranks check they are all gathering the same unit
(``Comm.agree``), so data-dependent control flow that skips a unit on one rank fails at once,
naming the unit and step, instead of aborting in gloo or hanging in NCCL.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from zfunc.dist import Comm

def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s storage with a version counter of its own: refilling a placeholder that
    autograd has saved must not look like an in-place edit of it."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, t.shape, t.stride())


class Gatherer:
    """Gathers, frees and prefetches the units of one stage-3 step (see the module docstring).

    Args:
      comm: the mesh's ``Comm``. pieces: this rank's param pieces, leaf order. placeholders:
      whole-shape leaves handed to the loss. flat_units: callable ``module -> list[FlatGroup]`` with
      their ``users``. order: units' run order from an earlier step (``[]`` to record it).
      depth: units to prefetch. step: the step number, for errors. verify: check the ranks agree
      on each collective before issuing it.
    """

    def __init__(self, comm: Comm, spec, pieces, placeholders, flat_units: Callable, order: list[int],
                 depth: int, step: int, verify: bool = True):
        self.comm, self.spec, self.pieces, self.placeholders = comm, spec, pieces, placeholders
        self.step, self.verify = step, verify
        self.flat_units, self.units, self.order, self.depth = flat_units, None, order, depth
        self.recording = not order
        self.gathered: dict[int, bool] = {}
        self.inflight: dict[int, tuple[Any, torch.Tensor]] = {}
        self.holders: dict[int, int] = {}
        self.current_bytes = self.peak_bytes = 0
        self._leaf_unit: dict[int, int] = {}  # id(placeholder) -> its unit, filled when units are known

    # ------------------------------------------------------------------ gather and free
    def _unit_bytes(self, u: int) -> int:
        return sum(self.placeholders[i].numel() * self.placeholders[i].element_size() for i in self.units[u].indices)

    def _launch(self, u: int) -> None:
        unit = self.units[u]
        ph = self.placeholders[unit.indices[0]]
        out, seg = unit.gather_buffer([self.pieces[i] for i in unit.indices], ph.dtype, ph.device, self.spec.world,
                                      self.spec.rank)
        self._issue(u, self.comm, out, seg)

    def _issue(self, u: int, comm: Comm, out: torch.Tensor, seg: torch.Tensor, kind: str = "all_gather") -> None:
        """Start unit ``u``'s all-gather of ``seg`` into ``out`` over ``comm`` (the ranks agreeing first)."""
        check = ((u, self.step), self.describe) if self.verify else None
        work = comm.all_gather(out, seg, label=self._what(u), async_op=True, check=check, kind=kind)
        self.inflight[u] = (work, out)
        self._count(self._unit_bytes(u))

    def ensure(self, u: int) -> None:
        """Make unit ``u``'s placeholders hold its whole params."""
        if self.gathered.get(u):
            return
        if u not in self.inflight:
            self._launch(u)
        work, out = self.inflight.pop(u)
        work.wait()  # raises CollectiveError naming the unit and step
        unit = self.units[u]
        targets = []
        for i in unit.indices:
            ph = self.placeholders[i]
            ph.untyped_storage().resize_(ph.numel() * ph.element_size())
            targets.append(_alias(ph))
        unit.unpack_into(out, self.spec.leaves, self.spec.world, targets)  # one copy, straight into place
        self.gathered[u] = True

    def release(self, u: int) -> None:
        """Free unit ``u``'s whole params (a no-op if they are not held)."""
        if not self.gathered.pop(u, False):
            return
        for i in self.units[u].indices:
            self.placeholders[i].untyped_storage().resize_(0)
        self.current_bytes -= self._unit_bytes(u)

    def _count(self, nbytes: int) -> None:
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def describe(self, op: list[int]) -> str:
        """Words for the op code ``(unit, step)`` the ranks compare before a gather."""
        u, step = op
        name = self.units[u].name if 0 <= u < len(self.units) else f"#{u}"
        return f"gather of unit '{name}' at step {step}"

    def _what(self, u: int) -> str:
        return self.describe([u, self.step])

    def _prefetch(self, u: int, backward: bool) -> None:
        if self.recording or not self.depth or u not in self.order:
            return
        seq = self.order[::-1] if backward else self.order
        at = seq.index(u)
        for nxt in seq[at + 1 : at + 1 + self.depth]:
            if not self.gathered.get(nxt) and nxt not in self.inflight:
                self._launch(nxt)

    # ------------------------------------------------------------------ hooks
    def _pre(self, u: int):
        def hook(module, args):
            if self.recording and u not in self.order:
                self.order.append(u)
            self.holders[u] = self.holders.get(u, 0) + 1
            self.ensure(u)
            self._prefetch(u, backward=False)

        return hook

    def _post(self, u: int):
        def hook(module, args, output):
            self.holders[u] -= 1
            if not self.holders[u]:
                self.release(u)

        return hook

    def _pack(self, t: torch.Tensor):
        # A saved param is its placeholder or a view of it (``weight.t()``): look both up by id.
        u = self._leaf_unit.get(id(t))
        if u is None and t._base is not None:
            u = self._leaf_unit.get(id(t._base))
        return u, t

    def _unpack(self, packed):
        u, t = packed
        if u is not None:
            self.ensure(u)
            self._prefetch(u, backward=True)
        return t

    @contextmanager
    def running(self, module: nn.Module):
        """Hooks on ``module``'s units for the duration of one ``apply`` call."""
        if self.units is None:
            self.units = self.flat_units(module)
            self._leaf_unit = {id(self.placeholders[i]): u for u, unit in enumerate(self.units) for i in unit.indices}
        handles = []
        for u, unit in enumerate(self.units):
            for name in unit.users:
                sub = module.get_submodule(name)
                handles.append(sub.register_forward_pre_hook(self._pre(u)))
                handles.append(sub.register_forward_hook(self._post(u)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            for h in handles:
                h.remove()
