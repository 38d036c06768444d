"""zfunc.ops.gpu's launchers, run on the CPU with the launch itself recorded: every launch names an entry
point its program defines and passes one argument per kernel parameter, of the parameter's size (a
pointer, an int, a 64-bit int or a float: a wrong count or size would misread every argument after it
on a GPU), over a grid that covers the work. What the kernels compute is checked on a GPU only
(``pytest -m gpu``); that they compile, by tests/test_gpu_compile.py."""
import re

import numpy as np
import pytest
import torch

from zfunc.ops.gpu import adam, cast, lamb, lion, norm, onebit, program, quantize, runtime

_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\w+\) )?(\w+)\(([^)]*)\)')
_SCALARS = {"int": np.int32, "zf_i64": np.int64, "float": np.float32}


def _kind(decl: str):
    decl = " ".join(decl.split())
    return np.uint64 if "*" in decl else _SCALARS[decl.rsplit(" ", 1)[0]]


SIGNATURES = {(p.name, m.group(1)): [_kind(d) for d in m.group(2).split(",")]
              for p in program.every() for m in _KERNEL.finditer(p.source)}


@pytest.fixture
def launches(monkeypatch):
    seen = []

    def launch(name, entry, device, grid, block, args):
        want = SIGNATURES.get((name, entry))
        assert want is not None, f"program {name!r} has no entry point {entry!r}"
        assert [type(a) for a in args] == want, (name, entry, [type(a).__name__ for a in args])
        assert grid >= 1 and 1 <= block <= 1024, (name, entry, grid, block)
        seen.append((entry, grid))

    monkeypatch.setattr(runtime, "launch", launch)
    monkeypatch.setattr(runtime, "cuda_device", lambda t, name: t.device)  # CPU tensors stand in
    return seen


def test_every_entry_point_has_a_parsed_signature():
    for p in program.every():
        assert {(p.name, e) for e in p.every_entry} <= set(SIGNATURES), p.name


def test_adam_launches_one_kernel_per_dtype_pair_and_one_to_reduce(launches):
    ps = [torch.randn(n) for n in (5, 9000, 3)]
    gs = [torch.randn(5).bfloat16(), torch.randn(9000), torch.randn(3).bfloat16()]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    outs = [torch.empty(5, dtype=torch.bfloat16), None, torch.empty(3, dtype=torch.bfloat16)]
    adam.adamw_many_(ps, gs, ms, vs, step=1, lr=1e-3, param_outs=outs, grad_sq=True, scale_tensor=torch.ones(1),
                     decay=[True, False, True])
    # a CPU counts as one multiprocessor: so few blocks fit the chunk down to CHUNK / 4 (9000 elements: 5 blocks)
    assert launches == [("adam_BF16_BF16", 2), ("adam_F32_NONE", 5), ("zf_reduce_partials", 1)]


def test_fitted_chunk_keeps_four_waves_and_the_table_carries_it(monkeypatch):
    """The largest of CHUNK, CHUNK/2 that gives 32 blocks per multiprocessor, else CHUNK/4; every table
    row carries its chunk and the starts count blocks of it."""
    monkeypatch.setitem(runtime._SMS, -1, 132)  # an H100's multiprocessors, for the CPU stand-in
    cpu = torch.device("cpu")
    C = program.CHUNK
    assert runtime.fitted_chunk([10**9], cpu) == C
    assert runtime.fitted_chunk([32 * 132 * C // 2], cpu) == C // 2
    assert runtime.fitted_chunk([10**7], cpu) == C // 4  # 1221 blocks of CHUNK: one wave and a bit
    rows = [(1, 2, 3, 4, 0, 5000, 0), (1, 2, 3, 4, 0, 1, 0)]
    tab, blocks, n_rows = runtime._table(rows, cpu, 2048)
    host = tab.numpy()
    assert (n_rows, blocks) == (2, 4)
    assert list(host[program.ROW - 1: 2 * program.ROW: program.ROW]) == [2048, 2048]
    assert list(host[2 * program.ROW:]) == [0, 3, 4]


@pytest.mark.parametrize("value", ["1000", "0", "x", str(2**21)])
def test_a_forced_chunk_is_checked_and_named(monkeypatch, value):
    monkeypatch.setenv(runtime.CHUNK_ENV, value)
    with pytest.raises(ValueError, match=f"ZFUNC_GPU_CHUNK={value!r}.*multiple of 1024"):
        runtime.fitted_chunk([10], torch.device("cpu"))
    monkeypatch.setenv(runtime.CHUNK_ENV, "4096")
    assert runtime.fitted_chunk([10], torch.device("cpu")) == 4096


def test_lion_lamb_norm_and_cast_launches(launches):
    ps = [torch.randn(n) for n in (7, 20000)]
    gs = [torch.randn(7).half(), torch.randn(20000)]
    lion.lion_many_(ps, gs, [torch.zeros_like(p) for p in ps], lr=1e-3, param_outs=[None, torch.empty(20000).half()])
    lamb.lamb_many_(ps, gs, [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps], step=3, lr=1e-3)
    norm.norm_and_finite(gs, scale=0.5)
    cast.cast_many_(ps, [torch.empty(7).bfloat16(), torch.empty(20000).half()], 2.0, squares=True)
    assert [e for e, _ in launches] == [
        "lion_F16_NONE", "lion_F32_F16",
        "lamb_moments_F16", "lamb_ratio", "lamb_update_NONE", "lamb_moments_F32", "lamb_ratio", "lamb_update_NONE",
        "sumsq_F16", "sumsq_F32", "zf_reduce_partials",
        "cast_F32_BF16", "cast_F32_F16", "zf_reduce_partials"]
    assert ("lamb_moments_F32", 3) in launches  # 20000 elements: 3 chunks of 8192


def test_onebit_and_quantizer_launches(launches):
    rows = torch.randn(3, 64)
    onebit.pack_signs(rows)
    onebit.decode(*onebit.scaled_signs(rows)[:2])
    x = torch.randn(2, 4 * quantize.BLOCK)
    for bits in (8, 4):
        quantize.dequantize(*quantize.quantize(x, bits), bits)
    assert [e for e, _ in launches] == ["onebit_pack", "onebit_compress", "onebit_decode", "quantize_int8",
                                        "dequantize_int8", "quantize_int4", "dequantize_int4"]


def test_cpu_tensors_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"params\[0\]: expected a CUDA tensor, got one on cpu"):
        adam.adamw_many_([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"step: expected an int >= 1"):
        adam.adamw_many_([], [], [], [], step=0, lr=1e-3)


def test_a_mismatched_tensor_is_refused_naming_it(launches):
    with pytest.raises(ValueError, match=r"grads\[1\]: expected a contiguous .* tensor of 4 elements"):
        adam.adamw_many_([torch.zeros(2), torch.zeros(4)], [torch.zeros(2), torch.zeros(5)],
                         [torch.zeros(2), torch.zeros(4)], [torch.zeros(2), torch.zeros(4)], step=1, lr=1e-3)
    assert launches == []


def test_a_plan_is_reused_for_the_same_tensors_and_rebuilt_when_one_moves_or_dies(launches, monkeypatch):
    """planned: the same tensor objects at the same addresses reuse their plan without a check; a tensor
    given new storage in place (set_) is checked again; a dead tensor's plans are forgotten."""
    built = []
    real = runtime._plan
    monkeypatch.setattr(runtime, "_plan", lambda *a: built.append(1) or real(*a))
    runtime.forget_plans()
    ps = [torch.randn(n) for n in (5, 9000)]
    gs, ms, vs = ([torch.randn(n) for n in (5, 9000)] for _ in range(3))
    for _ in range(3):
        adam.adamw_many_(ps, gs, ms, vs, step=1, lr=1e-3)
    assert len(built) == 1 and len(runtime._SEEN) == 1
    ms[1].set_(torch.zeros(9000))  # new storage, same object
    adam.adamw_many_(ps, gs, ms, vs, step=1, lr=1e-3)
    assert len(built) == 2
    described = runtime.describe(ps, gs, ms, vs, [None, None])
    del gs[0]
    assert runtime._SEEN == {} and len(runtime._PLANS) == 2 and described  # the checked tables stay
    runtime.forget_plans()
