"""swap: read gives back exactly the last completed write; faults give clear errors, never torn data."""
import errno
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zfunc.offloading.swap import engine as swap
from zfunc.offloading.swap.directory import LOCK_FILE, check_path, rank_dir
from zfunc.offloading.swap.file_format import (SwapChecksumError, SwapError, SwapInUseError, SwapMismatchError,
                                               SwapPathError, aligned_empty, aligned_like, crc32_combine, disk_bytes,
                                               file_nbytes)
from zfunc.offloading.swap.engine import SwapEngine

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
SIZES = [1, 4097, (3 << 20) + 3]  # elements: one, just over a page, a few MB in several blocks


@pytest.fixture
def engine(tmp_path):
    with SwapEngine(tmp_path / "swap", block_bytes=1 << 20) as e:
        yield e


def sample(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-(1 << 40), 1 << 40, (n,), generator=g, dtype=dtype)


def unaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of t whose data does not start on a 4096 boundary."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = base[1:] if base[1:].data_ptr() % 4096 else base[:-1]
    assert out.data_ptr() % 4096
    return out.copy_(t.reshape(-1)).view(t.shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))


# ----------------------------------------------------------------------------- the law


def test_aligned_buffers():
    for n in (0, 1, 4096, 4097, 10 << 20):
        buf = aligned_empty(n)
        assert buf.dtype == torch.uint8 and buf.data_ptr() % 4096 == 0 and buf.numel() == -(-n // 4096) * 4096
    like = aligned_like(torch.zeros(3, 5, dtype=torch.bfloat16))
    assert like.shape == (3, 5) and like.dtype == torch.bfloat16 and like.data_ptr() % 4096 == 0
    with pytest.raises(ValueError, match="nbytes"):
        aligned_empty(-1)


def test_crc32_combine_matches_zlib():
    rng = random.Random(0)
    data = rng.randbytes(1 << 16)
    for _ in range(20):
        cut = rng.randrange(len(data) + 1)
        a, b = data[:cut], data[cut:]
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_roundtrip(engine, dtype, n):
    t = sample(n, dtype).reshape(1, n) if n > 1 else sample(1, dtype).reshape(())
    for src, out in [(aligned_like(t).copy_(t), torch.empty_like(t)), (unaligned(t), aligned_like(t)),
                     (unaligned(t), unaligned(torch.zeros_like(t)))]:
        header = engine.write("group/0", src).result(timeout=30)
        got = engine.read("group/0", out).result(timeout=30)
        assert same_bytes(out, t) and got == header
        assert header.crc32 == zlib.crc32(t.reshape(-1).view(torch.uint8).numpy())
        assert header.dtype == dtype and header.shape == tuple(t.shape)
    assert engine.bytes_written == engine.bytes_read == 3 * t.numel() * t.element_size()


def test_file_layout(engine):
    t = sample(1000, torch.float32)
    engine.write("w", t).result()
    raw = engine.file("w").read_bytes()
    assert len(raw) == file_nbytes(4000) == 8192
    assert raw[4096:8096] == t.numpy().tobytes() and raw[8096:] == bytes(96)


def test_empty_tensor_and_versions(engine):
    e = torch.empty(0, 3)
    assert engine.write("e", e).result().version == 1
    assert engine.read("e", torch.empty(0, 3)).result().nbytes == 0
    assert engine.write("e", e).result().version == 2


def test_many_concurrent_ops_take_effect_in_issue_order(engine):
    tensors = {f"t{i}": sample(1000 + 37 * i, torch.float32, seed=i) for i in range(24)}
    writes = [engine.write(k, v) for k, v in tensors.items()]
    outs = {k: torch.empty_like(v) for k, v in tensors.items()}
    reads = [engine.read(k, outs[k]) for k in tensors]  # issued before the writes finish
    for f in writes + reads:
        f.result(timeout=30)
    assert all(same_bytes(outs[k], tensors[k]) for k in tensors)
    # rewrites of one name: the last issued wins, reads see the writes issued before them
    versions = [torch.full((5000,), float(v)) for v in range(6)]
    outs = [torch.empty(5000) for _ in versions]
    reads = [(engine.write("x", v), engine.read("x", o))[1] for v, o in zip(versions, outs, strict=True)]
    for r in reads:
        r.result(timeout=30)
    assert all(torch.equal(o, v) for o, v in zip(outs, versions, strict=True))
    assert engine.read("x", outs[0]).result().version == 6


def test_remove_and_close(tmp_path):
    e = SwapEngine(tmp_path)
    e.write("a", torch.ones(10))
    assert e.remove("a") and not e.remove("a")
    with pytest.raises(SwapError, match="no swap file for 'a'"):
        e.read("a", torch.empty(10)).result(timeout=10)
    pending = e.write("b", torch.ones(1 << 20))
    e.close()
    assert pending.done() and e.file("b").exists()
    with pytest.raises(SwapError, match="closed"):
        e.write("c", torch.ones(1))
    e.close()


def test_spare_is_overwritten_in_place_and_never_aliases_the_live_file(engine, monkeypatch):
    ino = []
    for v in range(4):
        engine.write("r", torch.full((300_000,), float(v))).result()
        ino.append(engine.file("r").stat().st_ino)
    spare = engine.path / ".r.swap.spare"
    assert ino[2] == ino[0] and ino[3] == ino[1] and spare.stat().st_ino == ino[2]  # two files, recycled
    # a crash between link and rename can leave the spare naming the live file: never write into it
    spare.unlink()
    os.link(engine.file("r"), spare)
    real = swap._pwrite_all

    def dies_midway(fd, data, pos):
        if pos > 600_000:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, data, pos)

    monkeypatch.setattr(swap, "_pwrite_all", dies_midway)
    with pytest.raises(SwapError, match="previous version is unchanged"):
        engine.write("r", torch.full((300_000,), 9.0)).result(timeout=10)
    monkeypatch.undo()
    out = torch.empty(300_000)
    assert engine.read("r", out).result(timeout=10).version == 4 and bool((out == 3).all())
    with SwapEngine(engine.path / "fresh", spare=False) as fresh:  # its own directory: one engine per directory
        fresh.write("s", out).result()
        fresh.write("s", out).result()
    assert not (fresh.path / ".s.swap.spare").exists()
    assert engine.remove("r") and not spare.exists()


# ----------------------------------------------------------------------------- bad input


def test_mismatched_out_names_file_and_both_layouts(engine):
    engine.write("m", torch.zeros(4, 8)).result()
    with pytest.raises(SwapMismatchError) as info:
        engine.read("m", torch.zeros(8, 4)).result(timeout=10)
    assert str(engine.file("m")) in str(info.value) and "[4, 8]" in str(info.value) and "[8, 4]" in str(info.value)
    with pytest.raises(SwapMismatchError, match="torch.float32.*torch.bfloat16"):
        engine.read("m", torch.zeros(4, 8, dtype=torch.bfloat16)).result(timeout=10)
    assert isinstance(info.value, ValueError)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="block_bytes"):
        SwapEngine(tmp_path, block_bytes=1000)
    with pytest.raises(ValueError, match="fsync"):
        SwapEngine(tmp_path, fsync="sometimes")
    with pytest.raises(ValueError, match="threads"):
        SwapEngine(tmp_path, threads=0)
    with SwapEngine(tmp_path) as e:
        with pytest.raises(ValueError, match="tensor: expected a contiguous CPU tensor"):
            e.write("t", torch.zeros(4, 4).t())
        with pytest.raises(TypeError, match="out: expected a torch.Tensor"):
            e.read("t", [1, 2])
        with pytest.raises(ValueError, match="name"):
            e.write("", torch.zeros(1))


def test_unwritable_path_is_caught_before_training(tmp_path):
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises(SwapPathError, match=f"path: swap directory {regular}/swap cannot be created"):
        SwapEngine(regular / "swap")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.geteuid() != 0:
            with pytest.raises(SwapPathError, match=f"{locked}"):
                check_path(locked)
        else:  # root ignores the mode bits: a directory where nothing can be created stands in for it
            assert check_path(locked) == locked
            with pytest.raises(SwapPathError, match="/proc/self/zfunc-swap"):
                check_path("/proc/self/zfunc-swap")
    finally:
        locked.chmod(0o700)


def test_not_enough_space(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(SwapPathError, match=f"{tmp_path} has .* GiB free, needs"):
        SwapEngine(tmp_path, need_bytes=free + (1 << 40))
    check_path(tmp_path, need_bytes=1 << 20)


def test_a_full_disk_at_start_is_named_and_leaves_no_probe_file(tmp_path, monkeypatch):
    def full(path, data):  # as a full disk does it: the file is created, its bytes do not fit
        open(path, "wb").close()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(SwapPathError, match=f"path: swap directory {tmp_path} is full: [0-9]+ bytes free") as info:
        SwapEngine(tmp_path)
    assert info.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


def test_disk_full_during_write_keeps_previous_version(engine, monkeypatch):
    engine.write("s", torch.ones(1 << 20)).result()
    real = swap._pwrite_all

    def full(fd, data, pos):
        if pos > 1 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, pos)

    monkeypatch.setattr(swap, "_pwrite_all", full)
    need = file_nbytes(4 << 20)
    message = (f"{engine.file('s')}: writing 's' failed, its previous version is unchanged: swap directory "
               f"{engine.path} is full: [0-9]+ bytes free, needs {need} bytes .*No space left")
    with pytest.raises(SwapPathError, match=message) as failed:
        engine.write("s", torch.zeros(1 << 20)).result(timeout=10)
    assert failed.value.errno == errno.ENOSPC and isinstance(failed.value.__cause__, OSError)
    monkeypatch.undo()
    out = torch.empty(1 << 20)
    assert engine.read("s", out).result(timeout=10).version == 1 and bool((out == 1).all())
    assert not list(engine.path.glob(".*.tmp"))
    spare = engine.path / ".s.swap.spare"  # the failed write's blocks, kept for the next one
    assert spare.stat().st_blocks * 512 >= need and spare.stat().st_ino != engine.file("s").stat().st_ino


def test_a_write_failing_for_other_causes_names_the_file_and_keeps_its_errno(engine, monkeypatch):
    engine.write("e", torch.ones(1 << 20)).result()
    calls = [0]

    def broken(fd, buffers, pos, *flags):  # every write moves nothing: a loop on it would spin forever
        calls[0] += 1
        if calls[0] > 100:
            raise OSError(errno.EIO, "Input/output error")
        return 0

    monkeypatch.setattr(os, "pwritev", broken)
    with pytest.raises(SwapError, match=f"{engine.file('e')}: writing 'e' failed, its previous version is "
                                        "unchanged .*short write: 0 of [0-9]+ bytes") as failed:
        engine.write("e", torch.zeros(1 << 20)).result(timeout=10)
    assert failed.value.errno == errno.EIO and not isinstance(failed.value, SwapPathError)
    assert calls[0] <= 4  # a block each
    monkeypatch.setattr(os, "pwritev", lambda *a: (_ for _ in ()).throw(OSError(errno.EDQUOT, "Disk quota exceeded")))
    with pytest.raises(SwapPathError, match=f"swap directory {engine.path} is over its disk quota") as failed:
        engine.write("e", torch.zeros(1 << 20)).result(timeout=10)
    assert failed.value.errno == errno.EDQUOT
    monkeypatch.undo()
    out = torch.empty(1 << 20)
    assert engine.read("e", out).result(timeout=10).version == 1 and bool((out == 1).all())
    assert not list(engine.path.glob(".*.tmp"))


def test_restore_goes_back_to_the_version_before_the_last_write(engine, monkeypatch):
    def version(name):
        out = torch.empty(1000)
        engine.read(name, out).result(timeout=10)
        return int(out[0])

    for v in (1, 2, 3):
        engine.write("a", torch.full((1000,), float(v)))
    assert engine.restore("a").result(timeout=10) and version("a") == 2  # the last write undone
    assert not engine.restore("a").result(timeout=10) and version("a") == 2  # one step back only
    spare = engine.path / ".a.swap.spare"  # the undone version's blocks: the next write's target
    assert spare.stat().st_ino != engine.file("a").stat().st_ino and spare.stat().st_blocks > 0
    assert engine.write("a", torch.full((1000,), 4.0)).result(timeout=10).version == 3 and version("a") == 4
    monkeypatch.setattr(os, "pwritev", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(SwapError):
        engine.write("a", torch.full((1000,), 5.0)).result(timeout=10)
    monkeypatch.undo()
    assert engine.restore("a").result(timeout=10) and version("a") == 4  # a failed write: nothing to undo
    assert not engine.restore("never").result(timeout=10)
    with SwapEngine(engine.path / "no-spares", spare=False) as plain:
        plain.write("b", torch.ones(3))
        plain.write("b", torch.zeros(3))
        assert not plain.restore("b").result(timeout=10)  # the previous version is gone


def test_reserve_allocates_the_next_writes_room_or_says_how_much_is_missing(tmp_path, monkeypatch):
    with SwapEngine(tmp_path, block_bytes=1 << 20) as e:
        e.write("a", torch.ones(100_000))
        e.write("b", torch.ones(10))
        e.reserve({"a": 400_000, "b": 40})
        for name, n in (("a", 400_000), ("b", 40)):
            spare = tmp_path / f".{name}.swap.spare"
            assert spare.stat().st_blocks * 512 >= file_nbytes(n) and spare.stat().st_ino != e.file(name).stat().st_ino
        spare = tmp_path / ".a.swap.spare"
        spare.unlink()
        os.link(e.file("a"), spare)  # a crash between link and rename: the spare is the live file
        real = os.statvfs
        monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((*real(p)[:3], 0, 1, *real(p)[5:])))
        short = (f"path: swap directory {tmp_path} has [0-9]+ bytes free, needs "
                 "[0-9]+ more: the room of the next write of 1 swap file \\(a\\.swap\\)")
        with pytest.raises(SwapPathError, match=short) as info:
            e.reserve({"a": 400_000, "b": 40})
        assert info.value.errno == errno.ENOSPC and os.path.samefile(spare, e.file("a"))  # nothing allocated
        monkeypatch.undo()
        e.reserve({"a": 400_000, "b": 40})
        assert not os.path.samefile(spare, e.file("a")) and spare.stat().st_blocks * 512 >= file_nbytes(400_000)
        assert e.write("a", torch.full((400_000,), 2.0)).result(timeout=10).version == 2
        out = torch.empty(400_000)
        e.read("a", out).result(timeout=10)
        assert bool((out == 2).all())


def test_a_read_only_engine_creates_writes_and_removes_nothing(tmp_path, monkeypatch):
    with SwapEngine(tmp_path) as holder:
        holder.write("r", torch.arange(5000.0)).result()
        (tmp_path / ".r.swap.999999999.0.tmp").write_bytes(b"a dead writer's")
        before = sorted(p.name for p in tmp_path.iterdir())
        real_open = os.open

        def no_writes(path, flags, *args):
            assert not flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT), f"opened {path} to write"
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", no_writes)
        with SwapEngine(tmp_path, read_only=True) as reader:
            out = torch.empty(5000)
            assert reader.read("r", out).result(timeout=10).version == 1 and torch.equal(out, torch.arange(5000.0))
            for op, call in (("write", lambda: reader.write("r", out)), ("remove", lambda: reader.remove("r")),
                             ("restore", lambda: reader.restore("r")), ("reserve", lambda: reader.reserve({"r": 4}))):
                with pytest.raises(SwapError, match=f"{op} on a read-only swap engine"):
                    call()
        monkeypatch.undo()
        assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises(SwapPathError, match=f"{tmp_path / 'missing'} does not exist"):
        SwapEngine(tmp_path / "missing", read_only=True)


def test_free_space_counts_each_file_in_whole_blocks(tmp_path, monkeypatch):
    block = 1 << 16
    sizes = [1, 5000, 70_000]  # files of 8 KiB, 12 KiB and 76 KiB: 1, 1 and 2 blocks of 64 KiB
    assert [disk_bytes(n, block) for n in sizes] == [block, block, 2 * block]
    assert disk_bytes(5000) == file_nbytes(5000) == 12288
    free = [4]
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free[0], f_frsize=block))
    assert check_path(tmp_path, files=sizes) == tmp_path
    free[0] = 3  # 192 KiB: twice the files' 96 KiB of bytes, one block short
    with pytest.raises(SwapPathError, match=f"{tmp_path} has .* GiB free, needs .*3 files in {block}-byte blocks"):
        check_path(tmp_path, files=sizes)
    with pytest.raises(SwapPathError, match="need_bytes=1 "):
        check_path(tmp_path, need_bytes=1, files=sizes[:1] * 3)
    # the engine makes room for each file's spare too; without spares, for one new version beside
    for spare, blocks in ((True, 8), (False, 6)):
        free[0] = blocks - 1
        with pytest.raises(SwapPathError, match=f"{2 * len(sizes) if spare else len(sizes) + 1} files"):
            SwapEngine(tmp_path, files=sizes, spare=spare)
        free[0] = blocks
        SwapEngine(tmp_path, files=sizes, spare=spare).close()


def test_files_take_no_more_than_disk_bytes_on_this_file_system(tmp_path):
    block = os.statvfs(tmp_path).f_frsize
    sizes = [1, 4097, 100_000]
    with SwapEngine(tmp_path, files=sizes) as e:
        for i, n in enumerate(sizes):
            t = torch.randint(0, 256, (n,), dtype=torch.uint8)
            e.write(f"f{i}", t).result()
            e.write(f"f{i}", t).result()  # a second version: the first is kept as its spare
    used = sum(f.stat().st_blocks * 512 for f in tmp_path.iterdir())
    assert len(list(tmp_path.iterdir())) == 2 * len(sizes)
    assert 2 * sum(sizes) < used <= 2 * sum(disk_bytes(n, block) for n in sizes)


# ----------------------------------------------------------------------------- one engine per directory


def test_rank_dir_gives_each_rank_its_folder():
    assert rank_dir("/scratch/run") == Path("/scratch/run")  # this process is alone
    assert rank_dir("/scratch/run", 0, 1) == Path("/scratch/run")
    assert rank_dir("/scratch/run", 3, 8) == Path("/scratch/run/rank00003")
    with pytest.raises(ValueError, match="rank, world: expected ints with 0 <= rank < world, got rank=2, world=2"):
        rank_dir("/scratch/run", 2, 2)
    with pytest.raises(ValueError, match="pass both or neither"):
        rank_dir("/scratch/run", 1)


def test_a_second_engine_on_a_live_directory_is_refused_until_the_first_closes(tmp_path):
    first = SwapEngine(tmp_path)
    message = f"{re.escape(str(tmp_path))} is in use by another live SwapEngine \\(pid {os.getpid()}, this process\\)"
    with pytest.raises(SwapInUseError, match=message):
        SwapEngine(tmp_path)
    first.write("a", torch.ones(10)).result()
    with SwapEngine(tmp_path, lock=False) as reader:  # a reader beside the holder takes no lock
        out = torch.empty(10)
        assert reader.read("a", out).result().version == 1 and bool((out == 1).all())
    first.close()
    with SwapEngine(tmp_path) as second:  # the directory is free again: a later run resumes in it
        out = torch.empty(10)
        assert second.read("a", out).result().version == 1 and bool((out == 1).all())
    assert not (tmp_path / LOCK_FILE).exists(), "close leaves the directory as it found it"
    dropped = SwapEngine(tmp_path)
    dropped.cycle = dropped  # never closed, and kept alive by a reference cycle until collected
    del dropped
    SwapEngine(tmp_path).close()


HOLDER = textwrap.dedent("""
    import sys
    from zfunc.offloading.swap.engine import SwapEngine
    engine = SwapEngine(sys.argv[1])
    print("held", flush=True)
    if sys.stdin.readline().strip() == "close":
        engine.close()
        print("closed", flush=True)
    sys.stdin.readline()
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize("end", ["close", "kill -9"])
def test_a_directory_held_by_another_process_is_refused_until_it_closes_or_dies(tmp_path, end):
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(SwapInUseError, match=f"{re.escape(str(tmp_path))} is in use .*\\(pid {child.pid}\\)"):
            SwapEngine(tmp_path)
        if end == "close":
            child.stdin.write("close\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "closed"
        else:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
        with SwapEngine(tmp_path) as e:  # the holder is gone: the next run starts in the same directory
            e.write("x", torch.ones(3)).result()
    finally:
        child.kill()
        child.wait(timeout=30)


# ----------------------------------------------------------------------------- corrupt files


@pytest.mark.parametrize("damage", ["truncate_payload", "truncate_header", "flip_payload", "flip_header"])
def test_corrupt_file_raises_checksum_error_naming_it(engine, damage):
    t = sample(300_000, torch.float32)
    engine.write("c", t).result()
    file = engine.file("c")
    size = file.stat().st_size
    if damage.startswith("truncate"):
        os.truncate(file, size - 4096 if damage == "truncate_payload" else 100)
    else:
        with open(file, "r+b") as f:
            f.seek(4096 + 777_777 if damage == "flip_payload" else 40)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(SwapChecksumError, match=str(file)):
        engine.read("c", torch.empty_like(t)).result(timeout=10)
    if damage == "flip_payload":  # the crc is what caught it
        with SwapEngine(engine.path, verify=False, lock=False) as unchecked:  # a reader beside the holder
            unchecked.read("c", torch.empty_like(t)).result(timeout=10)


# ----------------------------------------------------------------------------- O_DIRECT fallback


def test_falls_back_when_o_direct_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(swap.os, "open", refuse_direct)
    t = unaligned(sample(5000, torch.bfloat16))
    with SwapEngine(tmp_path, block_bytes=4096) as e:
        assert e.o_direct is False
        e.write("f", t).result()
        out = torch.empty_like(t)
        e.read("f", out).result()
    assert same_bytes(out, t)
    with SwapEngine(tmp_path, read_only=True) as reader:  # probes nothing: its first read finds out
        out = torch.empty_like(t)
        reader.read("f", out).result()
        assert reader.o_direct is False and same_bytes(out, t)


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_roundtrip_with_and_without_o_direct(tmp_path, where):
    root = Path("/dev/shm") if where == "shm" and Path("/dev/shm").is_dir() else tmp_path
    t = sample(100_003, torch.float16)
    for o_direct in (True, False):
        with SwapEngine(root / f"zfunc-swap-test-{os.getpid()}", o_direct=o_direct, fsync="write") as e:
            assert e.o_direct <= o_direct
            e.write("d", t).result()
            out = torch.empty_like(t)
            e.read("d", out).result()
            e.remove("d")
        assert same_bytes(out, t)
    os.rmdir(root / f"zfunc-swap-test-{os.getpid()}")


# ----------------------------------------------------------------------------- kill -9 mid-write

CHILD = textwrap.dedent("""
    import sys, time, torch
    from zfunc.offloading.swap.engine import SwapEngine
    path, pause = sys.argv[1], sys.argv[2] == "pause"
    engine = SwapEngine(path, threads=2, block_bytes=1 << 20)
    t = torch.empty(2 << 20, dtype=torch.int64)  # 16 MiB
    version, blocks, move = [0], [0], SwapEngine._move

    def pausing(self, *args, **kwargs):  # stalls version 2 after two of its blocks are on disk
        if pause and version[0] == 2:
            blocks[0] += 1
            if blocks[0] == 3:
                print("mid", flush=True)
                time.sleep(600)
        return move(self, *args, **kwargs)

    SwapEngine._move = pausing
    while True:
        version[0] += 1
        t.fill_(version[0])
        engine.write("state", t).result()
        print(version[0], flush=True)
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize("when", ["pause", "random"])
def test_kill_9_during_write_leaves_previous_version(tmp_path, when):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), when], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    try:
        assert child.stdout.readline().strip() == "1"  # the first version is complete
        if when == "pause":
            assert child.stdout.readline().strip() == "mid"
        else:
            time.sleep(random.uniform(0.0, 0.3))
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    if when == "pause":
        assert list(tmp_path.glob(".*.tmp")), "the kill should have left a half-written temporary"
    with SwapEngine(tmp_path) as e:
        assert not list(tmp_path.glob(".*.tmp")), "stale temporaries of dead writers are removed"
        out = torch.empty(2 << 20, dtype=torch.int64)
        header = e.read("state", out).result(timeout=10)
        assert bool((out == header.version).all()), "a torn mix of two versions"
        assert header.version == 1 if when == "pause" else header.version >= 1
        assert e.write("state", out).result(timeout=10).version == header.version + 1


def test_an_in_place_write_overwrites_the_file_itself_keeping_no_spare(tmp_path):
    """``write(in_place=True)`` (held grads' scratch files): the file is rewritten where it is, its inode and
    blocks kept, no spare and no temporary left; reads give the last write; ``restore`` has nothing to go to."""
    from zfunc.offloading.swap.directory import spare_path

    with SwapEngine(tmp_path) as engine:
        a, b = torch.arange(3000, dtype=torch.float32), -torch.arange(3000, dtype=torch.float32)
        engine.write("g0", a, in_place=True).result()
        inode = engine.file("g0").stat().st_ino
        engine.write("g0", b, in_place=True).result()
        out = torch.empty(3000)
        engine.read("g0", out).result()
        assert torch.equal(out, b) and engine.file("g0").stat().st_ino == inode
        assert not spare_path(engine.file("g0")).exists() and not list(tmp_path.glob(".*.tmp"))
        assert engine.restore("g0").result() is False
