"""The function form of ``zf.tile``: ``fn`` run on k chunks of its arguments one after another, each under
non-reentrant checkpointing, the outputs concatenated or summed."""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from zfunc.model.tiling.split import _check_tiles, _sizes


def _tile_function(fn: Callable, tiles: int, dim: int, reduce: str | None, argnums: Sequence[int]) -> Callable:
    @functools.wraps(fn)
    def tiled(*args: Any, **kwargs: Any) -> Any:
        split = _split_args(args, argnums, tiles, dim)
        # checkpoint saves only the tile's inputs (views) and recomputes the rest in its backward
        run = functools.partial(checkpoint, fn, use_reentrant=False) if torch.is_grad_enabled() else fn
        outs = [run(*chunk_args, **kwargs) for chunk_args, _ in split]
        return _combine(outs, [n for _, n in split], reduce, dim)

    return tiled


def _split_args(args: tuple, argnums: Sequence[int], tiles: int, dim: int) -> list[tuple[tuple, int]]:
    """Per tile: the arguments (chunked ones replaced by their views) and the tile's size."""
    size = None
    chunks: dict[int, tuple[torch.Tensor, ...]] = {}
    for i in argnums:
        if not -len(args) <= i < len(args) or not isinstance(args[i], torch.Tensor):
            raise ValueError(f"argnums: argument {i} is not a tensor of this call ({len(args)} positional args)")
        x = args[i]
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim: {dim} is out of range for argument {i} of shape {tuple(x.shape)}")
        if size is None:
            size = x.shape[dim]
            _check_tiles(tiles, size, f"dim {dim} of argument {i} (shape {tuple(x.shape)})")
        elif x.shape[dim] != size:
            raise ValueError(f"argnums: argument {i} has {x.shape[dim]} entries along dim {dim}, argument "
                             f"{argnums[0]} has {size}; the chunked arguments must agree")
        chunks[i % len(args)] = x.split(_sizes(size, tiles), dim)
    return [(tuple(chunks[i][t] if i in chunks else a for i, a in enumerate(args)), n)
            for t, n in enumerate(_sizes(size, tiles))]


def _combine(outs: list[Any], sizes: list[int], reduce: str | None, dim: int) -> Any:
    if reduce is None:
        if isinstance(outs[0], torch.Tensor):
            return torch.cat(outs, dim)
        return type(outs[0])(torch.cat(parts, dim) for parts in zip(*outs))
    weights = [1.0] * len(outs) if reduce == "sum" else [n / sum(sizes) for n in sizes]
    total = outs[0] * weights[0]
    for out, w in zip(outs[1:], weights[1:]):
        total = total + out * w
    return total
