"""zfunc.dist.mailbox: point-to-point transfers through shared-memory rings, matched per tag in call order."""
import os

import pytest
import torch

import zfunc as zf
from zfunc.dist import mailbox, shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory rings need x86-64 Linux")


def _exchange(rank, world, ring_bytes):
    """Rank 0 sends 40 messages of three tags and sizes (the ring wraps, fills and backs up into the
    thread); rank 1 receives them in another order of tags. Both directions at once for the last ones."""
    boxes = mailbox.open_mailboxes(None, f"test-{ring_bytes}", ring_bytes=ring_bytes)
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
@pytest.mark.parametrize("ring_bytes", [16384, 1 << 20])
def test_messages_arrive_unchanged_in_call_order_per_tag(ring_bytes):
    sender, receiver = zf.dist.spawn(_exchange, 2, 2, ring_bytes)
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
    return into_small[0].item(), into_large[0].item(), (p2p._boxes is not None) != shm.oversubscribed(), \
        dict(p2p.bytes)


@pytest.mark.multiprocess
def test_p2p_takes_the_rings_for_small_tensors_and_gloo_for_large():
    # (on a host with more ranks than cores every transfer stays on gloo)
    for rank, (small, large, boxed, nbytes) in enumerate(zf.dist.spawn(_p2p, 2, 2)):
        assert (small, large, boxed) == (1.0 - rank, 1.0 - rank, True)
        assert nbytes == {"send": 40 + 2_400_000, "recv": 40 + 2_400_000}


def _sender_dies(rank, world):
    boxes = mailbox.open_mailboxes(None, "dies", ring_bytes=4096)
    if rank == 0:
        os._exit(3)
    try:
        boxes.recv(torch.empty(4), 0, 1).wait()
    except shm.ShmError as e:
        raise AssertionError(str(e)) from None


@pytest.mark.multiprocess
def test_a_receive_from_a_dead_sender_fails_naming_it():
    with pytest.raises(RuntimeError, match=r"rank 0 \(pid \d+\) died before it could send"):
        zf.dist.spawn(_sender_dies, 2, 2, timeout_s=60)
