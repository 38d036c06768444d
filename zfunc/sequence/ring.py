"""Ring attention: keys and values passed around the sequence group, an online softmax over the blocks.

Rank ``r`` of an ``sp`` group holds its tokens of the queries, keys and values, every head
(``(B, H, T/sp, D)``, the balanced layout of ``zfunc.sequence.layout``: chunks ``r`` and ``2 sp - 1 -
r`` of ``2 sp``). In ``sp`` steps each rank attends its queries to one rank's key/value block while
the next block travels one rank further round the ring (point to point, overlapped with the block's
compute); a running log-sum-exp merges the blocks' softmaxes (flash attention's online softmax), so
no rank ever holds more than two key/value blocks. Causal: a query chunk skips key chunks after it and
masks its own; with the balanced layout every rank does the same work at every step (one early and
one late chunk). Each block is computed in ``(TILE x TILE)`` score tiles (queries by keys). Backward
passes the blocks round again, each carrying its key/value grads, which arrive home after the last step.

**Law.** The output and grads equal ``scaled_dot_product_attention`` over the whole sequence (causal
or not, grouped-query included), restricted to this rank's tokens, to fp32 rounding: the softmax is
summed in another order. Any head count: no heads are split (``sp`` need not divide them).

**Needs.** No ``attn_mask`` tensor and no dropout (the blocks' masks are built from the layout).

**Cost** per attention call, per rank, ``e`` bytes per element: forward ``sp - 1``
sends and receives of ``2 B (T/sp) H_kv D e`` bytes (a key/value block), backward the same plus
``sp`` of the fp32 key/value grads, ``2 B (T/sp) H_kv D 4``. Compute: the causal half of the score
matrix, in ``(TILE x TILE)`` tiles. Memory: this rank's q, k, v, output and log-sum-exp saved for
backward (``activation_bytes``; a test counts what autograd saves), plus two key/value blocks and
one ``(B, H, TILE, TILE)`` fp32 score tile while it runs -- never ``T`` keys.
"""
from __future__ import annotations

import torch

from zfunc.dist.p2p import P2P
from zfunc.sequence.layout import SequenceLayout

_KV, _DKV = 1, 2  # point-to-point tags: the blocks and their grads
TILE = 256  # tokens of queries and of keys per score tile: a (B, H, 256, 256) fp32 tile, 256 KiB a head


def _tiles(layout: SequenceLayout, rank: int, length: int, tile: int) -> list[tuple[slice, int, int]]:
    """``rank``'s tokens of a ``length``-token sequence as tiles: (local slice, first position, size)."""
    size = length // layout.parts
    out, local = [], 0
    for c in SequenceLayout(layout.sp, rank, layout.kind).chunks():
        for start in range(0, size, tile):
            n = min(tile, size - start)
            out.append((slice(local + start, local + start + n), c * size + start, n))
        local += size
    return out


def _pairs(layout: SequenceLayout, source: int, length: int, causal: bool, tile: int):
    """(query rows, key rows, mask or None) for this rank's queries against ``source``'s block: causal
    skips the key tiles after a query tile and masks the keys after each query in a tile they share."""
    keys = _tiles(layout, source, length, tile)
    for rows, q0, qn in _tiles(layout, layout.rank, length, tile):
        for cols, k0, kn in keys:
            if causal and k0 > q0 + qn - 1:
                continue
            mask = None
            if causal and k0 + kn - 1 > q0:  # some keys come after some queries
                q_pos, k_pos = torch.arange(q0, q0 + qn), torch.arange(k0, k0 + kn)
                mask = k_pos[None, :] > q_pos[:, None]
            yield rows, cols, mask


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        s.masked_fill_(mask.to(s.device), float("-inf"))
    return s


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that share them (grouped-query attention)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _ungrouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The grads of repeated key/value heads summed back onto each shared head."""
    if groups == 1:
        return x
    B, H, n, D = x.shape
    return x.view(B, H // groups, groups, n, D).sum(2)


def _shift(p2p: P2P, t: torch.Tensor, layout: SequenceLayout, tag: int, label: str) -> tuple:
    """Start sending ``t`` to the next rank of the ring and receiving the previous rank's into a new tensor."""
    nxt, prev = (layout.rank + 1) % layout.sp, (layout.rank - 1) % layout.sp
    got = torch.empty_like(t)
    return got, (p2p.send(t, nxt, label, tag), p2p.recv(got, prev, label, tag))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, p2p, layout, causal, scale, label, tile):
        sp, groups, length = layout.sp, q.shape[1] // k.shape[1], q.shape[2] * layout.sp
        qf = q.float()
        out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for i in range(sp):
            source = (layout.rank - i) % sp
            moving = _shift(p2p, kv, layout, _KV, f"{label}: k, v block of rank {source}") if i < sp - 1 else None
            keys, values = (_grouped(t.float(), groups) for t in kv)
            for rows, cols, mask in _pairs(layout, source, length, causal, tile):
                s = _scores(qf[:, :, rows], keys[:, :, cols], scale, mask)
                block_lse = torch.logsumexp(s, dim=-1)  # finite: a query's tile always holds a key before it
                block_out = torch.matmul(s.sub_(block_lse[..., None]).exp_(), values[:, :, cols])
                new = torch.logaddexp(lse[:, :, rows], block_lse)
                out[:, :, rows].mul_((lse[:, :, rows] - new).exp_()[..., None]).add_(
                    block_out.mul_((block_lse - new).exp_()[..., None]))
                lse[:, :, rows] = new
            if moving is not None:
                kv, works = moving
                for w in works:
                    w.wait()
        return out.to(q.dtype), lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.p2p, ctx.layout, ctx.causal, ctx.scale, ctx.label, ctx.tile = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale, p2p, label = ctx.layout, ctx.scale, ctx.p2p, ctx.label
        sp, groups, length = layout.sp, q.shape[1] // k.shape[1], q.shape[2] * layout.sp
        qf, dout = q.float(), grad_out.float()
        delta = (dout * out.float()).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for i in range(sp):
            source = (layout.rank - i) % sp
            moving = _shift(p2p, kv, layout, _KV, f"the backward of {label}: k, v block of rank {source}") \
                if i < sp - 1 else None
            keys, values = (_grouped(t.float(), groups) for t in kv)
            for rows, cols, mask in _pairs(layout, source, length, ctx.causal, ctx.tile):
                p = _scores(qf[:, :, rows], keys[:, :, cols], scale, mask).sub_(lse[:, :, rows, None]).exp_()
                dkv[1][:, :, cols] += _ungrouped(torch.matmul(p.transpose(-1, -2), dout[:, :, rows]), groups)
                ds = torch.matmul(dout[:, :, rows], values[:, :, cols].transpose(-1, -2))
                ds = p.mul_(ds.sub_(delta[:, :, rows, None])).mul_(scale)
                dq[:, :, rows] += torch.matmul(ds, keys[:, :, cols])
                dkv[0][:, :, cols] += _ungrouped(torch.matmul(ds.transpose(-1, -2), qf[:, :, rows]), groups)
            if sp > 1:  # the grads travel with their block; after the last step they are home
                dkv, grads_moving = _shift(p2p, dkv, layout, _DKV, f"the backward of {label}: k, v grads")
                for w in grads_moving + (moving[1] if moving is not None else ()):
                    w.wait()
            if moving is not None:
                kv = moving[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p2p: P2P, layout: SequenceLayout, *,
                   is_causal: bool = False, scale: float | None = None, label: str = "ring attention",
                   tile: int = TILE) -> torch.Tensor:
    """Attention of this rank's ``(B, H, T/sp, D)`` queries (``layout``'s tokens) over the whole sequence, the
    key/value blocks passed round the ``sp`` ranks of ``p2p``. ``k``, ``v``: ``(B, H_kv, T/sp, D)``, ``H_kv``
    dividing ``H``; ``tile``: query and key tokens per score tile. Law and cost: the module docstring."""
    if q.dim() != 4 or k.shape != v.shape or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q, k, v: expected (B, H, T, D) queries and (B, H_kv, T, D) keys and values with H_kv "
                         f"dividing H, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, p2p, layout, bool(is_causal), float(scale), label, int(tile))[0]


def comm_bytes(batch: int, tokens: int, kv_heads: int, head_dim: int, element: int, sp: int) -> int:
    """Bytes a rank sends (and as many it receives) round the ring for one attention call, forward and
    backward, with ``tokens`` (``T / sp``) of its own: ``2 (sp - 1)`` key/value blocks of ``2 B t H_kv D e``
    bytes and ``sp`` fp32 key/value grads of ``2 B t H_kv D 4``. The module docstring's cost."""
    block = 2 * batch * tokens * kv_heads * head_dim
    return 2 * (sp - 1) * block * element + (sp * block * 4 if sp > 1 else 0)


def activation_bytes(batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, element: int) -> int:
    """Bytes one attention call saves for backward on a rank with ``tokens`` (``T / sp``) of its own: its
    queries, keys, values and output, ``B t (2 H + 2 H_kv) D e``, and the fp32 log-sum-exp, ``4 B t H``; the
    key/value blocks in flight are freed when the call returns. The module docstring's memory."""
    return batch * tokens * (2 * heads + 2 * kv_heads) * head_dim * element + 4 * batch * tokens * heads
