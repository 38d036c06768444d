"""tile_tokens: a token-wise layer (a transformer's MLP) run over sequence tiles, each rematerialized.

``zf.tiling.tile_tokens(block.mlp, tiles=k)`` replaces the module's ``forward`` (as ``zf.remat``
does a block's) by one that cuts its input along the sequence dim into ``k`` tiles, runs the
original forward on each under activation checkpointing (as ``zf.remat``) and concatenates the outputs: the ``(T, 4d)``
intermediate of an MLP exists one tile at a time, in forward and in the recomputation of backward
(ALST's tiled MLP). Composes with ``zf.remat`` of the enclosing block (the tiles are rematerialized
inside its recomputation), with ``zf.shard`` stage 3 (remat passes the params the forward read, the
gathered ones, to the recomputation) and with ``zf.sequence_parallel`` (a rank tiles its own tokens).

**Law.** Outputs and grads equal the untiled module's for a module that treats tokens
independently (an MLP, a norm): the same ops on the same rows, in tiles. Not for attention or
anything mixing tokens.

**Cost.** Time: one more forward of the module (the recomputation), as ``zf.remat``. Memory: the
intermediates of ``T / k`` tokens instead of ``T``; the tiles' outputs and their concatenation (one
output-sized copy, for a moment); each tile's input is saved for backward (views of the input).
"""
from __future__ import annotations

import contextvars
import functools
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint


def tile_tokens(module: nn.Module, *, tiles: int, dim: int = 1) -> nn.Module:
    """``module`` with its forward run over ``tiles`` tiles of its first argument along ``dim`` (the sequence
    dim of ``(B, T, d)``), each tile rematerialized; returns ``module``. Law and cost: the module docstring.

    As ``zf.remat``, the params the module holds when called (under ``functional_call``, the tensors swapped
    in: stage 3's gathered ones) are explicit inputs of each tile's checkpoint, so the recomputation in
    backward reads the same ones. Buffers are read as the module holds them (an MLP has none).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module (an MLP), got {type(module).__name__}")
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles: expected an int >= 1, got {tiles!r}")
    if getattr(module.forward, "token_tiles", None) is not None:
        raise ValueError(f"module: {type(module).__name__} is tiled already (tiles={module.forward.token_tiles})")
    forward = module.forward
    one_tile = contextvars.ContextVar("zfunc_token_tile", default=False)  # set while a tile runs the module

    def run(names: tuple[str, ...], kwargs: dict, *inputs: Any) -> Any:
        token = one_tile.set(True)  # functional_call calls module.forward, which is ``tiled``: run ``forward``
        try:
            return functional_call(module, dict(zip(names, inputs[: len(names)])), inputs[len(names):], kwargs)
        finally:
            one_tile.reset(token)

    @functools.wraps(forward)
    def tiled(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if one_tile.get():
            return forward(x, *args, **kwargs)
        if not isinstance(x, torch.Tensor) or not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim: {dim} is not a dim of the tiled module's input "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        held = dict(module.named_parameters())
        names, values = tuple(held), tuple(held.values())
        call = functools.partial(run, names, kwargs)
        if torch.is_grad_enabled():
            call = functools.partial(checkpoint, call, use_reentrant=False)
        parts = x.tensor_split(min(tiles, x.shape[dim]), dim=dim)
        outs = [call(*values, part, *args) for part in parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=dim)

    tiled.token_tiles = tiles
    module.forward = tiled
    return module
