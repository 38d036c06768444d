"""``lm_head_loss``: the LM head and cross-entropy over token tiles, its grads made in the forward pass,
never the whole (N, vocab) logits; over a tensor-parallel vocab slice with ``mesh=``."""
from __future__ import annotations

import functools
from typing import Any

import torch

from zfunc.model import vocab_slice
from zfunc.model.tiling.split import _check_tiles, _sizes


class _LMHeadLoss(torch.autograd.Function):
    """Tiled cross-entropy of ``hidden @ weight.T``; grads made in forward (see ``lm_head_loss``)."""

    @staticmethod
    def forward(hidden, weight, targets, tiles, ignore_index, mean, need_h, need_w, vocab):
        h, y = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        valid = y != ignore_index
        denom = valid.sum().clamp(min=1) if mean else torch.ones((), device=y.device)
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)  # low-precision dW sums in fp32
        dh = torch.empty_like(h) if need_h else h.new_empty(0)
        dw = torch.zeros_like(weight, dtype=acc_dtype) if need_w else weight.new_empty(0)
        total = torch.zeros((), dtype=acc_dtype, device=h.device)
        start = 0
        for n in _sizes(h.shape[0], tiles):
            rows = slice(start, start + n)
            tile = _tile_loss if vocab is None else functools.partial(vocab_slice.tile_loss, vocab=vocab)
            total += tile(h[rows], weight, y[rows], valid[rows], denom, dh[rows] if need_h else None,
                          dw if need_w else None)
            start += n
        if vocab is not None and need_h:
            vocab_slice.sum_hidden_grads(dh, vocab)
        loss = total / valid.sum() if mean else total  # 0/0 = nan with every target ignored, as torch
        return loss, dh.view(hidden.shape) if need_h else dh, dw

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, dh, dw = output
        ctx.mark_non_differentiable(dh, dw)
        ctx.save_for_backward(dh, dw)
        ctx.need, ctx.w_dtype = inputs[6:8], inputs[1].dtype  # inputs[8]: the vocab slice (no grad)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _dh, _dw):
        dh, dw = ctx.saved_tensors
        gh = dh * grad.to(dh.dtype) if ctx.need[0] else None
        gw = (dw * grad).to(ctx.w_dtype) if ctx.need[1] else None
        return gh, gw, None, None, None, None, None, None, None


def _tile_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, valid: torch.Tensor, denom: torch.Tensor,
               dh: torch.Tensor | None, dw: torch.Tensor | None) -> torch.Tensor:
    """Summed CE of one token tile; writes its rows of ``dh`` and adds into ``dw`` when given."""
    logits = h @ w.T
    # log_softmax is one fused pass (logsumexp + subtract take several); fp32 for fp16/bf16 inputs.
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    del logits
    safe = y.masked_fill(~valid, 0)
    loss = -(logp.gather(1, safe[:, None]).squeeze(1) * valid).sum()
    if dh is None and dw is None:
        return loss
    grad = logp.exp_()  # softmax, in log_softmax's memory
    grad[torch.arange(len(y), device=y.device), safe] -= 1.0
    grad.mul_((valid / denom).to(grad.dtype)[:, None])  # ignored rows give nothing; mean's 1/count
    vocab_slice.head_grads(grad, w, h, dh, dw)
    return loss


def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, tiles: int,
                 ignore_index: int = -100, reduction: str = "mean", mesh: Any = None,
                 vocab_size: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets)`` without ever holding the whole logits.

    Args:
      hidden: ``(..., d)`` activations. weight: the head's ``(vocab, d)`` weight (bias-free, as in
        GPT and Llama). targets: ``(...)`` class indices; ``ignore_index`` entries count nothing.
      tiles: token tiles (at most the token count; sizes differ by at most one).
      reduction: ``"mean"`` over the non-ignored tokens of the whole input (not per tile) or ``"sum"``.
      mesh: a ``zf.Mesh`` with ``tp > 1`` when ``weight`` is this rank's vocab slice (``zf.tensor_parallel``'s
        "vocab" head: rows ``[rank * per, (rank + 1) * per)`` of the vocabulary padded to ``tp * per``);
        every rank of the tp group calls with the same ``hidden`` and ``targets`` (ids in the whole
        vocabulary), and each tile's loss is the vocab-parallel cross-entropy (``zfunc.model.vocab_slice``):
        the loss, ``hidden``'s grad and this rank's rows of the weight's grad are the whole head's.
      vocab_size: with ``mesh``, the whole vocabulary (default ``tp * per``: no padding rows).
    Law: loss and grads of ``hidden`` and ``weight`` equal the untiled expression (fp32 rounding;
    ``nan`` loss and zero grads when every target is ignored, as torch). The loss is fp32 for
    fp16/bf16 inputs (softmax in fp32). Not twice differentiable.
    Cost: three matmuls like the untiled op, no recomputation; memory: one ``(N/k, vocab)`` fp32
    tile (two for a moment: the logits and their log-softmax) and the grads of ``hidden`` and
    ``weight``, computed in forward and held until backward. Under stage 3 ``weight`` must be whole
    where this runs (it reaches no module's forward hook): there, tile the head module instead.
    """
    for arg, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg}: expected a tensor, got {type(t).__name__}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight: expected shape (vocab, {hidden.shape[-1] if hidden.dim() else '?'}) for hidden "
                         f"{tuple(hidden.shape)}, got {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1] or targets.is_floating_point():
        raise ValueError(f"targets: expected integer class indices of shape {tuple(hidden.shape[:-1])}, "
                         f"got {targets.dtype} {tuple(targets.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
    _check_tiles(tiles, targets.numel(), f"hidden (shape {tuple(hidden.shape)}) in tokens")
    if mesh is None and vocab_size is not None:
        raise ValueError(f"vocab_size: names the vocabulary of a vocab-sliced weight, with mesh=; got {vocab_size!r} "
                         "without a mesh")
    vocab = None if mesh is None or getattr(mesh, "tp", 1) == 1 else vocab_slice.of_mesh(mesh, weight.shape[0],
                                                                                          vocab_size)
    grad_on = torch.is_grad_enabled()
    need_h, need_w = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
    out = _LMHeadLoss.apply(hidden, weight, targets, tiles, ignore_index, reduction == "mean", need_h, need_w, vocab)
    return out[0]
