"""store: RAM and swap-file handles, and reads kept ahead of their use within a byte budget."""
import torch

from zfunc.offloading.store import OnDisk, ReadAhead, Store, done
from zfunc.offloading.swap.engine import SwapEngine


def test_read_ahead_follows_the_expected_order_within_its_budget():
    launched = []

    def fetch(i):
        launched.append(i)
        return done(torch.full((1,), float(i)))

    reader = ReadAhead(fetch, nbytes=lambda i: 10, order=[3, 1, 2, 1, 0], budget=20)
    assert reader.get(3).item() == 3  # on schedule: read now, then two more (20 bytes) ahead
    assert launched == [3, 1, 2]
    assert reader.get(1).item() == 1 and launched == [3, 1, 2, 1]
    assert reader.get(7).item() == 7  # unexpected: read on demand, the schedule goes on
    assert reader.get(2).item() == 2 and reader.get(1).item() == 1
    assert reader.seen == [3, 1, 7, 2, 1]  # the next pass's order
    assert launched[:5] == [3, 1, 2, 1, 7]


def test_ram_and_file_handles_round_trip(tmp_path):
    t = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    ram = Store()
    assert ram.put("x", t) is t and ram.fetch(t).result() is t
    writes = []
    with SwapEngine(tmp_path) as engine:
        disk = Store(engine, track=lambda fut, nbytes: writes.append((fut, nbytes)))
        handle = disk.put("x", t.clone())
        assert handle == OnDisk("x", (2, 5), torch.float32) and handle.nbytes == 40 and writes[0][1] == 40
        assert torch.equal(disk.fetch(handle).result(), t)
        same, write = disk.store_back(handle, t * 2)
        write.result()
        assert same == handle and torch.equal(disk.fetch(handle).result(), t * 2)
