"""The layer forms of ``zf.tile``: ``TiledLinear`` and ``TiledEmbedding``, a layer tiled alone or a model's
named layers tiled in place with their ties kept, and ``materializer``, a tiled model's params made from an
init written for it untiled."""
from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zfunc.model.materialize import Materializer, leaf as materialize_leaf
from zfunc.model.tiling.split import _check_tiles, _sizes


_LAYERS = (nn.Linear, nn.Embedding)


def _param_like(src: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data.detach().clone(memory_format=torch.contiguous_format), requires_grad=src.requires_grad)


class TiledLinear(nn.Module):
    """``nn.Linear`` as k sub-``Linear`` tiles of its weight along ``dim`` (0: out, 1: in features).

    Law: ``TiledLinear(lin, k, dim)(x)`` equals ``lin(x)``, grads included. Cost: the flops of
    ``lin``; ``dim=0`` concatenates the tile outputs (one extra output-sized copy), ``dim=1`` sums
    them in place. The bias lives in every out tile (``dim=0``) or in the first in tile (``dim=1``).
    """

    def __init__(self, linear: nn.Linear, tiles: int, dim: int, weights: Sequence[nn.Parameter] | None = None):
        super().__init__()
        self.in_features, self.out_features, self.dim = linear.in_features, linear.out_features, dim
        self.sizes = _sizes(linear.weight.shape[dim], tiles)
        parts = weights or [_param_like(linear.weight, w) for w in linear.weight.split(self.sizes, dim)]
        biases = (linear.bias.split(self.sizes) if dim == 0 else [linear.bias] + [None] * (tiles - 1)) \
            if linear.bias is not None else [None] * tiles
        self.tiles = nn.ModuleList(self._tile(linear, w, b) for w, b in zip(parts, biases))

    @staticmethod
    def _tile(linear: nn.Linear, weight: nn.Parameter, bias: torch.Tensor | None) -> nn.Linear:
        out_f, in_f = weight.shape
        t = nn.Linear(in_f, out_f, bias=bias is not None, device="meta")  # meta: no random init to throw away
        t.weight = weight
        if bias is not None:
            t.bias = _param_like(linear.bias, bias)
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim == 0:
            return torch.cat([t(x) for t in self.tiles], dim=-1)
        chunks = x.split(self.sizes, dim=-1)
        out = self.tiles[0](chunks[0])
        for t, xi in zip(self.tiles[1:], chunks[1:]):
            out = out.add_(t(xi))  # in place: a Linear's backward does not read its output
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dim={self.dim}, sizes={self.sizes}"


class TiledEmbedding(nn.Module):
    """``nn.Embedding`` as k sub-``Embedding`` tiles of its weight along ``dim`` (0: vocabulary
    rows, 1: embedding columns).

    Law: ``TiledEmbedding(emb, k, dim)(idx)`` equals ``emb(idx)``, grads included (``padding_idx``
    and ``scale_grad_by_freq`` keep their meaning: an index's occurrences all reach one tile).
    Cost: ``dim=1`` concatenates; ``dim=0`` sorts the indices by tile, reads the tile sizes (one
    device sync) and puts the rows back in order (two output-sized copies). Every tile runs on
    every call, even with no index in it, so stage 3's ranks gather the same units.
    """

    def __init__(self, emb: nn.Embedding, tiles: int, dim: int, weights: Sequence[nn.Parameter] | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dim = emb.num_embeddings, emb.embedding_dim, dim
        self.sizes = _sizes(emb.weight.shape[dim], tiles)
        self.starts = [sum(self.sizes[:i]) for i in range(tiles)]
        parts = weights or [_param_like(emb.weight, w) for w in emb.weight.split(self.sizes, dim)]
        self.tiles = nn.ModuleList(self._tile(emb, w, start) for w, start in zip(parts, self.starts))

    def _tile(self, emb: nn.Embedding, weight: nn.Parameter, start: int) -> nn.Embedding:
        pad = emb.padding_idx
        if self.dim == 0:  # the padding row belongs to one tile only
            pad = pad - start if pad is not None and start <= pad < start + weight.shape[0] else None
        t = nn.Embedding(*weight.shape, padding_idx=pad, scale_grad_by_freq=emb.scale_grad_by_freq, device="meta")
        t.weight = weight
        return t

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.dim == 1:
            return torch.cat([t(idx) for t in self.tiles], dim=-1)
        if idx.is_meta:  # no tile sizes to read: each tile looks every id up (clamped into it), same shape
            return sum(t(idx.clamp(s, s + n - 1) - s) for t, s, n in zip(self.tiles, self.starts, self.sizes))
        flat = idx.reshape(-1)
        which = torch.bucketize(flat, torch.tensor(self.starts[1:], device=flat.device), right=True)
        order = torch.argsort(which, stable=True)
        counts = torch.bincount(which, minlength=len(self.tiles)).tolist()
        rows = torch.cat([t(i - s) for t, i, s in zip(self.tiles, flat[order].split(counts), self.starts)])
        return rows.new_empty(rows.shape).index_copy(0, order, rows).view(*idx.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dim={self.dim}, sizes={self.sizes}"


def _tile_layer(layer: nn.Module, tiles: int, dim: Any, name: str = "module",
                weights: Sequence[nn.Parameter] | None = None) -> nn.Module:
    if type(layer) not in _LAYERS:  # subclasses may change forward: refuse rather than guess
        raise TypeError(f"{name}: zf.tile tiles nn.Linear and nn.Embedding layers, got {type(layer).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -2 <= dim <= 1:
        axes = "0 (out features) or 1 (in features)" if type(layer) is nn.Linear else "0 (rows) or 1 (columns)"
        raise ValueError(f"dim: expected {axes} of the {type(layer).__name__} weight, got {dim!r}")
    dim %= 2
    if type(layer) is nn.Embedding and (layer.max_norm is not None or layer.sparse):
        raise ValueError(f"{name}: Embedding with max_norm or sparse=True is not supported by zf.tile "
                         "(max_norm renormalizes rows in place, sparse grads have no tiled form)")
    _check_tiles(tiles, layer.weight.shape[dim], f"dim {dim} of {name}'s weight {tuple(layer.weight.shape)}")
    cls = TiledLinear if type(layer) is nn.Linear else TiledEmbedding
    return cls(layer, tiles, dim, weights)


def _other_holders(layer: nn.Module) -> list[nn.Module]:
    """Modules besides ``layer`` whose ``_parameters`` hold its weight (a tie). A module's
    ``_parameters`` dict is referred to by the module itself or by its ``__dict__``."""
    found = []
    for d in gc.get_referrers(layer.weight):
        if not isinstance(d, dict) or d is layer._parameters:
            continue
        for r in gc.get_referrers(d):
            owners = [r] if isinstance(r, nn.Module) else gc.get_referrers(r) if isinstance(r, dict) else []
            found += [m for m in owners if isinstance(m, nn.Module) and m._parameters is d]
    return found


def _tile_in_model(model: nn.Module, names: Sequence[str], tiles: int, dim: int) -> nn.Module:
    """Replace each named layer of ``model`` (and every layer tied to it) by its tiled form."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"modules: expected a list of submodule names, got {names!r}")
    done: set[str] = set()  # tiled already, as the tie of an earlier name
    for name in names:
        known = dict(model.named_modules(remove_duplicate=False))
        if name not in known or name == "":
            raise ValueError(f"modules: {name!r} is not a submodule of the model (the model itself cannot be "
                             "replaced in place: tile a layer with zf.tile(layer, tiles=k))")
        if name in done:
            continue
        target = known[name]
        tiled = _tile_layer(target, tiles, dim, f"modules[{name!r}]")
        shared = [t.weight for t in tiled.tiles]
        for qual, mod in known.items():
            if mod is target:
                _replace(model, qual, tiled)
            elif mod._parameters.get("weight") is target.weight:  # a tie: tile it with the same params
                _replace(model, qual, _tile_layer(mod, tiles, dim, f"{qual!r} (tied to {name!r})", shared))
            else:
                continue
            done.add(qual)
    return model


def _replace(model: nn.Module, qualname: str, new: nn.Module) -> None:
    parent, _, leaf = qualname.rpartition(".")
    setattr(model.get_submodule(parent), leaf, new)


def materializer(fn: Materializer, model: nn.Module) -> Materializer:
    """``fn``, written for a model's untiled layers, as the materializer of ``model`` after ``zf.tile``
    split some of them: a tile's leaf ``LAYER.tiles.I.KIND`` is its part of the whole layer's leaf
    ``LAYER.KIND`` as ``fn`` makes it -- a tile along dim 0 its rows, along dim 1 its columns (and the
    bias, which tile 0 holds whole) -- and every other leaf is ``fn``'s. So one init rule serves the model
    tiled or not, and both start from the same values. A leaf is a tile's when its module is a
    ``TiledLinear`` / ``TiledEmbedding`` tile (looked up in ``model`` when the leaf is asked for).

    Law: as the module docstring's, for ``fn``'s law holds for the whole leaf. Cost: a dim-0 tile's
    rows asked for; a dim-1 tile's rows at the whole layer's width (the other tiles' columns are
    made and dropped)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected the (tiled, meta-device) nn.Module, got {type(model).__name__}")
    if not callable(fn):
        raise TypeError(f"fn: expected a materializer materialize(name, like[, rows]), got {type(fn).__name__}")

    def materialize(name: str, like: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        found = _tile_of(model, name)
        if found is None:
            return materialize_leaf(fn, name, like, rows)
        whole_name, layer, index = found
        start, size = sum(layer.sizes[:index]), layer.sizes[index]
        mine = rows or slice(0, like.shape[0] if like.dim() else 1)
        if like.dim() == 2 and layer.dim == 1:  # a slice of the columns: the whole rows, cut
            whole = torch.empty((like.shape[0], sum(layer.sizes)), dtype=like.dtype, device="meta")
            return materialize_leaf(fn, whole_name, whole, mine)[:, start : start + size].contiguous()
        if layer.dim == 1:  # the bias of an in-features tile: the layer's whole bias
            return materialize_leaf(fn, whole_name, like, rows)
        whole = torch.empty((sum(layer.sizes), *like.shape[1:]), dtype=like.dtype, device="meta")
        return materialize_leaf(fn, whole_name, whole, slice(start + mine.start, start + mine.stop))

    return materialize


def _tile_of(model: nn.Module, name: str) -> tuple[str, nn.Module, int] | None:
    """For a tile's leaf ``LAYER.tiles.I.KIND``: the whole layer's leaf name ``LAYER.KIND``, the tiled
    layer and ``I``; None for any other leaf."""
    owner, _, kind = name.rpartition(".")
    tiles, _, index = owner.rpartition(".")
    path, _, attr = tiles.rpartition(".")
    if attr != "tiles" or not index.isdigit():
        return None
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        return None
    if not isinstance(layer, (TiledLinear, TiledEmbedding)) or int(index) >= len(layer.sizes):
        return None
    return (f"{path}.{kind}" if path else kind), layer, int(index)
