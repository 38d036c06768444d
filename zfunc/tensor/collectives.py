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

Cost (bytes as ``Comm`` counts them, per call, ``A`` the activation's bytes): ``copy_to`` 2A in
backward, ``reduce_from`` 2A in forward, ``gather_from`` ``tp * A`` in forward.
"""
from __future__ import annotations

import weakref

import torch

from zfunc.dist.mesh import Comm


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


class Group:
    """The tp group a sliced model's collectives run over: ``comm`` (the mesh's ``tp_comm``), its
    size ``world`` and this process's ``rank`` in it."""

    def __init__(self, comm: Comm, world: int, rank: int):
        self.comm, self.world, self.rank = comm, world, rank
        self._last: tuple[weakref.ref, weakref.ref] | None = None

    def copy_to(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's *f* (see the module docstring); the same input again gives the same result."""
        if self.world == 1:
            return x
        if self._last is not None:
            last_in, last_out = self._last[0](), self._last[1]()
            if last_in is x and last_out is not None and torch.is_grad_enabled():
                return last_out
        out = _Copy.apply(x, self.comm)
        self._last = (weakref.ref(x), weakref.ref(out))
        return out

    def reduce_from(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's *g*: the sum over the group of ``x`` (identity in backward)."""
        return x if self.world == 1 else _Reduce.apply(x, self.comm)

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
