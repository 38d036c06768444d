"""zf.tree: optree helpers in zfunc's namespace and flat dtype-grouped buffers."""
import pytest
import torch

import zfunc as zf
from zfunc.core import tree


def sample():
    return {
        "w": torch.randn(3, 4),
        "b": torch.arange(5, dtype=torch.float16),
        "ids": torch.arange(6).view(2, 3),
        "nested": (torch.randn(2), 7, None),
    }


def test_map_leaves_structure_roundtrip():
    t = sample()
    leaves, spec = tree.flatten(t)
    assert tree.unflatten(spec, leaves)["nested"][1] == 7
    doubled = tree.map(lambda x: x * 2, t)
    assert torch.equal(doubled["w"], t["w"] * 2) and doubled["nested"][1] == 14
    assert tree.structure(t) == spec
    assert len(tree.tensors(t)) == 4


def test_byte_accounting():
    t = sample()
    assert tree.nbytes(t) == 12 * 4 + 5 * 2 + 6 * 8 + 2 * 4
    assert tree.nbytes_by_dtype(t) == {torch.float32: 56, torch.float16: 10, torch.int64: 48}
    assert tree.numel(t) == 12 + 5 + 6 + 2


def test_flatten_to_buffers_groups_by_dtype_and_unflattens_to_views():
    t = sample()
    buffers, layout = tree.flatten_to_buffers(t)
    assert {g[1]: b.numel() for g, b in buffers.items()} == {torch.float32: 14, torch.float16: 5, torch.int64: 6}
    back = tree.unflatten_from_buffers(buffers, layout)
    for a, b in zip(tree.leaves(back), tree.leaves(t)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    # views: writing through the buffer shows in the pytree, no copy was made
    fp32 = buffers[(torch.device("cpu"), torch.float32)]
    fp32.zero_()
    assert back["w"].abs().sum() == 0 and t["w"].abs().sum() > 0
    assert back["nested"][0].data_ptr() == fp32.data_ptr()  # leaf order: dict keys sorted


def test_unflatten_from_buffers_checks_sizes():
    buffers, layout = tree.flatten_to_buffers({"a": torch.ones(4)})
    with pytest.raises(ValueError, match="expected a 1-D buffer of 4 elements"):
        tree.unflatten_from_buffers({g: torch.ones(3) for g in buffers}, layout)


def test_clone_shares_no_storage():
    t = sample()
    c = tree.clone(t)
    c["w"].add_(1)
    assert not torch.equal(c["w"], t["w"])


def test_clone_of_big_cpu_tensors_goes_to_host_memory_equal_and_unshared():
    from zfunc.ops.cpu import hostmem

    big = torch.randn(tree._FRESH_MAP_BYTES // 4 + 3)
    strided = torch.randn(6, 4).t()  # small and strided: torch's clone, strides kept
    c = tree.clone({"big": big, "strided": strided, "n": 3})
    assert torch.equal(c["big"], big) and c["big"].untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    assert c["strided"].stride() == strided.stride() and torch.equal(c["strided"], strided) and c["n"] == 3
    if hostmem.huge_pages_available():  # hostmem maps the tensor's own pages as a region of their own
        with open("/proc/self/maps") as f:
            starts = {int(line.split("-")[0], 16) for line in f}
        assert c["big"].data_ptr() in starts


def test_train_state_is_a_node_in_zfunc_namespace():
    state = zf.TrainState({"w": torch.ones(2)}, (), 3, 0, None)
    assert [x for x in tree.leaves(state) if not isinstance(x, torch.Tensor)] == [3, 0]
    rebuilt = tree.map(lambda x: x, state)
    assert isinstance(rebuilt, zf.TrainState) and rebuilt.step == 3
