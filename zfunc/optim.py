"""Optimizers as pure ``GradientTransformation(init, update)`` pairs, in the shape of optax.

``init(params) -> state`` and ``update(grads, state, params) -> (updates, new_state)`` are pure: they
never modify their arguments, and ``params + updates`` is the new parameters (``apply_updates``).
``chain`` composes transformations left to right.

A third, optional member, ``apply(grads, state, params) -> (new_params, new_state)``, does the whole
update and is allowed to *consume* its arguments: it may write into their tensors, which is how the
training step avoids holding two copies of the state (JAX's buffer donation). ``adamw``/``adam``
implement it with one fused kernel per (device, dtype) group -- zfunc's CPU-Adam where the state
is contiguous fp32 in CPU RAM (``backend="auto"``: the placement picks), else ``torch._fused_adamw_``
(the kernel behind ``torch.optim.AdamW(fused=True)``) -- and every other transformation gets it
from ``update`` (see ``apply``). The step only ever calls
``apply`` on state it owns. Likewise ``update_`` (optional) is an ``update`` allowed to write into
the grads it is given; ``chain``'s ``apply`` uses it, so ``clip_by_global_norm`` scales the grads
in place there instead of allocating a second copy of them.

Learning rates are floats or schedules ``count -> float``, where ``count`` is the number of updates
already applied (0 on the first step). Step counts are Python ints in the state. Hyperparameters are
checked when a transformation is built (finite and in range; errors name the argument and value);
a schedule's values are checked when used (finite and >= 0), naming the count.

A grad leaf may be ``None``: the param got no grad (the loss never used it). Every optimizer here
leaves such a param alone, as ``torch.optim`` does for a param whose ``.grad`` is None: no weight
decay, moments and momentum untouched, its update ``None`` (``apply_updates`` keeps the param).
Step counts stay global: ``count`` advances with every update, while torch keeps a step per param
(so Adam's bias correction of a param that gets its first grad late differs from torch's).
"""
from __future__ import annotations

import contextvars
import math
import numbers
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, NamedTuple

import optree
import torch

from zfunc import tree
from zfunc.ops import hostmem

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
    overlap is off) and the step computes the norm. ``writes_out``: ``apply`` takes a keyword
    ``out`` (a pytree of tensors shaped like the params, e.g. their bf16 compute copy) and writes
    the new params, cast to each ``out`` leaf's dtype, into it in the same pass as the update
    (see ``apply``). ``sums_squares``: ``apply`` takes a keyword ``squares`` (a list) and appends
    to it the sum of the squares of the grads its kernel read (a float: ``global_norm(grads)**2``
    up to rounding), when its kernel computed it in the update's own pass; nothing where it
    could not (see ``apply``).
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree | None], tuple[PyTree, PyTree]]
    apply: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]] | None = None
    learning_rate: Callable[[PyTree], float] | None = None
    update_: Callable[[PyTree, PyTree, PyTree | None], tuple[PyTree, PyTree]] | None = None
    needs_global_norm: bool = False
    writes_out: bool = False
    sums_squares: bool = False


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


# ----------------------------------------------------------------------------- helpers


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leaf by leaf, as new tensors (updates cast to each param's dtype); a
    ``None`` update (a param without grad) keeps the param as it is."""
    return tree.map(lambda p, u: p if u is None else p + u.to(p.dtype), params, updates)


def apply(tx: GradientTransformation, grads: PyTree, state: PyTree, params: PyTree,
          out: PyTree | None = None, squares: list[float] | None = None) -> tuple[PyTree, PyTree]:
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
    """
    if squares is not None and tx.sums_squares:
        return tx.apply(grads, state, params, out=out, squares=squares)
    if out is None:
        return tx.apply(grads, state, params) if tx.apply is not None else _update_in_place(tx.update, grads, state, params)
    if tx.writes_out:
        return tx.apply(grads, state, params, out=out)
    params, state = apply(tx, grads, state, params)
    _copy_out(params, out)
    return params, state


def _copy_out(params: PyTree, out: PyTree, only: set[int] | None = None) -> None:
    """``out``'s tensors (at ``params``' leaf positions ``only``, all if None) set to ``params``."""
    with torch.no_grad():
        for k, (p, o) in enumerate(zip(tree.leaves(params), tree.structure(params).flatten_up_to(out))):
            if o is not None and (only is None or k in only):
                o.copy_(p)


def _update_in_place(update, grads: PyTree, state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
    """``update``, then its updates added into ``params``' own tensors."""
    updates, state = update(grads, state, params)
    p_leaves, treespec = tree.flatten(params)
    pairs = [(p, u) for p, u in zip(p_leaves, treespec.flatten_up_to(updates)) if u is not None]
    if pairs:
        torch._foreach_add_([p for p, _ in pairs], [u.to(p.dtype) for p, u in pairs])
    return tree.unflatten(treespec, p_leaves), state


def learning_rate(tx: GradientTransformation, state: PyTree) -> float | None:
    """The learning rate ``tx``'s next update will use, or ``None`` if it has none."""
    return None if tx.learning_rate is None else float(tx.learning_rate(state))


# Set by a sharded step: sums a 0-d tensor over the ranks, so norms of sharded grads are global.
_SUM_ACROSS_RANKS: contextvars.ContextVar[Callable[[torch.Tensor], torch.Tensor] | None] = contextvars.ContextVar(
    "zfunc_sum_across_ranks", default=None)


@contextmanager
def summing_across(sum_fn: Callable[[torch.Tensor], torch.Tensor]):
    """Within the block, ``global_norm`` treats the grads as one rank's share: it sums the squared
    norm with ``sum_fn`` (an all-reduce) before the square root, like ``psum`` in JAX."""
    token = _SUM_ACROSS_RANKS.set(sum_fn)
    try:
        yield
    finally:
        _SUM_ACROSS_RANKS.reset(token)


# Set by the training step around the optimizer: the norm it already computed of its grads.
_KNOWN_NORM: contextvars.ContextVar[tuple[list[tuple[torch.Tensor, int]], torch.Tensor] | None] = \
    contextvars.ContextVar("zfunc_known_norm", default=None)


@contextmanager
def known_norm(grads: PyTree, norm: torch.Tensor):
    """Within the block, ``global_norm`` of these same grad tensors, unmodified since (same
    objects, same version counters), returns ``norm`` instead of computing it again: in a sharded
    step each computation is an all-reduce, and the step reports the norm that clipping uses."""
    token = _KNOWN_NORM.set(([(t, t._version) for t in tree.tensors(grads)], norm))
    try:
        yield
    finally:
        _KNOWN_NORM.reset(token)


def _known_norm_of(leaves: list[torch.Tensor]) -> torch.Tensor | None:
    known = _KNOWN_NORM.get()
    if known is None or len(known[0]) != len(leaves):
        return None
    same = all(t is k and t._version == v for t, (k, v) in zip(leaves, known[0]))
    return known[1] if same else None


def global_norm(grads: PyTree) -> torch.Tensor:
    """The L2 norm of all tensor leaves together, as a 0-d fp32 tensor on the first leaf's device
    (summed over ranks inside ``summing_across``; taken as given inside ``known_norm``)."""
    leaves = tree.tensors(grads)
    known = _known_norm_of(leaves)
    if known is not None:
        return known
    device = leaves[0].device if leaves else torch.device("cpu")
    norms = [n.to(device, torch.float32) for n in torch._foreach_norm(leaves)] if leaves else []
    norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), device=device)
    sum_fn = _SUM_ACROSS_RANKS.get()
    return norm if sum_fn is None else sum_fn(norm * norm).sqrt()


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


def _as_schedule(learning_rate: ScalarOrSchedule) -> Schedule:
    """``learning_rate`` as a schedule whose every value is checked to be finite and >= 0 when
    used (a negative rate would ascend the loss, a nan one poison every param)."""
    if not callable(learning_rate):
        _check_number("learning_rate", learning_rate, "a finite float >= 0 or a schedule", lambda x: x >= 0)
        return constant_schedule(float(learning_rate))

    def schedule(count: int) -> float:
        value = learning_rate(count)
        try:
            ok = math.isfinite(value) and value >= 0
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"learning_rate: the schedule returned {value!r} at update count {count}; "
                             "expected a finite float >= 0")
        return value

    return schedule


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


# ----------------------------------------------------------------------------- schedules


def constant_schedule(value: float) -> Schedule:
    """``count -> value``."""
    _check_non_negative(value=value)
    return lambda count: value


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """Linear from ``init_value`` at count 0 to ``end_value`` at ``transition_steps``, then flat."""
    _check_non_negative(init_value=init_value, end_value=end_value)
    _check_int("transition_steps", transition_steps, 1)

    def schedule(count: int) -> float:
        frac = min(count, transition_steps) / transition_steps
        return init_value + frac * (end_value - init_value)

    return schedule


def linear_warmup(peak_value: float, warmup_steps: int) -> Schedule:
    """``peak * (count + 1) / warmup_steps`` for the first ``warmup_steps`` updates, then ``peak``."""
    _check_non_negative(peak_value=peak_value)
    _check_int("warmup_steps", warmup_steps, 0)
    return lambda count: peak_value * min(1.0, (count + 1) / warmup_steps) if warmup_steps else peak_value


def warmup_cosine(peak_value: float, warmup_steps: int, total_steps: int, end_value: float = 0.0) -> Schedule:
    """Linear warmup to ``peak_value`` (``linear_warmup``), then a cosine decay to ``end_value``.

    ``lr(count) = end + (peak - end) * (1 + cos(pi * t)) / 2`` with
    ``t = (count - warmup_steps) / (total_steps - warmup_steps)`` clipped to [0, 1].
    """
    _check_non_negative(peak_value=peak_value, end_value=end_value)
    _check_int("total_steps", total_steps, 1)
    _check_int("warmup_steps", warmup_steps, 0)
    if not warmup_steps < total_steps:
        raise ValueError(
            f"warmup_steps, total_steps: expected 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}"
        )
    warmup = linear_warmup(peak_value, warmup_steps)

    def schedule(count: int) -> float:
        if count < warmup_steps:
            return warmup(count)
        t = min(1.0, (count - warmup_steps) / (total_steps - warmup_steps))
        return end_value + (peak_value - end_value) * 0.5 * (1.0 + math.cos(math.pi * t))

    return schedule


# ----------------------------------------------------------------------------- combinators


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

    def run(grads, state, params, consuming: bool):
        new_state = []
        for tx, s in zip(txs, state):
            grads, s = ((consuming and tx.update_) or tx.update)(grads, s, params)
            new_state.append(s)
        return grads, tuple(new_state)

    def update(grads, state, params=None):
        return run(grads, state, params, consuming=False)

    def update_(grads, state, params=None):
        return run(grads, state, params, consuming=True)

    def apply_(grads, state, params, out=None, squares=None):  # owns grads: each transformation may write into them
        grads, new_state = update_(grads, state[:-1], params)  # zip stops at the last tx
        params, last = apply(txs[-1], grads, state[-1], params, out, squares if len(txs) == 1 else None)
        return params, (*new_state, last)

    def learning_rate_(state):
        rates = [learning_rate(tx, s) for tx, s in zip(txs, state)]
        return next((r for r in reversed(rates) if r is not None), None)

    # sums_squares only for a chain of one: a transformation before the last may change the grads it reads
    return GradientTransformation(init, update, apply_ if txs else None, learning_rate_, update_,
                                  needs_global_norm=any(tx.needs_global_norm for tx in txs), writes_out=bool(txs),
                                  sums_squares=len(txs) == 1 and txs[0].sums_squares)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all grads by ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``
    (in place in ``update_``, which ``chain``'s ``apply`` uses)."""
    _check_number("max_norm", max_norm, "a finite float > 0", lambda x: x > 0)

    def coefficient(grads):
        return torch.clamp(max_norm / (global_norm(grads) + 1e-6), max=1.0)

    def update(grads, state, params=None):
        leaves, treespec = tree.flatten(grads)  # None grads (no grad) are no leaves: kept as they are
        if not leaves:
            return grads, state
        return tree.unflatten(treespec, torch._foreach_mul(leaves, coefficient(grads))), state

    def update_(grads, state, params=None):
        tensors = tree.tensors(grads)
        if tensors:
            torch._foreach_mul_(tensors, coefficient(grads))
        return grads, state

    return GradientTransformation(lambda params: EmptyState(), update, update_=update_, needs_global_norm=True)


# ----------------------------------------------------------------------------- adam family


class AdamState(NamedTuple):
    """``count``: updates applied so far; ``mu``/``nu``: first/second moments, shaped and typed like params."""

    count: int
    mu: PyTree
    nu: PyTree


def _zeros_like(params: PyTree) -> PyTree:
    """Zero state shaped like ``params``; CPU state on huge pages, where the kernels run faster."""
    return tree.map(hostmem.zeros_like, params)


def _adam_update(grads, state, params, *, lr, b1, b2, eps, weight_decay, decoupled, mask):
    """Pure Adam/AdamW in the order of ``torch.optim.AdamW``'s single-tensor loop."""
    if params is None:
        raise ValueError("params: adam/adamw need the current params for weight decay, got None")
    g_leaves, treespec = _grad_leaves(grads, params)
    p_leaves, m_leaves, v_leaves = tree.leaves(params), tree.leaves(state.mu), tree.leaves(state.nu)
    decay = _mask_leaves(mask, params, len(p_leaves))
    count = state.count + 1
    step_lr = lr(state.count)
    bc1, bc2_sqrt = 1 - b1**count, math.sqrt(1 - b2**count)
    updates, mus, nus = [], [], []
    for g, p, m, v, d in zip(g_leaves, p_leaves, m_leaves, v_leaves, decay):
        if g is None:  # no grad: left alone, as torch does
            updates.append(None)
            mus.append(m)
            nus.append(v)
            continue
        g = g.to(m.dtype)
        p32 = p.to(m.dtype)
        if weight_decay and d and not decoupled:
            g = g + weight_decay * p32
        m = m.lerp(g, 1 - b1)
        v = v * b2 + (1 - b2) * g * g
        denom = v.sqrt() / bc2_sqrt + eps
        new_p = p32 * (1 - step_lr * weight_decay) if (weight_decay and d and decoupled) else p32
        new_p = new_p - (step_lr / bc1) * (m / denom)
        updates.append(new_p - p32)
        mus.append(m)
        nus.append(v)
    unflat = lambda xs: tree.unflatten(treespec, xs)  # noqa: E731
    return unflat(updates), AdamState(count, unflat(mus), unflat(nus))


def _adam_apply_fused(grads, state, params, *, lr, b1, b2, eps, weight_decay, decoupled, mask, backend, out=None,
                      squares=None):
    """In-place Adam/AdamW: one fused kernel call per (device, dtype, decays?) group (torch's
    multi-tensor kernel, or zfunc's CPU-Adam over the group's leaves: ``adamw_many_``); ``out``
    and ``squares`` (CPU-Adam only) as in ``apply``."""
    p_leaves, treespec = tree.flatten(params)
    backend = _resolve_backend(backend, p_leaves)
    g_leaves = treespec.flatten_up_to(grads)
    m_leaves, v_leaves = _leaves_like(treespec, state.mu), _leaves_like(treespec, state.nu)
    o_leaves = None if out is None else treespec.flatten_up_to(out)
    decay = None if mask is None else _mask_leaves(mask, params, len(p_leaves))
    count = state.count + 1
    step_lr = float(lr(state.count))
    if backend == "numba":  # updated in place: the same trees
        sq = _numba_adam(p_leaves, g_leaves, m_leaves, v_leaves, o_leaves, decay, count, step_lr, b1, b2, eps,
                         weight_decay, decoupled, squares is not None)
        if squares is not None:
            squares.append(sq)
        return params, AdamState(count, state.mu, state.nu)
    groups: dict[tuple, list[int]] = {}
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves)):
        if g is not None:  # a param without grad is left alone
            groups.setdefault((p.device, p.dtype, decay is None or decay[i]), []).append(i)
        elif o_leaves is not None and o_leaves[i] is not None:
            o_leaves[i].copy_(p)
    for key, idx in groups.items():
        wd = weight_decay if key[-1] else 0.0
        ps, ms, vs = [p_leaves[i] for i in idx], [m_leaves[i] for i in idx], [v_leaves[i] for i in idx]
        gs = [g_leaves[i].to(ps[0].dtype) for i in idx]
        steps = [torch.tensor(float(count), device=key[0])] * len(ps)
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel(ps, gs, ms, vs, [], steps, lr=step_lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
               amsgrad=False, maximize=False)
        _copy_pairs(ps, [None] * len(idx) if o_leaves is None else [o_leaves[i] for i in idx])
    mu, nu = tree.unflatten(treespec, m_leaves), tree.unflatten(treespec, v_leaves)
    return tree.unflatten(treespec, p_leaves), AdamState(count, mu, nu)


def _leaves_like(treespec: optree.PyTreeSpec, moments: PyTree) -> list[Any]:
    """The leaves of ``moments``, a tree shaped like the params (``treespec``): read along that
    treespec (~10x cheaper than a flatten), or flattened where its containers differ."""
    try:
        return treespec.flatten_up_to(moments)
    except ValueError:
        return tree.leaves(moments)


_LOW = (torch.bfloat16, torch.float16)  # the dtypes the kernel writes as param_out
_GRAD_DTYPES = (torch.float32, *_LOW)  # the grad dtypes it reads


def _numba_adam(ps, gs, ms, vs, outs, decay, count, lr, b1, b2, eps, weight_decay, decoupled, grad_sq=False):
    """The leaves through zfunc's CPU-Adam (``adamw_many_``: big leaves threaded, small ones in one
    call), in two groups where ``decay`` (per-leaf flags; None: all decay) differs; a leaf whose
    grad is None is left alone. An ``out`` leaf is written in the same pass where the kernel can
    write it (a contiguous bf16/fp16 CPU tensor), else copied after. ``grad_sq``: returns the sum
    of the squares of the grads read (else None)."""
    from zfunc.ops import cpu_adam

    n = len(ps)
    outs = [None] * n if outs is None else outs
    plain = decay is None and all(g is not None and g.dtype in _GRAD_DTYPES and g.is_contiguous() for g in gs)
    if plain and all(o is None for o in outs):  # the common case: one group, nothing to fix up
        return cpu_adam.adamw_many_(ps, gs, ms, vs, step=count, lr=lr, beta1=b1, beta2=b2, eps=eps,
                                    weight_decay=weight_decay, decoupled=decoupled, grad_sq=grad_sq)
    total = 0.0
    for flag in (True, False):
        idx = [i for i in range(n) if gs[i] is not None and (decay is None or decay[i]) is flag]
        if not idx:
            continue
        g_ = [gs[i] if gs[i].dtype in _GRAD_DTYPES and gs[i].is_contiguous() else gs[i].float().contiguous()
              for i in idx]
        o_ = [outs[i] for i in idx]
        fused = [o if o is not None and o.dtype in _LOW and o.is_cpu and o.is_contiguous() else None for o in o_]
        sq = cpu_adam.adamw_many_([ps[i] for i in idx], g_, [ms[i] for i in idx], [vs[i] for i in idx], step=count,
                                  lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=weight_decay if flag else 0.0,
                                  decoupled=decoupled, param_outs=fused, grad_sq=grad_sq)
        total += sq or 0.0
        _copy_pairs([ps[i] for i in idx], [o if f is None else None for o, f in zip(o_, fused)])
    _copy_pairs(ps, [o if g is None else None for o, g in zip(outs, gs)])  # no grad: the param unchanged
    return total if grad_sq else None


def _copy_pairs(ps: list[torch.Tensor], outs: list[torch.Tensor | None]) -> None:
    for p, o in zip(ps, outs):
        if o is not None:
            o.copy_(p)


# "auto": the kernel follows where the state lives. Contiguous fp32 tensors in CPU RAM (a plain or
# sharded step on the CPU, offload's leaves) go to zfunc's Numba CPU-Adam, each leaf viewed 1-D;
# everything else (CUDA, other dtypes, strided views) to torch's fused multi-tensor kernel.
_BACKENDS = ("auto", "torch", "numba")


def _resolve_backend(backend: str, params: PyTree) -> str:
    """``backend``, with "auto" resolved for ``params`` (a pytree or a list of its leaves)."""
    if backend != "auto":
        return backend
    leaves = params if isinstance(params, list) else tree.tensors(params)
    on_cpu = bool(leaves) and all(not isinstance(p, torch.Tensor) or (p.dtype is torch.float32 and p.is_cpu
                                                                     and p.is_contiguous()) for p in leaves)
    return "numba" if on_cpu else "torch"


def _check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")


def _check_fused_leaves(params: PyTree, backend: str) -> None:
    for p in tree.tensors(params):
        if not p.is_floating_point():
            raise TypeError(f"params: the optimizer kernels need floating-point params, got {p.dtype}")
        if p.device.type == "meta":  # shapes only (zf.checkpoint.load lays a state out this way): no kernel runs
            continue
        if backend == "numba" and (p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous()):
            raise ValueError(
                f"backend='numba': expected contiguous fp32 CPU params, got {p.dtype} on {p.device}"
                f"{'' if p.is_contiguous() else ' (non-contiguous)'}; use backend='torch'"
            )


def _adam_family(learning_rate, b1, b2, eps, weight_decay, mask, backend, decoupled) -> GradientTransformation:
    _check_betas(b1=b1, b2=b2)
    _check_number("eps", eps, "a finite float > 0", lambda x: x > 0)
    _check_non_negative(weight_decay=weight_decay)
    _check_backend(backend)
    hyper = dict(lr=_as_schedule(learning_rate), b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                 decoupled=decoupled, mask=mask)

    def init(params):
        _check_fused_leaves(params, backend)
        return AdamState(0, _zeros_like(params), _zeros_like(params))

    def update(grads, state, params=None):
        return _adam_update(grads, state, params, **hyper)

    def apply_(grads, state, params, out=None, squares=None):
        return _adam_apply_fused(grads, state, params, backend=backend, out=out, squares=squares, **hyper)

    return GradientTransformation(init, update, apply_, lambda state: hyper["lr"](state.count), writes_out=True,
                                  sums_squares=True)


def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-2, mask: MaskOrFn = None, backend: str = "auto") -> GradientTransformation:
    """AdamW (Loshchilov & Hutter, 2019), equal to ``torch.optim.AdamW`` with the same arguments.

    ``m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  p = p (1 - lr wd) - lr/(1-b1^t) * m / (sqrt(v/(1-b2^t)) + eps)``

    Args:
      mask: which params decay: a pytree of bools shaped like params, or a function of params
        returning one (e.g. ``decay_mask``); ``None`` decays all, as torch does.
      backend: the fused in-place kernel: ``"torch"`` (``torch._fused_adamw_``, CPU or CUDA),
        ``"numba"`` (zfunc's CPU-Adam; contiguous fp32 CPU params only) or ``"auto"``: the
        placement picks: numba where every param is a contiguous fp32 CPU tensor (any shape:
        each leaf is viewed 1-D; a plain or sharded step on the CPU, offload), torch otherwise.
        The two agree to rtol = atol = 1e-6 over 20 steps (``zfunc.ops.cpu_adam``'s law).
    State: ``AdamState(count, mu, nu)``, moments in the params' dtype (8 bytes per fp32 param).
    """
    return _adam_family(learning_rate, b1, b2, eps, weight_decay, mask, backend, decoupled=True)


def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         weight_decay: float = 0.0, mask: MaskOrFn = None, backend: str = "auto") -> GradientTransformation:
    """Adam (Kingma & Ba, 2015) with L2 weight decay added to the grad, as ``torch.optim.Adam``.

    Arguments as ``adamw``.
    """
    return _adam_family(learning_rate, b1, b2, eps, weight_decay, mask, backend, decoupled=False)


# ----------------------------------------------------------------------------- sgd, lion


class TraceState(NamedTuple):
    """``count``: updates applied so far; ``trace``: momentum buffers shaped like params."""

    count: int
    trace: PyTree


def sgd(learning_rate: ScalarOrSchedule, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
        weight_decay: float = 0.0, mask: MaskOrFn = None, backend: str = "auto") -> GradientTransformation:
    """SGD with momentum, as ``torch.optim.SGD``: ``g += wd p; b = mu b + (1-damp) g`` (``b = g`` at
    the first step); ``d = g + mu b`` if nesterov else ``b``; ``p -= lr d``.

    ``backend`` as ``adamw``: ``"numba"`` updates in place with zfunc's CPU kernel, ``"torch"``
    through ``update``."""
    _check_betas(momentum=momentum, dampening=dampening)
    _check_non_negative(weight_decay=weight_decay)
    _check_backend(backend)
    if not isinstance(nesterov, bool):
        raise ValueError(f"nesterov: expected a bool, got {nesterov!r}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov: needs momentum > 0 and dampening == 0")
    lr = _as_schedule(learning_rate)

    def init(params):
        return TraceState(0, tree.map(lambda p: hostmem.zeros_like(p) if momentum else None, params))

    def update(grads, state, params=None):
        g_leaves, treespec = _grad_leaves(grads, params)
        if weight_decay and params is None:
            raise ValueError("params: sgd with weight_decay needs the current params, got None")
        p_leaves = tree.leaves(params) if params is not None else [None] * len(g_leaves)
        decay = _mask_leaves(mask, params, len(g_leaves)) if weight_decay else [False] * len(g_leaves)
        traces = tree.leaves(state.trace) if momentum else [None] * len(g_leaves)
        step_lr = lr(state.count)
        updates, new_traces = [], []
        for g, p, d, b in zip(g_leaves, p_leaves, decay, traces):
            if g is None:  # no grad: left alone, momentum untouched, as torch does
                updates.append(None)
                new_traces.append(b)
                continue
            if d:
                g = g + weight_decay * p
            if momentum:
                b = g.clone() if state.count == 0 else b * momentum + (1 - dampening) * g
                g = g + momentum * b if nesterov else b
            updates.append(-step_lr * g)
            new_traces.append(b)
        trace = tree.unflatten(treespec, new_traces) if momentum else state.trace
        return tree.unflatten(treespec, updates), TraceState(state.count + 1, trace)

    def numba_apply(grads, state, params):
        from zfunc.ops import cpu_adam

        p_leaves, treespec = tree.flatten(params)
        decay = _mask_leaves(mask, params, len(p_leaves))
        traces = tree.leaves(state.trace) if momentum else [None] * len(p_leaves)
        for p, g, b, d in zip(p_leaves, _grad_leaves(grads, params)[0], traces, decay):
            if g is None:
                continue
            cpu_adam.sgd_(p.view(-1), g.contiguous().view(-1), None if b is None else b.view(-1),
                          lr=float(lr(state.count)), momentum=momentum, dampening=dampening, nesterov=nesterov,
                          weight_decay=weight_decay if d else 0.0, first_step=state.count == 0)
        return tree.unflatten(treespec, p_leaves), TraceState(state.count + 1, state.trace)

    return GradientTransformation(init, update, _kernel_apply(backend, update, numba_apply), lambda state: lr(state.count))


def lion(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 0.0,
         mask: MaskOrFn = None, backend: str = "auto") -> GradientTransformation:
    """Lion (Chen et al., 2023): ``p = p (1 - lr wd) - lr sign(b1 m + (1-b1) g);  m = b2 m + (1-b2) g``.

    ``backend`` as ``sgd``."""
    _check_betas(b1=b1, b2=b2)
    _check_non_negative(weight_decay=weight_decay)
    _check_backend(backend)
    lr = _as_schedule(learning_rate)

    def init(params):
        return TraceState(0, _zeros_like(params))

    def update(grads, state, params=None):
        g_leaves, treespec = _grad_leaves(grads, params)
        p_leaves, m_leaves = tree.leaves(params), tree.leaves(state.trace)
        decay = _mask_leaves(mask, params, len(g_leaves))
        step_lr = lr(state.count)
        updates, new_m = [], []
        for g, p, m, d in zip(g_leaves, p_leaves, m_leaves, decay):
            if g is None:  # no grad: left alone
                updates.append(None)
                new_m.append(m)
                continue
            g = g.to(m.dtype)
            u = -step_lr * torch.sign(m.lerp(g, 1 - b1))
            if weight_decay and d:
                u = u - step_lr * weight_decay * p
            updates.append(u)
            new_m.append(m.lerp(g, 1 - b2))
        return tree.unflatten(treespec, updates), TraceState(state.count + 1, tree.unflatten(treespec, new_m))

    def numba_apply(grads, state, params):
        from zfunc.ops import cpu_adam

        p_leaves, treespec = tree.flatten(params)
        decay = _mask_leaves(mask, params, len(p_leaves))
        for p, g, m, d in zip(p_leaves, _grad_leaves(grads, params)[0], tree.leaves(state.trace), decay):
            if g is None:
                continue
            cpu_adam.lion_(p.view(-1), g.contiguous().view(-1), m.view(-1), lr=float(lr(state.count)), beta1=b1,
                           beta2=b2, weight_decay=weight_decay if d else 0.0)
        return tree.unflatten(treespec, p_leaves), TraceState(state.count + 1, state.trace)

    return GradientTransformation(init, update, _kernel_apply(backend, update, numba_apply), lambda state: lr(state.count))


def _kernel_apply(backend: str, update, numba_apply):
    """``apply`` for optimizers whose only fused kernel is Numba's: it where ``backend`` resolves
    to numba for these params, else ``update`` plus an in-place add."""

    def apply_(grads, state, params):
        if _resolve_backend(backend, params) == "numba":
            _check_fused_leaves(params, "numba")
            return numba_apply(grads, state, params)
        return _update_in_place(update, grads, state, params)

    return apply_
