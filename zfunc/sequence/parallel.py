"""sequence_parallel: a model computes its rank's part of every sequence; attention sees them all.

``zf.sequence_parallel(model, mesh, kind="ulysses")`` returns ``model`` with its ``forward``
replaced (as ``zf.remat`` replaces a block's): every rank of an ``sp`` group is given the same whole
``(B, T)`` token ids; the forward takes this rank's ``T / sp`` tokens of each sequence
(``zfunc.sequence.layout``), passes their positions as ``position_ids`` (learned and rotary
positions offset per rank: the model's forward must take ``position_ids``, as Hugging Face's do)
and runs the model unchanged on them. Every ``torch.nn.functional.scaled_dot_product_attention``
call the model makes while it runs -- in forward, and in backward when ``zf.remat`` recomputes -- is
computed over the whole sequence: ``kind="ulysses"`` by an all-to-all to all tokens of ``H / sp``
heads and back (``zfunc.sequence.ulysses``), ``kind="ring"`` by passing key/value blocks round the
group (``zfunc.sequence.ring``). The output (logits) holds this rank's tokens: the loss takes the
same tokens of the labels, ``zfunc.sequence.cross_entropy``, and the grads are reduced over the
``dp x sp`` ranks (``zf.shard(step, mesh.dp_sp, stage)``, ``zf.Mesh``'s docstring).

**Law.** With each rank's loss ``zfunc.sequence.cross_entropy`` and the grads averaged over the
``dp x sp`` ranks, a step equals the plain step on the whole sequences (fp32 rounding: attention's
sums are reordered by ring). Models that attend through another function (an eager attention's
matmul-softmax) are not changed and compute wrong results: Hugging Face models take
``attn_implementation="sdpa"``.

**With tensor parallelism** (``zf.Mesh(dp=d, sp=s, tp=t)``: a sequence group is ``s`` ranks holding the same
tp slice, ``zf.Mesh``'s layout): ``zf.tensor_parallel(model, mesh)`` first, then ``zf.sequence_parallel(model,
mesh, kind)``, and the step ``zf.shard(zf.tensor_parallel.step(step, model), mesh, stage)`` (ZeRO over each tp
slice's ``dp x sp`` ranks). Each rank's attention then holds ``H / t`` heads of its ``T / s`` tokens:
Ulysses needs ``(H / t) % s == 0`` (else ``kind="ring"``, which splits no heads); the tp collectives carry
``T / s`` tokens. Same law. Megatron's ``sequence_parallel=True`` of ``zf.tensor_parallel`` is refused with
it (``zfunc.core.compose``: the sharded step does not sum its replicated grads over tp).

**Under a pipeline** (``zf.Mesh(dp=d, pp=p, sp=s)``): ``zf.pipeline(zf.shard(step, mesh, stage), ...)``,
stage 1-3 over each stage's ``dp x sp`` ranks (``mesh.dp_sp`` keeps the pp axis); every rank of a stage runs
its units on its ``T / s`` tokens of each microbatch, and the activations sent between stages are those
tokens'. A unit under ``zf.remat`` recomputes with this attention in force (``zf.remat``'s replayed
context), on stages whose backward never reaches the model's output too. Same law, for a loss that is
a mean over each microbatch (as ``zf.pipeline``'s).

**Cost.** Per rank, activations of ``T / sp`` tokens (attention's: see its kind); communication per
attention call as the kind's docstring says; the whole ``(B, T)`` ids on every rank (8 bytes a
token). A Python call per attention call; outside a sequence-parallel model's forward and backward,
``scaled_dot_product_attention`` is torch's own.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zfunc.dist.mesh import Mesh
from zfunc.model.rematerialize import replay_context
from zfunc.sequence.layout import SequenceLayout
from zfunc.sequence.ring import ring_attention
from zfunc.sequence.ulysses import ulysses_attention

KINDS = {"ulysses": "contiguous", "ring": "balanced"}
_TORCH_SDPA = F.scaled_dot_product_attention


class _Attention:
    """What a sequence-parallel model's attention calls run as while it is active."""

    def __init__(self, mesh: Mesh, kind: str, layout: SequenceLayout):
        self.mesh, self.kind, self.layout, self.calls = mesh, kind, layout, 0

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        if attn_mask is not None:
            raise ValueError("attn_mask: sequence-parallel attention takes is_causal or no mask, got a mask tensor "
                             f"{tuple(attn_mask.shape)} (a Hugging Face model builds one from an attention_mask: "
                             "leave attention_mask out)")
        if query.dim() != 4:
            raise ValueError(f"query: sequence-parallel attention takes (B, H, T, D) tensors, got {tuple(query.shape)}")
        self.calls += 1
        label = f"attention call {self.calls}"
        if self.kind == "ulysses":
            return ulysses_attention(query, key, value, self.mesh.sp_comm, self.mesh.sp, sdpa=_TORCH_SDPA,
                                     is_causal=is_causal, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa,
                                     label=label, tp=self.mesh.tp)
        if dropout_p:
            raise ValueError(f"dropout_p: ring attention has no dropout, got {dropout_p}; set the model's attention "
                             "dropout to 0 or use kind='ulysses'")
        if key.shape[1] != query.shape[1] and not enable_gqa:
            raise ValueError(f"key: {key.shape[1]} heads for {query.shape[1]} query heads without enable_gqa=True")
        return ring_attention(query, key, value, self.mesh.sp_p2p, self.layout, is_causal=is_causal, scale=scale,
                              label=f"ring {label}")


# The attention in force: set while a sequence-parallel model runs forward, and from the start of its
# backward to the end of that backward pass (remat recomputes there). Process-wide, not per thread:
# CUDA's backward runs on the autograd engine's device threads.
_active: list[_Attention] = []
_lock = threading.Lock()


def _dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    attention = _active[-1] if _active else None
    if attention is None:
        return _TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _enter(attention: _Attention) -> None:
    with _lock:
        _active.append(attention)
        F.scaled_dot_product_attention = _dispatch


def _exit(attention: _Attention) -> None:
    with _lock:
        _active.remove(attention)
        if not _active:
            F.scaled_dot_product_attention = _TORCH_SDPA


@contextmanager
def _attending(attention: _Attention):
    _enter(attention)
    try:
        yield
    finally:
        _exit(attention)


class _Attending:
    """``attention`` in force while entered; reusable (``zf.remat`` may recompute a unit twice)."""

    def __init__(self, attention: _Attention):
        self.attention = attention

    def __enter__(self) -> None:
        _enter(self.attention)

    def __exit__(self, *exc: Any) -> None:
        _exit(self.attention)


def _in_force() -> Any:
    """The sequence-parallel attention in force now, as a context to recompute under (``zf.remat``'s replay)."""
    return _Attending(_active[-1]) if _active else contextlib.nullcontext()


replay_context(_in_force)


class _InBackward(torch.autograd.Function):
    """The identity on the model's output; its backward puts the sequence-parallel attention in force
    until the end of the backward pass (so remat's recomputation runs it)."""

    @staticmethod
    def forward(x: torch.Tensor, attention: _Attention) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.attention = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        attention = ctx.attention
        _enter(attention)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _exit(attention))
        return grad, None


def _mark(out: Any, attention: _Attention) -> Any:
    """The model's output with every tensor that needs grad passed through ``_InBackward``, once."""
    marked = [False]

    def mark(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad and not marked[0]:
            marked[0] = True
            return _InBackward.apply(x, attention)
        return x

    if isinstance(out, torch.Tensor):
        return mark(out)
    if isinstance(out, dict):  # a Hugging Face ModelOutput is a dict whose items are its fields
        for key in list(out.keys()):
            out[key] = mark(out[key])
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(mark(x) for x in out) if type(out) in (tuple, list) else out
    return out


@contextmanager
def _one_sequence_per_row():
    """Hugging Face models read a jump in ``position_ids`` as packed sequences and build a mask for them;
    here every row is one sequence (the balanced layout's positions jump between its two chunks)."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    found = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = found


def _takes_positions(forward: Callable) -> bool:
    params = inspect.signature(forward).parameters
    return "position_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def sequence_parallel(model: nn.Module, mesh: Mesh, kind: str = "ulysses") -> nn.Module:
    """``model`` computing its rank's part of each sequence over ``mesh``'s sequence-parallel group.

    Args:
      model: an ``nn.Module`` whose attention calls ``F.scaled_dot_product_attention`` and whose
        ``forward(input_ids, ..., position_ids=...)`` takes positions (the recipes' GPT and Llama, Hugging
        Face models in ``attn_implementation="sdpa"``).
      mesh: a ``zf.Mesh`` with ``sp`` ranks (``mesh.sp``); every rank of a sequence group is given the
        same batch.
      kind: ``"ulysses"`` (heads divisible by ``sp``) or ``"ring"`` (any head count).
    Returns ``model``, whose forward takes the whole ``(B, T)`` ids (or ``input_ids=``) of the batch and
    returns its rank's tokens' outputs (``zfunc.sequence.layout_of(model).take`` of the whole output).
    Law and cost: the module docstring.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {tuple(KINDS)}, got {kind!r}")
    if not isinstance(getattr(mesh, "sp", None), int):
        raise TypeError(f"mesh: expected a zf.Mesh, got {type(mesh).__name__}")
    if getattr(model.forward, "sequence_layout", None) is not None:
        raise ValueError("model: already sequence-parallel (zf.sequence_parallel was applied to it before)")
    forward = model.forward
    if not _takes_positions(forward):
        raise ValueError(f"model: {type(model).__name__}.forward takes no position_ids; sequence parallelism passes "
                         "each rank's token positions there (forward(idx, position_ids=None), as Hugging Face models)")
    layout = SequenceLayout(mesh.sp, mesh.sp_rank, KINDS[kind])
    attention = _Attention(mesh, kind, layout)

    @functools.wraps(forward)
    def parallel_forward(*args: Any, **kwargs: Any) -> Any:
        if parallel_forward.whole:
            return forward(*args, **kwargs)
        ids_at = "input_ids" if "input_ids" in kwargs else 0
        ids = kwargs["input_ids"] if ids_at == "input_ids" else (args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"input_ids: a sequence-parallel model takes (B, T) token ids, got "
                             f"{type(ids).__name__ if not isinstance(ids, torch.Tensor) else tuple(ids.shape)}")
        if kwargs.get("position_ids") is not None or kwargs.get("attention_mask") is not None:
            raise ValueError("position_ids, attention_mask: a sequence-parallel model makes its own positions and "
                             "attends causally or fully; pass neither")
        mine = layout.take(ids)
        if ids_at == 0:
            args = (mine, *args[1:])
        else:
            kwargs["input_ids"] = mine
        kwargs["position_ids"] = layout.index(ids.shape[1], ids.device)[None]
        attention.calls = 0
        with _attending(attention), _one_sequence_per_row():
            out = forward(*args, **kwargs)
        return _mark(out, attention) if torch.is_grad_enabled() else out

    parallel_forward.sequence_layout, parallel_forward.whole = layout, False
    model.forward = parallel_forward
    return model


@contextmanager
def whole(model: nn.Module):
    """While open, a sequence-parallel ``model`` computes whole sequences on this rank alone, as before
    ``zf.sequence_parallel`` (one rank evaluating or sampling); ``layout_in_force`` is then None."""
    forward = model.forward
    if getattr(forward, "sequence_layout", None) is None:
        yield
        return
    before, forward.whole = forward.whole, True
    try:
        yield
    finally:
        forward.whole = before


def layout_in_force(model: nn.Module) -> SequenceLayout | None:
    """The layout a call of ``model`` computes now: its ``SequenceLayout``, or None when it computes whole
    sequences (not sequence-parallel, or inside ``whole(model)``)."""
    forward = getattr(model, "forward", None)
    layout = getattr(forward, "sequence_layout", None)
    return None if layout is None or forward.whole else layout


def layout_of(model: nn.Module) -> SequenceLayout:
    """The ``SequenceLayout`` of a model ``zf.sequence_parallel`` made: which tokens its rank computes."""
    layout = getattr(getattr(model, "forward", None), "sequence_layout", None)
    if layout is None:
        raise ValueError(f"model: {type(model).__name__} is not sequence-parallel; apply zf.sequence_parallel first")
    return layout
