"""The collectives of tensor parallelism as differentiable functions over the mesh's tp ``Comm``.

Megatron's conjugate pair, and the gather of sliced outputs:

- ``copy_to(x)`` (Megatron's *f*): the identity in forward; backward all-reduces the grad. It enters a
  column-parallel region: every rank reads the whole (replicated) input, each rank's grad of it is
  partial.
- ``reduce_from(x)`` (*g*): forward all-reduces ``x``; the identity in backward. It leaves a
  row-parallel region: each rank's output is a partial sum.
- ``gather_from(x)``: forward all-gathers ``x`` along its last dim (rank-major); backward keeps this
  rank's slice of the grad.

``copy_to`` reuses its last result when handed the same input tensor again (the q, k and v
projections, or gate and up, read one normalized activation): their grads then meet before the
one all-reduce, so a region costs one all-reduce in backward however many column-parallel
projections read its input.

Sequence parallelism (Megatron's): between the regions each rank holds ``T / tp`` of the tokens, so
``copy_to`` becomes an all-gather of the tokens (backward: a reduce-scatter) and ``reduce_from`` a
reduce-scatter (backward: an all-gather); ``split_seq`` cuts a replicated lookup (positions) to this
rank's tokens.

Cost (bytes as ``Comm`` counts them, per call, ``A`` the whole activation's bytes): ``copy_to`` 2A in
backward, ``reduce_from`` 2A in forward, ``gather_from`` ``tp * A`` in forward (A: its input's). With
sequence parallelism ``copy_to`` and ``reduce_from`` move ``A`` each way instead (an all-gather
counts its output, a reduce-scatter its input): the same bytes per region as the all-reduces.
"""
from __future__ import annotations

import weakref

import torch

from zfunc.dist.comm import Comm


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, label="tensor parallel: the grad of a column-parallel input")
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, label="tensor parallel: a row-parallel output")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, world: int, rank: int) -> torch.Tensor:
        ctx.rank, ctx.width = rank, x.shape[-1]
        x = x.contiguous()
        out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
        comm.all_gather(out, x, label="tensor parallel: a vocab-sliced output gathered")
        return out.movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None, None, None


def _gather_seq(x: torch.Tensor, comm: Comm, world: int, label: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim -2 (the sequence), rank-major."""
    x = x.contiguous()
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x, label=label)
    return out.movedim(0, -3).reshape(*x.shape[:-2], world * x.shape[-2], x.shape[-1])


def _scatter_seq(x: torch.Tensor, comm: Comm, world: int, label: str) -> torch.Tensor:
    """This rank's chunk along dim -2 of the sum over the group of ``x``."""
    per = x.shape[-2] // world
    full = x.reshape(*x.shape[:-2], world, per, x.shape[-1]).movedim(-3, 0).contiguous()
    out = torch.empty(full.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, full, label=label)
    return out


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, world: int) -> torch.Tensor:
        ctx.comm, ctx.world = comm, world
        return _gather_seq(x, comm, world, "tensor parallel: a sequence-parallel input gathered")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _scatter_seq(grad, ctx.comm, ctx.world, "tensor parallel: the grad of a sequence-parallel input"), \
            None, None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, world: int) -> torch.Tensor:
        ctx.comm, ctx.world = comm, world
        return _scatter_seq(x, comm, world, "tensor parallel: a row-parallel output reduce-scattered")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_seq(grad, ctx.comm, ctx.world, "tensor parallel: the grad of a sequence-parallel output"), \
            None, None


class Group:
    """The tp group a sliced model's collectives run over: ``comm`` (the mesh's ``tp_comm``), its
    size ``world`` and this process's ``rank`` in it."""

    def __init__(self, comm: Comm, world: int, rank: int, sequence_parallel: bool = False):
        self.comm, self.world, self.rank = comm, world, rank
        self.sequence_parallel = sequence_parallel
        # The last input copy_to entered (weakly) and its result (strongly: once its consumer returns,
        # nothing but autograd's saved tensors, which are not this object, holds it).
        self._last: tuple[weakref.ref, torch.Tensor] | None = None

    def copy_to(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's *f* (see the module docstring); the same input again gives the same result.
        Sequence-parallel: the all-gather of the tokens' chunks (backward: reduce-scatter)."""
        if self.world == 1:
            return x
        if self._last is not None:
            last_in, last_out = self._last
            if last_in() is x and torch.is_grad_enabled():
                return last_out
        out = _GatherSeq.apply(x, self.comm, self.world) if self.sequence_parallel else _Copy.apply(x, self.comm)
        self._last = (weakref.ref(x), out)
        return out

    def sum_grad(self, x: torch.Tensor) -> torch.Tensor:
        """The identity; backward all-reduces the grad over the group (Megatron's *f*, whatever the
        sequence parallelism, with no reuse): for a replicated param each rank's grad of which is
        partial (grouped-query kv projections replicated over tp, ``zfunc.tensor.layers``)."""
        return x if self.world == 1 else _Copy.apply(x, self.comm)

    def reduce_from(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's *g*: the sum over the group of ``x`` (identity in backward). Sequence-parallel:
        this rank's chunk of the tokens of that sum, a reduce-scatter (backward: all-gather)."""
        if self.world == 1:
            return x
        if self.sequence_parallel:
            if x.dim() < 2 or x.shape[-2] % self.world:
                raise ValueError(f"sequence_parallel: the sequence length (dim -2 of shape {tuple(x.shape)}) must be "
                                 f"a multiple of tp={self.world}")
            return _ScatterSeq.apply(x, self.comm, self.world)
        return _Reduce.apply(x, self.comm)

    def split_seq(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of ``x``'s tokens (dim -2): a replicated lookup (positions) joining the
        sequence-parallel stream; its grad is this rank's share, summed over the group by the step."""
        if self.world == 1 or not self.sequence_parallel:
            return x
        if x.dim() < 2 or x.shape[-2] % self.world:
            raise ValueError(f"sequence_parallel: the sequence length (dim -2 of shape {tuple(x.shape)}) must be a "
                             f"multiple of tp={self.world}")
        per = x.shape[-2] // self.world
        return x.narrow(-2, self.rank * per, per)

    def gather_from(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dim (backward: this rank's slice)."""
        return x if self.world == 1 else _Gather.apply(x, self.comm, self.world, self.rank)

    def all_gather_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max over the group of ``x`` (no grad): one all-gather of ``x``."""
        if self.world == 1:
            return x.detach()
        x = x.detach().contiguous()
        out = torch.empty((self.world, *x.shape), dtype=x.dtype, device=x.device)
        self.comm.all_gather(out, x, label="tensor parallel: the logits' max")
        return out.amax(0)
