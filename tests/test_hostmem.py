"""hostmem: CPU tensors on transparent huge pages, equal to torch's in everything but the pages."""
import gc
import mmap
import os
import subprocess
import sys

import pytest
import torch

import zfunc as zf
from tests.recipe_runs import checkout_pythonpath
from zfunc.core import env
from zfunc.ops.cpu import hostmem

BIG = hostmem.HUGE_MIN // 4 + 1000  # fp32 elements: past the threshold, not a multiple of a page


def _vma_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``, with its "range"."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = lo <= address < hi
                fields["range"] = (lo, hi)
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields if inside else {}


needs_thp = pytest.mark.skipif(not hostmem.huge_pages_available(), reason="no transparent huge pages here")


@pytest.mark.parametrize("shape, dtype", [((BIG,), torch.float32), ((3, BIG), torch.bfloat16), ((5,), torch.float32),
                                          ((0,), torch.float16), (7, torch.int64)])
def test_empty_is_a_contiguous_writable_cpu_tensor(shape, dtype):
    t = hostmem.empty(shape, dtype)
    want = (shape,) if isinstance(shape, int) else shape
    assert (tuple(t.shape), t.dtype, t.device.type, t.is_contiguous()) == (want, dtype, "cpu", True)
    t.fill_(3)
    assert bool((t == 3).all())


@needs_thp
def test_big_tensors_are_advised_for_huge_pages_at_spread_offsets():
    ts = [hostmem.empty(BIG) for _ in range(8)]
    for t in ts:
        assert t.data_ptr() % mmap.PAGESIZE == 0
        vma = _vma_of(t.data_ptr())
        assert "hg" in vma["VmFlags"].split()  # MADV_HUGEPAGE: the kernel may use 2 MiB pages
        # exactly the tensor's pages are advised: no huge page is faulted in beyond its ends
        assert vma["range"] == (t.data_ptr(), t.data_ptr() + -(-t.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    # not all at one offset within their huge pages, where a kernel's streams would collide
    assert len({t.data_ptr() % hostmem.HUGE for t in ts}) > 4
    small = hostmem.empty(100)  # torch.empty's own (not a view into a mapping of hostmem's)
    assert small.untyped_storage().nbytes() == small.nbytes


@needs_thp
def test_the_mapping_is_released_with_its_last_tensor():
    t = hostmem.empty(BIG)
    address = t.data_ptr()
    view = t[10:20]
    del t
    gc.collect()
    assert "hg" in _vma_of(address).get("VmFlags", "")  # the view keeps it
    del view
    gc.collect()
    assert "hg" not in _vma_of(address).get("VmFlags", "")  # unmapped (or the address reused unadvised)


@needs_thp
def test_transient_puts_what_glibc_would_map_afresh_on_huge_pages(monkeypatch):
    n = hostmem._MMAP_MIN // 4  # fp32 elements: the first size glibc maps rather than reuses
    big, small = hostmem.transient(n, torch.float32, "cpu"), hostmem.transient(n - 1, torch.float32, "cpu")
    assert (big.shape, big.dtype, small.shape) == ((n,), torch.float32, (n - 1,))
    assert "hg" in _vma_of(big.data_ptr())["VmFlags"].split()
    assert small.untyped_storage().nbytes() == small.nbytes  # torch.empty's own below it: the heap's
    monkeypatch.setattr(hostmem, "HEAP_REUSE", "all")  # the heap serves every size: torch's own then
    same = hostmem.transient(n, torch.float32, "cpu")
    assert same.untyped_storage().nbytes() == same.nbytes
    assert hostmem.transient(n, torch.float32, "meta").device.type == "meta"


def test_zeros_like_and_copy_to_equal_torch():
    x = torch.randn(BIG)
    z = hostmem.zeros_like(x)
    assert z.shape == x.shape and z.dtype == x.dtype and not z.any()
    c = hostmem.copy_to(x.view(2, -1)[:, :5].t(), "cpu", torch.bfloat16)  # strided, cast
    assert c.is_contiguous() and torch.equal(c, x.view(2, -1)[:, :5].t().to(torch.bfloat16))
    assert c.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    strided = torch.randn(4, 6).t()  # not contiguous: torch's zeros_like keeps its strides
    assert hostmem.zeros_like(strided).stride() == torch.zeros_like(strided).stride()


def test_cpu_optimizer_state_and_masters_live_in_host_memory():
    params = {"w": torch.randn(BIG), "b": torch.randn(3)}
    step = zf.train_step(lambda p, x: (p["w"][:3] * x).sum() + p["b"].sum(), zf.optim.adamw(1e-3))
    state = step.init(params)
    held = [state.params["w"], state.opt_state.mu["w"], state.opt_state.nu["w"]]
    for t in held:
        assert not hostmem.huge_pages_available() or "hg" in _vma_of(t.data_ptr())["VmFlags"].split()
    new, _ = step(state, torch.ones(3))  # donated: updated in place, so the pages stay
    assert [new.params["w"].data_ptr(), new.opt_state.mu["w"].data_ptr(), new.opt_state.nu["w"].data_ptr()] == \
        [t.data_ptr() for t in held]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="shape"):
        hostmem.empty((-1, 2))
    with pytest.raises(TypeError, match="dtype"):
        hostmem.empty(4, "float32")
    for fn in (hostmem.zeros_like, lambda t: hostmem.copy_to(t, "cpu")):
        with pytest.raises(TypeError, match="t: expected a torch.Tensor, got list"):
            fn([1.0, 2.0])


@needs_thp
def test_a_loaded_checkpoint_lands_in_host_memory(tmp_path):
    params = {"w": torch.randn(BIG)}
    step = zf.train_step(lambda p, x: (p["w"][:3] * x).sum(), zf.optim.adamw(1e-3))
    zf.checkpoint.save(step.init(params), tmp_path / "ckpt")
    loaded = zf.checkpoint.load(tmp_path / "ckpt", step)
    for t in (loaded.params["w"], loaded.opt_state.mu["w"]):
        assert "hg" in _vma_of(t.data_ptr())["VmFlags"].split()


def _faults_of(fn) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not hostmem.reuse_freed_memory(), reason="not glibc, or ZFUNC_HEAP_REUSE=off")
def test_reuse_freed_memory_keeps_a_step_s_freed_tensors_for_the_next():
    # 8 tensors of 4 MiB (2048 pages each) touched, freed, then allocated and touched again: glibc's
    # default would give them back (unmapped, or trimmed off the top of the heap) and fault all
    # 8192 pages in again; kept, the second round reuses them.
    def round_():
        ts = [torch.ones(1 << 20) for _ in range(8)]
        del ts
    for _ in range(3):  # the heap settles (small blocks carved from the freed ones at first)
        round_()
    assert _faults_of(round_) < 1000
    assert hostmem.reuse_freed_memory() is True  # once per process: the answer is cached


def test_a_cpu_step_applies_reuse_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(hostmem, "reuse_freed_memory", lambda: calls.append(1))
    zf.train_step(lambda p, b: (p["w"] * b).sum(), zf.optim.sgd(0.1)).init({"w": torch.ones(3)})
    assert calls == [1]


def test_zfunc_heap_reuse_refuses_an_unknown_mode(monkeypatch):
    monkeypatch.setenv("ZFUNC_HEAP_REUSE", "most")
    with pytest.raises(ValueError, match=r"ZFUNC_HEAP_REUSE: expected one of \('small', 'all', 'off'\), got 'most'"):
        env.choice("ZFUNC_HEAP_REUSE", "small", hostmem._MODES)


def _in_fresh_python(code: str, **environ: str) -> str:
    """What ``code`` prints in a fresh interpreter (this checkout's zfunc first on its path)."""
    env_ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | environ
    env_["PYTHONPATH"] = checkout_pythonpath()
    done = subprocess.run([sys.executable, "-c", code], env=env_, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


_ON = "from zfunc.ops.cpu import hostmem; print(hostmem.torch_on_huge_pages())"


@needs_thp
@pytest.mark.multiprocess
def test_torch_on_huge_pages_says_whether_torch_s_own_switch_took_effect():
    assert _in_fresh_python(f"import zfunc; {_ON}") == "False"  # zfunc leaves torch's pages alone
    assert _in_fresh_python(f"import zfunc; {_ON}", THP_MEM_ALLOC_ENABLE="1") == "True"


def test_vm_flags_reads_the_flags_of_the_mapping_that_holds_an_address():
    t = hostmem.empty(BIG)
    assert ("hg" in hostmem.vm_flags(t.data_ptr())) == hostmem.huge_pages_available()
    assert "rd" in hostmem.vm_flags(t.data_ptr())
    assert hostmem.vm_flags(0) == []  # no mapping holds it
    for bad in (-1, 1.5, "0x10"):
        with pytest.raises(ValueError, match="address: expected a non-negative int"):
            hostmem.vm_flags(bad)
