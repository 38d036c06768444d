"""ZeRO++'s quantized collectives (Wang et al., 2023: qwZ and qgZ): block-quantized int8 param
all-gathers and int4/int8 grad reduce-scatters, as a ``Comm`` that quantizes what it sends
(``QuantizedComm``, wrapping the mesh's own).

Quantization is symmetric, per block of ``BLOCK`` = 256 values: ``scale = max|x| / qmax`` (qmax 127
for int8, 7 for int4), ``q = round(x / scale)``; int4 values go two to a byte. Law: the round trip
``dequantize(quantize(x))`` is within half a quantization step (``scale / 2``) of x in every block
(tests/test_quantized.py). Cost: per value 1 byte (int8) or half a byte (int4), plus 4 bytes of
scale per block: 3.94x (int8) and 7.76x (int4) fewer bytes than fp32; one pass to quantize and one
to dequantize.

``all_gather`` (params): every rank's segment quantized, the int8 payload and scales all-gathered,
every chunk (this rank's own too, so every rank computes with the same values) dequantized into
``out``. ``reduce_scatter`` (grads): each destination chunk of ``full`` quantized, sent with one
all-to-all (payload and scales), the N received chunks dequantized and summed in fp32 into ``out``.
Bytes are counted by the wrapped comm, under "quantized_all_gather" and "quantized_reduce_scatter".

**Two levels** (qgZ's hierarchical all-to-all; ``nodes``: the comm's ranks as ``n`` nodes of ``L``
consecutive ranks, ``zfunc.dist.hierarchy.blocks``; rank ``r = a L + l`` is rank l of node a):
1. inside the node: rank (a, l) quantizes every destination chunk of ``full`` and sends to its node's
   rank m the n chunks of ranks (b, m), b = 0..n-1 (one all-to-all of the whole quantized tensor
   over the L ranks); it dequantizes what its L node peers sent and sums it in fp32: the node's
   partial sums for ranks (b, l), b = 0..n-1;
2. across nodes: it quantizes those n partial sums and sends partial b to rank (b, l) (one
   all-to-all over the n ranks at position l); it dequantizes the n partials it receives and sums
   them in fp32 into ``out``.
Law: bit for bit a plain-torch simulation of these steps over the ranks' inputs (tests/test_quantized.py,
4 ranks as 2 nodes); within the quantization errors of both levels of the exact sum. Cost: inside
the node the quantized tensor, as one level moves it, counted as "quantized_reduce_scatter_in_node";
across nodes 1/L of it, "quantized_reduce_scatter_across_nodes" (ZeRO++: the inter-node volume of qgZ
divided by the ranks per node); one more quantize and dequantize pass over 1/L of the tensor. The
levels run one after the other on a thread of their own (``_Levels``), so a call returns at once
and calls complete in order, overlapping backward as one level does.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

BLOCK = 256
_QMAX = {8: 127, 4: 7}


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


_NIBBLES = torch.tensor([[(b >> 4) - 8, (b & 15) - 8] for b in range(256)], dtype=torch.float32)  # byte -> 2 ints


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (rows x n, n a multiple of ``BLOCK``) as ``(payload uint8, scales fp32)``: per
    row, n bytes (int8, offset by 128) or n/2 (int4, two offset nibbles a byte, the first high), and
    n / BLOCK scales. On a GPU with zfunc's kernels (``zfunc.ops.gpu.quantize``, ``ZFUNC_GPU_KERNELS``),
    the same bits in one pass; on the CPU the payload in one pass after the scales (``zfunc.ops.cpu.codec``)."""
    if x.is_cuda and x.dim() == 2 and _gpu_kernels():
        from zfunc.ops.gpu import quantize as gpu_quantize

        return gpu_quantize.quantize(x.float().contiguous(), bits)
    rows = x.shape[0]
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:  # one pass (zfunc.ops.cpu.codec)
        from zfunc.ops.cpu import codec

        return codec.quantize_blocks(x, BLOCK, _QMAX[bits], bits)
    blocks = x.float().reshape(rows, -1, BLOCK)
    scales = blocks.abs().amax(dim=2) * (1.0 / _QMAX[bits])  # a reciprocal, as torch's CUDA division by a scalar
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    if x.device.type == "cpu":  # the same bits in one pass (zfunc.ops.cpu.codec)
        from zfunc.ops.cpu import codec

        return codec.quantize(blocks.reshape(rows, -1), safe, BLOCK, _QMAX[bits], bits), scales
    q = torch.round(blocks / safe[..., None]).clamp_(-_QMAX[bits], _QMAX[bits])
    if bits == 8:
        return q.add_(128).to(torch.uint8).reshape(rows, -1), scales
    pairs = q.add_(8).reshape(rows, -1, 2)
    return (pairs[..., 0] * 16 + pairs[..., 1]).to(torch.uint8), scales


def dequantize(payload: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """``quantize``'s inverse: rows of fp32 values (rows x n); on a GPU with zfunc's kernels, or on the
    CPU (``zfunc.ops.cpu.codec``), in one pass (the same bits)."""
    if payload.is_cuda and payload.dim() == 2 and payload.is_contiguous() and scales.dtype == torch.float32 and (
            _gpu_kernels()):
        from zfunc.ops.gpu import quantize as gpu_quantize

        return gpu_quantize.dequantize(payload, scales.contiguous(), bits)
    rows = payload.shape[0]
    if payload.device.type == "cpu" and payload.dim() == 2 and scales.dtype == torch.float32:
        from zfunc.ops.cpu import codec

        return codec.dequantize(payload, scales, BLOCK, bits)
    q = payload.float() - 128 if bits == 8 else _NIBBLES.to(payload.device)[payload.long()]
    return (q.reshape(rows, -1, BLOCK) * scales[..., None]).reshape(rows, -1)


def _gpu_kernels() -> bool:
    from zfunc.ops.gpu import runtime

    return runtime.usable()


class _Dequantized:
    """Collectives in flight whose result ``finish()`` writes where it belongs, once waited on."""

    def __init__(self, works: list[Any], finish):
        self.works, self.finish = works, finish

    def wait(self) -> bool:
        if self.works is not None:
            for work in self.works:
                work.wait()
            self.finish()
            self.works = None
        return True


class QuantizedComm:
    """``inner`` (a ``Comm``) whose ``all_gather`` quantizes to int8 where ``weights`` and whose
    ``reduce_scatter`` quantizes to ``grad_bits`` (4 or 8; None: full precision); everything else is
    ``inner``'s (module docstring). ``nodes`` (a ``zfunc.dist.hierarchy.Blocks`` of ``inner``'s ranks,
    one block a node): the reduce-scatter in two levels where there are several nodes of several ranks."""

    def __init__(self, inner: Any, weights: bool, grad_bits: int | None, nodes: Any = None):
        if grad_bits not in (None, 4, 8):
            raise ValueError(f"grad_bits: expected 4, 8 or None, got {grad_bits!r}")
        self.inner, self.weights, self.grad_bits = inner, weights, grad_bits
        two_level = nodes is not None and nodes.inner.world > 1 and nodes.outer.world > 1
        self.nodes = nodes if two_level else None
        self._levels: ThreadPoolExecutor | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_gather(self, out: torch.Tensor, local: torch.Tensor, label: str = "", async_op: bool = False,
                   check: tuple | None = None, kind: str = "all_gather"):
        if not self.weights or not out.is_floating_point() or self.inner.world == 1:
            return self.inner.all_gather(out, local, label, async_op, check, kind)
        world, k = self.inner.world, local.numel()
        if k == _padded(k) and local.dtype == torch.float32 and local.is_contiguous():  # whole blocks: no copy
            seg = local.detach().view(1, k)
        else:
            seg = torch.zeros(1, _padded(k), dtype=torch.float32, device=local.device)
            seg[0, :k] = local.reshape(-1)
        payload, scales = quantize(seg, 8)
        all_payload = torch.empty(world, payload.shape[1], dtype=torch.uint8, device=out.device)
        all_scales = torch.empty(world, scales.shape[1], dtype=torch.float32, device=out.device)
        works = [self.inner.all_gather(all_payload, payload.view(-1), label, True, check, "quantized_all_gather"),
                 self.inner.all_gather(all_scales, scales.view(-1), label, True, None, "quantized_all_gather")]

        def finish():
            with torch.no_grad():
                if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
                    from zfunc.ops.cpu import codec  # straight into out: the same bits, no whole copy

                    codec.dequantize_into(all_payload, all_scales, BLOCK, out.view(world, -1))
                else:
                    out.view(world, -1).copy_(dequantize(all_payload, all_scales, 8)[:, :k])

        work = _Dequantized(works, finish)
        if not async_op:
            work.wait()
        return work

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, label: str = "", async_op: bool = False,
                       check: tuple | None = None):
        if self.grad_bits is None or self.inner.world == 1:
            return self.inner.reduce_scatter(out, full, label, async_op, check)
        if self.nodes is not None:
            if self._levels is None:
                self._levels = ThreadPoolExecutor(1, thread_name_prefix="zfunc-qgz")
            work = _Levels(self._levels.submit(two_level_reduce_scatter, self.nodes, out, full, self.grad_bits,
                                               label))
            if not async_op:
                work.wait()
            return work
        world, k = self.inner.world, out.numel()
        if k == _padded(k) and full.dtype == torch.float32:  # whole blocks already: no padded copy
            rows = full.view(world, k)
        else:
            rows = torch.zeros(world, _padded(k), dtype=torch.float32, device=full.device)
            rows[:, :k] = full.view(world, k)
        payload, scales = quantize(rows, self.grad_bits)
        got_payload, got_scales = torch.empty_like(payload), torch.empty_like(scales)
        works = [self.inner.all_to_all(got_payload, payload, label, "quantized_reduce_scatter", async_op=True),
                 self.inner.all_to_all(got_scales, scales, label, "quantized_reduce_scatter", async_op=True)]

        def finish():
            dequantized_sum(got_payload, got_scales, self.grad_bits, out)

        work = _Dequantized(works, finish)
        if not async_op:
            work.wait()
        return work


class _Levels:
    """A two-level reduce-scatter running on its own thread: ``wait()`` returns once ``out`` holds the sum."""

    def __init__(self, future: Any):
        self.future = future

    def wait(self) -> bool:
        self.future.result()  # raises the CollectiveError of a failed level
        return True


def two_level_reduce_scatter(nodes: Any, out: torch.Tensor, full: torch.Tensor, bits: int, label: str = "") -> None:
    """``out`` <- this rank's chunk of the sum over every rank of ``full``, in two quantized levels
    (module docstring): ``nodes.inner`` the L ranks of this rank's node, ``nodes.outer`` the n ranks at
    its position on every node. Blocks until done."""
    per_node, nodes_n, k = nodes.inner.world, nodes.outer.world, out.numel()
    rows = torch.zeros(per_node, nodes_n, _padded(k), dtype=torch.float32, device=full.device)
    rows[..., :k] = full.view(nodes_n, per_node, k).transpose(0, 1)  # row block m: chunks for ranks (b, m)
    payload, scales = quantize(rows.view(per_node * nodes_n, -1), bits)
    got_payload, got_scales = torch.empty_like(payload), torch.empty_like(scales)
    nodes.inner.all_to_all(got_payload, payload, label, "quantized_reduce_scatter_in_node")
    nodes.inner.all_to_all(got_scales, scales, label, "quantized_reduce_scatter_in_node")
    partial = dequantize(got_payload, got_scales, bits).view(per_node, nodes_n, -1).sum(dim=0)
    payload, scales = quantize(partial, bits)
    got_payload, got_scales = torch.empty_like(payload), torch.empty_like(scales)
    nodes.outer.all_to_all(got_payload, payload, label, "quantized_reduce_scatter_across_nodes")
    nodes.outer.all_to_all(got_scales, scales, label, "quantized_reduce_scatter_across_nodes")
    dequantized_sum(got_payload, got_scales, bits, out)


def dequantized_sum(payload: torch.Tensor, scales: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """``out`` (k values) <- the first k values of every dequantized row, summed over the rows in fp32;
    on the CPU in one pass (``zfunc.ops.cpu.codec``: the same bits)."""
    k = out.numel()
    if payload.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
        from zfunc.ops.cpu import codec

        codec.dequantize_sum(payload, scales, BLOCK, bits, out)
        return
    torch.sum(dequantize(payload, scales, bits)[:, :k], dim=0, out=out.view(-1))
