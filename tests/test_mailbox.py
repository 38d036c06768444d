"""zfunc.dist.mailbox: point-to-point transfers through shared-memory rings, matched per tag in call order."""
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import zfunc as zf
from zfunc.dist import mailbox, shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory rings need x86-64 Linux")


def _exchange(rank, world, ring_bytes, busy_s):
    """Rank 0 sends 40 messages of three tags and sizes (the ring wraps, fills and backs up into the
    thread); rank 1 receives them in another order of tags. Both directions at once for the last ones."""
    boxes = mailbox.open_mailboxes(None, f"test-{ring_bytes}", ring_bytes=ring_bytes, busy_s=busy_s)
    sizes = {0: 7, 1: 300, 2: 1000}
    if rank == 0:
        sent = [boxes.send(torch.full((sizes[i % 3],), float(i)), 1, i % 3) for i in range(40)]
        back = torch.empty(5)
        boxes.recv(back, 1, 9).wait()
        for s in sent:
            s.wait()
        return back.tolist(), [s.done() for s in sent]
    got = {}
    for tag in (2, 0, 1):  # tag 2's messages first: the others are set aside as they come
        for k in range(40 // 3 + (tag < 40 % 3)):
            out = torch.empty(sizes[tag])
            work = boxes.recv(out, 0, tag)
            work.wait()
            got.setdefault(tag, []).append(out[0].item())
            assert torch.equal(out, torch.full_like(out, out[0].item()))
    boxes.send(torch.arange(5.0), 0, 9).wait()
    return got


@pytest.mark.multiprocess
@pytest.mark.parametrize("ring_bytes,busy_s", [(16384, 0.0), (1 << 20, None)])
def test_messages_arrive_unchanged_in_call_order_per_tag(ring_bytes, busy_s):
    # busy_s=0: every wait (the receiver's for a message, the sending thread's for room) sleeps in the kernel at once
    sender, receiver = zf.dist.spawn(_exchange, 2, 2, ring_bytes, busy_s)
    assert sender == ([0.0, 1.0, 2.0, 3.0, 4.0], [True] * 40)
    assert receiver == {t: [float(i) for i in range(40) if i % 3 == t] for t in (0, 1, 2)}


def _p2p(rank, world):
    mesh = zf.Mesh(pp=2)
    p2p = mesh.p2p
    small, large = torch.full((10,), float(rank)), torch.full((600_000,), float(rank))  # 2.4 MB: through gloo
    into_small, into_large = torch.empty(10), torch.empty(600_000)
    works = [p2p.send(small, 1 - rank, "small", 3), p2p.send(large, 1 - rank, "large", 4),
             p2p.recv(into_small, 1 - rank, "small", 3), p2p.recv(into_large, 1 - rank, "large", 4)]
    for w in works:
        w.wait()
    return into_small[0].item(), into_large[0].item(), p2p._boxes is not None, dict(p2p.bytes)


@pytest.mark.multiprocess
def test_p2p_takes_the_rings_for_small_tensors_and_gloo_for_large():
    for rank, (small, large, boxed, nbytes) in enumerate(zf.dist.spawn(_p2p, 2, 2)):
        assert (small, large, boxed) == (1.0 - rank, 1.0 - rank, True)
        assert nbytes == {"send": 40 + 2_400_000, "recv": 40 + 2_400_000}


def _around(rank, world):
    """Three ranks, every wait asleep in the kernel at once: each sends 30 messages of two tags and sizes to
    the next rank through a small ring while it receives the previous rank's; then rank 0 sends to rank 1
    0.2 s late, while rank 1 sleeps in its receive."""
    boxes = mailbox.open_mailboxes(None, "around", ring_bytes=8192, busy_s=0.0)
    default = mailbox.mailboxes_of(None)  # what P2P gets: rings even where ranks outnumber cores
    assert default is not None and default.busy_s == (0.0 if shm.oversubscribed() else mailbox.BUSY_S)
    to, frm = (rank + 1) % world, (rank - 1) % world
    sent = [boxes.send(torch.full((100 + 400 * (i % 2),), float(100 * rank + i)), to, i % 2) for i in range(30)]
    got = []
    for i in range(30):
        out = torch.empty(100 + 400 * (i % 2))
        boxes.recv(out, frm, i % 2).wait()
        assert torch.equal(out, torch.full_like(out, out[0].item()))
        got.append(out[0].item())
    for s in sent:
        s.wait()
    dist.barrier()
    if rank == 0:
        time.sleep(0.2)
        at = time.monotonic()
        boxes.send(torch.ones(4), 1, 7).wait()
        return got, at
    if rank == 1:
        out, cpu, start = torch.empty(4), time.thread_time(), time.monotonic()
        boxes.recv(out, 0, 7).wait()
        return got, (start, time.monotonic(), time.thread_time() - cpu, out.tolist())
    return got, None


@pytest.mark.multiprocess
def test_three_ranks_asleep_in_the_kernel_pass_messages_in_order_and_a_late_sender_wakes_its_receiver():
    ranks = zf.dist.spawn(_around, 3, 3)
    for rank, (got, _) in enumerate(ranks):
        assert got == [100.0 * ((rank - 1) % 3) + i for i in range(30)]
    sent_at, (start, woke, cpu, out) = ranks[0][1], ranks[1][1]
    assert out == [1.0] * 4
    assert woke - start >= 0.15 and woke - sent_at < 0.15  # it waited for the send, and woke at it (not at 1 s)
    assert cpu < 0.05  # asleep in the kernel, not polling


def _sender_dies(rank, world):
    boxes = mailbox.open_mailboxes(None, "dies", ring_bytes=4096, busy_s=0.0)
    if rank == 0:
        os._exit(3)
    start = time.monotonic()
    try:
        boxes.recv(torch.empty(4), 0, 1).wait()
    except shm.ShmError as e:
        raise AssertionError(f"{e} after {time.monotonic() - start:.1f} s") from None


@pytest.mark.multiprocess
def test_a_receive_from_a_dead_sender_fails_naming_it_within_about_a_second():
    with pytest.raises(RuntimeError, match=r"rank 0 \(pid \d+\) died before it could send") as failed:
        zf.dist.spawn(_sender_dies, 2, 2, timeout_s=60)
    after = float(re.search(r"send after (\d+\.\d) s", str(failed.value)).group(1))
    assert after < 1.6  # asleep in the kernel, it still checks its sender every second
