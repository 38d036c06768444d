"""The 1-bit compressed all-reduce with error feedback (1-bit Adam's, Tang et al. 2021; DeepSpeed's
``compressed_allreduce``), a ``Comm`` operation (``Comm.compressed_all_reduce``).

Over N ranks, for a tensor x of n elements padded to P (a multiple of 8N), rank i:

1. adds its worker error: ``c = x + e``; splits c into N chunks of k = P/N; per chunk j, the scale
   ``s_j = ||c_j||_2 / sqrt(k)`` and the signs ``b_j = sign(c_j)`` (0 counts as +), packed 8 to a
   byte (one pass each way: an int64 multiply to pack, a table lookup to unpack); keeps ``e = c - s * b``
   (what the compression lost) for the next call;
2. sends chunk j's signs and scale to rank j (one all-to-all): each rank is the *server* of 1/N;
3. as server of chunk r: averages what it received, ``m = sum_i s_ir b_ir / N``, adds its server
   error ``E``, compresses m the same way (one scale for the chunk) and keeps ``E = m - S * sign(m)``;
4. all-gathers every server's signs and scale: every rank ends with the same ``S_r sign(m_r)`` for
   every chunk r, its result, written into x.

Law: equal bit for bit to a plain-torch simulation of these steps over the N ranks' inputs
(tests/test_compressed.py, 2 and 4 ranks). Error feedback: summed over calls t = 1..T, the results
equal the summed true means minus ``mean_i e_i(T) + E(T)`` (the errors left at T), so the drift from
the uncompressed sum stays as small as the errors, however many calls (the test checks a bound over
50 calls). Cost: 2 * (P/8 + 4N) bytes per rank (signs and scales out, all-gathered back) against
2 * 4n for an fp32 all-reduce: ~32x fewer bytes; 4 passes over x and errors of P + P/N fp32 elements
per tensor kept by the caller (``ErrorFeedback``). Over one rank nothing is sent and x is unchanged.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

KIND = "compressed_all_reduce"  # the byte counter's call type
# 8 bits <- 8 bytes of 0/1 read as one little-endian int64: the product's top byte holds byte i at bit i
_PACK = 0x0102040810204080
_SIGNS = torch.tensor([[1.0 if (b >> i) & 1 else -1.0 for i in range(8)] for b in range(256)])  # byte -> 8 signs


class ErrorFeedback(NamedTuple):
    """One rank's errors for one compressed tensor: ``worker`` (P fp32, the padded length) and
    ``server`` (P / N fp32, the chunk it serves)."""

    worker: torch.Tensor
    server: torch.Tensor


def padded_numel(numel: int, world: int) -> int:
    """``numel`` rounded up to a multiple of ``8 * world`` (whole bytes of signs per chunk)."""
    unit = 8 * world
    return -(-numel // unit) * unit


def error_feedback(numel: int, world: int, device: torch.device | str = "cpu") -> ErrorFeedback:
    """Zero errors for a tensor of ``numel`` elements over ``world`` ranks."""
    total = padded_numel(numel, world)
    return ErrorFeedback(torch.zeros(total, device=device), torch.zeros(total // world, device=device))


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``x >= 0`` as bits, 8 per uint8 (element 8j + i at bit i of byte j); x.numel() % 8 == 0. One
    pass: each 8 bytes of 0/1, read as an int64, times ``_PACK`` gather into its top byte. On a GPU
    with zfunc's kernels (``zfunc.ops.gpu.onebit``, ``ZFUNC_GPU_KERNELS``), the same bytes in one kernel."""
    if x.is_cuda and x.numel() % 8 == 0 and _gpu_kernels():
        from zfunc.ops.gpu import onebit

        return onebit.pack_signs(x.reshape(-1).float().contiguous())
    words = (x.reshape(-1) >= 0).to(torch.uint8).view(torch.int64)
    return ((words * _PACK) >> 56).to(torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """``pack_signs``' inverse as fp32 +-1, shaped ``packed.shape[:-1] + (8 * packed.shape[-1],)``
    (a table lookup per byte)."""
    return _SIGNS.to(packed.device)[packed.long()].reshape(*packed.shape[:-1], -1)


def scaled_signs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of ``rows`` (chunks x k) as ``scale * sign``: ``(packed signs (chunks x k/8),
    scales (chunks), residual rows - scale * sign)``, scale = ``||row||_2 / sqrt(k)``. On a GPU with
    zfunc's kernels, or fp32 on the CPU (``zfunc.ops.cpu.codec``), the signs and the residual in one
    pass after the norms (the same bits)."""
    if (rows.is_cuda and rows.dtype == torch.float32 and rows.is_contiguous() and rows.shape[1] % 8 == 0
            and _gpu_kernels()):
        from zfunc.ops.gpu import onebit

        return onebit.scaled_signs(rows)
    scales = torch.linalg.vector_norm(rows, dim=1) / math.sqrt(rows.shape[1])
    if _on_cpu_kernels(rows):  # the same bits in one pass (zfunc.ops.cpu.codec)
        from zfunc.ops.cpu import codec

        packed, residual = codec.sign_residual(rows, scales)
        return packed, scales, residual
    packed = pack_signs(rows).view(rows.shape[0], -1)
    s = scales[:, None]
    residual = torch.where(rows >= 0, rows - s, rows + s)  # rows - s * sign, exactly
    return packed, scales, residual


def decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows ``scale * sign`` from packed signs (rows x k/8) and their scales (rows); on a GPU with
    zfunc's kernels, in one pass (the same bits)."""
    if packed.is_cuda and packed.dim() == 2 and packed.is_contiguous() and scales.dtype == torch.float32 and (
            _gpu_kernels()):
        from zfunc.ops.gpu import onebit

        return onebit.decode(packed, scales.contiguous())
    if packed.device.type == "cpu" and packed.dim() == 2 and scales.dtype == torch.float32:
        from zfunc.ops.cpu import codec

        return codec.decode(packed, scales)
    return unpack_signs(packed) * scales[:, None]


def _on_cpu_kernels(rows: torch.Tensor) -> bool:
    """fp32 rows on the CPU, whole bytes of signs: ``zfunc.ops.cpu.codec`` packs them."""
    return rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.dim() == 2 and rows.shape[1] % 8 == 0


def _gpu_kernels() -> bool:
    from zfunc.ops.gpu import runtime

    return runtime.usable()


def onebit_all_reduce(comm: Any, x: torch.Tensor, errors: ErrorFeedback, label: str = "") -> torch.Tensor:
    """``x`` <- the compressed mean over ``comm``'s ranks of ``x`` (module docstring), in place;
    ``errors`` are updated in place. Returns ``x``."""
    world = comm.world
    if world == 1:
        return x
    n, total = x.numel(), errors.worker.numel()
    if total != padded_numel(n, world) or errors.server.numel() != total // world:
        raise ValueError(f"errors: expected ErrorFeedback for {n} elements over {world} ranks (worker "
                         f"{padded_numel(n, world)}, server {padded_numel(n, world) // world}), got worker {total}, "
                         f"server {errors.server.numel()}")
    if _on_cpu_kernels(errors.worker.view(world, -1)) and x.dtype == torch.float32 and x.is_contiguous():
        return _onebit_all_reduce_cpu(comm, x, errors, label)
    c = errors.worker.clone()
    c[:n] += x.detach().reshape(-1).float()
    packed, scales, residual = scaled_signs(c.view(world, -1))
    errors.worker.copy_(residual.view(-1))
    got_signs, got_scales = torch.empty_like(packed), torch.empty_like(scales)
    comm.all_to_all(got_signs, packed, label, kind=KIND)
    comm.all_to_all(got_scales, scales, label, kind=KIND)
    m = decode(got_signs, got_scales / world).sum(0) + errors.server
    s_packed, s_scale, s_residual = scaled_signs(m.view(1, -1))
    errors.server.copy_(s_residual.view(-1))
    all_signs = torch.empty(world, s_packed.shape[1], dtype=torch.uint8, device=x.device)
    all_scales = torch.empty(world, dtype=s_scale.dtype, device=x.device)
    comm.all_gather(all_signs, s_packed.view(-1), label, kind=KIND)
    comm.all_gather(all_scales, s_scale, label, kind=KIND)
    with torch.no_grad():
        x.view(-1).copy_(decode(all_signs, all_scales).view(-1)[:n])
    return x


def _onebit_all_reduce_cpu(comm: Any, x: torch.Tensor, errors: ErrorFeedback, label: str) -> torch.Tensor:
    """``onebit_all_reduce`` on fp32 CPU tensors with ``zfunc.ops.cpu.codec``: the same bits, with the
    worker's compression in place in its error buffer (which holds ``c`` and then its residual) and the
    server's sum and the final decode in one pass each (no whole decoded copies)."""
    from zfunc.ops.cpu import codec

    world, n = comm.world, x.numel()
    c = errors.worker
    c[:n] += x.detach().reshape(-1)
    rows = c.view(world, -1)
    scales = torch.linalg.vector_norm(rows, dim=1) / math.sqrt(rows.shape[1])
    packed, _ = codec.sign_residual(rows, scales, out=rows)
    got_signs, got_scales = torch.empty_like(packed), torch.empty_like(scales)
    comm.all_to_all(got_signs, packed, label, kind=KIND)
    comm.all_to_all(got_scales, scales, label, kind=KIND)
    m = codec.decode_sum(got_signs, got_scales / world, errors.server).view(1, -1)
    s_scale = torch.linalg.vector_norm(m, dim=1) / math.sqrt(m.shape[1])
    s_packed, _ = codec.sign_residual(m, s_scale, out=errors.server)
    all_signs = torch.empty(world, s_packed.shape[1], dtype=torch.uint8)
    all_scales = torch.empty(world, dtype=s_scale.dtype)
    comm.all_gather(all_signs, s_packed.view(-1), label, kind=KIND)
    comm.all_gather(all_scales, s_scale, label, kind=KIND)
    with torch.no_grad():
        codec.decode_into(all_signs, all_scales, x.view(-1))
    return x
