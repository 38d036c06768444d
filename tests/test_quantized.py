"""ZeRO++'s quantized collectives (zfunc.dist.quantized): round trip within half a quantization step
per block; zf.shard(quantize_weights=, quantize_grads=) on 2 ranks trains like the fp32 step within
the quantization error, with the bytes counted as int8/int4."""
from __future__ import annotations

import pytest
import torch

import zfunc as zf
from tests.models import adamw, batches, local, make, mesh_shaped, token_loss
from zfunc.dist import quantized as Q


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_is_within_half_a_step_per_block(bits):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4 * Q.BLOCK, generator=g) * torch.tensor([1e-3, 1.0, 1e3])[:, None]
    x[1, : Q.BLOCK] = 0  # an all-zero block round-trips exactly
    payload, scales = Q.quantize(x, bits)
    assert payload.dtype == torch.uint8 and payload.shape == (3, 4 * Q.BLOCK * bits // 8)
    back = Q.dequantize(payload, scales, bits)
    step = scales.repeat_interleave(Q.BLOCK, dim=1)  # each value's quantization step
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(back[1, : Q.BLOCK], torch.zeros(Q.BLOCK))


def test_shard_refuses_zero_plus_plus_where_it_does_not_apply():
    step, _ = make()
    with pytest.raises(ValueError, match="quantize_weights: .*expected stage 3, got stage 2"):
        zf.shard(step, mesh_shaped(dp=2), 2, quantize_weights=True)
    with pytest.raises(ValueError, match="quantize_grads: .*got stage 0"):
        zf.shard(step, mesh_shaped(dp=2), 0, quantize_grads=True)
    with pytest.raises(ValueError, match="quantize_grads: expected False, True"):
        zf.shard(step, mesh_shaped(dp=2), 2, quantize_grads=2)


def _zpp_worker(rank, world, stage, weights, grads, mesh=None):
    mesh = mesh or zf.Mesh()
    torch.manual_seed(0)
    from tests.models import Block, Tiny
    apply, params = zf.functionalize(Tiny(vocab=256, d=64))
    units = zf.units.by_class(Block) if stage == 3 else None
    loss_fn = token_loss(apply)
    inner = zf.train_step(loss_fn, adamw(clip=False), "fp32")
    step = zf.shard(inner, mesh, stage, units=units, quantize_weights=weights, quantize_grads=grads)
    state = step.init(params)
    losses = []
    for batch in batches(world, vocab=256):
        state, m = step(state, local(batch, rank, world))
        losses.append(float(m["loss"]))
    return losses, dict(mesh.comm_bytes())


@pytest.mark.multiprocess
def test_zero_plus_plus_trains_like_fp32_and_moves_fewer_bytes():
    ref, ref_bytes = zf.dist.spawn(_zpp_worker, 2, 2, 3, False, False)[0]
    q8, q8_bytes = zf.dist.spawn(_zpp_worker, 2, 2, 3, True, 8)[0]
    q4, q4_bytes = zf.dist.spawn(_zpp_worker, 2, 2, 3, True, True)[0]
    for got in (q8, q4):
        for a, b in zip(got, ref):
            assert abs(a - b) <= 2e-2 * abs(b), (got, ref)
    # the step's bytes (5 steps), fp32 over int8 / int4 (units of ~4-16k values: padding to 256 costs a little)
    assert ref_bytes["all_gather"] / q8_bytes["quantized_all_gather"] >= 3.5
    assert ref_bytes["reduce_scatter"] / q8_bytes["quantized_reduce_scatter"] >= 3.5
    assert ref_bytes["reduce_scatter"] / q4_bytes["quantized_reduce_scatter"] >= 7
    assert "reduce_scatter" not in q4_bytes and "all_gather" not in q8_bytes


def _accounted_worker(rank, world, cases):
    mesh = zf.Mesh()
    out = []
    for stage, bits, accum in cases:
        torch.manual_seed(0)
        from tests.models import Tiny
        apply, params = zf.functionalize(Tiny())
        step = zf.shard(zf.train_step(token_loss(apply), adamw(), "fp32", accum), mesh, stage, quantize_grads=bits)
        state = step.init(params)
        state, _ = step(state, local(batches(world, 1, b=2 * accum)[0], rank, world))
        out.append(dict(step.memory(state)["comm"]))
    return out


@pytest.mark.multiprocess
def test_the_plan_counts_the_quantized_bytes_the_ranks_move():
    """``zfunc.plan``'s quantized reduce-scatter bytes (``compression.engine_compressed_comm``, from the
    params' shapes) equal what each rank's comm counted, stages 1 and 2 (every microbatch), int8 and int4."""
    from tests.models import Tiny
    from zfunc import plan as zp
    from zfunc.plan.compression import engine_compressed_comm

    cases = [(1, 8, 1), (2, 4, 2), (2, 8, 1)]
    leaves = zp.from_module(Tiny()).leaves
    for rank, got in enumerate(zf.dist.spawn(_accounted_worker, 2, 2, cases)):
        for (stage, bits, accum), moved in zip(cases, got):
            want = engine_compressed_comm(leaves, 2, stage, quantized_grads=bits, accum=accum)
            assert moved == want, (rank, stage, bits, accum, moved, want)


def _simulated_two_level(fulls, per_node, bits):
    """Plain torch: every rank's result of the two-level quantized reduce-scatter of ``fulls`` (one
    flat tensor per rank) over ranks in nodes of ``per_node`` (zfunc.dist.quantized's docstring)."""
    world = len(fulls)
    nodes, k = world // per_node, fulls[0].numel() // world
    pad = -(-k // Q.BLOCK) * Q.BLOCK

    def round_trip(x):  # quantized, sent, dequantized
        rows = torch.zeros(x.shape[0], pad)
        rows[:, :k] = x
        return Q.dequantize(*Q.quantize(rows, bits), bits)

    chunks = [round_trip(f.view(world, k)) for f in fulls]  # rank s's chunk for rank r: chunks[s][r]
    partial = {}  # (node a, position l) -> the node's sums for ranks (b, l), b = 0..nodes-1
    for a in range(nodes):
        for l in range(per_node):
            sent = torch.stack([torch.stack([chunks[a * per_node + m][b * per_node + l] for b in range(nodes)])
                                for m in range(per_node)])
            partial[a, l] = round_trip(sent.sum(0)[:, :k])
    return [torch.stack([partial[a, r % per_node][r // per_node] for a in range(nodes)]).sum(0)[:k]
            for r in range(world)]


def _two_level_worker(rank, world, per_node):
    from zfunc.dist.hierarchy import blocks

    mesh = zf.Mesh(ranks_per_node=per_node)
    comm = Q.QuantizedComm(mesh.reduce_comm, False, 8, blocks(mesh.reduce_comm, per_node, "nodes"))
    k = 300  # not a multiple of the block: padded
    full = torch.randn(world * k, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    out = torch.empty(k)
    comm.reduce_scatter(out, full, label="test").wait()
    collective = (out, dict(mesh.comm_bytes()))
    trained = {}
    for bits in (False, 8):
        mesh.clear_comm_bytes()
        trained[bits] = _zpp_worker(rank, world, 2, False, bits, mesh)
    return collective, trained


@pytest.mark.multiprocess
def test_two_level_reduce_scatter_equals_its_simulation_on_two_nodes():
    """4 ranks told they are 2 nodes of 2: the quantized grad reduce-scatter goes inside the node then
    across, bit for bit as simulated; across nodes it moves half the in-node bytes; a ZeRO-2 step over
    it trains like fp32 within the quantization error."""
    world, per_node = 4, 2
    results = zf.dist.spawn(_two_level_worker, world, world, per_node)
    fulls = [torch.randn(world * 300, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(world)]
    want = _simulated_two_level(fulls, per_node, 8)
    exact = torch.stack(fulls).sum(0).view(world, -1)
    for rank, ((out, moved), trained) in enumerate(results):
        assert torch.equal(out, want[rank]), rank
        assert (out - exact[rank]).abs().max() < 0.1 * exact[rank].abs().max()  # within the quantization error
        assert moved["quantized_reduce_scatter_in_node"] == 2 * moved["quantized_reduce_scatter_across_nodes"]
        (ref, _), (q8, q8_bytes) = trained[False], trained[8]
        for a, b in zip(q8, ref):
            assert abs(a - b) <= 2e-2 * abs(b), (q8, ref)
        assert "quantized_reduce_scatter" not in q8_bytes and q8_bytes["quantized_reduce_scatter_across_nodes"] > 0


def test_a_mesh_is_told_its_ranks_per_node():
    assert zf.Mesh(ranks_per_node=1).ranks_per_node == 1
    assert zf.Mesh().ranks_per_node is None  # not told, not under torchrun: one node
    with pytest.raises(ValueError, match="ranks_per_node: expected an int >= 1 dividing the world size 1, got 2"):
        zf.Mesh(ranks_per_node=2)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_cpu_codec_writes_the_torch_expressions_bits(bits):
    """zfunc.ops.cpu.codec (what Q.quantize / Q.dequantize / the reduce-scatter's sum run on the CPU)
    against the torch expressions it replaces, bit for bit."""
    from zfunc.ops.cpu import codec

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3 * Q.BLOCK, generator=g) * torch.tensor([1e-3, 1.0, 1e3, 0.0])[:, None]
    x[1, 7], x[2, 300], x[3, 600] = -0.0, 1e-42, -1e-40  # the scale's max runs over the values' bits
    qmax = {8: 127, 4: 7}[bits]
    scales = x.reshape(4, -1, Q.BLOCK).abs().amax(dim=2) * (1.0 / qmax)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(x.reshape(4, -1, Q.BLOCK) / safe[..., None]).clamp_(-qmax, qmax).reshape(4, -1)
    want = (q + 128).to(torch.uint8) if bits == 8 else ((q[:, 0::2] + 8) * 16 + q[:, 1::2] + 8).to(torch.uint8)
    payload, got_scales = codec.quantize_blocks(x, Q.BLOCK, qmax, bits)
    assert torch.equal(payload, want) and torch.equal(got_scales, scales)
    back = (q.reshape(4, -1, Q.BLOCK) * scales[..., None]).reshape(4, -1)
    assert torch.equal(codec.dequantize(payload, scales, Q.BLOCK, bits), back)
    for k in (700, 701):  # whole blocks, a partial one, an odd tail
        out = torch.empty(k)
        codec.dequantize_sum(payload, scales, Q.BLOCK, bits, out)
        assert torch.equal(out, back[:, :k].sum(0)), k
    if bits == 8:  # the all-gather's rows, straight into their destination
        rows = torch.empty(4, 700)
        codec.dequantize_into(payload, scales, Q.BLOCK, rows)
        assert torch.equal(rows, back[:, :700])
