"""Gradients of a loss function of params: ``value_and_grad``, and the plain step's forward and
backward over its microbatches (``_LocalGrads``, driven by the microbatch loop) or, for its one fp32
microbatch on a CPU-only process, in one function (``one_microbatch``: the same loss and grads, bit
for bit, in fewer Python calls).

Gradients use ``torch.autograd.grad`` over detached leaves that require grad: it supports
saved-tensor hooks and non-reentrant checkpointing, which ``torch.func.grad`` refuses
(docs/design.md, section 1), and costs the same as ``loss.backward()``. A param the loss never uses
gets no grad (``None``), and the optimizer leaves it alone, as torch does.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from zfunc import optim
from zfunc.core import tree
from zfunc.core.microbatches import accumulate, cast_batch

PyTree = Any


def split_loss(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    """``(loss, aux)`` from what a loss function returned, the loss checked to be a scalar tensor."""
    loss, aux = out if has_aux else (out, None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        got = f"shape {tuple(loss.shape)} {loss.dtype}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn: expected a 0-d floating-point tensor (a scalar loss), got {got}")
    return loss, aux


class _LocalGrads:
    """The plain step's forward and backward: grads of ``loss_fn(params, microbatch)`` (its loss times
    ``scale``, None: 1) with respect to ``params``' floating leaves, by ``torch.autograd.grad`` over
    detached leaves that require grad, summed in fp32 over the microbatches (``accumulate``)."""

    __slots__ = ("loss_fn", "scale", "has_aux", "treespec", "flags", "wrt", "plain", "params", "live", "acc", "left",
                 "squares")

    def __init__(self, params: PyTree, loss_fn: Callable, scale: float | None, has_aux: bool, squares_at: int = 0):
        """``squares_at``: the number of backwards whose last adds its grads to the sums in one pass
        with the sum of the squares of the results (``optim.add_with_squares``, into ``squares``:
        the norm with no read of its own); 0: none does."""
        leaves, self.treespec = tree.flatten(params)
        self.flags = [isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves]
        diff = [x.detach().requires_grad_() if f else x for x, f in zip(leaves, self.flags)]
        self.wrt = diff if all(self.flags) else [x for x, f in zip(diff, self.flags) if f]
        self.plain = _plain_tensors(self.wrt)
        self.params = tree.unflatten(self.treespec, diff)
        self.loss_fn, self.scale, self.has_aux = loss_fn, scale, has_aux
        self.live: dict[int, torch.Tensor] = {}  # microbatches between forward and backward: their losses
        self.acc: list | None = None
        self.left, self.squares = squares_at, None

    def forward(self, i: int, micro: PyTree) -> tuple[torch.Tensor, Any]:
        """Microbatch ``i``'s ``(loss, aux)``; its graph kept for ``backward(i)``."""
        with torch.enable_grad():
            loss, aux = split_loss(self.loss_fn(self.params, micro), self.has_aux)
        self.live[i] = loss
        return loss, aux

    def backward(self, i: int) -> None:
        """Microbatch ``i``'s grads, added to the sums (``None`` for a leaf it did not use)."""
        grads = self.grads(self.live.pop(i))
        self.left -= 1
        if self.left == 0 and self.acc is not None:
            self.squares = optim.add_with_squares(self.acc, grads)
            if self.squares is not None:
                return
        self.acc = accumulate(self.acc, grads)

    def grads(self, loss: torch.Tensor) -> list:
        """The grads of ``loss`` (times ``scale``), a list in leaf order, ``None`` for a leaf that is
        not floating or that the loss did not use."""
        if self.scale is not None:
            with torch.enable_grad():  # the product joins the graph (the backward itself needs no grad mode)
                loss = loss * self.scale
        grads = _grads(loss, self.wrt, self.plain)
        if len(grads) != len(self.flags):
            it = iter(grads)
            grads = [next(it) if f else None for f in self.flags]
        return list(grads)


_ENGINE = torch.autograd.Variable._execution_engine


def _plain_tensors(wrt: list) -> bool:
    """Whether every tensor of ``wrt`` is a plain ``torch.Tensor`` (no subclass: nothing for
    ``__torch_function__`` to dispatch)."""
    return all(type(x) is torch.Tensor for x in wrt)


def _grads(loss: torch.Tensor, wrt: list, plain: bool | None = None) -> tuple:
    """``torch.autograd.grad(loss, wrt, allow_unused=True)``. In a process without CUDA, whose
    graphs run on the calling thread, on plain tensors (``plain``: ``_plain_tensors(wrt)``, None:
    checked here): torch's engine called directly, as that function ends up calling it, without
    its argument handling, ``__torch_function__`` dispatch and stash of the caller's context for
    device threads (6 of the 16 us it takes, at 1e3 params, of a plain CPU step's ~47)."""
    if (type(loss) is torch.Tensor and loss.grad_fn is not None and not torch.cuda.is_initialized()
            and (_plain_tensors(wrt) if plain is None else plain)):
        return _ENGINE.run_backward((loss,), (torch.ones_like(loss),), False, False, tuple(wrt), True, False)
    return torch.autograd.grad(loss, wrt, allow_unused=True)


def one_microbatch(params: PyTree, loss_fn: Callable, has_aux: bool, batch: PyTree,
                   seed: int) -> tuple[torch.Tensor, Any, list, optree.PyTreeSpec]:
    """The loss and grads of ``loss_fn(params, batch)`` in fp32, unscaled, in a process without
    CUDA: what ``run_microbatches`` over ``Accumulation(1)`` with ``_LocalGrads`` computes (the
    batch's floating tensors cast to fp32, torch's CPU generator seeded by ``seed`` and restored
    after), bit for bit, written out in one function. Returns the detached fp32 loss, the aux, the
    grads (a list in leaf order, fp32; None for a leaf that is not floating or that the loss did not
    use) and the params' treespec.

    Cost: ~7 Python calls where the loop's layers make ~30. Past ~1M params a step's arrays
    evict the interpreter's own data from the caches and the TLB, and each call's code and objects
    are fetched again: at 1M, ~3-10 us a call."""
    leaves, treespec = optree.tree_flatten(params, namespace=tree.NAMESPACE)
    diff, wrt, flags, plain = [], [], [], True
    for x in leaves:  # _LocalGrads' flags, diff and wrt in one loop
        floating = isinstance(x, torch.Tensor) and x.is_floating_point()
        if floating:
            x = x.detach().requires_grad_()
            wrt.append(x)
            plain = plain and type(x) is torch.Tensor
        diff.append(x)
        flags.append(floating)
    micro = cast_batch(batch, torch.float32)
    generator = torch.default_generator  # ``seeded(seed, [])``, written out
    saved = generator.get_state()
    generator.manual_seed(seed)
    try:
        enabled = torch.is_grad_enabled()  # ``torch.enable_grad()``, written out
        torch._C._set_grad_enabled(True)
        try:
            loss, aux = split_loss(loss_fn(treespec.unflatten(diff), micro), has_aux)
        finally:
            torch._C._set_grad_enabled(enabled)
        grads = iter(_grads(loss, wrt, plain))
    finally:
        generator.set_state(saved)
    acc = []  # ``accumulate(None, grads)``: fp32 as they are, others as fp32 copies
    for floating in flags:
        g = next(grads) if floating else None
        acc.append(g if g is None or g.dtype is torch.float32 else g.float())
    loss = loss.detach()
    return loss if loss.dtype is torch.float32 else loss.float(), aux, acc, treespec


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


def value_and_grad(fn: Callable[..., Any], has_aux: bool = False) -> Callable[..., Any]:
    """``fn(params, *args) -> loss`` becomes ``(params, *args) -> (loss, grads)``.

    ``loss`` must be a 0-d floating tensor; it comes back detached. ``grads`` has the structure of
    ``params``, a tensor (zeros where unused) for each floating leaf and ``None`` elsewhere. With
    ``has_aux`` ``fn`` returns ``(loss, aux)`` and the result is ``((loss, aux), grads)``. Pure:
    ``params`` are read, never written.
    """

    def wrapped(params: PyTree, *args: Any):
        local = _LocalGrads(params, fn, None, has_aux)
        with torch.enable_grad():
            loss, aux = split_loss(fn(local.params, *args), has_aux)
        grads = local.grads(loss)
        leaves = tree.leaves(params)
        grads = [_or_zeros(g, x) if _differentiable(x) else None for g, x in zip(grads, leaves)]
        grads = tree.unflatten(local.treespec, grads)
        return ((loss.detach(), aux) if has_aux else loss.detach()), grads

    return wrapped
