"""Turn an ``nn.Module`` into a pure function of its parameters, and carry the buffers it updates.

``functionalize(model)`` returns ``(apply, params)``: ``params`` is a ``dict[str, Tensor]`` of the
model's trainable parameters (detached aliases of the module's own tensors: no copy is made, and
tied parameters appear once under their first name); ``apply(params, *args, **kwargs)`` runs the
module with those tensors in its slots, as ``torch.func.functional_call`` does (``zfunc.model.slots``:
the slots found once, not per call). The module is used unchanged:
its own tensors are never written, now or when ``apply`` runs.

**Buffers a step carries.** A forward in training mode updates some buffers (BatchNorm's running
statistics and ``num_batches_tracked``, an EMA a module keeps). A training step (``zf.train_step``
and its transformations) carries them in ``TrainState.buffers`` (name -> tensor): during the step
``apply`` reads each buffer from the state (a buffer the state does not hold yet comes from the
module, as it holds it at the call), runs the module on copies, and hands every buffer the
forward wrote to the step, which puts it into the new state. So a step of ``k`` forwards
(``accum=k``, or a loss that calls ``apply`` twice) updates them ``k`` times, in order, as torch's
own loop does in train mode; ``model.eval()`` makes the forward read them without updating them.
A step whose update is skipped (fp16 overflow) keeps what its forwards wrote, as torch's
``GradScaler`` loop does.

A buffer counts as written when the forward updates it in place (torch's version counter), assigns
a new tensor to it, or when it is the running statistics of a normalization layer that tracks
them and is in training mode (``torch.nn.modules.batchnorm._NormBase``: BatchNorm*, SyncBatchNorm,
InstanceNorm* with ``track_running_stats=True``), whose update inside ``F.batch_norm`` does not bump
the version counter. Only those enter the state: buffers no forward writes (a causal mask, rotary
tables) stay in the module, out of the state and its checkpoints. A state from ``init``
holds no buffers; they join it at the first step whose forward writes them.

Cost: each ``apply`` clones the module's buffers (so neither the state nor the module is ever
written: a failed step leaves its state intact) -- the buffers' bytes, small next to the params.

**Evaluation with the trained statistics**: ``with zf.functional.using(state): out = apply(params, x)``
(``state`` a ``TrainState`` or a dict of buffers; a sharded state's buffers are whole, its params
come from ``zf.checkpoint.full_params``). After ``model.eval()`` the module normalizes with them,
as torch does; updates a forward makes under ``using`` are discarded. Outside any step or
``using``, ``apply`` reads the module's buffers and discards updates.

**One module per step.** The buffers of a step belong to one module: a loss that runs two
functionalized modules with buffers (a teacher) must give the other explicit buffers:
``apply, (params, buffers) = functionalize(module, with_buffers=True)`` and
``out, new_buffers = apply(params, buffers, *args)``, which never reads or writes a step's state.

**The module stays as it was.** ``apply`` runs the module it was given: its code, its submodules,
its frozen parameters and buffers (read at each call: values written in place, as
``load_state_dict`` does, are seen), and whatever tensor the dict it passes does not override (a
tie torch finds at call time, a tensor kept as a plain attribute). So while ``apply`` is in use the
module keeps every parameter, buffer and submodule ``functionalize`` found, on the same storage,
with the same ``requires_grad``. Each ``apply`` call checks, before it runs anything, that no slot
of the module tree (``_parameters``, ``_buffers``, ``_modules`` of every submodule) was replaced,
deleted or added, that no tensor's data moved in place (``module.to``/``.cuda``/``.half`` swap a
parameter's data under the same object), and that no parameter's ``requires_grad`` flipped; a
change raises ``ModuleChangedError`` naming the first tensor or submodule and what changed, and
what to do. ``train()``/``eval()``, hooks, a ``forward`` set on an instance (``zf.remat``) and
in-place writes of values are no change. Transformations of the module (``zf.tile``,
``zf.config.prepare``, a meta-device build for ``zf.materialize``) come before ``functionalize``.

Cost of the check: per call, four passes over the module tree, each one C-level ``map`` (no Python
loop): the identity of each slot's object, the size of each slot dict, each tensor's ``data_ptr``,
each parameter's ``requires_grad``: O(slots) at tens of nanoseconds each, under a tenth of what
``functional_call`` itself spends per call swapping every tensor in and out, nothing next to a
forward.

**Who runs the module now.** ``run_by(runner)`` registers, for the duration of a block, an object
whose ``running(module)`` context manager every ``apply`` enters around the module's call: ZeRO-3
gathers units around their forwards, a pipeline stage runs only its units. That registry is all
``functionalize`` knows of the transformations.
"""
from __future__ import annotations

import contextvars
import operator
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _NormBase

from zfunc.model.slots import Slots

_RUNNERS: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("zfunc_module_runners", default=())


@contextmanager
def run_by(runner: Any) -> Iterator[None]:
    """While the block runs, every ``apply`` enters ``runner.running(module)`` around the module's
    call (after the runners registered before it: the outer one first)."""
    token = _RUNNERS.set((*_RUNNERS.get(), runner))
    try:
        yield
    finally:
        _RUNNERS.reset(token)


@contextmanager
def _runners_of(module: nn.Module) -> Iterator[None]:
    runners = _RUNNERS.get()
    if not runners:
        yield
        return
    with ExitStack() as stack:
        for runner in runners:
            stack.enter_context(runner.running(module))
        yield


class BufferScope:
    """The module buffers of one step (or one ``using`` block), and the context manager that makes
    them the current ones: ``with BufferScope(...) as scope:`` (``carrying``, ``using``). Entered
    once at a time.

    ``buffers``: name -> tensor, the state's at first, then each forward's updates. ``written``:
    the names a forward wrote in the scope, in the order first written (only when ``record``).
    """

    def __init__(self, buffers: Mapping[str, torch.Tensor], record: bool):
        if type(buffers) is not dict and not isinstance(buffers, Mapping):  # a state's: a dict, no ABC check
            raise TypeError(f"buffers: expected a dict[str, Tensor], got {type(buffers).__name__}")
        self.buffers = dict(buffers)
        self.record = record
        self.written: dict[str, None] = {}
        self._owner: nn.Module | None = None
        self._token: contextvars.Token | None = None

    def __enter__(self) -> BufferScope:
        # the scope is its own context manager, not a wrapper's: every step enters one, and each
        # Python call on the step's path costs ~3 us at 1M params (its code and data cold)
        self._token = _SCOPE.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _SCOPE.reset(self._token)

    def read(self, module: nn.Module, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every buffer of ``module``: the scope's where it has one, else ``held`` (the module's)."""
        if self._owner is None:
            self._owner = module
        elif self._owner is not module:
            raise ValueError(
                f"apply: this step already ran a {type(self._owner).__name__} with buffers, now a "
                f"{type(module).__name__}; a step carries one module's buffers: functionalize the other "
                "with with_buffers=True and pass its buffers explicitly")
        unknown = self.buffers.keys() - held.keys()
        if unknown:
            raise KeyError(f"state.buffers: names {sorted(unknown)[:5]} are not buffers of the "
                           f"{type(module).__name__} being run (expected some of {sorted(held)[:5]})")
        return {**held, **self.buffers}

    def write(self, updates: dict[str, torch.Tensor]) -> None:
        if self.record and updates:
            self.buffers.update(updates)
            self.written.update(dict.fromkeys(updates))


_SCOPE: contextvars.ContextVar[BufferScope | None] = contextvars.ContextVar("zfunc_module_buffers", default=None)


def carrying(buffers: Mapping[str, torch.Tensor]) -> AbstractContextManager[BufferScope]:
    """For steps: run the block with ``buffers`` (a state's) as the module's, recording what each
    forward writes in the yielded ``BufferScope`` (its ``buffers`` become the new state's)."""
    return BufferScope(buffers, record=True)


def using(state_or_buffers: Any) -> AbstractContextManager[BufferScope]:
    """Run the block's ``apply`` calls with the buffers of ``state_or_buffers`` (a ``TrainState``
    or a dict name -> tensor): evaluation with trained statistics (``model.eval()`` first, as in
    torch). The buffers are read, never written: updates a forward makes are discarded."""
    buffers = getattr(state_or_buffers, "buffers", state_or_buffers)
    if not isinstance(buffers, Mapping):
        raise TypeError(f"state_or_buffers: expected a TrainState or a dict[str, Tensor], got "
                        f"{type(state_or_buffers).__name__}")
    return BufferScope(buffers, record=False)


def _buffer_snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers()}


def _norm_stats(module: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """``(norm layer, names of its running statistics)`` for each layer that tracks them."""
    out = []
    for prefix, m in module.named_modules():
        if isinstance(m, _NormBase):
            names = tuple(f"{prefix}.{n}" if prefix else n for n, b in m.named_buffers(recurse=False))
            out.append((m, names))
    return out


def _check_params(params: Any, expected: frozenset[str]) -> None:
    if not isinstance(params, dict):
        raise TypeError(f"params: expected a dict[str, Tensor], got {type(params).__name__}")
    unknown = params.keys() - expected
    if unknown:
        raise KeyError(
            f"params: names {sorted(unknown)[:5]} are not parameters of the module "
            f"(expected its trainable names {sorted(expected)[:5]}...)"
        )
    missing = expected - params.keys()
    if missing:  # taking them from the module instead would silently never train them
        raise KeyError(
            f"params: {len(missing)} trainable parameters of the module are missing: {sorted(missing)[:5]} "
            f"(expected every name of the params functionalize returned, {len(expected)} in all)"
        )


class ModuleChangedError(RuntimeError):
    """The module an ``apply`` runs no longer holds what ``functionalize`` found (module docstring)."""


_REMEDY = ("apply runs the module as zf.functionalize found it, so nothing ran. Keep the module as it is "
           "while apply is in use (apply and params hold its tensors already: moving it frees no memory), or "
           "change it first (zf.tile, zf.config.prepare, requires_grad, .to()) and call zf.functionalize "
           "again. To start a model without memory, build it on the meta device before zf.functionalize and "
           "give init a materializer (zf.materialize, as the README shows).")
_KINDS = ("parameter", "buffer", "submodule")
_MISSING = object()  # a slot deleted since functionalize
_requires_grad = operator.attrgetter("requires_grad")


def _data_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.data_ptr()
    except RuntimeError:  # sparse, or a subclass without storage: its identity is checked
        return None


def _a(name: str) -> str:
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


class _Held:
    """The slots of a module tree as ``functionalize`` found them: ``check()`` compares, in C-level
    passes, what the module holds now (law and cost: module docstring) and names what differs."""

    def __init__(self, module: nn.Module):
        self.dicts: list[tuple[str, str, dict]] = []  # (module prefix, kind, slot dict)
        self.slots: list[tuple[str, str, dict, str, Any]] = []  # (qualified name, kind, dict, key, object)
        for prefix, m in module.named_modules():  # each module once; a shared child is a slot of each parent
            for kind, d in zip(_KINDS, (m._parameters, m._buffers, m._modules)):
                self.dicts.append((prefix, kind, d))
                self.slots += [(f"{prefix}.{k}" if prefix else k, kind, d, k, v) for k, v in d.items()]
        tensors = {n: v for n, kind, _, _, v in self.slots if kind != "submodule" and v is not None}
        self.was = {n: (t.device, t.dtype, tuple(t.shape), _data_ptr(t)) for n, t in tensors.items()}
        self.flags = {n: p.requires_grad for n, kind, _, _, p in self.slots if kind == "parameter" and p is not None}
        self._slot_dicts = [s[2] for s in self.slots]
        self._slot_keys = [s[3] for s in self.slots]
        self._objects = [s[4] for s in self.slots]
        self._dicts = [d for _, _, d in self.dicts]
        self._tensors = [tensors[n] for n, w in self.was.items() if w[3] is not None]
        self._params = [tensors[n] for n in self.flags]
        self._fingerprint = self.fingerprint()

    def fingerprint(self) -> tuple[list, list, list]:
        """The sizes of the slot dicts, the tensors' ``data_ptr``s, the params' ``requires_grad``."""
        return (list(map(len, self._dicts)), list(map(torch.Tensor.data_ptr, self._tensors)),
                list(map(_requires_grad, self._params)))

    def intact(self) -> bool:
        """Whether every slot holds the object it held, each slot dict its size, each tensor its
        storage and each param its ``requires_grad`` (each pass one C-level ``map``)."""
        try:
            return (all(map(operator.is_, map(dict.get, self._slot_dicts, self._slot_keys), self._objects))
                    and self.fingerprint() == self._fingerprint)
        except RuntimeError:  # a tensor without storage now
            return False

    def check(self) -> None:
        """Raise ``ModuleChangedError`` naming the first change, if the module changed."""
        if not self.intact():
            changes = self.changes() or ["its slots are not the ones it held"]
            more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
            raise ModuleChangedError(f"apply: the module changed since zf.functionalize: {changes[0]}{more}. {_REMEDY}")

    def changes(self) -> list[str]:
        """What differs, in module order: slots replaced or deleted, then added, then tensors whose
        data moved in place, then flipped ``requires_grad`` flags."""
        out = [f"{kind} {name!r} {self._replaced(name, obj, d.get(key, _MISSING))}"
               for name, kind, d, key, obj in self.slots if d.get(key, _MISSING) is not obj]
        known = {(id(d), key) for _, _, d, key, _ in self.slots}
        for prefix, kind, d in self.dicts:
            for key in d:
                if (id(d), key) not in known:
                    out.append(f"{kind} {(f'{prefix}.{key}' if prefix else key)!r} was added")
        for name, kind, d, key, obj in self.slots:
            if kind == "submodule" or obj is None:
                continue
            device, dtype, _, ptr = self.was[name]
            if (obj.device, obj.dtype, _data_ptr(obj)) != (device, dtype, ptr):
                out.append(f"{kind} {name!r} had its data replaced in place: {obj.device} {obj.dtype} (was {device} "
                           f"{dtype}), as module.to(), .cuda() or .half() do")
            if kind == "parameter" and obj.requires_grad != self.flags[name]:
                out.append(f"parameter {name!r} has requires_grad={obj.requires_grad} (was {self.flags[name]} at "
                           "zf.functionalize, which decides what trains)")
        return out

    def _replaced(self, name: str, obj: Any, now: Any) -> str:
        if now is _MISSING:
            return "was deleted"
        if now is None:
            return "was set to None"
        if obj is None:
            return f"was None and now holds {_a(type(now).__name__)}"
        if isinstance(obj, nn.Module):
            return f"was replaced by {_a(type(now).__name__)} (was {_a(type(obj).__name__)})"
        device, dtype, shape, _ = self.was[name]
        if isinstance(now, torch.Tensor) and now.device != device:
            return f"was replaced by a tensor on {now.device} (was {device}), as module.to({now.device.type!r}) does"
        got = f"{now.device} {now.dtype} {tuple(now.shape)}" if isinstance(now, torch.Tensor) else type(now).__name__
        return f"was replaced by another tensor ({got}; was {device} {dtype} {shape})"


def functionalize(module: nn.Module, *, with_buffers: bool = False) -> tuple[Callable[..., Any], Any]:
    """Split ``module`` into a pure ``apply`` function and its parameters.

    Args:
      module: any ``nn.Module``; it is not modified, now or when ``apply`` runs.
      with_buffers: give ``apply`` its buffers explicitly, outside any step's state (see the
        module docstring): ``out, new_buffers = apply(params, buffers, *args)``.

    Returns:
      ``(apply, params)``, or ``(apply, (params, buffers))`` with ``with_buffers=True``. ``params``
      maps each trainable parameter's qualified name to a detached alias of it (same dtype, device
      and storage); parameters with ``requires_grad=False`` are frozen into ``apply`` instead.
      ``apply``'s ``params`` must hold every trainable name, else ``KeyError`` names the missing.
      Inside a step, ``apply`` reads and updates the step's ``TrainState.buffers`` (module
      docstring); elsewhere it reads the module's buffers and discards updates. The module must
      stay as it is: ``apply`` raises ``ModuleChangedError`` at its first call after a change
      (module docstring); values written into its tensors in place (``load_state_dict``) are read.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    trainable = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}
    frozen = {n: p.detach() for n, p in module.named_parameters() if not p.requires_grad}
    names = frozenset(trainable)
    norms = _norm_stats(module)
    held = _Held(module)
    slots = Slots(module)

    def call(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], args, kwargs,
             done: Callable[[dict[str, torch.Tensor]], None]):
        """The module's output; ``done(written)`` gets the buffers the forward wrote, also when
        the forward stops by an exception (a pipeline stage ends its forward that way)."""
        held.check()
        _check_params(params, names)
        copies = {n: b.clone() for n, b in buffers.items()}  # the forward may write them in place
        versions = {n: b._version for n, b in copies.items()}
        # One dict: functional_call writes buffers the forward reassigned back into it.
        tensors = {**trainable, **params, **frozen, **copies}
        try:
            with _runners_of(module):
                if slots.covers(tensors):
                    return slots.swapped(tensors, args, kwargs)
                return functional_call(module, tensors, args, kwargs)
        finally:
            stats = {n for m, ns in norms if m.training and m.track_running_stats for n in ns}
            done({n: tensors[n].detach() for n, b in copies.items()
                  if tensors[n] is not b or b._version != versions[n] or n in stats})

    if with_buffers:

        def apply_with_buffers(params, buffers, *args, **kwargs):
            """``(out, new_buffers)``: the module's output and its buffers after the forward
            (copies: ``buffers`` is left untouched)."""
            new_buffers = dict(buffers)
            out = call(params, buffers, args, kwargs, new_buffers.update)
            return out, new_buffers

        return apply_with_buffers, (trainable, _buffer_snapshot(module))

    held_buffers = {n: b.detach() for n, b in module.named_buffers()}  # aliases: the values at each call

    def apply(params, *args, **kwargs):
        """The module's output for ``params``, with the step's buffers (module docstring)."""
        scope = _SCOPE.get()
        if scope is None or not held_buffers:
            return call(params, held_buffers, args, kwargs, lambda written: None)
        return call(params, scope.read(module, held_buffers), args, kwargs, scope.write)

    return apply, trainable
