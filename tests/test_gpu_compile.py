"""zfunc.ops.gpu's kernels compile with NVRTC alone (no GPU, no CUDA driver) to sm_90 cubins, every entry
point the dispatcher can pick among them. Not marked gpu: CI runs it (the ``test`` extra installs
cupy-cuda13x and nvidia-cuda-nvrtc). Compiled is not run: ``pytest -m gpu`` on a GPU checks the results."""
import pytest
import torch

pytest.importorskip("cupy_backends", reason="needs cupy (the test extra)")
# The NVRTC binding's first import runs `ldconfig -p` (cuda-pathfinder looks up libdl): a process.
pytestmark = pytest.mark.multiprocess

from zfunc.ops.gpu import adam, cast, lamb, lion, norm, nvrtc, program, runtime  # noqa: E402


@pytest.fixture(scope="module")
def compiled():
    return {c.name: c for c in nvrtc.compile_all("sm_90")}


def test_every_program_compiles_to_an_sm90_cubin_holding_every_entry_point(compiled):
    assert [p.name for p in program.every()] == list(compiled)
    for p in program.every():
        c = compiled[p.name]
        assert c.cubin[:4] == b"\x7fELF", p.name
        assert [e for e in p.every_entry if not c.has_entry(e)] == [], p.name


def test_every_instantiation_the_launchers_can_pick_is_an_entry_point():
    grads = {runtime.dtype_name(d) for d in (torch.float32, torch.bfloat16, torch.float16)}
    outs = {"NONE"} | {runtime.dtype_name(d) for d in (torch.bfloat16, torch.float16)}
    families = {adam: adam.ENTRIES, lion: lion.ENTRIES}
    for module, entries in families.items():
        assert set(entries) == {(g, o) for g in grads for o in outs}
        assert set(entries.values()) <= set(module.PROGRAM.entries)
    assert set(norm.ENTRIES) == grads and set(norm.ENTRIES.values()) <= set(norm.PROGRAM.entries)
    assert set(cast.ENTRIES) == {(s, d) for s in grads for d in grads}
    assert set(cast.ENTRIES.values()) <= set(cast.PROGRAM.entries)
    assert set(lamb.MOMENTS) == grads and set(lamb.UPDATES) == outs
    assert {*lamb.MOMENTS.values(), *lamb.UPDATES.values(), lamb.RATIO} <= set(lamb.PROGRAM.entries)


def test_no_kernel_spills_registers_to_local_memory(compiled):
    for p in program.every():
        report = compiled[p.name].resources()
        for entry in p.every_entry:
            r = report.get(entry)
            assert r is not None and r.get("registers", 0) > 0, (p.name, entry, compiled[p.name].log[-500:])
            assert r.get("spill_stores", 0) == r.get("spill_loads", 0) == 0, (p.name, entry, r)


def test_the_runtime_loads_cubins_compiled_once_and_kept_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("ZFUNC_KERNEL_CACHE", str(tmp_path))
    first = nvrtc.cubin(norm.PROGRAM, "sm_90")
    assert first == nvrtc.compile_program(norm.PROGRAM, "sm_90", report=False).cubin  # the options CI compiles with
    [kept] = tmp_path.iterdir()
    assert kept.name.startswith("norm-sm_90-") and kept.read_bytes() == first
    monkeypatch.setattr(nvrtc, "compile_program", None)  # a second process reads it: no compile
    assert nvrtc.cubin(norm.PROGRAM, "sm_90") == first
