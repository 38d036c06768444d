"""One pipeline stage's schedule for one step (``zf.pipeline``'s schedule and run objects).

``PipelineSchedule`` is a schedule of the one microbatch loop (``zfunc.core.microbatches``), as
``roles.Accumulation`` is: a ``zfunc.pipelining.schedules.Schedule`` (built-in by name, or a
user's, checked by ``zfunc.pipelining.check``) over ``m`` microbatches, ``split(batch)`` and each
rank's ``ops`` for the loop: ``("F", i)`` for a forward, ``("B", i)`` for any backward op (whole,
input-grad or weight-grad: the run reads which from the schedule's own ops). It is no role: the
pipeline leaves ``Roles`` (``zfunc.core.roles`` says why).

``_Run`` is one step's schedule on this rank (its forwards run the model under
``zfunc.pipelining.hooks``): the params the loss sees, point-to-point transfers in flight, live
microbatches and the fp32 grad sums, its ``forward`` and ``backward`` what the microbatch loop
calls for each op. It is made per call and dropped after it (docs/design.md, "Run objects");
the rules and costs it implements are in ``zfunc.pipelining.step``'s docstring.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from zfunc.core import tree
from zfunc.core.microbatches import accumulate, run_microbatches, split_batch
from zfunc.model.functional import run_by
from zfunc.core.grads import split_loss
from zfunc.pipelining.check import Timeline, check
from zfunc.pipelining import header as hdr
from zfunc.pipelining.hooks import _StageOutput, _StageRun, unit_modules
from zfunc.pipelining.placement import PipelineSpec
from zfunc.pipelining.schedules import Op, Schedule, build
from zfunc.pipelining.split_backward import PendingWeights, input_grad, weight_grads

PyTree = Any


def schedule_ops(schedule: str, stages: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """Rank ``stage``'s ops of built-in schedule ``schedule`` (one virtual stage per rank), as
    ``("F", i)`` / ``("B", i)`` (zfunc.pipelining.schedules: GPipe runs every forward then every
    backward; 1F1B at most ``p - s`` live microbatches)."""
    return [(op.kind, op.microbatch) for op in build(schedule, stages, microbatches).ops[stage]]


class PipelineSchedule:
    """The pipeline's schedule (``zfunc.core.microbatches.Schedule``) over ``count`` microbatches:
    ``kind``, a built-in schedule's name (``zfunc.pipelining.schedules.BUILT_IN``) with ``virtual``
    stages per rank, or a user's ``Schedule``; with accumulation's interface
    (``roles.Accumulation``): ``split(batch)``, and ``ops(stages, stage)``, the rank's ops for the
    loop. ``plan(stages)`` is the checked ``Schedule`` for ``stages`` ranks, ``timeline(stages)``
    its simulated run (``zfunc.pipelining.check``). On one stage 1F1B is accumulation."""

    def __init__(self, kind: str | Schedule, count: int, virtual: int = 1):
        self.kind = kind.name if isinstance(kind, Schedule) else kind
        self.given = kind if isinstance(kind, Schedule) else None
        self.count, self.virtual = count, (kind.virtual if isinstance(kind, Schedule) else virtual)
        self._timelines: dict[int, Timeline] = {}

    def __str__(self) -> str:
        return self.kind if self.virtual == 1 else f"{self.kind} (v={self.virtual})"

    def split(self, batch: PyTree) -> list[PyTree]:
        """``count`` microbatches of ``batch``, whose every tensor's leading dim they must divide."""
        m = self.count
        for x in tree.leaves(batch):
            if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % m):
                raise ValueError(f"batch: microbatches={m} must divide the leading dim of every batch tensor, got a "
                                 f"tensor of shape {tuple(x.shape)}")
        return split_batch(batch, m)

    def timeline(self, stages: int) -> Timeline:
        """The schedule for ``stages`` ranks, checked, and its simulated run with unit op costs."""
        if stages not in self._timelines:
            plan = self.given if self.given is not None else build(self.kind, stages, self.count, self.virtual)
            if (plan.stages, plan.microbatches) != (stages, self.count):
                raise ValueError(f"schedule: {plan.name!r} is for {plan.stages} ranks and {plan.microbatches} "
                                 f"microbatches; the pipeline has {stages} stages and {self.count} microbatches")
            self._timelines[stages] = check(plan)
        return self._timelines[stages]

    def plan(self, stages: int) -> Schedule:
        """The checked ``Schedule`` for ``stages`` ranks."""
        return self.timeline(stages).schedule

    def ops(self, stages: int = 1, stage: int = 0) -> list[tuple[str, int]]:
        """Rank ``stage``'s ops for the microbatch loop, in order: ``("F", i)``, else ``("B", i)``."""
        return [("F" if op.kind == "F" else "B", op.microbatch) for op in self.plan(stages).ops[stage]]


# ----------------------------------------------------------------------------- one step's schedule


class _Run:
    """One step's schedule on this rank: the params the loss sees, p2p in flight, live
    microbatches, fp32 grad sums (``acc`` for owned params, unless a ``sink`` takes each op's grads
    of them: ZeRO 2/3 over the stage's dp ranks; ``lent_acc`` for borrowed ones). ``ps`` is the
    ``PipelineStep`` (read: its model, loss, layout, mesh, schedule, microbatches and compute
    dtype), not imported: zfunc.pipelining.step imports this module.

    Every message has its own tag (``_tag``), so receives match sends whatever order a rank posts
    them in; an output whose next stage runs on this rank is handed over in memory (``local``)."""

    def __init__(self, ps: Any, spec: PipelineSpec, whole: list[torch.Tensor], number: int, scale,
                 digest: int, sink: Any = None):
        self.ps, self.spec, self.number, self.scale, self.digest = ps, spec, number, scale, digest
        self.s, self.p, self.m, self.p2p = spec.stage, spec.stages, ps.microbatches, ps.mesh.p2p
        self.plan = ps.schedule.plan(self.p)
        self.ranks, self.last = self.plan.ranks, len(self.plan.ranks) - 1
        self.device = whole[0].device if whole else torch.device("cpu")
        self.shapes = dict(zip(spec.names, spec.shapes))
        self.owned = [w.detach().requires_grad_() for w in whole]
        self.params = dict(zip(spec.owned, self.owned))
        self.shared = [n for n in spec.names if n in ps.layout.shared]  # the order both ends use
        self.sizes = [torch.Size(self.shapes[n]).numel() for n in self.shared]
        self.lender, self.borrower = self.ranks[0], self.ranks[self.last]
        self.lent_names = self.shared if self.s == self.borrower != self.lender else []
        self.lent: list[torch.Tensor] = []
        self.stand_in_names = [n for n in spec.names if n not in self.params and n not in self.lent_names]
        zero = torch.zeros((), dtype=ps.compute_dtype, device=self.device)
        self.stand_ins = [zero.expand(self.shapes[n]).detach().requires_grad_() for n in self.stand_in_names]
        self.params.update(zip(self.stand_in_names, self.stand_ins))
        self.acc: list[torch.Tensor | None] = [None] * len(self.owned)
        self.sink = sink  # None: owned params' grads summed into acc (no lambda: a cycle would keep the run alive)
        self.lent_acc: list[torch.Tensor | None] = [None] * len(self.lent_names)
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.pending: dict[tuple[int, int], Any] = {}  # after "I", until "W"
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}  # ("F" | "G", microbatch, stage) -> its input
        self.meta_in: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # stage -> its input's shape, dtype
        self.meta_out: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # stage -> its output's
        self.headers: dict[int, Any] = {}  # stage -> its header's receive, posted at the start when its shape is known
        self.headed: set[int] = set()  # stages whose output's header went out this step
        self.posted, self.recvs, self.sends = set(), {}, []
        self.peak_live, self.wait_s, self.compute_s, self.trace = 0, 0.0, 0.0, []
        self.subs = unit_modules(ps.model, ps.layout)  # looked up once per step, not per forward

    def execute(self, batch: PyTree, seed: int, params: PyTree) -> tuple[torch.Tensor | None, Any]:
        """The rank's ops on ``batch`` through the microbatch loop (``run_microbatches``, seeded by
        ``seed``): ``(loss, aux)``, the mean of this rank's microbatch losses (None but where the
        last stage runs) and their aux."""
        self.t0 = self.last_end = time.perf_counter()
        self.ops, self.k = self.plan.ops[self.s], 0
        signature = hdr.signature(batch)
        known = self.ps.boundary_shapes
        if known is not None and known[0] == signature:  # the last step's shapes: no header to wait for
            self.meta_in, self.meta_out = dict(known[1]), dict(known[2])
        loss, aux = run_microbatches(self.ps.schedule, batch, self.ps.compute_dtype, seed, params, self.forward,
                                     self.backward, self.p, self.s)
        self._finish_shared()
        for work in self.sends:
            self._wait(work)
        self.step_s = time.perf_counter() - self.t0
        self.ps.boundary_shapes = (signature, self.meta_in, self.meta_out)
        return loss, aux

    def forward(self, i: int, micro: PyTree) -> tuple[torch.Tensor, Any] | None:
        """The next op, a forward of microbatch ``i``: the loss and aux on the last stage, else None."""
        op = self.ops[self.k]
        return self._op(op, lambda: self._forward(op, micro))

    def backward(self, i: int) -> None:
        """The next op, a backward of microbatch ``i``: whole ("B"), input grad ("I") or weight grads ("W")."""
        op = self.ops[self.k]
        run = {"B": self._backward, "I": self._backward_input, "W": self._backward_weight}[op.kind]
        self._op(op, lambda: run(op))

    def _op(self, op: Op, run):
        """Run one op, its receive and the next one's posted first (transfers overlap compute),
        timed and traced, then the sends that completed reaped. Before the first, the shared params
        set out (once the batch has split). Its busy time runs from the previous op's end (the
        runtime's work between the two: reaping, posting, the microbatch loop) to its own end, less
        its waits on peers: the work a rank does for an op is not idle time."""
        waited = self.wait_s
        if self.k == 0:
            self._start_shared()
            for k in self.meta_in:  # known shapes: the headers are checked as their first activation is read
                self.headers[k] = self._recv(hdr.SIZE, torch.int64, self.ranks[k - 1], "the activation shape",
                                             self._tag(k - 1, 0, 2))
        for ahead in self.ops[self.k : self.k + 2]:
            self._post(ahead)
        self.k += 1
        start = time.perf_counter()
        out = run()
        end = time.perf_counter()
        busy = end - self.last_end - (self.wait_s - waited)
        self.compute_s += busy
        self.trace.append((op.kind, op.microbatch, start - self.t0, end - self.t0, op.stage, busy))
        self.last_end = end
        self._reap_sends()
        return out

    # -- p2p
    def _tag(self, boundary: int, i: int, what: int) -> int:
        """The tag of a message across ``boundary`` (between virtual stages ``boundary`` and
        ``boundary + 1``) for microbatch ``i``: ``what`` 0 its activation, 1 that activation's grad,
        2 the boundary's shape header (``i`` 0). Tag 1 is the shared params'."""
        return 2 + 3 * (boundary * self.m + i) + what

    def _send(self, t: torch.Tensor, peer: int, what: str, tag: int) -> None:
        label = f"send of {what} from stage {self.s} to {peer} at step {self.number}"
        self.sends.append(self.p2p.send(t, peer, label, tag))

    def _recv(self, shape, dtype: torch.dtype, peer: int, what: str, tag: int):
        buf = self.ps.recv_buffers.take(shape, dtype, self.device)  # reused across steps once nothing refers to it
        return self.p2p.recv(buf, peer, f"recv of {what} from stage {peer} to {self.s} at step {self.number}", tag)

    def _wait(self, work) -> torch.Tensor:
        t0 = time.perf_counter()
        out = work.wait()  # raises CollectiveError naming the transfer
        self.wait_s += time.perf_counter() - t0
        return out

    def _reap_sends(self) -> None:
        """Wait for the sends that completed, oldest first, up to the first still in flight (one
        ``done()`` per op as a rule, not one per pending send); the rest wait at the step's end."""
        k = 0
        while k < len(self.sends) and self.sends[k].done():
            self.sends[k].wait()  # already complete: raises only if it failed
            k += 1
        del self.sends[:k]

    def _post(self, op: Op) -> None:
        """Post the receive ``op`` needs from another rank, once its shape is known."""
        i, k = op.microbatch, op.stage
        if op in self.posted or op.kind == "W":
            return
        if op.kind == "F":
            if k == 0 or self.ranks[k - 1] == self.s or k not in self.meta_in:
                return
            peer, what, meta, tag = self.ranks[k - 1], "activation", self.meta_in[k], self._tag(k - 1, i, 0)
        else:
            if k == self.last or self.ranks[k + 1] == self.s or k not in self.meta_out:
                return
            peer, what, meta, tag = self.ranks[k + 1], "activation grad", self.meta_out[k], self._tag(k, i, 1)
        self.posted.add(op)
        self.recvs[op] = self._recv(*meta, peer, f"the {what} of microbatch {i}", tag)

    def _send_header(self, out: torch.Tensor, k: int) -> None:
        """Step, microbatches, batch digest, dtype and shape of stage ``k``'s outputs to follow."""
        header = hdr.pack(out, self.s, self.number, self.m, self.digest)
        self._send(torch.tensor(header, device=self.device), self.ranks[k + 1], "the activation shape",
                   self._tag(k, 0, 2))

    def _recv_header(self, k: int) -> None:
        """Stage ``k``'s input shape, from the rank of stage ``k - 1``, checked against this step."""
        header = self._recv(hdr.SIZE, torch.int64, self.ranks[k - 1], "the activation shape", self._tag(k - 1, 0, 2))
        self.meta_in[k] = self._read_header(k, self._wait(header).tolist())

    def _check_header(self, k: int) -> None:
        """Stage ``k``'s header, received while its activations were (their shape known from the last
        step with this batch's shapes), checked against this step and that shape."""
        meta = self._read_header(k, self._wait(self.headers.pop(k)).tolist())
        if meta != self.meta_in[k]:
            raise ValueError(hdr.changed(self.ranks[k - 1], k - 1, self.meta_in[k], meta, self.number))

    def _read_header(self, k: int, header: list[int]) -> hdr.Meta:
        return hdr.read(header, self.ranks[k - 1], self.s, self.number, self.m, self.digest)

    # -- shared params: stage 0's rank lends them to the last stage's, which returns their grads (tag 1)
    def _start_shared(self) -> None:
        if not self.shared or self.lender == self.borrower:
            return
        if self.s == self.lender:
            owned = dict(zip(self.spec.owned, self.owned))
            self._send(torch.cat([owned[n].detach().reshape(-1) for n in self.shared]), self.borrower,
                       "the shared params", 1)
            self.returned = self._recv(sum(self.sizes), torch.float32, self.borrower, "the shared params' grads", 1)
        elif self.s == self.borrower:
            self.lent_flat = self._recv(sum(self.sizes), self.ps.compute_dtype, self.lender, "the shared params", 1)

    def _borrow(self) -> None:
        pieces = self._wait(self.lent_flat).split(self.sizes)
        self.lent = [x.view(self.shapes[n]).requires_grad_() for x, n in zip(pieces, self.lent_names)]
        self.params.update(zip(self.lent_names, self.lent))

    def _finish_shared(self) -> None:
        if self.lent_names:
            flat = [(torch.zeros(self.shapes[n], device=self.device) if g is None else g).reshape(-1)
                    for g, n in zip(self.lent_acc, self.lent_names)]
            self._send(torch.cat(flat), self.lender, "the shared params' grads", 1)
        elif self.s == self.lender != self.borrower and self.shared:
            back = dict(zip(self.shared, self._wait(self.returned).split(self.sizes)))
            self._owned_grads([back[n].view(self.shapes[n]) if n in back else None for n in self.spec.owned])

    # -- compute
    def _input(self, op: Op) -> torch.Tensor | None:
        """Stage ``op.stage``'s input activation for ``op``'s microbatch (None on stage 0)."""
        i, k = op.microbatch, op.stage
        if k == 0:
            return None
        if self.ranks[k - 1] == self.s:
            return self.local.pop(("F", i, k)).requires_grad_()
        if k not in self.meta_in:
            self._recv_header(k)
        elif k in self.headers:
            self._check_header(k)
        self._post(op)
        return self._wait(self.recvs.pop(op)).requires_grad_()

    def _forward(self, op: Op, micro: PyTree) -> tuple[torch.Tensor, Any] | None:
        i, k = op.microbatch, op.stage
        act_in = self._input(op)
        if self.lent_names and not self.lent:
            self._borrow()
        output, aux = self._run_loss(k, micro, act_in)
        self.outputs[i, k] = (act_in, output)
        self.peak_live = max(self.peak_live, len(self.outputs) + len(self.pending))
        if k == self.last:
            return output, aux
        sent, peer = output.detach().contiguous(), self.ranks[k + 1]
        if k not in self.headed:  # the first output of stage k this step: its header first
            self.headed.add(k)
            known, self.meta_out[k] = self.meta_out.get(k), (tuple(sent.shape), sent.dtype)
            if peer != self.s:
                self._send_header(sent, k)
            if known is not None and known != self.meta_out[k]:  # the next stage expects the known shape
                raise ValueError(hdr.changed(self.s, k, known, self.meta_out[k], self.number))
        if peer == self.s:
            self.local["F", i, k + 1] = sent
        else:
            self._send(sent, peer, f"the activation of microbatch {i}", self._tag(k, i, 0))
        return None

    def _run_loss(self, k: int, micro: PyTree, act_in: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """``(output, aux)``: stage ``k``'s output activation (aux None), or on the last stage the loss and its aux."""
        run = _StageRun(self.ps.model, self.ps.layout, k, self.last + 1, act_in, self.subs)
        try:
            with torch.enable_grad(), run_by(run):
                out = self.ps.loss_fn(self.params, micro)
        except _StageOutput as stop:
            return stop.output, None
        run.check_complete()
        return split_loss(out, self.ps.has_aux)

    def _root_and_grad(self, op: Op) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor] | None]:
        """``(act_in, root, grad_out)`` of ``op``'s backward: the loss (scaled) on the last stage,
        else the output and its grad from the next stage."""
        i, k = op.microbatch, op.stage
        act_in, output = self.outputs.pop((i, k))
        if k == self.last:
            return act_in, (output * self.scale if self.scale is not None else output), None
        if self.ranks[k + 1] == self.s:
            return act_in, output, [self.local.pop(("G", i, k))]
        self._post(op)
        return act_in, output, [self._wait(self.recvs.pop(op))]

    def _send_input_grad(self, op: Op, act_in: torch.Tensor, g: torch.Tensor | None) -> None:
        i, k = op.microbatch, op.stage
        g = torch.zeros_like(act_in) if g is None else g.contiguous()
        if self.ranks[k - 1] == self.s:
            self.local["G", i, k - 1] = g
        else:
            self._send(g, self.ranks[k - 1], f"the activation grad of microbatch {i}", self._tag(k - 1, i, 1))

    def _weights(self) -> list[torch.Tensor]:
        return self.owned + self.lent + self.stand_ins

    def _backward(self, op: Op) -> None:
        act_in, root, grad_out = self._root_and_grad(op)
        inputs = ([act_in] if act_in is not None else []) + self._weights()
        grads = list(torch.autograd.grad([root], inputs, grad_out, allow_unused=True))
        if act_in is not None:
            self._send_input_grad(op, act_in, grads.pop(0))
        self._add_weight_grads(grads)

    def _backward_input(self, op: Op) -> None:
        """Op "I": the input's grad, sent on; what the weight grads need kept for "W"
        (``zfunc.pipelining.split_backward``). Stage 0 has no input: its "W" runs the whole backward."""
        act_in, root, grad_out = self._root_and_grad(op)
        if act_in is None:
            self.pending[op.microbatch, op.stage] = (root, grad_out)
            return
        dinput, held = input_grad(root, grad_out, act_in, self._weights())
        self._send_input_grad(op, act_in, dinput)
        self.pending[op.microbatch, op.stage] = held

    def _backward_weight(self, op: Op) -> None:
        held = self.pending.pop((op.microbatch, op.stage))
        if isinstance(held, PendingWeights):
            grads = weight_grads(held)
        else:
            root, grad_out = held
            grads = list(torch.autograd.grad([root], self._weights(), grad_out, allow_unused=True))
        self._add_weight_grads(grads)

    def _owned_grads(self, grads: list[torch.Tensor | None]) -> None:
        if self.sink is None:
            accumulate(self.acc, grads)
        else:
            self.sink(grads)

    def _add_weight_grads(self, grads: list[torch.Tensor | None]) -> None:
        n, k = len(self.owned), len(self.lent)
        self._owned_grads(grads[:n])
        accumulate(self.lent_acc, grads[n : n + k])
        used = [name for name, g in zip(self.stand_in_names, grads[n + k :]) if g is not None]
        if used:
            holder = self.ranks[self.ps.layout.owner.get(used[0], 0)]
            raise ValueError(f"pipeline: stage {self.s}'s forward used param '{used[0]}', which stage {holder} "
                             "holds: a pipeline unit's params must be read only inside the unit")

