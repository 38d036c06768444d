"""One pipeline stage's schedule for one step (``zf.pipeline``'s schedule and run objects).

``PipelineSchedule`` is a schedule of the one microbatch loop (``zfunc.core.microbatches``), as
``roles.Accumulation`` is: GPipe or 1F1B over ``m`` microbatches, ``split(batch)`` and each
stage's ``ops`` (``schedule_ops``). It is no role: the pipeline leaves ``Roles``
(``zfunc.core.roles`` says why).

``_StageRun`` holds the hooks a stage puts on the model for one microbatch's forward (other
stages' units become the identity, the first local unit takes the received activation, a
non-last stage stops after its last unit); ``_Run`` is one step's schedule on this stage: the
params the loss sees, point-to-point transfers in flight, live microbatches and the fp32 grad
sums, its ``forward`` and ``backward`` what the microbatch loop calls for each op. Both are made
per call and dropped after it (docs/design.md, "Run objects"); the rules and costs they
implement are in ``zfunc.pipelining.step``'s docstring.
"""
from __future__ import annotations

import time
import zlib
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from zfunc.core import tree
from zfunc.core.microbatches import accumulate, run_microbatches, split_batch
from zfunc.model.functional import run_by
from zfunc.core.step import split_loss
from zfunc.pipelining.layout import Layout
from zfunc.pipelining.placement import PipelineSpec

PyTree = Any
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 8
_HEADER = 5 + _MAX_DIMS  # int64s: step, microbatches, batch digest, dtype, ndim, shape


class _StageOutput(BaseException):
    """Stops a non-last stage's forward after its last unit. A ``BaseException``, so a loss
    function's ``except Exception`` cannot swallow it."""

    def __init__(self, output: torch.Tensor):
        super().__init__("pipeline stage output")
        self.output = output


def schedule_ops(schedule: str, stages: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s ops, ``("F", i)`` / ``("B", i)``: GPipe runs every forward then every
    backward; 1F1B runs ``min(p - 1 - s, m)`` forwards, then alternates one forward and one
    backward, then the remaining backwards, so at most ``p - s`` microbatches are live."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(stages - 1 - stage, m)
    ops = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warm, m)]


class PipelineSchedule:
    """The pipeline's schedule (``zfunc.core.microbatches.Schedule``): ``kind`` ("gpipe" or "1f1b")
    over ``count`` microbatches, with accumulation's interface (``roles.Accumulation``):
    ``split(batch)``, and ``ops(stages, stage)``, the stage's ``schedule_ops``. On one stage 1F1B is
    accumulation."""

    def __init__(self, kind: str, count: int):
        self.kind, self.count = kind, count

    def __str__(self) -> str:
        return self.kind

    def split(self, batch: PyTree) -> list[PyTree]:
        """``count`` microbatches of ``batch``, whose every tensor's leading dim they must divide."""
        m = self.count
        for x in tree.leaves(batch):
            if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % m):
                raise ValueError(f"batch: microbatches={m} must divide the leading dim of every batch tensor, got a "
                                 f"tensor of shape {tuple(x.shape)}")
        return split_batch(batch, m)

    def ops(self, stages: int, stage: int) -> list[tuple[str, int]]:
        """Stage ``stage``'s forwards and backwards, in order (``schedule_ops``)."""
        return schedule_ops(self.kind, stages, stage, self.count)


# ----------------------------------------------------------------------------- the stage's hooks


class _StageRun:
    """Hooks one stage puts on the model for one microbatch's forward (see the module docstring)."""

    def __init__(self, model: nn.Module, layout: Layout, stage: int, stages: int, act_in: torch.Tensor | None):
        self.model, self.layout, self.stage, self.stages, self.act_in = model, layout, stage, stages, act_in
        self.first, self.last = layout.bounds[stage]
        self.seen, self.boundary, self.calls = 0, None, 0

    @contextmanager
    def running(self, module: nn.Module):
        if module is not self.model:
            raise ValueError(f"pipeline: loss_fn ran a {type(module).__name__}, not the model given to "
                             f"zf.pipeline(model=...) (a {type(self.model).__name__})")
        self.calls += 1
        if self.calls > 1:
            raise ValueError("pipeline: loss_fn ran the model more than once per microbatch")
        subs = [module.get_submodule(n) for n in self.layout.units]
        handles, skipped = [], []
        try:
            for k, sub in enumerate(subs):
                if self.first <= k <= self.last:
                    handles.append(sub.register_forward_pre_hook(self._enter(k)))
                else:
                    skipped.append((sub, sub.__dict__.get("forward")))
                    sub.forward = self._skip(k)
            if self.stage < self.stages - 1:
                handles.append(subs[self.last].register_forward_hook(self._leave))
            yield
        finally:
            for h in handles:
                h.remove()
            for sub, forward in skipped:
                if forward is None:
                    del sub.forward
                else:
                    sub.forward = forward

    def _arrive(self, k: int) -> None:
        units = self.layout.units
        if k != self.seen:
            expected = f"'{units[self.seen]}'" if self.seen < len(units) else "no more units"
            raise ValueError(f"pipeline: units must run once each, in module order; unit '{units[k]}' ran "
                             f"when {expected} was due")
        self.seen += 1

    def _skip(self, k: int):
        def identity(*args, **kwargs):
            self._arrive(k)
            if not args or not isinstance(args[0], torch.Tensor):
                raise ValueError(f"pipeline: unit '{self.layout.units[k]}' must take the activation as its "
                                 "first positional argument")
            if k == self.first - 1:
                self.boundary = args[0]
            return args[0]

        return identity

    def _enter(self, k: int):
        def hook(module, args):
            self._arrive(k)
            if k != self.first or self.act_in is None:
                return None
            if not args or args[0] is not self.boundary:
                units = self.layout.units
                raise ValueError(f"pipeline: unit '{units[k]}' (first of stage {self.stage}) must get the output "
                                 f"of unit '{units[k - 1]}' unchanged as its first argument: code between two "
                                 "units cannot be split across stages")
            return (self.act_in, *args[1:])

        return hook

    def _leave(self, module, args, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"pipeline: unit '{self.layout.units[self.last]}' (last of stage {self.stage}) must "
                            f"return one tensor to send to the next stage, got {type(output).__name__}")
        raise _StageOutput(output)

    def check_complete(self) -> None:
        """After a forward that returned normally (only the last stage's may): every unit ran."""
        if self.calls == 0:
            raise ValueError("loss_fn: the pipeline needs the loss to run the model through the apply "
                             "of zf.functionalize(model)")
        if self.seen != len(self.layout.units):
            raise ValueError(f"pipeline: unit '{self.layout.units[self.seen]}' never ran in stage {self.stage}'s "
                             "forward (the loss must run every pipeline unit, once, in module order)")


# ----------------------------------------------------------------------------- one step's schedule


class _Run:
    """One step's schedule on this stage: the params the loss sees, p2p in flight, live
    microbatches, fp32 grad sums (``acc`` for owned params, ``lent_acc`` for borrowed ones).
    ``ps`` is the ``PipelineStep`` (read: its model, loss, layout, mesh, schedule, microbatches and
    compute dtype), not imported: zfunc.pipelining.step imports this module."""

    def __init__(self, ps: Any, spec: PipelineSpec, whole: list[torch.Tensor], number: int, scale,
                 digest: int):
        self.ps, self.spec, self.number, self.scale, self.digest = ps, spec, number, scale, digest
        self.s, self.p, self.m, self.p2p = spec.stage, spec.stages, ps.microbatches, ps.mesh.p2p
        self.device = whole[0].device if whole else torch.device("cpu")
        self.shapes = dict(zip(spec.names, spec.shapes))
        self.owned = [w.detach().requires_grad_() for w in whole]
        self.params = dict(zip(spec.owned, self.owned))
        self.shared = [n for n in spec.names if n in ps.layout.shared]  # the order both ends use
        self.sizes = [torch.Size(self.shapes[n]).numel() for n in self.shared]
        self.lent_names = self.shared if 0 < self.s == self.p - 1 else []
        self.lent: list[torch.Tensor] = []
        self.stand_in_names = [n for n in spec.names if n not in self.params and n not in self.lent_names]
        zero = torch.zeros((), dtype=ps.compute_dtype, device=self.device)
        self.stand_ins = [zero.expand(self.shapes[n]).detach().requires_grad_() for n in self.stand_in_names]
        self.params.update(zip(self.stand_in_names, self.stand_ins))
        self.acc: list[torch.Tensor | None] = [None] * len(self.owned)
        self.lent_acc: list[torch.Tensor | None] = [None] * len(self.lent_names)
        self.outputs: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # "F": input, "B": output
        self.posted, self.recvs, self.sends = set(), {}, []
        self.peak_live, self.wait_s, self.compute_s, self.trace = 0, 0.0, 0.0, []

    def execute(self, batch: PyTree, seed: int, params: PyTree) -> tuple[torch.Tensor | None, Any]:
        """The stage's ops on ``batch`` through the microbatch loop (``run_microbatches``, seeded by
        ``seed``): ``(loss, aux)``, the mean of this stage's microbatch losses (None but on the last
        stage) and their aux."""
        self.t0 = time.perf_counter()
        self.ops, self.k = self.ps.schedule.ops(self.p, self.s), 0
        loss, aux = run_microbatches(self.ps.schedule, batch, self.ps.compute_dtype, seed, params, self.forward,
                                     self.backward, self.p, self.s)
        self._finish_shared()
        for work in self.sends:
            self._wait(work)
        self.step_s = time.perf_counter() - self.t0
        return loss, aux

    def forward(self, i: int, micro: PyTree) -> tuple[torch.Tensor, Any] | None:
        """Op ``("F", i)``: the loss and aux on the last stage, None on the others."""
        return self._op("F", i, lambda: self._forward(i, micro))

    def backward(self, i: int) -> None:
        """Op ``("B", i)``."""
        self._op("B", i, lambda: self._backward(i))

    def _op(self, kind: str, i: int, run):
        """Run one op, its receive and the next one's posted first (transfers overlap compute),
        timed and traced, then the sends that completed reaped. Before the first, the shared params
        set out (once the batch has split)."""
        if self.k == 0:
            self._start_shared()
        for op in self.ops[self.k : self.k + 2]:
            self._post(op)
        self.k += 1
        start, waited = time.perf_counter(), self.wait_s
        out = run()
        self.compute_s += time.perf_counter() - start - (self.wait_s - waited)
        self.trace.append((kind, i, start - self.t0, time.perf_counter() - self.t0))
        self._reap_sends()
        return out

    # -- p2p
    def _send(self, t: torch.Tensor, peer: int, what: str, tag: int = 0) -> None:
        label = f"send of {what} from stage {self.s} to {peer} at step {self.number}"
        self.sends.append(self.p2p.send(t, peer, label, tag))

    def _recv(self, shape, dtype: torch.dtype, peer: int, what: str, tag: int = 0):
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return self.p2p.recv(buf, peer, f"recv of {what} from stage {peer} to {self.s} at step {self.number}", tag)

    def _wait(self, work) -> torch.Tensor:
        t0 = time.perf_counter()
        out = work.wait()  # raises CollectiveError naming the transfer
        self.wait_s += time.perf_counter() - t0
        return out

    def _reap_sends(self) -> None:
        done = [w for w in self.sends if w.done()]
        for w in done:
            w.wait()  # already complete: raises only if it failed
        self.sends = [w for w in self.sends if w not in done]

    def _post(self, op: tuple[str, int]) -> None:
        kind, i = op
        peer = self.s - 1 if kind == "F" else self.s + 1
        if op in self.posted or kind not in self.meta or not 0 <= peer < self.p:
            return
        self.posted.add(op)
        what = "activation" if kind == "F" else "activation grad"
        self.recvs[op] = self._recv(*self.meta[kind], peer, f"the {what} of microbatch {i}")

    def _send_header(self, out: torch.Tensor) -> None:
        """Step, microbatches, batch digest, dtype and shape of the activations about to follow."""
        if out.dim() > _MAX_DIMS or out.dtype not in _DTYPES:
            raise ValueError(f"pipeline: stage {self.s} output has shape {tuple(out.shape)} {out.dtype}; expected at "
                             f"most {_MAX_DIMS} dims and one of {_DTYPES}")
        header = [self.number, self.m, self.digest, _DTYPES.index(out.dtype), out.dim(), *out.shape]
        self._send(torch.tensor(header + [0] * (_HEADER - len(header)), device=self.device), self.s + 1,
                   "the activation shape")

    def _recv_header(self) -> None:
        header = self._wait(self._recv(_HEADER, torch.int64, self.s - 1, "the activation shape")).tolist()
        number, m, digest, code, ndim = header[:5]
        if (number, m) != (self.number, self.m):
            raise ValueError(f"pipeline: stage {self.s - 1} runs step {number} with {m} microbatches but stage "
                             f"{self.s} runs step {self.number} with {self.m}: the ranks' steps diverged")
        if digest != self.digest:
            raise ValueError(f"pipeline: stages {self.s - 1} and {self.s} were given different batches at step "
                             f"{self.number}; every rank of a pipeline must call the step with the same batch")
        self.meta["F"] = (tuple(header[5 : 5 + ndim]), _DTYPES[code])

    # -- shared params: stage 0 lends them to the last stage, which returns their grads (tag 1)
    def _start_shared(self) -> None:
        last = self.p - 1
        if not self.shared or last == 0 or 0 < self.s < last:
            return
        if self.s == 0:
            owned = dict(zip(self.spec.owned, self.owned))
            self._send(torch.cat([owned[n].detach().reshape(-1) for n in self.shared]), last, "the shared params", 1)
            self.returned = self._recv(sum(self.sizes), torch.float32, last, "the shared params' grads", 1)
        else:
            self.lent_flat = self._recv(sum(self.sizes), self.ps.compute_dtype, 0, "the shared params", 1)

    def _borrow(self) -> None:
        pieces = self._wait(self.lent_flat).split(self.sizes)
        self.lent = [x.view(self.shapes[n]).requires_grad_() for x, n in zip(pieces, self.lent_names)]
        self.params.update(zip(self.lent_names, self.lent))

    def _finish_shared(self) -> None:
        if self.lent_names:
            flat = [(torch.zeros(self.shapes[n], device=self.device) if g is None else g).reshape(-1)
                    for g, n in zip(self.lent_acc, self.lent_names)]
            self._send(torch.cat(flat), 0, "the shared params' grads", 1)
        elif self.s == 0 and self.p > 1 and self.shared:
            back = dict(zip(self.shared, self._wait(self.returned).split(self.sizes)))
            accumulate(self.acc, [back[n].view(self.shapes[n]) if n in back else None for n in self.spec.owned])

    # -- compute
    def _forward(self, i: int, micro: PyTree) -> tuple[torch.Tensor, Any] | None:
        act_in = None
        if self.s > 0:
            if "F" not in self.meta:
                self._recv_header()
            self._post(("F", i))
            act_in = self._wait(self.recvs.pop(("F", i))).requires_grad_()
        if self.lent_names and not self.lent:
            self._borrow()
        output, aux = self._run_loss(micro, act_in)
        self.outputs[i] = (act_in, output)
        self.peak_live = max(self.peak_live, len(self.outputs))
        if self.s == self.p - 1:
            return output, aux
        sent = output.detach().contiguous()
        if "B" not in self.meta:
            self.meta["B"] = (tuple(sent.shape), sent.dtype)
            self._send_header(sent)
        self._send(sent, self.s + 1, f"the activation of microbatch {i}")
        return None

    def _run_loss(self, micro: PyTree, act_in: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """``(output, aux)``: the stage's output activation (aux None), or on the last stage the loss and its aux."""
        run = _StageRun(self.ps.model, self.ps.layout, self.s, self.p, act_in)
        try:
            with torch.enable_grad(), run_by(run):
                out = self.ps.loss_fn(self.params, micro)
        except _StageOutput as stop:
            return stop.output, None
        run.check_complete()
        return split_loss(out, self.ps.has_aux)

    def _backward(self, i: int) -> None:
        act_in, output = self.outputs.pop(i)
        if self.s == self.p - 1:
            root, grad_out = (output * self.scale if self.scale is not None else output), None
        else:
            self._post(("B", i))
            root, grad_out = output, [self._wait(self.recvs.pop(("B", i)))]
        inputs = ([act_in] if act_in is not None else []) + self.owned + self.lent + self.stand_ins
        grads = list(torch.autograd.grad([root], inputs, grad_out, allow_unused=True))
        if act_in is not None:
            g = grads.pop(0)
            self._send(torch.zeros_like(act_in) if g is None else g.contiguous(), self.s - 1,
                       f"the activation grad of microbatch {i}")
        n, k = len(self.owned), len(self.lent)
        accumulate(self.acc, grads[:n])
        accumulate(self.lent_acc, grads[n : n + k])
        used = [name for name, g in zip(self.stand_in_names, grads[n + k :]) if g is not None]
        if used:
            raise ValueError(f"pipeline: stage {self.s}'s forward used param '{used[0]}', which stage "
                             f"{self.ps.layout.owner.get(used[0], 0)} holds: a pipeline unit's params must be "
                             "read only inside the unit")


def _digest(batch: PyTree) -> int:
    """crc32 of the batch's tensors' bytes: adjacent stages compare it (cheap: the batch is small)."""
    crc = 0
    for x in tree.leaves(batch):
        if isinstance(x, torch.Tensor):
            crc = zlib.crc32(x.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc
