"""Ulysses attention: an all-to-all from this rank's tokens of every head to every token of its heads.

A rank of an ``sp`` group holds ``T / sp`` tokens (the contiguous layout) of the ``(B, H, T/sp, D)``
queries, keys and values. One all-to-all over the group (q, k and v packed together) gives it all
``T`` tokens of ``H / sp`` heads; attention runs there unchanged (``torch``'s own
``scaled_dot_product_attention``, causal or not, grouped-query included), and a second all-to-all
gives each rank its tokens of every head back. Backward is the same two all-to-alls, reversed.

**Law.** The output (and grads) equal ``scaled_dot_product_attention`` over the whole sequence,
restricted to this rank's tokens: the heads are independent, and each rank attends over all ``T``
tokens of its heads.

**Needs.** ``H`` divisible by ``sp`` (else ``kind="ring"``, which splits no heads); grouped-query
key/value heads ``H_kv`` divisible by ``sp`` too, else they are repeated to ``H`` heads first (more
bytes: ``H / H_kv`` times the key/value traffic).

**Cost** per attention call, per rank, ``e`` bytes per element: forward two all-to-alls of ``B T/sp
(H + 2 H_kv) D e`` (in) and ``B T/sp H D e`` (out) bytes, counted as ``Comm.all_to_all`` counts them
(the whole input, its own ``1/sp`` included); backward the same again. Activation memory: the
attention's inputs and output over all ``T`` tokens of ``H / sp`` heads, ``B T (2 H + 2 H_kv) D e / sp``
-- the same bytes as this rank's own ``T / sp`` tokens of every head -- and torch's fp32 log-sum-exp,
``4 B T H / sp`` (``activation_bytes``; a test counts what autograd saves).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from zfunc.dist.comm import Comm


class _Exchange(torch.autograd.Function):
    """``all_to_all`` of ``x`` (dim 0 = sp chunks): chunk ``s`` goes to rank ``s``, rank ``s``'s chunk
    ``r`` comes back as chunk ``s``. The exchange is its own transpose, so backward is the same exchange."""

    @staticmethod
    def forward(x: torch.Tensor, comm: Comm, label: str) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all(out, x, label)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.label = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad, f"the backward of {ctx.label}")
        return out, None, None


def tokens_to_heads(x: torch.Tensor, comm: Comm, sp: int, label: str) -> torch.Tensor:
    """``(B, H, T/sp, D)`` (this rank's tokens of every head) -> ``(B, H/sp, T, D)`` (every token of its heads)."""
    B, H, t, D = x.shape
    parts = x.view(B, sp, H // sp, t, D).transpose(0, 1)  # (sp, B, H/sp, t, D): head group s goes to rank s
    got = _Exchange.apply(parts, comm, label)  # (sp, B, H/sp, t, D): rank s's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(B, H // sp, sp * t, D)


def heads_to_tokens(x: torch.Tensor, comm: Comm, sp: int, label: str) -> torch.Tensor:
    """``(B, H/sp, T, D)`` -> ``(B, H, T/sp, D)``: the inverse of ``tokens_to_heads``."""
    B, h, T, D = x.shape
    parts = x.view(B, h, sp, T // sp, D).permute(2, 0, 1, 3, 4)  # (sp, B, h, t, D): token chunk s to rank s
    got = _Exchange.apply(parts, comm, label)  # (sp, B, h, t, D): rank s's heads of my tokens
    return got.transpose(0, 1).reshape(B, sp * h, T // sp, D)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, sp: int, *,
                      sdpa: Callable[..., torch.Tensor], is_causal: bool = False, dropout_p: float = 0.0,
                      scale: float | None = None, enable_gqa: bool = False, label: str = "attention",
                      tp: int = 1) -> torch.Tensor:
    """Attention of this rank's ``(B, H, T/sp, D)`` queries over the whole sequence's keys and values,
    computed by ``sdpa`` (torch's ``scaled_dot_product_attention``) on all ``T`` tokens of ``H / sp`` heads.
    ``tp``: the tensor-parallel ranks the model's heads are split over (``H`` is then this rank's ``1/tp``).

    Law and cost: the module docstring. Raises ``ValueError`` naming ``kind="ring"`` when ``sp`` does not
    divide the heads.
    """
    H, H_kv = q.shape[1], k.shape[1]
    if H % sp:
        held = (f"the {H} attention heads this rank holds of the model's {H * tp} over tp={tp} (Ulysses under "
                f"tensor parallelism needs (heads / tp) % sp == 0)" if tp > 1 else f"the {H} attention heads")
        raise ValueError(f"sp: Ulysses splits {held} over sp={sp} ranks, which does not divide them; use "
                         f"zf.sequence_parallel(..., kind='ring'), which splits no heads")
    if H_kv != H and H_kv % sp:  # grouped-query heads that do not split: give every query head its own
        k, v = (t.repeat_interleave(H // H_kv, dim=1) for t in (k, v))
        H_kv, enable_gqa = H, False
    B, _, t, D = q.shape
    packed = torch.cat([x.reshape(B, sp, x.shape[1] // sp, t, D) for x in (q, k, v)], dim=2).view(B, -1, t, D)
    whole = tokens_to_heads(packed, comm, sp, f"{label}: q, k, v to heads")
    q, k, v = whole.split([H // sp, H_kv // sp, H_kv // sp], dim=1)
    out = sdpa(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return heads_to_tokens(out, comm, sp, f"{label}: output to tokens")


def comm_bytes(batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, element: int, sp: int) -> int:
    """Bytes ``Comm.all_to_all`` counts on a rank for one attention call, forward and backward, with ``tokens``
    (``T / sp``) of the rank's own: ``2 B t (H + 2 H_kv' + H) D e``, ``H_kv' = H_kv`` if ``sp`` divides it, else
    ``H`` (the repeated heads). The module docstring's cost."""
    kv = kv_heads if kv_heads % sp == 0 else heads
    return 2 * batch * tokens * (heads + 2 * kv + heads) * head_dim * element


def activation_bytes(batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, element: int, sp: int) -> int:
    """Bytes one attention call saves for backward on a rank with ``tokens`` (``T / sp``) of its own: the
    queries, keys, values and output over all ``T`` tokens of ``H / sp`` heads, ``B t (2 H + 2 H_kv') D e``
    (``H_kv'`` as in ``comm_bytes``: the same bytes as this rank's tokens of every head), and torch's fp32
    log-sum-exp, ``4 B t H``. The module docstring's activation memory."""
    kv = kv_heads if kv_heads % sp == 0 else heads
    return batch * tokens * (2 * heads + 2 * kv) * head_dim * element + 4 * batch * tokens * heads
