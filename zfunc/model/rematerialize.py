"""remat: activation checkpointing per unit, optionally keeping the saved inputs in CPU memory.

``zf.remat(fn)`` returns a function computing the same as ``fn`` that keeps only ``fn``'s inputs
for backward and recomputes its inside when backward reaches it; ``offload=True`` also moves those
inputs to (pinned) CPU memory until then -- ZeRO-Infinity's activation offload. Apply it per unit
without touching the model's code or parameter names, by replacing an instance's ``forward``::

    for block in model.blocks:
        block.forward = zf.remat(block.forward, offload=True)

**Law.** Outputs and grads equal ``fn``'s: the recomputation replays torch's RNG state, so dropout
draws the same mask (``torch.utils.checkpoint``'s ``preserve_rng_state``). Buffers the module
updates in training (BatchNorm's running statistics) are updated once per call, as without remat:
the recomputation reads them as the forward left them, as torch's checkpoint does, but writes into
copies. ``torch.utils.checkpoint`` alone would update them a second time in backward (measured on
torch 2.13: ``num_batches_tracked`` is 2 after one forward and backward, and the running mean has
moved twice); a buffer the forward reassigns is kept too.

**Cost.** Memory: per unit, its inputs instead of everything its backward would save (a
transformer block saves ~10-30x its input); with ``offload`` the inputs live in CPU RAM and only the
unit being recomputed holds device memory. Time: one more forward of each unit (~+33% of a step's
FLOPs), plus a host round trip of the inputs with ``offload`` (overlapped on CUDA: the copies are
``non_blocking`` from pinned memory). On a CPU device ``offload`` moves nothing.

**Context.** The recomputation runs under the contexts the forward ran under that a module's code cannot
see: each ``replay_context(capture)`` registered, ``capture()`` is called as the forward runs and what it
returns is entered around the recomputation (``zf.sequence_parallel`` registers its attention: a unit
recomputed where nothing else puts it in force, a pipeline stage's backward, attends as its forward did).

Implemented with the non-reentrant ``torch.utils.checkpoint``, which works under
``torch.autograd.grad`` and ``backward`` (what zfunc's steps use) but not under ``torch.func.grad``
(docs/design.md, section 1). The reentrant variant would compute param grads into ``.grad`` behind
``autograd.grad``'s back, so it is not used.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from zfunc.core import compose


_replayed: list[Callable[[], contextlib.AbstractContextManager]] = []


def replay_context(capture: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Register ``capture``: called as a rematerialized function runs forward, the context manager it returns is
    entered around each recomputation of that call in backward (the module docstring's context; a split
    backward recomputes twice, so it must be reusable: not a ``contextlib.contextmanager`` generator)."""
    if not callable(capture):
        raise TypeError(f"capture: expected a callable returning a context manager, got {type(capture).__name__}")
    _replayed.append(capture)


class _Replayed:
    """The contexts captured at a forward, entered around each of its recomputations."""

    def __init__(self, captured: list[contextlib.AbstractContextManager]):
        self.captured, self.stacks = captured, []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        for context in self.captured:
            stack.enter_context(context)
        self.stacks.append(stack)

    def __exit__(self, *exc: Any) -> bool:
        return self.stacks.pop().__exit__(*exc)


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``checkpoint``'s ``context_fn``: nothing around the forward; the captured contexts around the recomputation."""
    return contextlib.nullcontext(), _Replayed([capture() for capture in _replayed])


def _to_host(x: Any) -> Any:
    """A CPU copy of a device tensor (pinned, so the way back can be asynchronous), kept in the
    autograd graph so grads flow back to ``x``; anything else unchanged."""
    if not isinstance(x, torch.Tensor) or x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
    return _CopyToHost.apply(x, host)


class _CopyToHost(torch.autograd.Function):
    """``host.copy_(x)`` with the grad going back to ``x``'s device (``setup_context`` style, so
    it also works under ``torch.func``)."""

    @staticmethod
    def forward(x: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        return host.copy_(x, non_blocking=True)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.device = inputs[0].device

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.device, non_blocking=True), None


def _owner(fn: Callable[..., Any]) -> nn.Module | None:
    """The module whose parameters ``fn`` reads: ``fn`` itself, or the module of a bound method."""
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _keep_reassigned(module: nn.Module, given: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    """Set on ``module`` each buffer the forward reassigned (``functional_call`` wrote it back into
    ``after``): under an outer ``functional_call`` (``zf.functionalize``'s apply), that one sees it."""
    for n in given:
        if after[n] is not given[n]:
            owner, _, leaf = n.rpartition(".")
            setattr(module.get_submodule(owner), leaf, after[n])


def remat(fn: Callable[..., Any], offload: bool = False) -> Callable[..., Any]:
    """``fn`` with activation checkpointing (see the module docstring for law and cost).

    Args:
      fn: any callable of tensors (and other arguments): a function, a module, or a module's bound
        ``forward`` (the form to assign back to ``module.forward``; a module itself must not be).
        For a module (or its bound method), the parameters and buffers it holds *when called* --
        under ``functional_call``, the tensors swapped in -- are what the recomputation in
        backward (outside ``functional_call``) uses too: the parameters as explicit inputs of the
        checkpoint, the buffers as the forward left them, copied (see the law).
      offload: keep the positional tensor arguments in pinned CPU memory between forward and
        backward; each comes back to its own device when the recomputation needs it (tensors
        nested in other arguments stay where they are).
    Outside autograd (``torch.no_grad``, inference) ``fn`` runs as it is.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    compose.check_model_level("remat", fn)
    if not isinstance(offload, bool):
        raise TypeError(f"offload: expected a bool, got {type(offload).__name__}")
    module = _owner(fn)
    replaying = contextvars.ContextVar("zfunc_remat_replaying", default=False)

    def with_state(names: tuple[str, ...], buffers: dict[str, torch.Tensor], kwargs: dict):
        """``(*params, *args) -> fn(*args, **kwargs)`` with ``module``'s params set to ``params``
        and its buffers to ``buffers``: the forward (first call) updates them, the recomputation
        (any later call) updates copies. Buffers are not inputs of the checkpoint: it would
        refuse to recompute from a buffer the forward updated in place (a version check)."""
        calls = 0

        def run(*inputs: Any) -> Any:
            nonlocal calls
            params, args = inputs[: len(names)], inputs[len(names):]
            if module is None:
                return fn(*args, **kwargs)
            recompute, calls = calls > 0, calls + 1
            given = {n: b.clone() for n, b in buffers.items()} if recompute else buffers
            tensors = {**dict(zip(names, params)), **given}
            token = replaying.set(True)  # ``module.forward`` may be this very wrapper: call ``fn``
            try:
                return functional_call(module, tensors, args, kwargs)
            finally:
                replaying.reset(token)
                if not recompute:
                    _keep_reassigned(module, buffers, tensors)

        return run

    @functools.wraps(fn)
    def rematerialized(*args: Any, **kwargs: Any) -> Any:
        if replaying.get():
            return fn(*args, **kwargs)
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        held = dict(module.named_parameters()) if module is not None else {}
        buffers = dict(module.named_buffers()) if module is not None else {}
        names, state = tuple(held), tuple(held.values())
        if not offload:
            return checkpoint(with_state(names, buffers, kwargs), *state, *args, use_reentrant=False,
                              context_fn=_contexts)
        devices = [x.device if isinstance(x, torch.Tensor) else None for x in args]
        run = with_state(names, buffers, kwargs)

        def on_device(*inputs: Any) -> Any:
            back = [h.to(d, non_blocking=True) if d is not None else h
                    for h, d in zip(inputs[len(names):], devices)]
            return run(*inputs[: len(names)], *back)

        return checkpoint(on_device, *state, *[_to_host(x) for x in args], use_reentrant=False, context_fn=_contexts)

    rematerialized.zfunc_transform = "remat"  # what zfunc.core.compose looks for (a pipeline unit refuses it)
    return rematerialized
