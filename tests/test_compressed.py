"""The 1-bit compressed all-reduce (zfunc.dist.compressed): bit for bit a plain-torch simulation of
its algorithm on 2 and 4 ranks, sign packing, byte counts, and error feedback's bounded drift."""
from __future__ import annotations

import math

import pytest
import torch

import zfunc as zf
from zfunc.dist import compressed as C


def _simulate(xs, worker_errors, server_errors):
    """The algorithm over N ranks in one process, in plain torch (no packing, no collectives):
    returns (result, new worker errors, new server errors)."""
    world, n = len(xs), xs[0].numel()
    total = worker_errors[0].numel()
    k = total // world
    scales, signs, new_worker = [], [], []
    for x, e in zip(xs, worker_errors):
        c = e.clone()
        c[:n] += x.reshape(-1)
        rows = c.view(world, k)
        s = torch.linalg.vector_norm(rows, dim=1) / math.sqrt(k)
        b = torch.where(rows >= 0, 1.0, -1.0)
        scales.append(s)
        signs.append(b)
        new_worker.append((rows - s[:, None] * b).view(-1))
    out, new_server = [], []
    for r in range(world):
        got = torch.stack([signs[i][r] for i in range(world)]) * (torch.stack([scales[i][r] for i in range(world)])
                                                                 / world)[:, None]
        m = (got.sum(0) + server_errors[r]).view(1, k)
        s = torch.linalg.vector_norm(m, dim=1) / math.sqrt(k)
        b = torch.where(m >= 0, 1.0, -1.0)
        new_server.append((m - s[:, None] * b).view(-1))
        out.append((b * s[:, None]).view(-1))
    return torch.cat(out)[:n].view_as(xs[0]), new_worker, new_server


def _inputs(world, step, shape=(37, 5)):
    g = torch.Generator().manual_seed(1000 * step + world)
    return [torch.randn(shape, generator=g) * (1 + r) for r in range(world)]


def _ranks_reduce(rank, world, steps):
    comm = zf.Mesh().comm
    errors = C.error_feedback(37 * 5, world)
    results = []
    for t in range(steps):
        x = _inputs(world, t)[rank].clone()
        comm.compressed_all_reduce(x, errors, label=f"test {t}")
        results.append(x)
    return results, errors.worker, errors.server, dict(comm.bytes)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_all_reduce_equals_the_simulation_bit_for_bit(world):
    steps = 3
    out = zf.dist.spawn(_ranks_reduce, world, world, steps)
    total = C.padded_numel(37 * 5, world)
    w_err = [torch.zeros(total) for _ in range(world)]
    s_err = [torch.zeros(total // world) for _ in range(world)]
    for t in range(steps):
        expected, w_err, s_err = _simulate(_inputs(world, t), w_err, s_err)
        for rank in range(world):
            assert torch.equal(out[rank][0][t], expected), (world, t, rank)
    for rank in range(world):
        assert torch.equal(out[rank][1], w_err[rank]) and torch.equal(out[rank][2], s_err[rank])
        sent = out[rank][3][C.KIND]
        assert sent == steps * 2 * (total // 8 + 4 * world)  # signs and scales out, all-gathered back
        assert 2 * 4 * 37 * 5 / (sent / steps) > 7  # a tiny tensor: the scales weigh; ~32x for large ones


def test_sign_packing_round_trips_and_counts_zero_as_plus():
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1e-9, 5.0, -5.0] * 3)
    packed = C.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 3 and packed[0].item() == 0b01011101  # element i at bit i
    assert torch.equal(C.unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))


def test_error_feedback_bounds_the_drift_over_50_steps():
    """Bound: the summed results drift from the summed true means by exactly ``mean_i e_i + E``
    (the errors left), and that stays below 4 x the largest single mean's norm at every step up to
    50 (it grows ~sqrt(t) from 0.6x at the first step), while the same compression without feedback
    drifts linearly: past 20 x by step 50."""
    world, n = 4, 4096
    total = C.padded_numel(n, world)
    w_err = [torch.zeros(total) for _ in range(world)]
    s_err = [torch.zeros(total // world) for _ in range(world)]
    zero_w, zero_s = [torch.zeros(total) for _ in range(world)], [torch.zeros(total // world) for _ in range(world)]
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n, generator=g)  # a persistent direction, as momentum has
    summed_out = torch.zeros(n, dtype=torch.float64)
    summed_true = torch.zeros(n, dtype=torch.float64)
    summed_plain = torch.zeros(n, dtype=torch.float64)
    largest = 0.0
    for t in range(50):
        xs = [base + 0.5 * torch.randn(n, generator=g) for _ in range(world)]
        mean = torch.stack(xs).mean(0)
        largest = max(largest, float(mean.norm()))
        out, w_err, s_err = _simulate(xs, w_err, s_err)
        plain, _, _ = _simulate(xs, zero_w, zero_s)
        summed_out += out.double()
        summed_true += mean.double()
        summed_plain += plain.double()
        left = (torch.stack(w_err).mean(0) + torch.cat(s_err))[:n].double()
        drift = summed_true - summed_out
        torch.testing.assert_close(drift, left, rtol=0, atol=1e-3)  # the identity, up to fp32 rounding
        assert float(drift.norm()) <= 4 * largest, t
    assert float((summed_true - summed_plain).norm()) > 20 * largest


def test_the_cpu_codec_writes_the_torch_expressions_bits():
    """zfunc.ops.cpu.codec (what the compressed all-reduce runs on the CPU) against the torch expressions
    it replaces, bit for bit."""
    from zfunc.ops.cpu import codec

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 1024, generator=g) * torch.tensor([1e-3, 1.0, 1e3, 0.0])[:, None]
    rows[1, :40] = -0.0
    s = torch.linalg.vector_norm(rows, dim=1) / math.sqrt(1024)
    packed, residual = codec.sign_residual(rows, s)
    assert torch.equal(packed, C.pack_signs(rows).view(4, -1))
    assert torch.equal(residual, torch.where(rows >= 0, rows - s[:, None], rows + s[:, None]))
    signs = torch.where(rows >= 0, 1.0, -1.0)
    assert torch.equal(codec.decode(packed, s), signs * s[:, None])
    add = torch.randn(1024, generator=g)
    assert torch.equal(codec.decode_sum(packed, s, add), (signs * s[:, None]).sum(0) + add)
    out = torch.empty(3000)
    codec.decode_into(packed, s, out)
    assert torch.equal(out, (signs * s[:, None]).reshape(-1)[:3000])
    summed = add.clone()
    codec.decode_sum(packed, s, summed, out=summed)  # over its own addend
    assert torch.equal(summed, (signs * s[:, None]).sum(0) + add)
    e, x, y = (torch.randn(1000, generator=g) for _ in range(3))
    want = e + (x * 0.9 + (1 - 0.9) * y)
    codec.add_blend_(e, x, y, 0.9, 1 - 0.9)
    assert torch.equal(e, want)


def _ranks_reduce_many(rank, world):
    comm = zf.Mesh().comm
    xs = [_inputs(world, 0)[rank].clone(), _inputs(world, 1, (300,))[rank].clone()]
    errors = [C.error_feedback(x.numel(), world) for x in xs]
    C.onebit_all_reduce_many(comm, xs, errors, label="test")
    return xs, dict(comm.bytes)


@pytest.mark.multiprocess
def test_tensors_reduced_together_are_each_their_own_reduce():
    """Messages of two tensors sent together: each result is its own simulation, bit for bit, and the bytes are
    the sum of the two single calls' (the same messages, in 2 collectives instead of 4)."""
    world = 2
    out = zf.dist.spawn(_ranks_reduce_many, world, world)
    for t, shape in enumerate([(37, 5), (300,)]):
        total = C.padded_numel(math.prod(shape), world)
        want, _, _ = _simulate(_inputs(world, t, shape), [torch.zeros(total)] * world,
                               [torch.zeros(total // world)] * world)
        for rank in range(world):
            assert torch.equal(out[rank][0][t], want), (t, rank)
    sizes = [C.padded_numel(n, world) for n in (37 * 5, 300)]
    assert out[0][1][C.KIND] == sum(2 * (p // 8 + 4 * world) for p in sizes)
