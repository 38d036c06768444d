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


def test_a_packed_file_is_read_once_a_pass_and_written_once_all_its_members_are_back(tmp_path):
    tensors = [torch.arange(n, dtype=dtype) for n, dtype in ((3, torch.float32), (5, torch.int64), (2, torch.bfloat16))]
    writes = []
    with SwapEngine(tmp_path) as engine:
        disk = Store(engine, track=lambda fut, nbytes: writes.append((fut, nbytes)))
        handles = disk.pack("grp", [t.clone() for t in tensors])
        assert [h.name for h in handles] == ["grp"] * 3 and len(writes) == 1  # one file, one write
        assert all(h.offset % 64 == 0 and h.members == 3 and h.file_bytes == handles[0].packed for h in handles)
        writes[0][0].result()
        reads = engine.bytes_read
        got = [disk.fetch(h).result() for h in handles]
        assert all(torch.equal(a, b) for a, b in zip(got, tensors))
        assert engine.bytes_read - reads == handles[0].packed  # the pass read the file once
        got[0].mul_(2)  # updated in the read buffer, as the optimizer's kernel does
        assert disk.store_back(handles[0], got[0]) == (handles[0], None)  # not written: members remain
        assert disk.store_back(handles[1], got[1] + 1)[1] is None  # a new tensor is copied into the buffer
        _, write = disk.store_back(handles[2], got[2])
        write.result()  # the last member back: the file is written whole
        again = [Store(engine).fetch(h).result() for h in handles]
        assert torch.equal(again[0], tensors[0] * 2) and torch.equal(again[1], tensors[1] + 1)
        assert torch.equal(again[2], tensors[2])
        fresh = Store(engine)  # a pass that updates one member only: flush writes the rest as read
        one = fresh.fetch(handles[1]).result()
        fresh.store_back(handles[1], one * 0)
        [(name, _, write)] = fresh.flush()
        write.result()
        after = [Store(engine).fetch(h).result() for h in handles]
        assert name == "grp" and torch.equal(after[1], tensors[1] * 0) and torch.equal(after[0], tensors[0] * 2)
        lone = disk.pack("one", [tensors[0].clone()])  # a lone tensor: a file of its own, as put
        assert lone == [OnDisk("one", (3,), torch.float32)]


def test_big_buffers_round_trip_on_mappings_of_their_own(tmp_path):
    # from hostmem.HUGE_MIN bytes a pass's buffers are mappings of their own (unmapped when freed,
    # not kept by the heap), still 4096-aligned for O_DIRECT
    from zfunc.ops.cpu import hostmem

    big = [torch.randn(hostmem.HUGE_MIN // 8 + 7), torch.randn(hostmem.HUGE_MIN // 8 + 3)]  # > HUGE_MIN packed
    with SwapEngine(tmp_path) as engine:
        disk = Store(engine, track=lambda fut, nbytes: fut.result())
        handles = disk.pack("big", [t.clone() for t in big])
        got = [disk.fetch(h).result() for h in handles]
        assert got[0].data_ptr() % 4096 == 0 and all(torch.equal(a, b) for a, b in zip(got, big))
        for h, t in zip(handles, got):
            _, write = disk.store_back(h, t * 3)
        write.result()
        lone = disk.put("lone", big[0].clone())
        assert torch.equal(Store(engine).fetch(lone).result(), big[0])
        assert all(torch.equal(a, b * 3) for a, b in zip([Store(engine).fetch(h).result() for h in handles], big))
