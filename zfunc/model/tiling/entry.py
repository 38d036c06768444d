"""``zf.tile``: the entry point, which picks the form (a layer, a model's named layers, a function) by what
it is given and checks the arguments that form takes."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from zfunc.core import compose
from zfunc.model.tiling.function import _tile_function
from zfunc.model.tiling.layers import _other_holders, _tile_in_model, _tile_layer


def tile(module_or_fn: nn.Module | Callable, *, tiles: int, dim: int = 0, reduce: str | None = None,
         argnums: int | Sequence[int] | None = None, modules: Sequence[str] | None = None) -> Any:
    """Memory-centric tiling of a layer, of a model's named layers, or of a function.

    Args:
      module_or_fn: an ``nn.Linear`` / ``nn.Embedding`` (returns its tiled copy), a model with
        ``modules`` (tiles those layers in place, ties kept; returns the model), or a callable.
      tiles: k >= 1, at most the size being split.
      dim: layers: the weight dim to split (Linear 0 = out, 1 = in features; Embedding 0 = rows,
        1 = columns). Function: the dim of the chunked arguments and of the concatenated output.
      reduce: function form: ``None`` (concatenate), ``"sum"`` or ``"mean"`` (weighted by tile size).
      argnums: function form: positional arguments to chunk (default ``0``); the others go whole
        to every tile.
      modules: model form: qualified names of the layers to tile.
    Law and cost: see the module docstring. Errors name the argument at fault.
    """
    if isinstance(module_or_fn, nn.Module):
        for arg, value in (("reduce", reduce), ("argnums", argnums)):
            if value is not None:
                raise ValueError(f"{arg}: only the function form takes it; a layer's tiles are combined by its dim")
        if modules is not None:
            return _tile_in_model(module_or_fn, modules, tiles, dim)
        layer = _tile_layer(module_or_fn, tiles, dim)
        holders = _other_holders(module_or_fn)
        if holders:
            raise ValueError(f"module: its weight is also held by {type(holders[0]).__name__} (a tied weight); "
                             "tiling this layer alone would untie them. Tile through the model, which tiles "
                             "both with shared tiles: zf.tile(model, tiles=k, modules=['lm_head'])")
        return layer
    if not callable(module_or_fn):
        raise TypeError(f"module_or_fn: expected an nn.Linear, nn.Embedding, a model or a callable, "
                        f"got {type(module_or_fn).__name__}")
    compose.check_model_level("tile", module_or_fn)
    if modules is not None:
        raise ValueError("modules: only a model's layers can be named; got a function")
    if reduce not in (None, "sum", "mean"):
        raise ValueError(f"reduce: expected None, 'sum' or 'mean', got {reduce!r}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int, got {dim!r}")
    argnums = (0,) if argnums is None else (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not argnums or not all(isinstance(i, int) for i in argnums):
        raise ValueError(f"argnums: expected an int or a non-empty sequence of ints, got {argnums!r}")
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles: expected an int >= 1, got {tiles!r}")
    return _tile_function(module_or_fn, tiles, dim, reduce, argnums)
