"""The optimizer contract: ``GradientTransformation``, applying one, and ``chain`` (re-exported by
``zfunc.optim``, whose docstring states the contract).

Also the argument checks and per-leaf helpers every optimizer shares (``_grad_leaves``: a grad per
param leaf, ``None`` where a param got none; ``_mask_leaves``: a weight-decay mask as bools).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from zfunc.core import tree

PyTree = Any
Schedule = Callable[[int], float]
ScalarOrSchedule = float | Schedule
MaskOrFn = PyTree | Callable[[PyTree], PyTree] | None


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(grads, state, params) -> (updates, state)``, both pure.

    ``apply(grads, state, params) -> (params, state)`` is an optional fused update that may write
    into its arguments' tensors; ``None`` means "derive it from ``update``".
    ``learning_rate(state) -> float`` is the rate the next update will use, for optimizers that
    have one (reported in the step's metrics). ``update_`` is an optional ``update`` that may
    write into ``grads``' tensors (``None``: ``update`` is used where it is allowed).

    Declarations, which the transformations that run the optimizer read instead of probing it:
    ``needs_global_norm``: the update reads the norm of *all* grads together (``global_norm``,
    e.g. ``clip_by_global_norm``), so no leaf can be updated before every grad exists (offload's
    overlap is off) and the step computes the norm; its ``update``, ``update_``, ``apply`` and
    ``grad_factor`` take a keyword ``norm``, the step's ``KnownNorm`` of the grads (``apply(norm=)``;
    None: compute it from the grads given). ``writes_out``: ``apply`` takes a keyword
    ``out`` (a pytree of tensors shaped like the params, e.g. their bf16 compute copy) and writes
    the new params, cast to each ``out`` leaf's dtype, into it in the same pass as the update
    (see ``apply``). ``sums_squares``: ``apply`` takes a keyword ``squares`` (a list) and appends
    to it the sum of the squares of the grads its kernel read (a float: ``global_norm(grads)**2``
    up to rounding), when its kernel computed it in the update's own pass; nothing where it
    could not (see ``apply``). ``scales_grads``: ``apply`` takes a keyword ``grad_scale`` (a
    float) and updates with ``grads * grad_scale``, reading fp32, bf16 or fp16 grads as they are
    (the multiply in its kernel's pass, not a pass of its own). ``grad_factor``: the
    transformation only multiplies every grad by one scalar (``clip_by_global_norm``);
    ``grad_factor(grads, grad_scale)`` returns it for the grads ``grads * grad_scale``, so that a
    ``chain`` can fold it into the last transformation's ``grad_scale`` instead of a pass over the grads.
    ``local_grads(state) -> bool``: the update given ``state`` communicates itself (the 1-bit
    optimizers, ``zfunc.optim.onebit``) and takes this rank's own grads: a data-parallel step
    skips its grad all-reduce for it (``zf.shard`` stage 0; stages 1-3 refuse such an optimizer).
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree | None], tuple[PyTree, PyTree]]
    apply: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]] | None = None
    learning_rate: Callable[[PyTree], float] | None = None
    update_: Callable[[PyTree, PyTree, PyTree | None], tuple[PyTree, PyTree]] | None = None
    needs_global_norm: bool = False
    writes_out: bool = False
    sums_squares: bool = False
    scales_grads: bool = False
    grad_factor: Callable[[PyTree, float], Any] | None = None
    local_grads: Callable[[PyTree], bool] | None = None


class KnownNorm:
    """The global norm of some grad tensors, computed already (``zfunc.optim.known_norm``).
    ``of(grads)`` is the norm for these very tensors, unmodified since (same objects, same version
    counters), else None: a transformation before the one that reads it may have changed the grads.
    Cost: a list of the tensors and their version counters."""

    __slots__ = ("tensors", "value")

    def __init__(self, tensors: list[torch.Tensor], value: torch.Tensor):
        self.tensors, self.value = [(t, t._version) for t in tensors], value

    def of(self, grads: PyTree) -> torch.Tensor | None:
        """The norm, for the grads it was computed for (unmodified); None for any other."""
        return self.of_tensors(tree.tensors(grads))

    def of_tensors(self, leaves: list[torch.Tensor]) -> torch.Tensor | None:
        """``of`` the grads whose tensor leaves are ``leaves``."""
        known = self.tensors
        if len(known) != len(leaves):
            return None
        same = all(t is k and t._version == v for t, (k, v) in zip(leaves, known))
        return self.value if same else None


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leaf by leaf, as new tensors (updates cast to each param's dtype); a
    ``None`` update (a param without grad) keeps the param as it is."""
    return tree.map(lambda p, u: p if u is None else p + u.to(p.dtype), params, updates)


def apply(tx: GradientTransformation, grads: PyTree, state: PyTree, params: PyTree,
          out: PyTree | None = None, squares: list[float] | None = None,
          grad_scale: float | None = None, norm: KnownNorm | None = None) -> tuple[PyTree, PyTree]:
    """Run ``tx``'s whole update, consuming ``grads``, ``state`` and ``params``.

    Uses ``tx.apply`` when it has one; otherwise ``tx.update`` and an in-place add into ``params``.
    Callers must own all three arguments: their tensors may be overwritten.
    ``out``: a pytree shaped like ``params`` (``None`` leaves allowed) whose tensors receive the
    new params cast to their dtype (``out = new_params.to(out.dtype)``, bit for bit): in the
    update's own pass where ``tx.writes_out`` and its kernel can (zfunc's CPU-Adam writes a bf16 or
    fp16 copy while it updates, 2 B/param more written instead of a 6 B/param cast pass), else by
    a copy after it. Leaves whose param had no grad are written too (the param unchanged).
    ``squares``: a list to which the sum of the squares of ``grads`` is appended where ``tx``
    computes it in its own pass (``tx.sums_squares`` and a kernel that can: zfunc's CPU-Adam);
    left as it was otherwise, for the caller to compute the norm itself (the grads are unchanged).
    ``grad_scale`` (None: the grads as given): update with ``grads * grad_scale`` (an unscale by
    1/loss scale and ranks: ``squares`` then sums the squares of the product), the grads fp32,
    bf16 or fp16 (offload hands over autograd's own). Where ``tx.scales_grads``, the multiply (and
    the read of low-precision grads) happens in its kernel's pass; else the grads are first made
    fp32 and multiplied (in place where they are fp32 already), then updated as above.
    ``norm`` (a ``KnownNorm``, ``known_norm``; None: none known): the global norm of ``grads`` as
    given (before ``grad_scale``), computed already by the step, over every rank where ``grads``
    are one rank's share and over every leaf where they are a part of the grads; a ``tx`` that
    ``needs_global_norm`` takes it instead of computing one from ``grads``.
    """
    if out is None and squares is None and grad_scale is None and norm is None and tx.apply is not None:
        return tx.apply(grads, state, params)  # the plain step's call: nothing to route
    known = {"norm": norm} if norm is not None and tx.needs_global_norm else {}
    if grad_scale is not None and (grad_scale != 1.0 or _low_precision(grads)):
        if tx.scales_grads and (out is None or tx.writes_out):
            return tx.apply(grads, state, params, out=out, squares=squares if tx.sums_squares else None,
                            grad_scale=float(grad_scale), **known)
        value = norm.of(grads) if known else None  # read before the scaling writes into the grads
        grads = _scaled_fp32(grads, float(grad_scale))
        if value is not None:  # the norm of the grads now in hand: ``grads * grad_scale``
            known = {"norm": KnownNorm(tree.tensors(grads), value * float(grad_scale))}
    if squares is not None and tx.sums_squares:
        return tx.apply(grads, state, params, out=out, squares=squares, **known)
    if out is None:
        if tx.apply is not None:
            return tx.apply(grads, state, params, **known)
        return _update_in_place(tx.update, grads, state, params, **known)
    if tx.writes_out:
        return tx.apply(grads, state, params, out=out, **known)
    params, state = apply(tx, grads, state, params, **known)
    _copy_out(params, out)
    return params, state


def _low_precision(grads: PyTree) -> bool:
    return any(g.dtype in (torch.bfloat16, torch.float16) for g in tree.tensors(grads))


def _scaled_fp32(grads: PyTree, scale: float) -> PyTree:
    """``grads * scale`` as fp32 tensors: fp32 grads multiplied in place (``apply`` owns them)."""
    def one(g):
        if g.dtype != torch.float32:
            g = g.float()
        return g.mul_(scale) if scale != 1.0 else g

    return tree.map(one, grads)


def _copy_out(params: PyTree, out: PyTree, only: set[int] | None = None) -> None:
    """``out``'s tensors (at ``params``' leaf positions ``only``, all if None) set to ``params``."""
    with torch.no_grad():
        for k, (p, o) in enumerate(zip(tree.leaves(params), tree.structure(params).flatten_up_to(out))):
            if o is not None and (only is None or k in only):
                o.copy_(p)


def _update_in_place(update, grads: PyTree, state: PyTree, params: PyTree, **known) -> tuple[PyTree, PyTree]:
    """``update`` (given ``known``: the ``norm=`` of ``apply``), then its updates added into
    ``params``' own tensors."""
    updates, state = update(grads, state, params, **known)
    p_leaves, treespec = tree.flatten(params)
    pairs = [(p, u) for p, u in zip(p_leaves, treespec.flatten_up_to(updates)) if u is not None]
    if pairs:
        torch._foreach_add_([p for p, _ in pairs], [u.to(p.dtype) for p, u in pairs])
    return tree.unflatten(treespec, p_leaves), state


def learning_rate(tx: GradientTransformation, state: PyTree) -> float | None:
    """The learning rate ``tx``'s next update will use, or ``None`` if it has none."""
    return None if tx.learning_rate is None else float(tx.learning_rate(state))


def chain(*txs: GradientTransformation) -> GradientTransformation:
    """Apply ``txs`` in order; the state is the tuple of their states.

    ``apply`` runs the ``update_`` (else ``update``) of all but the last and the last one's
    ``apply``, so a fused optimizer at the end of a chain keeps its fused in-place path.
    """
    for i, tx in enumerate(txs):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"chain argument {i}: expected a GradientTransformation, got {type(tx).__name__}")

    def init(params):
        return tuple(tx.init(params) for tx in txs)

    def known(tx, norm) -> dict:
        """The ``norm=`` keyword for ``tx``: only a transformation that reads the global norm takes it."""
        return {"norm": norm} if norm is not None and tx.needs_global_norm else {}

    def run(grads, state, params, consuming: bool, norm):
        new_state = []
        for tx, s in zip(txs, state):  # ``norm`` holds for the grads as given; KnownNorm.of checks them
            grads, s = ((consuming and tx.update_) or tx.update)(grads, s, params, **known(tx, norm))
            new_state.append(s)
        return grads, tuple(new_state)

    def update(grads, state, params=None, norm=None):
        return run(grads, state, params, False, norm)

    def update_(grads, state, params=None, norm=None):
        return run(grads, state, params, True, norm)

    def apply_(grads, state, params, out=None, squares=None, grad_scale=None, norm=None):  # owns grads
        if grad_scale is not None:  # only when every tx but the last is a grad_factor (``folds``)
            for tx in txs[:-1]:  # the grads stay as given: each factor sees ``grads * grad_scale``
                grad_scale *= float(tx.grad_factor(grads, grad_scale, **known(tx, norm)))
            params, last = apply(txs[-1], grads, state[-1], params, out, squares if len(txs) == 1 else None,
                                 grad_scale, norm)
            return params, (*state[:-1], last)
        grads, new_state = update_(grads, state[:-1], params, norm)  # zip stops at the last tx
        params, last = apply(txs[-1], grads, state[-1], params, out, squares if len(txs) == 1 else None, norm=norm)
        return params, (*new_state, last)

    def learning_rate_(state):
        rates = [learning_rate(tx, s) for tx, s in zip(txs, state)]
        return next((r for r in reversed(rates) if r is not None), None)

    # sums_squares only for a chain of one: a transformation before the last may change the grads it reads.
    # A chain of grad factors (clipping) and a last tx that scales grads in its kernel folds the factors
    # into that kernel's grad_scale (apply(grad_scale=)): no pass of their own over the grads.
    folds = bool(txs) and txs[-1].scales_grads and all(tx.grad_factor is not None for tx in txs[:-1])
    talkers = [k for k, tx in enumerate(txs) if tx.local_grads is not None]
    if len(talkers) > 1:
        raise ValueError(f"chain: arguments {talkers} each communicate their own grads (local_grads); chain one")
    local = (lambda state: txs[talkers[0]].local_grads(state[talkers[0]])) if talkers else None
    return GradientTransformation(init, update, apply_ if txs else None, learning_rate_, update_,
                                  needs_global_norm=any(tx.needs_global_norm for tx in txs), writes_out=bool(txs),
                                  sums_squares=len(txs) == 1 and txs[0].sums_squares, scales_grads=folds,
                                  local_grads=local)


def _grad_leaves(grads: PyTree, params: PyTree | None) -> tuple[list[Any], optree.PyTreeSpec]:
    """``(leaves, treespec)`` of ``grads`` at the leaf positions of ``params`` (whose treespec it
    is): ``None`` where a param has no grad. Without ``params``, ``grads``' own leaves, ``None``
    counted as one."""
    if params is None:
        return optree.tree_flatten(grads, none_is_leaf=True, namespace=tree.NAMESPACE)
    treespec = tree.structure(params)
    return treespec.flatten_up_to(grads), treespec


def _check_number(name: str, value: Any, expected: str, ok: Callable[[float], bool]) -> None:
    """Raise unless ``value`` is a finite real number for which ``ok`` holds."""
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and ok(value)):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _check_non_negative(**values: float) -> None:
    for name, v in values.items():
        _check_number(name, v, "a finite float >= 0", lambda x: x >= 0)


def _check_betas(**betas: float) -> None:
    for name, b in betas.items():
        _check_number(name, b, "a value in [0, 1)", lambda x: 0.0 <= x < 1.0)


def _check_int(name: str, value: Any, least: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")


def _mask_leaves(mask: MaskOrFn, params: PyTree, n: int) -> list[bool]:
    """Per-leaf booleans of a weight-decay mask (``None``: every leaf)."""
    if mask is None:
        return [True] * n
    m = mask(params) if callable(mask) else mask
    flags = [bool(x) for x in tree.leaves(m)]
    if len(flags) != n:
        raise ValueError(f"mask: expected one bool per parameter ({n}), got {len(flags)}")
    return flags


def decay_mask(params: PyTree) -> PyTree:
    """Weight-decay mask: decay matrices and embeddings (ndim >= 2), not norms' gains or biases."""
    return tree.map(lambda p: p.ndim >= 2, params)
