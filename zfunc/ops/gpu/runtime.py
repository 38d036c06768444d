"""Launching the kernel programs on torch's tensors: CuPy imported where used, torch's current
stream handed to CuPy, the tensor tables a multi-tensor launch reads, and the sums its blocks leave.

Law: a launch runs on ``torch.cuda.current_stream(device)`` (a CuPy ``ExternalStream`` over it), so
it is ordered with the torch work before and after it exactly as a torch kernel would be, and
nothing here waits for the device: no host sync inside a step. Tables go host -> device by a
non-blocking copy from pinned memory (torch's host allocator keeps the pinned block until the
copy is done); a call's checked tables (its ``Plan``) are cached under a description of its tensors
(address, size, dtype, contiguity), so a step whose tensors stay put checks and uploads nothing
after its first call. Cost per multi-tensor call: one Python pass over the tensors to describe
them, one kernel launch per dtype combination, and one launch to sum the partial sums where asked.

``usable()`` says whether the kernels can be picked at all: CuPy imports (tried once, where a
CUDA tensor first asks), and ``ZFUNC_GPU_KERNELS`` is not ``0`` (``0`` leaves every CUDA update to
torch's kernels).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from zfunc.ops.gpu import program as prog

_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_ALIGN = {"F32": 4 * prog.VEC, "BF16": 2 * prog.VEC, "F16": 2 * prog.VEC}  # bytes a VEC load needs


def dtype_name(dtype: torch.dtype) -> str | None:
    """The kernels' name for ``dtype`` (``F32``/``BF16``/``F16``), None for any other."""
    return _DTYPE_NAMES.get(dtype)


@functools.lru_cache(maxsize=1)
def _importable() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy  # noqa: F401 - a CuPy that cannot load its CUDA libraries is no backend
    except Exception:  # noqa: BLE001
        return False
    return True


def usable() -> bool:
    """Whether the CUDA kernels may be picked: CuPy installed (the ``gpu`` extra) and importable, and
    ``ZFUNC_GPU_KERNELS`` unset or ``1``."""
    flag = os.environ.get("ZFUNC_GPU_KERNELS", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"environment variable ZFUNC_GPU_KERNELS: expected '0' or '1', got {flag!r}")
    return flag == "1" and _importable()


def cupy() -> Any:
    """The ``cupy`` module; ImportError naming the extra where it is not installed."""
    try:
        import cupy as cp
    except ImportError as e:
        raise ImportError("zfunc.ops.gpu needs CuPy: pip install 'zfunc[gpu]' (cupy-cuda13x)") from e
    return cp


@functools.lru_cache(maxsize=None)
def _module(name: str, device_index: int):
    from zfunc.ops.gpu import nvrtc

    cupy()
    from cupy.cuda import Device, function as cuda_function

    program = next(p for p in prog.every() if p.name == name)
    device = Device(device_index)
    code = nvrtc.cubin(program, f"sm_{device.compute_capability}")
    with device:
        module = cuda_function.Module()
        module.load(code)
    return module


@functools.lru_cache(maxsize=None)
def function(name: str, entry: str, device_index: int):
    """The kernel ``entry`` of program ``name``, loaded on device ``device_index`` from the cubin
    ``zfunc.ops.gpu.nvrtc`` compiles for its architecture with the options CI checks (so CuPy's own
    compile options, such as its ``-ftz=true``, never apply); once per process, the cubin kept on
    disk across processes (``nvrtc.cache_dir``)."""
    return _module(name, device_index).get_function(entry)


_streams: dict[tuple[int, int], Any] = {}


def _stream(device: torch.device):
    """CuPy's view of torch's current stream on ``device`` (made once per stream): through the CUDA
    stream protocol where torch's stream speaks it, else CuPy's ``ExternalStream``."""
    current = torch.cuda.current_stream(device)
    key = (device.index, current.cuda_stream)
    s = _streams.get(key)
    if s is None:
        cp = cupy()
        if hasattr(current, "__cuda_stream__") and hasattr(cp.cuda.Stream, "from_external"):
            s = cp.cuda.Stream.from_external(current)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                s = cp.cuda.ExternalStream(current.cuda_stream, device.index)
        _streams[key] = s
    return s


def launch(name: str, entry: str, device: torch.device, grid: int, block: int, args: tuple) -> None:
    """Launch ``entry`` of program ``name`` on ``device`` over ``grid`` blocks of ``block``
    threads, on torch's current stream. ``args`` are numpy scalars (``ptr``, ``np.float32``, ...)."""
    if grid <= 0:
        return
    device = _index(device)
    kernel = function(name, entry, device.index)
    with cupy().cuda.Device(device.index), _stream(device):
        kernel((grid,), (block,), args)


def _index(device: torch.device) -> torch.device:
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def cuda_device(t: torch.Tensor, name: str) -> torch.device:
    """``t``'s device, which must be a GPU (ValueError naming ``name`` otherwise)."""
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    return t.device


def keep_for_stream(t: torch.Tensor, device: torch.device) -> None:
    """Keep ``t`` (a cached table, maybe made on another stream) alive for the work now queued on
    the current stream."""
    if device.type == "cuda":
        t.record_stream(torch.cuda.current_stream(device))


def ptr(t: torch.Tensor | None) -> np.uint64:
    """``t``'s device address as a kernel argument (0 for None)."""
    return np.uint64(0 if t is None else t.data_ptr())


def aligned(t: torch.Tensor | None) -> bool:
    """Whether ``t`` (None: no buffer) may be read and written ``VEC`` elements at a time."""
    return t is None or t.data_ptr() % _ALIGN[dtype_name(t.dtype)] == 0


# ---- launch plans: the device tables of a call's tensors, validated once and cached ----
class Plan(NamedTuple):
    """A validated multi-tensor call: per group ``(key, device table, blocks, rows)``, and the
    blocks of all groups (the partial sums' slots)."""

    device: torch.device
    launches: tuple
    blocks: int


_PLANS: OrderedDict[tuple, Plan] = OrderedDict()  # by describe(): what checking the tensors depends on
_PLANS_KEPT = 32
_SEEN: dict[tuple, tuple[Plan, tuple, list]] = {}  # by the tensors' ids: (plan, their addresses, weakrefs)
_ADDRESS = torch.Tensor.data_ptr


def describe(*lists: list) -> tuple:
    """What checking these tensor lists depends on: per tensor its address, size, dtype and
    contiguity (None for no tensor). Addresses are unique across devices (CUDA's unified
    addressing), so two calls with equal descriptions pass or fail the same checks. Cost: about
    0.25 us a tensor on the host (4 calls into torch), paid only when ``planned`` meets tensors
    it has not seen."""
    return tuple(tuple(None if t is None else (t.data_ptr(), t.numel(), t.dtype, t.is_contiguous()) for t in ts)
                 for ts in lists)


def planned(kind: tuple, lists: tuple, build: Callable[[], dict[Any, list[tuple]]], device: torch.device,
            fit: bool = False) -> Plan:
    """The launch plan of a multi-tensor call of ``kind`` (the kernel's name and whatever else picks
    its rows) over tensor ``lists``: ``build()`` checks the tensors and returns, per launch key, rows
    ``(addr0, ..., addr4, n, flags)``, turned into device tables (``fit``: each group's chunk is
    ``fitted_chunk``'s for its sizes, for kernels whose blocks are independent; else ``CHUNK``).

    Cached twice. The same tensor objects again (their ids, held by weak references: a plan is
    forgotten when any of its tensors dies, so a live id names the same object) at the same
    addresses reuse the plan after one address read per tensor (~0.06 us each): a training step
    whose state stays put checks and uploads nothing after its first call. Other tensors with an
    equal ``describe`` (sizes, dtypes, addresses) reuse the checked tables. An in-place change of a
    tensor's metadata that keeps its address (``resize_`` to fewer elements, ``as_strided_``) keeps
    the plan: its rows still lie inside the tensor's storage."""
    flat = [t for ts in lists for t in ts]
    ids = (kind, *map(id, flat))
    live = [t for t in flat if t is not None]
    seen = _SEEN.get(ids)
    if seen is not None and seen[1] == tuple(map(_ADDRESS, live)):
        return seen[0]
    key = (kind, describe(*lists))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(build, device, fit)
        if len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    _remember(ids, plan, live)
    return plan


def _plan(build: Callable[[], dict[Any, list[tuple]]], device: torch.device, fit: bool) -> Plan:
    device = _index(device)
    launches = []
    for group, rows in build().items():
        chunk = fitted_chunk([row[5] for row in rows], device) if fit else prog.CHUNK
        tab, blocks, n_rows = _table(rows, device, chunk)
        if blocks:
            launches.append((group, tab, blocks, n_rows))
    return Plan(device, tuple(launches), sum(launch[2] for launch in launches))


def _remember(ids: tuple, plan: Plan, tensors: list[torch.Tensor]) -> None:
    """Keep ``plan`` under ``ids`` while every one of ``tensors`` lives (at most ``_PLANS_KEPT``)."""
    def forget(_ref, ids=ids):
        _SEEN.pop(ids, None)

    _SEEN.pop(ids, None)
    _SEEN[ids] = (plan, tuple(map(_ADDRESS, tensors)), [weakref.ref(t, forget) for t in tensors])
    if len(_SEEN) > _PLANS_KEPT:
        _SEEN.pop(next(iter(_SEEN)))


def forget_plans() -> None:
    """Drop every cached plan (a forced chunk changed, or a test wants fresh tables)."""
    _PLANS.clear()
    _SEEN.clear()


CHUNK_ENV = "ZFUNC_GPU_CHUNK"
_SMS: dict[int, int] = {}


def fitted_chunk(sizes: list[int], device: torch.device) -> int:
    """Elements per block for a launch over tensors of ``sizes``: the largest of ``CHUNK``,
    ``CHUNK / 2``, ``CHUNK / 4`` that still gives at least 32 blocks per multiprocessor (four waves
    of 8 resident blocks), else ``CHUNK / 4``. A launch of one wave and a bit (10M params at
    ``CHUNK``: 1221 blocks on an H100's 132 SMs) leaves most of the chip idle in its last wave;
    finer chunks spread that tail. ``ZFUNC_GPU_CHUNK`` (a multiple of ``THREADS * VEC``) overrides."""
    forced = os.environ.get(CHUNK_ENV)
    if forced:
        step = prog.THREADS * prog.VEC
        if not (forced.isdigit() and int(forced) % step == 0 and step <= int(forced) <= 2**20):
            raise ValueError(f"{CHUNK_ENV}={forced!r}: expected a multiple of {step} between {step} and {2**20}")
        return int(forced)
    index = device.index if device.type == "cuda" else -1
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(device).multi_processor_count if index >= 0 else 1
    want = 32 * _SMS[index]
    for chunk in (prog.CHUNK, prog.CHUNK // 2):
        if sum(-(-n // chunk) for n in sizes) >= want:
            return chunk
    return prog.CHUNK // 4


def _table(rows: list[tuple], device: torch.device, chunk: int = prog.CHUNK) -> tuple[torch.Tensor, int, int]:
    """``(device table, chunks, rows)`` for ``rows`` (rows of no element dropped): rows of ``ROW``
    int64 (the last word: ``chunk``, elements per block), then the chunk starts; chunks is the
    launch's grid. Uploaded by a non-blocking copy from pinned memory."""
    rows = [row for row in rows if row[5] > 0]  # an empty tensor owns no chunk
    host = np.zeros(len(rows) * prog.ROW + len(rows) + 1, dtype=np.int64)
    body = host[: len(rows) * prog.ROW].reshape(len(rows), prog.ROW)
    for r, row in enumerate(rows):
        body[r, : len(row)] = row
    body[:, prog.ROW - 1] = chunk
    np.cumsum(-(-body[:, 5] // chunk), out=host[len(rows) * prog.ROW + 1:])
    staged = torch.from_numpy(host)
    if device.type == "cuda":
        staged = staged.pin_memory()
    return staged.to(device, non_blocking=True), int(host[-1]), len(rows)


class Partials:
    """A buffer of per-block fp64 partial sums shared by several launches (each takes ``take(n)``
    slots), summed at the end by one block in a fixed order (``sum``, ``norm_and_finite``)."""

    def __init__(self, blocks: int, device: torch.device):
        self.device = _index(device)
        self.buf = torch.empty(max(blocks, 1), dtype=torch.float64, device=self.device)
        self.used = 0
        self.program = "norm"  # any program holds zf_reduce_partials

    def take(self, n: int) -> np.uint64:
        at = self.buf.data_ptr() + 8 * self.used
        self.used += n
        return np.uint64(at)

    def _reduce(self, sum_out, norm_out, finite_out) -> None:
        if self.used == 0:
            self.buf[:1].zero_()
        launch(self.program, prog.REDUCE, self.device, 1, prog.REDUCE_THREADS,
               (ptr(self.buf), np.int64(max(self.used, 1)), ptr(sum_out), ptr(norm_out), ptr(finite_out)))

    def sum(self) -> torch.Tensor:
        """The sum of every slot taken, a 0-d fp64 tensor on the device (not read back)."""
        out = torch.empty((), dtype=torch.float64, device=self.device)
        self._reduce(out, None, None)
        return out

    def norm_and_finite(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sqrt(sum), isfinite(sum))``: a 0-d fp32 and a 0-d bool tensor on the device."""
        norm = torch.empty((), dtype=torch.float32, device=self.device)
        finite = torch.empty((), dtype=torch.bool, device=self.device)
        self._reduce(None, norm, finite)
        return norm, finite


def run(name: str, entries: dict, plan: Plan, args: tuple, sums: bool = False) -> Partials | None:
    """One launch per group of ``plan``: ``entries[key]`` of program ``name`` with arguments
    ``(table, n_rows, partials) + args``. ``sums``: each block leaves a partial sum, all groups' in
    one ``Partials`` (returned), else none (a null address)."""
    partials = Partials(plan.blocks, plan.device) if sums else None
    for key, tab, blocks, n_rows in plan.launches:
        keep_for_stream(tab, plan.device)
        at = partials.take(blocks) if partials is not None else np.uint64(0)
        launch(name, entries[key], plan.device, blocks, prog.THREADS, (ptr(tab), np.int32(n_rows), at) + args)
    return partials


def check(name: str, i: int | None, t: torch.Tensor, dtypes: tuple, device: torch.device,
          numel: int | None = None) -> None:
    """ValueError naming ``name[i]`` unless ``t`` is a contiguous tensor of one of ``dtypes`` on
    ``device`` (of ``numel`` elements where given)."""
    if (t.dtype in dtypes and t.device == device and t.is_contiguous()
            and (numel is None or t.numel() == numel)):
        return
    what = name if i is None else f"{name}[{i}]"
    size = "" if numel is None else f" of {numel} elements"
    raise ValueError(f"{what}: expected a contiguous {'/'.join(str(d) for d in dtypes)} tensor{size} on {device}, "
                     f"got {t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (non-contiguous)'}")


def check_scale(scale_tensor: torch.Tensor | None, device: torch.device) -> None:
    """``scale_tensor`` (None allowed): one fp32 element on ``device``."""
    if scale_tensor is not None:
        check("scale_tensor", None, scale_tensor, (torch.float32,), device, 1)
