"""Where an offloaded step's grads wait for the global norm: host buffers, or swap files beside the moments.

When the update must wait for the whole backward (a ``clip_by_global_norm``, fp16's overflow
check, ``train_step(grad_norm=True)`` without overlap, accumulation), every reduced grad is held
until backward ends. The grads leave the compute device as backward produces them, bucket by bucket
(stage 3: unit by unit), so the device holds the bucket being produced and the one being reduced,
never a whole-model grad:

- ``HeldSlices`` (optimizer in RAM): each delivered slice goes to host RAM (``HostGrads``: pinned
  buffers, copied on a side stream when the device is a GPU; on a CPU device the grads *are* the
  host buffers: no copy). Alone (one rank) autograd's own grads, in the compute dtype (``e``
  bytes/param); over ranks the fp32 reduce-scatter slices (4 bytes/param/N: the sums need fp32).
  Over microbatches they are summed in fp32. The norm is taken from the held grads at the end.
- ``SpilledGrads`` (optimizer on NVMe, the held grads over ``chunk_bytes``; within it ``HeldSlices``
  holds them, ``accounting.spills``): the delivered grads of a group of leaves (the state's
  ``leaf_groups``) are packed into one swap file (``group<k>.grads``) beside the group's moments
  once the group's last grad arrived (groups some leaf of which got none: at the end of backward),
  at most ``2 * chunk_bytes`` of writes in flight, and dropped from RAM; each leaf's norm (fp32, as
  ``optim.global_norm`` takes it) is taken while the grad is in memory, so the global norm (and
  fp16's overflow check) is known at the end of backward from these partial norms, with no
  read-back. The update then reads a group's grads with its masters and moments (``LeafUpdate``'s
  read-ahead). With accumulation a leaf's later microbatches read its group's file back (once),
  add, and write the group again (its norm is the last sum's).

- ``UpdateOnArrival`` (with overlap: no clip, no fp16, ``accum=1``): no grad waits; each unit's leaves are updated
  as their reduced grads arrive, during the rest of backward.

**Law.** Either holding sink gives the update the same grads and the same global norm as ``GradSlices``
does (the norm bit for bit: the same per-leaf fp32 norms, stacked in leaf order). A skipped step
writes nothing of the state: the grad files are scratch, rewritten by the next step.

**Cost.** ``HeldSlices``: ``e P`` (alone) or ``4 P/N`` of host RAM during the step; on a GPU one
device-to-host copy per bucket, overlapped with backward. ``SpilledGrads``: ``e P`` (alone) or
``4 P/N`` of disk written during backward and read during the update (twice that with
accumulation), in scratch files (one per group of leaves) overwritten in place (``SwapEngine.write(in_place=True)``: no
spare, blocks allocated by the first step only, so a full disk fails no later step); RAM holds the grads of
the writes in flight, of the bucket being delivered and of the groups of leaves not yet complete.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Any

import torch

from zfunc.core.roles import Role, RunContext
from zfunc.sharding.layout import FlatGroup
from zfunc.sharding.reduce import GradSlices
from zfunc.sharding.run import ReducedSlices
from zfunc.offloading.store import OnDisk, Read

__all__ = ["HeldSlices", "HostGrads", "SpilledGrads", "grad_file", "leaf_norm"]


def grad_file(k: int) -> str:
    """The swap file name of group ``k``'s held grads (``zfunc.offloading.store.leaf_groups``)."""
    return f"group{k}.grads"


def leaf_norm(g: torch.Tensor) -> torch.Tensor:
    """``g``'s L2 norm in fp32, computed as ``optim.global_norm`` computes each leaf's."""
    if g.dtype in (torch.bfloat16, torch.float16):
        return torch._foreach_norm([g], 2, dtype=torch.float32)[0]
    return torch._foreach_norm([g])[0].float()


class HostGrads:
    """Grads moved off a GPU as they are delivered: each into a pinned host buffer on a side stream
    (the producing stream waits for nothing; ``ready()`` waits for the copies). On a CPU device the
    grad is the host buffer: ``to_host`` returns it as it is."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def to_host(self, g: torch.Tensor) -> torch.Tensor:
        if not self.cuda or g.device.type != "cuda":
            return g
        out = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(g.device))
        with torch.cuda.stream(self.stream):
            out.copy_(g, non_blocking=True)
        g.record_stream(self.stream)  # the device buffer is reused only once the copy is done
        return out

    def ready(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class _HostSlices(GradSlices):
    """``GradSlices`` whose delivered slices go to host memory first (``HostGrads``)."""

    def __init__(self, *args, host: HostGrads, **kwargs):
        super().__init__(*args, **kwargs)
        self.host = host

    def deliver(self, group: FlatGroup, slices: list[torch.Tensor | None]) -> None:
        super().deliver(group, [None if s is None else self.host.to_host(s) for s in slices])

    def result(self) -> list[torch.Tensor]:
        self.host.ready()
        return super().result()


class HeldSlices(ReducedSlices):
    """Grad sink of an offloaded step without overlap, optimizer in RAM: the reduced slices held in
    host RAM (module docstring) until the update reads them all. ``on_backward``: called as
    backward starts (the update's reads of what it keeps in files begin then)."""

    def __init__(self, context: RunContext, on_backward: Any = None):
        super().__init__(context)
        self.on_backward = on_backward

    def before_backward(self, loss: torch.Tensor) -> None:
        if self.on_backward is not None:
            self.on_backward()

    def open(self, pieces) -> GradSlices:
        spec = self.context.spec
        return _HostSlices(lambda i: torch.zeros(spec.leaves[i].local_shape(spec.rank), dtype=torch.float32),
                           len(spec.leaves), self.context.grad_divisor, own=True, host=HostGrads(spec.device))


class SpilledGrads(ReducedSlices):
    """Grad sink of an offloaded step without overlap, optimizer on NVMe: each grad written to swap
    files as it arrives, its norm kept (module docstring), a group of leaves' grads (``groups``:
    the state's ``leaf_groups``) packed in one file once the group's last grad arrived.
    ``engine``: the step's swap engine; ``budget``: bytes of writes in flight; ``on_backward``:
    called as backward starts (the update's reads of masters and moments begin then)."""

    early = False
    own = True

    def __init__(self, context: RunContext, engine: Any, budget: int, groups: list[list[int]],
                 on_backward: Any = None):
        super().__init__(context)
        self.engine, self.budget, self.groups, self.on_backward = engine, budget, groups, on_backward
        self.group_of = {i: k for k, group in enumerate(groups) for i in group}
        self.host = HostGrads(context.spec.device)
        self.peak_ram_bytes = 0  # most grad bytes in RAM at once (writes in flight), for memory()

    def open(self, pieces) -> SpilledGrads:
        n = len(self.context.spec.leaves)
        self.handles: list[OnDisk | None] = [None] * n
        self.norms: list[torch.Tensor | None] = [None] * n
        self._writes: deque = deque()
        self._in_flight = 0
        self._pending: dict[int, dict[int, torch.Tensor]] = {}  # group -> its grads arrived, not yet written
        self._read_back: dict[int, torch.Tensor] = {}  # group -> its file as read back (accumulation)
        return self

    def deliver(self, group: FlatGroup, slices: list[torch.Tensor | None]) -> None:
        for i, g in zip(group.indices, slices):
            if g is None:
                continue
            k = self.group_of[i]
            pending = self._pending.setdefault(k, {})
            if self.handles[i] is None and i not in pending:  # its norm where it is (on the device)
                norm, g = leaf_norm(g), self.host.to_host(g)
                self.host.ready()  # the write reads the host copy
            else:  # a later microbatch: sum in fp32 with what is held (in RAM, or in the group's file)
                g = self.host.to_host(g)
                self.host.ready()
                before = pending[i] if i in pending else self._member(k, self.handles[i])
                g = before.float().add_(g.reshape(before.shape))
                norm = leaf_norm(g)
            self.norms[i] = norm
            pending[i] = g
            if len(pending) == len(self.groups[k]):
                self._spill(k)

    def before_backward(self, loss: torch.Tensor) -> None:
        if self.on_backward is not None:  # the update's reads of masters and moments begin now
            self.on_backward()

    def _member(self, k: int, handle: OnDisk) -> torch.Tensor:
        """Leaf ``handle``'s grad as its group's file holds it (the file read once, its writes waited for)."""
        if k not in self._read_back:
            self._wait(0)  # its last write first (the engine orders them; waiting keeps the count simple)
            from zfunc.offloading.swap.file_format import aligned_empty

            n = handle.file_bytes
            out = aligned_empty(n)[:n]  # a lone grad's file holds it with its own dtype and shape
            out = out if handle.packed else out.view(handle.dtype).view(handle.shape)
            self._read_back[k] = Read(self.engine.read(handle.name, out), out).result()
        buf = self._read_back[k]
        if not handle.packed:
            return buf
        return buf[handle.offset : handle.offset + handle.nbytes].view(handle.dtype).view(handle.shape)

    def _spill(self, k: int) -> None:
        """Write group ``k``'s grads (those arrived, and those an earlier microbatch left in its file)."""
        pending = self._pending.pop(k)
        for i in self.groups[k]:
            if i not in pending and self.handles[i] is not None:
                pending[i] = self._member(k, self.handles[i]).clone()
        self._read_back.pop(k, None)
        members = sorted(pending)
        tensors = [pending[i].contiguous() for i in members]
        name = grad_file(k)
        if len(tensors) == 1:
            buf, handles = tensors[0], [OnDisk(name, tuple(tensors[0].shape), tensors[0].dtype)]
        else:
            from zfunc.offloading.store import PACK_ALIGN, packed_bytes
            from zfunc.offloading.swap.file_format import aligned_empty

            sizes = [t.numel() * t.element_size() for t in tensors]
            total = packed_bytes(sizes)
            buf, handles, offset = aligned_empty(total)[:total], [], 0
            for t, n in zip(tensors, sizes):
                buf[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
                handles.append(OnDisk(name, tuple(t.shape), t.dtype, offset, total, len(tensors)))
                offset = -(-(offset + n) // PACK_ALIGN) * PACK_ALIGN
        del pending, tensors
        for i, h in zip(members, handles):
            self.handles[i] = h
        nbytes = buf.numel() * buf.element_size()
        self._writes.append((self.engine.write(name, buf, in_place=True), nbytes))
        self._in_flight += nbytes
        self.peak_ram_bytes = max(self.peak_ram_bytes, self._in_flight)
        self._wait(self.budget)

    def _wait(self, budget: int) -> None:
        while self._writes and self._in_flight > budget:
            write, nbytes = self._writes.popleft()
            self._in_flight -= nbytes
            write.result()

    def result(self) -> list[OnDisk | torch.Tensor]:
        """Each leaf's grad file (a zero grad in RAM for a leaf none was delivered to), every write done."""
        for k in list(self._pending):  # groups some leaf of which got no grad
            self._spill(k)
        self._wait(0)
        spec = self.context.spec
        return [torch.zeros(spec.leaves[i].local_shape(spec.rank), dtype=torch.float32) if h is None else h
                for i, h in enumerate(self.handles)]

    def norm(self) -> torch.Tensor:
        """The global L2 norm of the grads ``result`` gives, from the per-leaf norms, as ``optim.global_norm``."""
        norms = [torch.zeros(()) if n is None else n.to("cpu") for n in self.norms]
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())

    def finish(self) -> dict[str, Any]:
        with contextlib.suppress(Exception):  # a failed call: its errors were raised already
            self._wait(0)
        return {"peak_spilled_ram_bytes": self.peak_ram_bytes}


class UpdateOnArrival(Role):
    """Grad sink of an offloaded step with overlap: it updates each unit's leaves as soon as their
    reduced grads arrive, during backward (``update``: the call's ``zfunc.offloading.run.LeafUpdate``,
    not imported, since it imports this module; over one rank: autograd's own grads, in the compute
    dtype; unscaled in the kernel's pass). It learns the order it met the leaves in, along which the
    next call reads them ahead (``update_order``)."""

    early = True
    own = True

    def __init__(self, context: RunContext, update: Any, update_order: list[int]):
        self.context, self.update, self.update_order = context, update, update_order
        self.learned: dict[str, Any] = {}

    def open(self, pieces) -> UpdateOnArrival:
        self.reader = self.update._leaf_reader(self.update_order)
        self.seen: list[int] = []
        return self

    def before_backward(self, loss: torch.Tensor) -> None:
        """Updates start during backward: a non-finite loss (summed over the ranks, so all decide
        alike) turns them off for this step, which ``LeafUpdate.apply`` then skips."""
        total = loss.detach().float().reshape(1).clone()
        if self.context.spec.world > 1:
            self.context.sum_across(total, "loss all-reduce before an overlapped backward")
        self.update._skip_updates = not bool(torch.isfinite(total))

    def deliver(self, unit: FlatGroup, slices: list[torch.Tensor]) -> None:
        """Update each leaf of ``unit`` with its reduced grad slice (None: no grad; over one rank
        the reducer hands over autograd's own grads, so a leaf without one comes as None; over N
        ranks other ranks' grads are unknown, and every slice is a grad); where the norm is wanted,
        add the slice's sum of squares, which the optimizer's kernel computes in its own pass
        (``optim.apply(squares=)``), so the grads are read once."""
        step = self.update
        scale, wants = 1.0 / self.context.grad_divisor, step._wants_norm
        start = time.perf_counter()
        for i, g in zip(unit.indices, slices):
            self.seen.append(i)
            produced = not step._skip_updates and g is not None
            squares = [] if wants and produced else None
            if not step._skip_updates:  # else a non-finite loss: the step will be skipped
                step._update_leaf(i, g if produced else None, self.reader, squares, scale)
            if squares:  # the kernel's sum of the unscaled grad's squares
                step.add_squares(i, squares[0])
            elif wants and g is not None:  # another kernel, or a leaf with no grad (zeros): the slice's norm
                step.add_squares(i, (torch.linalg.vector_norm(g, dtype=torch.float32).double() * scale) ** 2)
        step.update_s += time.perf_counter() - start

    def result(self):
        self.learned["update_order"] = self.seen  # all met: the next call reads ahead in this order
        return None

    def finish(self) -> dict[str, Any]:
        return self.learned
