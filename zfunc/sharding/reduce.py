"""Where a sharded step's grads go: reducers that move them across ranks as backward produces them,
and the sinks that receive this rank's reduced slices.

``GradReducer`` (stages 1-3: reduce-scatter, bucket by bucket or unit by unit, in one fixed order on
every rank), ``GradAllReducer`` over ``Buckets`` (stage 0: all-reduce into fp32 buckets kept from
step to step), ``GradSlices`` (the default sink: fp32 sums, averaged at the end; offload's sink
updates leaves as they arrive instead), and the averaging of module buffers over ranks.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from zfunc.model.functional import BufferScope
from zfunc.ops.cpu import hostmem
from zfunc.sharding.layout import FlatGroup, LeafShard, ShardSpec


class GradReducer:
    """Reduce-scatters whole grads, a group at a time (a ``FlatGroup``: a bucket at stages 1/2, a
    unit at stage 3; "group" below means either), and hands this rank's fp32 slice of each to
    ``deliver(group, slices)`` (the run's grad sink).

    ``eager``: a group is reduced as soon as backward has produced all its grads (overlapping the
    rest of backward), and ``on_group_done(u)`` is called (stage 3 frees the unit's params). Groups
    are launched strictly in the order ``sequence()`` gives (the backward order), so every rank
    issues the same reduce-scatters in the same order whatever order its grads arrive in (a group
    with an unused param waits for the end of backward, and the ones after it with it): on the
    mesh's ``reduce_comm`` nothing needs checking. ``keep_whole`` (stage 1): whole grads stay held
    for the step, as ZeRO-1 defines. Not eager (stage 1 with accumulation): whole grads are summed
    over microbatches and reduced by ``reduce_accumulated``. ``deliver_early``: deliver each group
    as soon as the next one is launched (offload's overlapped updates) instead of at the end.
    ``own_grads`` (a sink that takes them: offload's) over one rank: nothing to sum, so no fp32
    copy is packed and "reduced" (a fresh buffer per group, its pages faulting on a CPU device,
    then a copy of it): the sink gets autograd's own grads, in the compute dtype, shaped as the
    rank's slices; the accounting of whole grads held is the same.
    """

    def __init__(self, comm, spec: ShardSpec, groups: Callable[[], list[FlatGroup]],
                 deliver: Callable[[FlatGroup, list[torch.Tensor]], None], device: torch.device,
                 eager: bool, step: int, sequence: Callable[[], list[int]],
                 on_group_done: Callable[[int], None] | None = None, keep_whole: bool = False,
                 deliver_early: bool = False, own_grads: bool = False):
        self.comm, self.spec, self.groups, self.deliver, self.eager = comm, spec, groups, deliver, eager
        self.device, self.deliver_early = device, deliver_early
        self.own_grads = own_grads and spec.world == 1
        self.label, self._sequence_fn, self._sequence = f"step {step}", sequence, None
        self.on_group_done, self.keep_whole = on_group_done, keep_whole
        self.ready: dict[int, dict[int, torch.Tensor]] = {}  # complete units waiting for their turn
        self.launched = 0  # how many units of sequence() have been launched
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self.whole: dict[int, torch.Tensor] = {}
        self.works: list = []
        self._group_of: dict[int, int] | None = None
        self.held_bytes = self.peak_bytes = 0  # whole grads held at once (accounting)
        self.arrived: list[int] = []  # leaf indices in the order backward produced their grads

    def sequence(self) -> list[int]:
        """The launch order, asked for once: after the forward pass it no longer changes."""
        if self._sequence is None:
            self._sequence = self._sequence_fn()
        return self._sequence

    def group_of(self, i: int) -> int:
        if self._group_of is None:
            self._group_of = {i: u for u, group in enumerate(self.groups()) for i in group.indices}
        return self._group_of[i]

    def hook(self, leaves: list[torch.Tensor]) -> list:
        """Register the grad-ready hooks on ``leaves``; returns the handles."""
        def on_grad(i):
            def fn(leaf):
                grad, leaf.grad = leaf.grad, None  # ours now: free the leaf's slot at once
                self.add(i, grad)
            return fn

        return [leaf.register_post_accumulate_grad_hook(on_grad(i)) for i, leaf in enumerate(leaves)]

    def add(self, i: int, grad: torch.Tensor) -> None:
        self.arrived.append(i)
        self._held(grad.numel() * grad.element_size())
        if not self.eager:
            if i not in self.whole:
                self.whole[i] = grad  # autograd's tensor, ours now; kept in the compute dtype
            else:  # a later microbatch: sum in fp32
                if self.whole[i].dtype != torch.float32:
                    self._held(self.whole[i].numel() * 2)
                    self.whole[i] = self.whole[i].float()
                self.whole[i].add_(grad)
                self._held(-grad.numel() * grad.element_size())
            return
        self._collect(self.group_of(i), i, grad)

    def _collect(self, u: int, i: int, grad: torch.Tensor | None) -> None:
        """Leaf ``i``'s grad is in: launch group ``u`` (and those waiting for it) once it is complete."""
        got = self.pending.setdefault(u, {})
        got[i] = grad
        if len(got) == len(self.groups()[u].indices):
            self.ready[u] = self.pending.pop(u)
            self._launch_ready()

    def _launch_ready(self) -> None:
        sequence = self.sequence()
        while self.launched < len(sequence) and sequence[self.launched] in self.ready:
            u = sequence[self.launched]
            self._reduce(u, self.ready.pop(u))
            self.launched += 1

    def _held(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _reduce(self, u: int, grads: dict[int, torch.Tensor]) -> None:
        group, world = self.groups()[u], self.spec.world
        if self.own_grads:
            self._hand_over(u, grads)
            return
        what = f"reduce-scatter of {group.name} at {self.label}"
        device = self.device
        dtypes = {g.dtype for g in grads.values() if g is not None}
        wire = self.comm.reduce_dtype(dtypes.pop()) if len(dtypes) == 1 else torch.float32
        full = hostmem.transient(world * group.segment, wire, device).view(world, group.segment)
        group.pack_full([grads.get(i) for i in group.indices], self.spec.leaves, world, full)
        if not self.keep_whole:
            self._held(-sum(g.numel() * g.element_size() for g in grads.values() if g is not None))
        out = hostmem.transient(group.segment, torch.float32, device)
        work = self.comm.reduce_scatter(out, full.view(-1), label=what, async_op=True)
        self.works.append((work, out, u))
        if self.on_group_done is not None:
            self.on_group_done(u)
        if self.deliver_early:  # the one just launched overlaps what comes next; the others are due
            self._wait(keep_last=True)

    def _hand_over(self, u: int, grads: dict[int, torch.Tensor]) -> None:
        """One rank, ``own_grads``: deliver group ``u``'s grads as autograd made them (None: no grad)."""
        group, leaves = self.groups()[u], self.spec.leaves
        if not self.keep_whole:
            self._held(-sum(g.numel() * g.element_size() for g in grads.values() if g is not None))
        if self.on_group_done is not None:
            self.on_group_done(u)
        self.deliver(group, [None if grads.get(i) is None else grads[i].reshape(leaves[i].local_shape(0))
                             for i in group.indices])

    def finish_microbatch(self) -> None:
        """Reduce units some of whose params got no grad (unused this time), then wait for all."""
        if self.eager:
            for u in self.sequence()[self.launched :]:
                self._reduce(u, {**self.pending.pop(u, {}), **self.ready.pop(u, {})})
            self.launched = len(self.sequence())
        self._wait()

    def reduce_accumulated(self) -> None:
        """Stage 1: reduce the whole grads summed over microbatches, every group, then wait."""
        for u in self.sequence():
            self._reduce(u, {i: self.whole.pop(i, None) for i in self.groups()[u].indices})
        self._wait()

    def _wait(self, keep_last: bool = False) -> None:
        due = self.works[:-1] if keep_last else self.works
        for work, out, u in due:
            work.wait()  # raises CollectiveError naming the group and step
            self.deliver(self.groups()[u], self._slices(u, out))
        self.works = self.works[len(due):]

    def _slices(self, u: int, out: torch.Tensor) -> list[torch.Tensor]:
        """This rank's grad slices of group ``u``, from its reduced ``out``."""
        return self.groups()[u].local_views(out, self.spec.leaves, self.spec.rank)

    def forward_done(self, loss: torch.Tensor) -> None:
        """A microbatch's loss is computed (its backward is next)."""


class Buckets:
    """Stage 0's fp32 grad buckets, kept from step to step as DDP keeps its own: one flat buffer per
    bucket (the last with one slot more, for the loss) and each leaf's view into its bucket.

    Kept, backward writes into memory already mapped: with fresh buffers each step, a stage-0 step
    of the benchmark's GPT (7.4 MB of grads) took ~2800 minor page faults to DDP's ~1400; with kept
    ones, no more than DDP.
    """

    def __init__(self, groups: list[FlatGroup], leaves: tuple[LeafShard, ...], device: torch.device):
        self.groups, self.device = groups, device
        self.flat = [torch.empty(group.segment + (u == len(groups) - 1), dtype=torch.float32, device=device)
                     for u, group in enumerate(groups)]
        self.views = [group.local_views(self.flat[u][: group.segment], leaves, 0) for u, group in enumerate(groups)]
        self.place = {i: (u, k) for u, group in enumerate(groups) for k, i in enumerate(group.indices)}


class GradAllReducer(GradReducer):
    """Stage 0 (DDP): whole grads all-reduced bucket by bucket; delivers whole-shaped fp32 views of
    the reduced ``buckets``, divided by ``divisor`` (their means over the ranks and microbatches).

    Each grad is added, as backward produces it, into its view in its bucket (the first microbatch
    copies, later ones add: the microbatches' sum builds up in place, no per-leaf accumulators).
    Microbatches before the last only accumulate (DDP's ``no_sync``); during the last (``eager``),
    each bucket is all-reduced as soon as all its grads are in, launched in ``sequence()`` order
    like the reduce-scatters of ``GradReducer``, so the all-reduces overlap the rest of backward.
    The sum of this rank's microbatch losses (``forward_done``) rides in the last bucket's spare
    slot: ``loss`` is then their sum over the ranks too, with no collective of its own.
    ``spec``: the layout of one rank holding everything (``ShardSpec.split`` is ``(1, 0)``).
    ``local`` (an optimizer that communicates itself this step: ``GradientTransformation.local_grads``):
    only the loss slot is all-reduced; the grads delivered are this rank's own, divided by ``divisor``.
    """

    def __init__(self, comm, spec: ShardSpec, buckets: Buckets,
                 deliver: Callable[[FlatGroup, list[torch.Tensor]], None], step: int, divisor: float,
                 local: bool = False):
        super().__init__(comm, spec, lambda: buckets.groups, deliver, buckets.device, eager=False, step=step,
                         sequence=lambda: list(range(len(buckets.groups))))
        self.buckets, self.scale, self.local = buckets, 1.0 / divisor, local
        self.written: set[int] = set()  # leaves some microbatch produced a grad for
        self.loss = torch.zeros((), dtype=torch.float32, device=buckets.device)

    def forward_done(self, loss: torch.Tensor) -> None:
        self.loss += loss.detach().float()

    def add(self, i: int, grad: torch.Tensor) -> None:
        self.arrived.append(i)
        u, k = self.buckets.place[i]
        self.peak_bytes = max(self.peak_bytes, grad.numel() * grad.element_size())  # autograd's, until summed in
        if i in self.written:
            self.buckets.views[u][k].add_(grad)
        else:
            self.buckets.views[u][k].copy_(grad)
            self.written.add(i)
        if self.eager:
            self._collect(u, i, None)

    def _reduce(self, u: int, grads: dict) -> None:
        group, flat = self.groups()[u], self.buckets.flat[u]
        for i, view in zip(group.indices, self.buckets.views[u]):
            if i not in self.written:  # no microbatch reached this param: its grad is zero
                view.zero_()
        if flat.numel() > group.segment:
            flat[group.segment :].copy_(self.loss)
        sent = flat[group.segment :] if self.local else flat  # local grads: the loss alone (maybe nothing)
        work = (self.comm.all_reduce(sent, label=f"grad all-reduce of {group.name} at {self.label}", async_op=True)
                if sent.numel() else _Sent())
        self.works.append((work, flat, u))

    def _slices(self, u: int, out: torch.Tensor) -> list[torch.Tensor]:
        segment = self.groups()[u].segment
        if self.scale != 1.0:  # 1.0: a 1-bit optimizer's own grads, one microbatch: no pass to make
            out[:segment].mul_(self.scale)  # while the all-reduce's output is still in the cache
        if out.numel() > segment:
            self.loss.copy_(out[segment])
        return self.buckets.views[u]


class _Sent:
    """The work of a collective with nothing to send."""

    def wait(self) -> bool:
        return True


class GradSlices:
    """This rank's fp32 grad slices, summed as the reducer delivers them and averaged at the end.

    ``zeros(i)`` makes leaf i's zero slice, for a leaf nothing was delivered to. The first slice
    delivered for a leaf is kept as it is (a view into the reduce-scatter's output, which nothing
    else holds) and later ones are added into it: no zero-filled accumulators. ``early`` (False
    here) asks the reducer to deliver each group as soon as it can, for sinks that consume grads
    during backward (offload's overlapped updates).

    ``own=True`` (offload's held update): over one rank the reducer delivers autograd's own grads
    (``GradReducer(own_grads=)``: compute dtype, None for a leaf without one), summed over
    microbatches in fp32 (a low-precision first is upcast when the second arrives: the same sums
    as fp32 slices give); and the result is left undivided, for the update to multiply by
    ``1 / divisor`` in its own pass (``optim.apply(grad_scale=)``).
    """

    early = False

    def __init__(self, zeros: Callable[[int], torch.Tensor], n: int, divisor: float, own: bool = False):
        self.zeros, self.divisor, self.own = zeros, divisor, own
        self.acc: list[torch.Tensor | None] = [None] * n

    def deliver(self, group: FlatGroup, slices: list[torch.Tensor | None]) -> None:
        for i, piece in zip(group.indices, slices):
            if piece is None:
                continue
            if self.acc[i] is None:
                self.acc[i] = piece
            else:
                if self.acc[i].dtype != torch.float32:
                    self.acc[i] = self.acc[i].float()
                self.acc[i].add_(piece)

    def result(self) -> list[torch.Tensor]:
        self.acc = [self.zeros(i) if a is None else a for i, a in enumerate(self.acc)]
        if self.divisor != 1.0 and not self.own:
            torch._foreach_mul_(self.acc, 1.0 / self.divisor)
        return self.acc


def average_order(carried: BufferScope) -> list[str]:
    """The floating buffers a step's forwards wrote, in the order every rank averages them."""
    return sorted(n for n in carried.written if carried.buffers[n].is_floating_point())


def average_buffers(buffers: dict[str, torch.Tensor], names: list[str], comm, world: int,
                    label: str) -> dict[str, torch.Tensor]:
    """``buffers`` with each of ``names`` replaced by its mean over the ``world`` ranks of
    ``comm``: one all-reduce of their elements, in fp64, so that buffers equal on every rank stay
    bit-identical (``N x / N`` is ``x`` exactly) and the mean is rounded once, to the buffer's dtype."""
    if world == 1 or not names:
        return buffers
    flat = torch.cat([buffers[n].detach().reshape(-1).double() for n in names])
    comm.all_reduce(flat, label=label)
    flat.div_(world)
    out = dict(buffers)
    for n, mean in zip(names, flat.split([buffers[n].numel() for n in names])):
        out[n] = mean.view(buffers[n].shape).to(buffers[n].dtype)
    return out

