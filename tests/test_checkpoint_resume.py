"""checkpoint: what a restarted job pays to load; the template is built without torch's Python meta kernels."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zfunc as zf
from zfunc import checkpoint as ck
from zfunc.checkpoint import landing, read_manifest, restore
from zfunc.ops.cpu import hostmem
from tests.models import Tiny, make, make_offloaded


def _described(state):
    """``state``'s structure, and each leaf: a tensor's shape, dtype and device, or the value."""
    leaves, spec = zf.tree.flatten(state)
    return spec, [(tuple(x.shape), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else x for x in leaves]


OPTIMIZERS = {"adamw": lambda: zf.optim.adamw(1e-3), "sgd": lambda: zf.optim.sgd(0.1, momentum=0.9),
              "lamb": lambda: zf.optim.lamb(1e-3), "zero_one_adam": lambda: zf.optim.zero_one_adam(1e-3)}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_shapes_only_makes_the_template_init_meta_makes(name):
    """Law: under ``shapes_only`` a step's ``init_meta`` has the structure, shapes, dtypes and devices
    it has without it."""
    _, params = zf.functionalize(Tiny())
    step = zf.train_step(lambda p, b: 0, OPTIMIZERS[name]())
    with restore.shapes_only():
        got = step.init_meta(params)
    want = step.init_meta(params)
    assert _described(got) == _described(want)
    with restore.shapes_only():  # what it answers itself: *_like of a meta tensor, as asked
        x = torch.empty(3, 4, device="meta")
        assert torch.zeros_like(x, dtype=torch.float16).dtype == torch.float16
        assert torch.full_like(x, 2.0).shape == (3, 4) and torch.ones_like(x).device.type == "meta"
        assert torch.equal(torch.zeros_like(torch.ones(2)), torch.zeros(2))  # CPU: torch's own


def test_shapes_only_templates_of_an_offloaded_and_a_sharded_step(tmp_path):
    for step, state in (make_offloaded(where="cpu"), make(stage=1, mesh=zf.Mesh(dp=1))):
        ck.save(state, tmp_path / "c")
        template, _, _ = restore.template(read_manifest(tmp_path / "c"), step, None)
        want = step.init_meta(step.initialized_with)
        assert _described(template.params) == _described(want.params)
        assert _described(template.opt_state) == _described(want.opt_state)
        assert template.placement == want.placement


RESTART = textwrap.dedent("""
    import json, sys, torch
    import zfunc as zf
    from zfunc import checkpoint as ck
    from tests.models import Tiny, adamw

    directory, how = sys.argv[1], sys.argv[2]
    apply, params = zf.functionalize(Tiny())
    step = zf.train_step(lambda p, b: 0, adamw())
    before = set(sys.modules)
    if how == "zfunc":
        state = ck.load(directory, step)  # the checkpoint's params say the model
        state = ck.load(directory, step, params=params)
    else:
        state = torch.load(directory + ".pt", weights_only=True)
    print(json.dumps(sorted(set(sys.modules) - before)))
""")


@pytest.mark.multiprocess
def test_a_restarted_job_loads_importing_nothing_torch_load_does_not(tmp_path):
    """In a fresh process that has imported zfunc and built its step, ``zf.checkpoint.load`` imports
    no module that ``torch.load`` of the same tensors does not (torch's symbolic shapes, sympy,
    dynamo: seconds, once per process)."""
    step, state = make()
    ck.save(state, tmp_path / "000001")
    torch.save(zf.tree.tensors((state.params, state.opt_state)), tmp_path / "000001.pt")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    imported = {}
    for how in ("zfunc", "torch"):
        out = subprocess.run([sys.executable, "-c", RESTART, str(tmp_path / "000001"), how], check=True, env=env,
                             timeout=120, capture_output=True, text=True, cwd=root).stdout
        imported[how] = set(json.loads(out.strip().splitlines()[-1]))
    assert not imported["zfunc"] - imported["torch"], sorted(imported["zfunc"] - imported["torch"])
    assert not {m for m in imported["zfunc"] if m.startswith(("sympy", "torch.fx.experimental", "torch._dynamo"))}


@pytest.mark.skipif(not hostmem.huge_pages_available(), reason="no transparent huge pages here")
def test_a_load_reads_into_small_pages_then_advises_them_huge(tmp_path):
    """Law: what ``landing`` gives is ``torch.empty``'s equal; a big tensor is read on 4 KiB pages
    (``nh``) and advised ``MADV_HUGEPAGE`` (``hg``) once read, so khugepaged merges it later."""
    big = hostmem.HUGE_MIN // 4 + 1000
    t = landing.empty([3, big], torch.bfloat16)
    assert (tuple(t.shape), t.dtype, t.is_contiguous(), t.data_ptr() % 4096) == ((3, big), torch.bfloat16, True, 0)
    assert "nh" in hostmem.vm_flags(t.data_ptr()) and "hg" not in hostmem.vm_flags(t.data_ptr())
    t.fill_(2)
    landing.settle(t)
    assert "hg" in hostmem.vm_flags(t.data_ptr()) and bool((t == 2).all())
    small = landing.empty([5], torch.float32)  # torch's, wherever its heap puts it: settle leaves it be
    before = hostmem.vm_flags(small.data_ptr())
    landing.settle(small)
    assert hostmem.vm_flags(small.data_ptr()) == before
    step = zf.train_step(lambda p, x: (p["w"][:3] * x).sum(), zf.optim.adamw(1e-3))
    state = step.init({"w": torch.randn(big)})
    ck.save(state, tmp_path / "c")
    loaded = ck.load(tmp_path / "c", step)
    for got, want in ((loaded.params["w"], state.params["w"]), (loaded.opt_state.mu["w"], state.opt_state.mu["w"])):
        assert torch.equal(got, want) and "hg" in hostmem.vm_flags(got.data_ptr())
