"""A zfunc step driven one microbatch at a time from an imperative loop (forward, backward, step).

``zf.train_step`` computes a whole step in one call: ``step(state, batch)`` runs ``loss_fn(params,
micro)`` for each microbatch, differentiates it and updates. An imperative loop (DeepSpeed's
``engine(x)``, ``engine.backward(loss)``, ``engine.step()``) holds the code between the forward and
the loss: the criterion is the user's, run after the forward returns. ``SuspendedStep`` runs the
step on a thread of its own and suspends it inside ``loss_fn``: the caller's thread and the step's
thread take turns (one runs while the other waits), so the step's call never returns until the
loop reaches the accumulation boundary.

Per microbatch, inside the step's ``loss_fn``:
1. ``forward(*inputs)``: the model runs on the step's params (in the step's thread, so ZeRO-3's
   gathers, the carried buffers and the step's seeded generator apply) and each floating output is
   *cut*: the caller gets a detached copy that requires grad.
2. The caller computes its loss from the copies and calls ``backward`` on it (``loss.backward()`` or
   ``engine.backward(loss)``): autograd runs the criterion's part only, leaving d loss / d output in
   each copy's ``.grad``.
3. ``loss_fn`` returns ``join(loss, outputs, grads)``: a scalar whose value is the loss and whose
   backward hands each output its grad, so the step's own backward (ZeRO's reducers, offload's
   updates on arrival, fp16's loss scale) runs from the outputs down, as for any loss.

Law: the step's grads are those of the caller's loss (the chain rule cut at the outputs), so the
step trains as ``zf.train_step`` on a ``loss_fn`` that ran the criterion itself; within fp32
rounding, the grads equal ``loss.backward()`` through the whole graph. Randomness: the model's
forward draws from the step's generator (a function of ``state.rng`` and the step), the caller's
code from its own: the CPU generator's state is swapped at each turn, so the caller's stream is
what it would be without the step. Cost per microbatch: two turns between threads (a few tens of
microseconds), a detached copy of each output (a view, no data) and one multiply of each output's
grad by the loss scale in backward. The caller's thread never runs the model.
"""
from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

PyTree = Any


class StepFailed(RuntimeError):
    """The step's thread raised; the state it was given is lost (a step consumes its input state)."""


class _Join(torch.autograd.Function):
    """``value`` forward; in backward each output gets its saved grad times the incoming one."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, grads: tuple, *outputs: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scaled = [None if g is None else g * grad.to(g.dtype) for g in ctx.grads]
        ctx.grads = None
        return (None, None, *scaled)


def join(value: torch.Tensor, outputs: list[torch.Tensor], grads: list[torch.Tensor | None]) -> torch.Tensor:
    """A 0-d fp32 tensor equal to ``value`` whose backward gives ``outputs[i]`` the grad ``grads[i]``
    (scaled by the incoming grad: a loss scale)."""
    return _Join.apply(value.detach().float().reshape(()), tuple(grads), *outputs)


def _cut(out: Any) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """``out`` with each floating tensor that requires grad replaced by a detached copy that
    requires grad; the originals and the copies, in order. Containers are rebuilt as their own
    type: tuples, lists and named tuples, dicts and mappings such as transformers' ``ModelOutput``."""
    originals: list[torch.Tensor] = []
    copies: list[torch.Tensor] = []

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.requires_grad and x.is_floating_point():
                c = x.detach().requires_grad_()
                originals.append(x)
                copies.append(c)
                # a scalar (a loss) is shown as a non-leaf, so the caller may scale it in place (``loss *= k``)
                return c * 1 if c.dim() == 0 else c
            return x.detach()
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(cut(v) for v in x))
        if isinstance(x, (tuple, list)):
            return type(x)(cut(v) for v in x)
        if isinstance(x, Mapping):
            items = {k: cut(v) for k, v in x.items()}
            if type(x) is dict:
                return items
            try:
                return type(x)(**items)
            except TypeError:
                return type(x)(items)
        return x

    return cut(out), originals, copies


class SuspendedStep:
    """Calls of ``step(state, batch)`` on a thread of their own, each stopped in ``loss_fn`` at each
    microbatch; one thread serves every call (it is started at the first and joined at exit).

    ``model(params, *args, **kwargs)`` runs the model (``zf.functionalize``'s ``apply``); the step's
    ``loss_fn`` is ``self.loss_fn``. The caller: ``start(step, state, batch)``, then per microbatch
    any number of ``forward(...)`` and one ``backward(loss_value)`` (after autograd filled the
    copies' grads); ``result()`` after the last one returns ``(state, metrics)``.
    """

    def __init__(self, model: Callable[..., Any]):
        self.model = model
        self._to_step: queue.SimpleQueue = queue.SimpleQueue()
        self._to_caller: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._step_rng: torch.Tensor | None = None
        self._pending: list[list[torch.Tensor]] = []  # this microbatch's cut copies
        self.done: tuple | None = None  # (state, metrics) once the step returned
        self.busy = False  # a step is under way
        self.microbatches = 0  # microbatches whose backward the step has received

    # ------------------------------------------------------------------ the step's thread

    def loss_fn(self, params: PyTree, micro: Any) -> torch.Tensor:
        """The step's loss: waits for the caller's forwards and its backward (module docstring)."""
        self._to_caller.put(("want", None))
        cuts: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        while True:
            kind, payload = self._to_step.get()
            if kind == "forward":
                args, kwargs = payload
                try:
                    out = self.model(params, *args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - handed to the caller, the step goes on waiting
                    self._to_caller.put(("raised", e))
                    continue
                shown, originals, copies = _cut(out)
                cuts.append((originals, copies))
                self._to_caller.put(("outputs", (shown, copies)))
            elif kind == "backward":
                outputs = [o for originals, _ in cuts for o in originals]
                grads = [c.grad for _, copies in cuts for c in copies]
                value = payload if payload is not None else torch.zeros(())
                return join(value, outputs, grads)
            else:  # "abort"
                raise _Aborted()

    def _serve(self) -> None:
        """The step's thread: one step per "run" message, until "quit". One thread serves every step
        of the engine, so torch's and the kernels' OpenMP team for it is made once."""
        while True:
            kind, payload = self._to_step.get()
            if kind == "quit":
                return
            if kind != "run":  # a forward or backward with no step under way: say so, do not hang
                self._to_caller.put(("error", RuntimeError(f"zfunc.deepspeed: {kind} outside a step")))
                continue
            step, state, batch = payload
            try:
                self._to_caller.put(("done", step(state, batch)))
            except _Aborted:
                self._to_caller.put(("aborted", None))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._to_caller.put(("error", e))

    # ------------------------------------------------------------------ the caller's thread

    def start(self, step: Callable, state: Any, batch: Any) -> None:
        """Start ``step(state, batch)`` and wait until it asks for the first microbatch."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, daemon=True, name="zfunc-step")
            self._thread.start()
            atexit.register(self.close)  # joined before interpreter teardown, its OpenMP team with it
        self.done, self.busy, self.microbatches, self._pending = None, True, 0, []
        kind, payload = self._turn(("run", (step, state, batch)))
        if kind != "want":
            raise AssertionError(f"zfunc.deepspeed: the step's thread answered {kind!r}")

    @property
    def running(self) -> bool:
        return self.busy

    def close(self) -> None:
        """End the step's thread (a step under way is aborted first)."""
        if self._thread is not None:
            self.abort()
            self._to_step.put(("quit", None))
            self._thread.join()
            self._thread = None

    def forward(self, args: tuple, kwargs: dict) -> PyTree:
        """The model's output on ``args``, its floating outputs cut (module docstring)."""
        kind, payload = self._turn(("forward", (args, kwargs)))
        if kind == "raised":
            raise payload
        shown, copies = payload
        self._pending.append(copies)
        return shown

    def forwarded(self) -> bool:
        """Whether this microbatch ran a forward."""
        return bool(self._pending)

    def backward_seen(self) -> bool:
        """Whether autograd reached this microbatch's outputs (some copy has a grad)."""
        return any(c.grad is not None for copies in self._pending for c in copies)

    def backward(self, loss_value: torch.Tensor | None) -> None:
        """Hand the microbatch's grads (and loss value, None if unknown) to the step; wait until it
        asks for the next microbatch or returns."""
        self._pending = []
        self.microbatches += 1
        kind, payload = self._turn(("backward", loss_value))
        if kind == "done":
            self.done, self.busy = payload, False
        elif kind != "want":
            raise AssertionError(f"zfunc.deepspeed: the step's thread answered {kind!r}")

    def abort(self) -> None:
        """End a step waiting for a microbatch: it raises inside and its thread ends."""
        if self.busy:
            self._turn(("abort", None))
        self._pending, self.busy = [], False

    def _turn(self, message: tuple) -> tuple[str, Any]:
        """Let the step's thread run until it answers; swap torch's CPU generator state both ways."""
        gen = torch.default_generator
        mine = gen.get_state()
        if self._step_rng is not None:
            gen.set_state(self._step_rng)
        self._to_step.put(message)
        kind, payload = self._to_caller.get()
        self._step_rng = gen.get_state()
        gen.set_state(mine)
        if kind == "error":
            self.busy, self._pending = False, []
            raise StepFailed(f"the step raised {type(payload).__name__}: {payload}") from payload
        return kind, payload


class _Aborted(Exception):
    """Raised inside ``loss_fn`` to end a step the caller abandons."""
