"""zfunc.checkpoint.disk_io: files written and read in parallel aligned blocks hold exactly the bytes given."""
import zlib

import pytest
import torch

from zfunc.checkpoint import disk_io as cio
from zfunc.offloading.swap.file_format import aligned_empty


def _segments(sizes, misalign=0):
    g = torch.Generator().manual_seed(0)
    out = []
    for n in sizes:
        base = torch.randint(0, 256, (n + misalign,), dtype=torch.uint8, generator=g)
        out.append(base[misalign:])  # misalign: a memory address off the 4096 alignment
    return out


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("misalign", [0, 3])
def test_write_file_holds_the_segments_and_returns_their_crc32(tmp_path, monkeypatch, direct, misalign):
    if not direct:
        monkeypatch.setattr(cio, "DIRECT_WRITES", False)
    monkeypatch.setattr(cio, "BLOCK", 64 << 10)  # several blocks per segment, across segment ends
    sizes = [4096 * 40, 0, 13, 4096 * 17 + 5, 100_000, 0]
    segments = _segments(sizes, misalign)
    path = tmp_path / "f"
    crcs = cio.write_file(path, segments)
    data = path.read_bytes()
    assert data == b"".join(bytes(s.numpy()) for s in segments)
    assert crcs == [zlib.crc32(bytes(s.numpy())) for s in segments]


@pytest.mark.parametrize("direct", [True, False])
def test_reader_reads_any_range_and_stops_at_the_end(tmp_path, monkeypatch, direct):
    if not direct:
        monkeypatch.setattr(cio, "_O_DIRECT", 0)
    monkeypatch.setattr(cio, "BLOCK", 64 << 10)
    data = _segments([4096 * 100 + 7])[0]
    path = tmp_path / "f"
    path.write_bytes(bytes(data.numpy()))
    with cio.Reader(path) as reader:
        for offset, n in [(0, data.numel()), (4096, 4096 * 60), (4096 + 5, 4096 * 50 + 3), (17, 9), (4096 * 99, 4103)]:
            out = torch.empty(n, dtype=torch.uint8)
            assert reader.read_into(offset, out) == n
            assert torch.equal(out, data[offset : offset + n]), (offset, n)
        aligned = aligned_empty(4096 * 80)  # O_DIRECT straight into it, then short at the end
        assert reader.read_into(4096 * 30, aligned) == data.numel() - 4096 * 30
        assert torch.equal(aligned[: data.numel() - 4096 * 30], data[4096 * 30 :])


def test_a_pace_keeps_a_thread_busy_its_duty_share_of_the_time_until_hurried():
    import threading
    import time

    pace = cio.Pace(0.5)
    t0 = time.perf_counter()
    pace.block(time.sleep, 0.05)  # busy 0.05 s, then idle as long
    assert time.perf_counter() - t0 >= 0.095
    slow = cio.Pace(0.001)  # 0.02 s busy: ~20 s idle, unless hurried
    done = threading.Event()
    t = threading.Thread(target=lambda: slow.block(time.sleep, 0.02) or done.set())
    t0 = time.perf_counter()
    t.start()
    time.sleep(0.1)
    slow.hurry()
    assert done.wait(5) and time.perf_counter() - t0 < 2
    t1 = time.perf_counter()
    slow.block(time.sleep, 0.02)  # hurried for good
    assert time.perf_counter() - t1 < 1
    t.join()


@pytest.mark.parametrize("duty", [0, -0.5, 1.5])
def test_a_pace_refuses_a_duty_outside_0_1(duty):
    with pytest.raises(ValueError, match=f"duty: expected a fraction in \\(0, 1\\], got {duty!r}"):
        cio.Pace(duty)


def test_a_paced_write_holds_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(cio, "BLOCK", 64 << 10)
    segments = _segments([300 << 10, 5000])
    crcs = cio.write_file(tmp_path / "f", segments, pace=cio.Pace(0.5))
    assert (tmp_path / "f").read_bytes() == b"".join(s.numpy().tobytes() for s in segments)
    assert crcs == [zlib.crc32(s.numpy().tobytes()) for s in segments]
