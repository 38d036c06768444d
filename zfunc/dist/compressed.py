"""The 1-bit compressed all-reduce with error feedback (1-bit Adam's, Tang et al. 2021; DeepSpeed's
``compressed_allreduce``), a ``Comm`` operation (``Comm.compressed_all_reduce``).

Over N ranks, for a tensor x of n elements padded to P (a multiple of 8N), rank i:

1. adds its worker error: ``c = x + e``; splits c into N chunks of k = P/N; per chunk j, the scale
   ``s_j = ||c_j||_2 / sqrt(k)`` and the signs ``b_j = sign(c_j)`` (0 counts as +), packed 8 to a
   byte (one pass each way: an int64 multiply to pack, a table lookup to unpack); keeps ``e = c - s * b``
   (what the compression lost) for the next call;
2. sends chunk j's signs and scale to rank j (one all-to-all, the scale's bytes after the signs): each
   rank is the *server* of 1/N;
3. as server of chunk r: averages what it received, ``m = sum_i s_ir b_ir / N``, adds its server
   error ``E``, compresses m the same way (one scale for the chunk) and keeps ``E = m - S * sign(m)``;
4. all-gathers every server's signs and scale (one all-gather): every rank ends with the same ``S_r sign(m_r)`` for
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
from typing import Any, Callable, NamedTuple

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
    return onebit_all_reduce_many(comm, [x], [errors], label)[0]


def onebit_all_reduce_many(comm: Any, xs: list[torch.Tensor], errors: list[ErrorFeedback],
                           label: str = "", blend: tuple | None = None,
                           then: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Each of ``xs`` <- its compressed mean over ``comm``'s ranks, in place, each compressed on its own (its
    scales, its ``errors``: the same bits as one ``onebit_all_reduce`` per tensor), their messages sent
    together: one all-to-all of every tensor's signs and scales, one all-gather back, the same bytes in 2
    collectives instead of 2 per tensor (each one a sync of the ranks). On fp32 CPU tensors ``zfunc.ops.cpu.codec``
    compresses in place in the worker error buffer (``c``, then its residual) and sums and decodes in one
    pass each. ``blend`` ``(ys, a, b)``: the value reduced for ``xs[k]`` is ``xs[k] * a + b * ys[k]`` (1-bit
    Adam's local momentum), the bits of that torch expression, formed in the pass that adds it to the worker
    error (no pass or tensor of its own); ``xs[k]`` still receives the mean. ``then(k)`` runs as soon as
    ``xs[k]`` holds its mean, before the next tensor is decoded: work on it there finds it in the cache
    (1-bit Adam's param update: the model's momenta do not fit a CPU's last-level cache, one tensor's do).
    Returns ``xs``."""
    world = comm.world
    if blend is not None:
        ys, a, b = blend
        if len(ys) != len(xs):
            raise ValueError(f"blend: expected one y per x ({len(xs)}), got {len(ys)}")
    if world == 1 or not xs:
        if blend is not None:
            for x, y in zip(xs, ys):
                x.copy_(_blended(x, y, a, b))
        for k in range(len(xs) if then is not None else 0):
            then(k)
        return xs
    for x, e in zip(xs, errors):
        n, total = x.numel(), e.worker.numel()
        if total != padded_numel(n, world) or e.server.numel() != total // world:
            raise ValueError(f"errors: expected ErrorFeedback for {n} elements over {world} ranks (worker "
                             f"{padded_numel(n, world)}, server {padded_numel(n, world) // world}), got worker "
                             f"{total}, server {e.server.numel()}")
    sent = [_worker_compress(x, e, world, None if blend is None else (ys[t], a, b))
            for t, (x, e) in enumerate(zip(xs, errors))]
    # one message per rank: every tensor's signs for it, then their fp32 scales as bytes (one all-to-all)
    widths = [p.shape[1] for p, _ in sent]
    message = torch.cat([p for p, _ in sent] + [torch.stack([sc for _, sc in sent], dim=1).view(torch.uint8)], dim=1)
    got = torch.empty_like(message)
    comm.all_to_all(got, message, label, kind=KIND)
    got_signs, got_scales = _unpack(got, sum(widths))
    served = [_serve(signs, got_scales[:, t] / world, e) for t, (signs, e) in
              enumerate(zip(got_signs.split(widths, dim=1), errors))]
    s_message = torch.cat([p.view(-1) for p, _ in served] + [torch.cat([sc.view(-1) for _, sc in served])
                                                              .view(torch.uint8)])
    everyone = torch.empty(world, s_message.numel(), dtype=torch.uint8, device=s_message.device)
    comm.all_gather(everyone, s_message, label, kind=KIND)  # likewise: one all-gather
    all_signs, all_scales = _unpack(everyone, sum(widths))
    with torch.no_grad():
        for t, (x, signs) in enumerate(zip(xs, all_signs.split(widths, dim=1))):
            if signs.device.type == "cpu" and x.device.type == "cpu" and x.dtype == torch.float32 and (
                    x.is_contiguous()):
                from zfunc.ops.cpu import codec

                codec.decode_into(signs, all_scales[:, t], x.view(-1))
            else:
                x.view(-1).copy_(decode(signs.contiguous(), all_scales[:, t].contiguous()).view(-1)[: x.numel()])
            if then is not None:
                then(t)
    return xs


def _unpack(message: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A message's rows as ``(signs (rows x width uint8), scales (rows x T fp32))``: the signs, then the
    scales' bytes."""
    return message[:, :width], message[:, width:].contiguous().view(torch.float32)


def _blended(x: torch.Tensor, y: torch.Tensor, a: float, b: float) -> torch.Tensor:
    return x * a + b * y


def _worker_compress(x: torch.Tensor, errors: ErrorFeedback, world: int,
                     blend: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 for one tensor: ``c = x + e`` (``blend`` ``(y, a, b)``: ``c = (x a + b y) + e``) compressed per
    chunk, ``e`` <- its residual; ``(packed (world x k/8), scales (world))``. On fp32 CPU tensors, in place
    in ``e`` (``zfunc.ops.cpu.codec``)."""
    n = x.numel()
    if _on_cpu_kernels(errors.worker.view(world, -1)) and x.dtype == torch.float32 and x.is_contiguous() and (
            blend is None or (blend[0].dtype == torch.float32 and blend[0].is_contiguous())):
        from zfunc.ops.cpu import codec

        rows = errors.worker.view(world, -1)
        if blend is None:
            errors.worker[:n] += x.detach().reshape(-1)
        else:
            codec.add_blend_(errors.worker[:n], x.detach().reshape(-1), blend[0].detach().reshape(-1), *blend[1:])
        scales = torch.linalg.vector_norm(rows, dim=1) / math.sqrt(rows.shape[1])
        packed, _ = codec.sign_residual(rows, scales, out=rows)
        return packed, scales
    c = errors.worker.clone()
    value = x if blend is None else _blended(x, blend[0].to(x.dtype), *blend[1:])
    c[:n] += value.detach().reshape(-1).float()
    packed, scales, residual = scaled_signs(c.view(world, -1))
    errors.worker.copy_(residual.view(-1))
    return packed, scales


def _serve(signs: torch.Tensor, scales: torch.Tensor, errors: ErrorFeedback) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3 for one tensor's chunk: the ranks' ``scale * sign`` (``scales`` already divided by N) summed,
    plus the server error, recompressed; ``E`` <- its residual. ``(packed (1 x k/8), scale (1))``."""
    if _on_cpu_kernels(errors.server.view(1, -1)):
        from zfunc.ops.cpu import codec

        # m = the sum plus E, written over E (read before written), then its residual over it in turn
        m = codec.decode_sum(signs, scales, errors.server, out=errors.server).view(1, -1)
        scale = torch.linalg.vector_norm(m, dim=1) / math.sqrt(m.shape[1])
        packed, _ = codec.sign_residual(m, scale, out=errors.server)
        return packed, scale
    m = decode(signs.contiguous(), scales.contiguous()).sum(0) + errors.server
    packed, scale, residual = scaled_signs(m.view(1, -1))
    errors.server.copy_(residual.view(-1))
    return packed, scale
