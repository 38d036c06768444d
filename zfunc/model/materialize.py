"""materialize: initial values for params built on the meta device, a leaf or a row range at a time.

A model built under ``with torch.device("meta"):`` has shapes but no values; ``zf.functionalize``
gives meta params, and a step's ``init(params, materialize=...)`` asks a *materializer* for the
values each process keeps: ``zf.shard``'s init for this rank's rows only, ``zf.offload``'s for one
whole leaf at a time. A materializer is a callable

    materialize(name, like, rows=None) -> Tensor

``name``: the leaf's name in ``params`` (``zf.functionalize``'s qualified name); ``like``: the meta
leaf (shape, dtype); ``rows``: ``None`` for the whole leaf, or ``slice(start, stop)`` of its dim-0
rows (a 0-d leaf counts as shape ``(1,)``), for which it returns ``(stop - start, *like.shape[1:])``.
A plain ``materialize(name, like)`` (whole leaves only, as ``zf.offload`` first took) is accepted
wherever a materializer is: its whole leaf is made and sliced (``leaf``).

**Law** (every materializer here): a value depends only on ``(seed, leaf name, row index)`` -- never
on the world size, nor on which rows were asked for together: ``m(name, like, rows=s)`` equals
``m(name, like)[s]`` bit for bit. So N ranks that each materialize their own rows hold, together,
the model one process materializes whole: a sharded run from the meta device trains as the plain
run from ``{name: m(name, like)}``, and its checkpoints reshard like any other. A materializer of
your own must keep this law for the N-rank/1-process equality; one that draws from torch's global
RNG unseeded gives each rank other values (a valid random init, but not reproducible).

**Cost.** ``normal``, ``uniform``, ``constant``: the rows asked for, plus one block of
``BLOCK_ELEMS`` elements being drawn (values are drawn in fixed blocks of rows, each from its own
generator seeded by ``(seed, name, block)``: a rank whose range cuts a block draws the whole block
and keeps its part, at most two blocks of extra work per leaf). ``from_module`` and plain
``(name, like)`` callables: one whole leaf (``from_module``: its module's own params) per call,
then sliced -- fine for the many small leaves of a model; give its few large ones (embeddings,
big projections) a row-wise rule with ``by_name`` so no rank ever holds them whole.

A model split by ``zf.tile`` (``lm_head.tiles.3.weight``) keeps the init written for it untiled:
``tiled(fn, model)`` makes each tile's leaf as its part of the whole layer's leaf.
"""
from __future__ import annotations

import copy
import fnmatch
import hashlib
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


BLOCK_ELEMS = 1 << 18  # elements per drawn block of rows (1 MiB in fp32); part of the law: never change it

Materializer = Callable[..., torch.Tensor]  # materialize(name, like, rows=None) or materialize(name, like)


def leaf(fn: Materializer, name: str, like: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """Leaf ``name``'s initial value from ``fn`` (whole, or its ``rows``), shape-checked.

    ``fn`` gets ``rows`` when it takes a ``rows`` parameter; otherwise it makes the whole leaf,
    which is sliced here (cost: one whole leaf)."""
    if not callable(fn):
        raise TypeError(f"materialize: expected a callable materialize(name, like[, rows]), got {type(fn).__name__}")
    n = _rows_of(like)
    if rows is not None:
        _check_rows(rows, n, name)
    whole = rows is None or not _takes_rows(fn)
    if whole:
        out, want = fn(name, like), tuple(like.shape)
    else:
        out, want = fn(name, like, rows=rows), (rows.stop - rows.start, *like.shape[1:])
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"materialize: returned {type(out).__name__} for {name}, expected a tensor")
    if tuple(out.shape) != want:
        raise ValueError(f"materialize: returned shape {tuple(out.shape)} for {name}"
                         f"{'' if whole else f' rows {rows.start}:{rows.stop}'}, expected {want}")
    if whole and rows is not None:  # cut the rows out of the whole leaf
        out = (out.reshape(1) if like.dim() == 0 else out)[rows.start : rows.stop]
    return out


def normal(std: float, seed: int, mean: float = 0.0) -> Materializer:
    """Every leaf drawn from ``N(mean, std**2)``, row-deterministic (module docstring's law)."""
    _check_number("std", std, low=0.0)
    _check_number("mean", mean)
    return _Drawn("normal", seed, lambda g, n: torch.randn(n, generator=g).mul_(std).add_(mean))


def uniform(low: float, high: float, seed: int) -> Materializer:
    """Every leaf drawn from ``U(low, high)``, row-deterministic (module docstring's law)."""
    _check_number("low", low)
    _check_number("high", high, low=low)
    return _Drawn("uniform", seed, lambda g, n: torch.rand(n, generator=g).mul_(high - low).add_(low))


def constant(value: float) -> Materializer:
    """Every element ``value`` (``constant(1.0)`` for norm weights, ``constant(0.0)`` for biases)."""
    _check_number("value", value)

    def materialize(name: str, like: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        shape = tuple(like.shape) if rows is None else (rows.stop - rows.start, *like.shape[1:])
        return torch.full(shape, value, dtype=_dtype(like))

    return materialize


def by_name(rules: Mapping[str, Materializer]) -> Materializer:
    """A materializer per leaf name: the first ``fnmatch`` pattern of ``rules`` (in order) that
    matches the name picks it; ``"*"`` last is the default. Rows are passed through (``leaf``)."""
    if not isinstance(rules, Mapping) or not rules:
        raise TypeError(f"rules: expected a non-empty mapping of name pattern -> materializer, got {rules!r}")
    for pattern, fn in rules.items():
        if not isinstance(pattern, str) or not callable(fn):
            raise TypeError(f"rules: expected str pattern -> callable, got {pattern!r} -> {type(fn).__name__}")
    rules = dict(rules)

    def materialize(name: str, like: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        for pattern, fn in rules.items():
            if fnmatch.fnmatchcase(name, pattern):
                return leaf(fn, name, like, rows)
        raise ValueError(f"materialize: no rule of by_name matches {name!r} (patterns {list(rules)}); "
                         "add one, or '*' last as the default")

    return materialize


def from_module(model: nn.Module, seed: int, init: Callable[[nn.Module], None] | None = None) -> Materializer:
    """The module's own init, per owning submodule: for leaf ``a.b.weight``, submodule ``a.b``'s
    own params (not its children's) are made on the CPU, seeded from ``(seed, "a.b")``, and set by
    its ``reset_parameters()`` (if it has one), then by ``init(submodule)`` if given (a model's
    ``self.apply(_init_weights)`` function, e.g. nanoGPT's ``_init``).

    Law: as the module docstring's; the values follow the same distributions as eager construction
    but are not its values (those depend on the order in which the whole constructor drew them).
    Cost: one submodule's own params at a time (the last one is kept for its next leaf), whole on
    every rank. A param that neither call sets is an error, not uninitialized memory.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected the (meta-device) nn.Module, got {type(model).__name__}")
    if init is not None and not callable(init):
        raise TypeError(f"init: expected a callable init(module) or None, got {type(init).__name__}")
    _check_seed(seed)
    made: dict[str, nn.Module] = {}  # the last owner made, for its other params

    def materialize(name: str, like: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        path, _, attr = name.rpartition(".")
        if path not in made:
            made.clear()
            made[path] = _initialized(model, path, seed, init)
        value = made[path]._parameters.get(attr)
        if value is None:
            raise ValueError(f"materialize: {name!r} is no parameter of model (from_module looks it up by name)")
        if value.isnan().any():
            raise ValueError(f"materialize: {name!r} is not set by {type(made[path]).__name__}.reset_parameters() nor "
                             f"init; give it a rule: zf.materialize.by_name({{{name!r}: ..., '*': from_module(...)}})")
        if tuple(value.shape) != tuple(like.shape):
            raise ValueError(f"materialize: model's {name!r} has shape {tuple(value.shape)}, "
                             f"params' {tuple(like.shape)}")
        value = value.detach().to(_dtype(like))
        return value if rows is None else (value.reshape(1) if like.dim() == 0 else value)[rows.start : rows.stop]

    return materialize


def _initialized(model: nn.Module, path: str, seed: int, init) -> nn.Module:
    """A shallow copy of submodule ``path`` whose own params and buffers are new CPU tensors
    (NaN until set), set by its ``reset_parameters`` and ``init`` under a seed of its own. The
    copy shares the children, still on meta, where a reset's writes cost nothing."""
    try:
        owner = model.get_submodule(path)
    except AttributeError as e:
        raise ValueError(f"materialize: model has no submodule {path!r} ({e})") from None
    reset = getattr(owner, "reset_parameters", None)
    if reset is None and init is None:
        raise ValueError(f"materialize: {path or 'the model'} ({type(owner).__name__}) has no reset_parameters(); "
                         "pass from_module(..., init=fn) or give its params a rule with zf.materialize.by_name")
    mine = copy.copy(owner)
    mine._parameters = {k: None if p is None else nn.Parameter(_nans(p), p.requires_grad)
                        for k, p in owner._parameters.items()}
    mine._buffers = {k: None if b is None else _nans(b) for k, b in owner._buffers.items()}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(_stream_seed("module", seed, path))
        if reset is not None:
            mine.reset_parameters()
        if init is not None:
            init(mine)
    return mine


def _nans(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return out.fill_(math.nan) if out.is_floating_point() else out.zero_()


class _Drawn:
    """Values drawn block by block of rows, each block from a generator seeded by (seed, name, block)."""

    def __init__(self, kind: str, seed: int, draw: Callable[[torch.Generator, int], torch.Tensor]):
        _check_seed(seed)
        self.kind, self.seed, self.draw = kind, seed, draw

    def __call__(self, name: str, like: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        n = _rows_of(like)
        rowsize = math.prod(like.shape[1:])
        start, stop = (0, n) if rows is None else (rows.start, rows.stop)
        out = torch.empty((stop - start) * rowsize, dtype=torch.float32)
        per_block = max(1, BLOCK_ELEMS // max(rowsize, 1))  # from the leaf's shape only: part of the law
        g = torch.Generator()
        for k in range(start // per_block, -(-stop // per_block) if stop > start else 0):
            lo, hi = k * per_block, min((k + 1) * per_block, n)
            g.manual_seed(_stream_seed(self.kind, self.seed, name, k))
            block = self.draw(g, (hi - lo) * rowsize)
            a, b = max(lo, start), min(hi, stop)
            out[(a - start) * rowsize : (b - start) * rowsize] = block[(a - lo) * rowsize : (b - lo) * rowsize]
        out = out.to(_dtype(like))
        return out.view(like.shape) if rows is None else out.view(stop - start, *like.shape[1:])


def _stream_seed(*parts: Any) -> int:
    """A generator seed from ``parts``, the same in every process (Python's ``hash`` of a str is not)."""
    digest = hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes up to 2**63 - 1


def _takes_rows(fn: Callable) -> bool:
    try:
        return "rows" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: whole leaves
        return False


def _rows_of(like: torch.Tensor) -> int:
    return like.shape[0] if like.dim() else 1


def _check_rows(rows: Any, n: int, name: str) -> None:
    if not isinstance(rows, slice) or rows.step not in (None, 1) or not (
            isinstance(rows.start, int) and isinstance(rows.stop, int) and 0 <= rows.start <= rows.stop <= n):
        raise ValueError(f"rows: expected slice(start, stop) with 0 <= start <= stop <= {n} for {name}, got {rows!r}")


def _dtype(like: torch.Tensor) -> torch.dtype:
    return like.dtype if like.is_floating_point() else torch.float32


def _check_seed(seed: Any) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed: expected an int, got {seed!r}")


def _check_number(what: str, v: Any, low: float | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (low is not None and v < low):
        raise ValueError(f"{what}: expected a finite number{'' if low is None else f' >= {low}'}, got {v!r}")
