"""zfunc.dist.shm: collectives through shared memory between the ranks of one host, against gloo's."""
import os

import pytest
import torch
import torch.distributed as dist

import zfunc as zf
from zfunc.dist import shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory channels need x86-64 Linux")


def _gloo_reduce_scatter(out, full, world):
    everyone = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(everyone, full)
    rank, m = dist.get_rank(), out.numel()
    return torch.stack([e.view(world, m)[rank].to(out.dtype) for e in everyone]).sum(0)


def _against_gloo(rank, world, slot_bytes, busy_s):
    """Each collective on a channel (slot_bytes small: in pieces) and on gloo, of the same inputs."""
    channel = shm.open_channel(None, f"test-{slot_bytes}", slot_bytes=slot_bytes, busy_s=busy_s)
    gen = torch.Generator().manual_seed(rank)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        local = torch.randn(1001, generator=gen).to(dtype)
        out, ref = torch.empty(world * 1001, dtype=dtype), torch.empty(world * 1001, dtype=dtype)
        channel.all_gather(out, local)
        dist.all_gather_into_tensor(ref, local)
        results[f"all_gather {dtype}"] = torch.equal(out, ref)
        full = torch.randn(world * 777, generator=gen).to(dtype)
        out = torch.empty(777, dtype=torch.float32)
        channel.reduce_scatter(out, full)
        results[f"reduce_scatter {dtype}->fp32"] = (out - _gloo_reduce_scatter(out, full, world)).abs().max().item()
        for n in (3000, 50001):  # one phase; above ONE_PHASE_BYTES, chunks summed by their rank and copied
            t = torch.randn(n, generator=gen).to(dtype)
            ref = t.clone()
            channel.all_reduce(t)
            dist.all_reduce(ref)
            results[f"all_reduce {dtype} {n}"] = (t.float() - ref.float()).abs().max().item()
            results[f"all_reduce {dtype} {n} bits"] = t.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,slot_bytes,busy_s", [(2, 16 << 20, None), (3, 1024, 0.0)])
def test_channel_collectives_equal_gloo_and_replicas_agree_bit_for_bit(world, slot_bytes, busy_s):
    # busy_s=0: every wait sleeps in the kernel at once (woken by the rank it waits for)
    ranks = zf.dist.spawn(_against_gloo, world, world, slot_bytes, busy_s)
    for r in ranks:
        for dtype in ("torch.float32", "torch.bfloat16"):
            assert r[f"all_gather {dtype}"]
            assert r[f"reduce_scatter {dtype}->fp32"] <= (0 if world == 2 else 1e-6)
            # on 3 ranks the order of the additions differs from gloo's ring: fp32 rounding apart, bf16 an ulp
            for n in (3000, 50001):
                assert r[f"all_reduce {dtype} {n}"] <= {2: 0, 3: 1e-6 if dtype == "torch.float32" else 0.07}[world]
        assert all(torch.equal(r[k], ranks[0][k]) for k in r if k.endswith("bits"))  # every replica the same bits


def _comm_takes_the_channel(rank, world):
    mesh = zf.Mesh(dp=world)
    t = torch.full((4,), float(rank + 1))
    mesh.comm.all_reduce(t)
    out = torch.empty(2)
    work = mesh.comm.reduce_scatter(out, torch.arange(2.0 * world) * (rank + 1), async_op=True)
    work.wait()
    channel = shm.channel_of(mesh.comm.group)
    return t.tolist(), out.tolist(), None if channel is None else channel.count, dict(mesh.comm.bytes)


@pytest.mark.multiprocess
@pytest.mark.parametrize("setting", ["on", "off"])
def test_comm_runs_its_collectives_on_the_channel_unless_turned_off(setting, monkeypatch):
    monkeypatch.setenv("ZFUNC_SHM", setting)
    ranks = zf.dist.spawn(_comm_takes_the_channel, 2, 2)
    for rank, (t, out, count, nbytes) in enumerate(ranks):
        assert t == [3.0] * 4
        assert out == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]
        assert count == (2 if setting == "on" else None)
        assert nbytes == {"all_reduce": 32, "reduce_scatter": 16}  # counted alike on either transport


def _checked_gathers(rank, world):
    """Checked all-gathers on the channel: agreed (2 ints, then 3), then ranks posting different ops, then one
    posting none."""
    from zfunc.dist.comm import Comm
    channel = shm.channel_of(None) or shm.open_channel(None, "unused")
    seen, out = [], torch.empty(2 * world)

    def gather(op):
        before = channel.count
        try:
            Comm().all_gather(out, torch.full((2,), float(rank)), "gather of 'h.0'", check=None if op is None else
                              (op, lambda o: f"unit {o[0]} at step {o[1]}"))
            seen.append(("ok", out.tolist(), channel.count - before))
        except zf.dist.CollectiveError as e:
            seen.append(("diverged", str(e), channel.count - before))

    gather((3, 7))
    gather((3, 7, 9))  # more ints than a control line holds: a separate agreement first
    gather((rank, 7))
    gather((3, 7) if rank == 0 else None)
    gather((3, 8))  # the channel is still in step after the failures
    return seen


@pytest.mark.multiprocess
def test_a_checked_gather_agrees_within_its_own_barrier_and_names_each_ranks_op():
    for rank, seen in enumerate(zf.dist.spawn(_checked_gathers, 2, 2)):
        assert seen[0] == ("ok", [0.0, 0.0, 1.0, 1.0], 1)  # one collective: no agreement round trip of its own
        assert seen[1] == ("ok", [0.0, 0.0, 1.0, 1.0], 2)
        assert seen[2][0] == "diverged" and seen[2][2] == 1
        assert "ranks diverged at gather of 'h.0': rank 0: unit 0 at step 7; rank 1: unit 1 at step 7" in seen[2][1]
        if rank == 0:
            assert seen[3][0] == "diverged" and "rank 1: a collective with no check" in seen[3][1]
        else:
            assert seen[3][0] == "ok"  # it checked nothing, so it cannot tell
        assert seen[4] == ("ok", [0.0, 0.0, 1.0, 1.0], 1)


def _peer_dies(rank, world):
    channel = shm.open_channel(None, "dies", slot_bytes=4096, busy_s=0.0)  # asleep in the kernel, it still checks
    if rank == 1:
        os._exit(3)
    try:
        channel.all_gather(torch.empty(2 * world), torch.ones(2))
    except shm.ShmError as e:
        raise AssertionError(str(e)) from None


@pytest.mark.multiprocess
def test_a_peer_that_dies_fails_the_collective_naming_it():
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) died before it could write its input"):
        zf.dist.spawn(_peer_dies, 2, 2, timeout_s=60)


def _peer_late(rank, world):
    channel = shm.open_channel(None, "late", slot_bytes=4096, timeout_s=1.0)
    if rank == 1:
        dist.barrier()  # rank 0 has given up by now
        return "late"
    try:
        channel.all_reduce(torch.ones(2))
        return "no error"
    except shm.ShmError as e:
        return str(e)
    finally:
        dist.barrier()


@pytest.mark.multiprocess
def test_a_peer_that_does_not_arrive_within_the_timeout_fails_the_collective():
    message = zf.dist.spawn(_peer_late, 2, 2, timeout_s=60)[0]
    assert "rank 1 did not write its input within 1 s" in message


def test_a_comm_of_one_process_has_no_channel():
    assert zf.Mesh().comm._channel(torch.ones(1)) is None  # it copies


@pytest.mark.parametrize("posted", ["/etc/passwd|0123456789abcdef",
                                    "/dev/shm/../tmp/zfunc-1-0123456789ab|0123456789abcdef",
                                    "/dev/shm/zfunc-1-0123456789ab|not-a-token", "no separator"])
def test_a_segment_the_store_names_must_be_a_zfunc_segment_in_dev_shm(posted):
    assert shm._segment_named("/dev/shm/zfunc-12-0123456789ab|0123456789abcdef") == (
        "/dev/shm/zfunc-12-0123456789ab", "0123456789abcdef")
    with pytest.raises(OSError, match="not a zfunc segment in /dev/shm"):
        shm._segment_named(posted)


def test_attaching_refuses_a_link_and_a_short_file(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"\0" * 8192)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(OSError):
        shm._map(str(link), 8192, create=False)
    with pytest.raises(OSError, match="has 8192 bytes, 16384 expected"):
        shm._map(str(target), 16384, create=False)
