"""libgomp (OpenMP) teams started from Numba nopython code: ``parallel_range(block, k, args)``.

``block(lo, hi, *rest)`` with ``args = (lo, hi, *rest)`` runs on a team of k threads, [lo, hi)
cut in k chunks of whole 64-byte lines (``ALIGN`` elements of 4 bytes or less), chunk c on thread
c, so it stays in that core's cache from one call to the next. ``block`` must not raise (compile
it with ``error_model="numpy"`` and no bounds checks): a team has no way to report it.

Why not Numba's ``prange``: starting a team with GOMP_parallel (what ``#pragma omp parallel``
compiles to) costs ~1.0 us, against ~1.7 us for prange around the same call (its scheduler and
gufunc wrapper) -- what decides a 100K-param optimizer step (~20 us). libgomp is opened by soname,
which finds the copy torch loaded, so kernels and torch ops share one pool of worker threads (with
two pools, each one's idle workers spin on the cores the other needs, which about doubles a
100K-param AdamW call in ``benchmarks/cpu_adam.py``). Each Python thread that launches gets its own
team, so concurrent calls neither share nor nest. libgomp's entry points reach the JIT as
``zfunc_*`` symbols resolved when code is loaded, cached code included, so no address is compiled
in. ``AVAILABLE`` is False where libgomp cannot be loaded; callers then fall back to prange.
"""
from __future__ import annotations

import ctypes

from llvmlite import binding as llvm, ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["ALIGN", "AVAILABLE", "chunk_length", "parallel_range"]

ALIGN = 64  # chunk length granule, in elements: whole 64-byte lines for fp32 and 16-bit dtypes


@njit(inline="always")
def chunk_length(lo, hi, k):
    """Elements per chunk when [lo, hi) is cut in k: a multiple of ``ALIGN`` (the last is shorter)."""
    return ((hi - lo + k - 1) // k + ALIGN - 1) // ALIGN * ALIGN


def _bind() -> bool:
    """Register libgomp's entry points with the JIT; False if libgomp cannot be loaded."""
    names = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
    try:
        lib = ctypes.CDLL("libgomp.so.1")
        addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names]
    except (OSError, AttributeError):
        return False
    for name, address in zip(names, addresses):
        llvm.add_symbol("zfunc_" + name, address)
    return True


AVAILABLE = _bind()


def _libgomp(module, name: str, ret, *params):
    """libgomp's function ``name``, declared in ``module`` under the symbol ``_bind`` added."""
    return cgutils.get_or_insert_function(module, ir.FunctionType(ret, params), "zfunc_" + name)


def _chunks_of(block):
    """``run(t, n, k, args)``: chunks t, t + n, ... of ``block(*args)``'s range [lo, hi) =
    ``args[:2]`` cut in k, for thread t of a team of n. libgomp may give fewer threads than asked
    (OMP_THREAD_LIMIT, nesting); then a thread takes several chunks, so the result never depends
    on the team's size."""
    def run(t, n, k, args):
        lo, hi = args[0], args[1]
        per = chunk_length(lo, hi, k)
        for c in range(t, k, n):
            a = min(lo + c * per, hi)
            block(a, min(a + per, hi), *args[2:])
    return run


@intrinsic
def parallel_range(typingctx, block, k, args):
    """``block(*args)``, ``args = (lo, hi, *rest)``, in k chunks on a libgomp team of k threads."""
    run, run_sig = _chunks_of(block.dispatcher), types.void(types.int32, types.int32, k, args)
    data_type = types.Tuple((k, args))

    def codegen(context, builder, sig, llargs):
        mod, voidp, i32 = builder.module, ir.IntType(8).as_pointer(), ir.IntType(32)
        data_ll = context.get_value_type(data_type)
        # void team(void *data): what each thread of the team runs, data pointing at (k, args).
        team_type = ir.FunctionType(ir.VoidType(), [voidp])
        team = ir.Function(mod, team_type, mod.get_unique_name("team"))
        team.linkage = "internal"
        tb = ir.IRBuilder(team.append_basic_block())
        data = tb.load(tb.bitcast(team.args[0], data_ll.as_pointer()))
        t, n = (tb.call(_libgomp(mod, f, i32), []) for f in ("omp_get_thread_num",
                                                              "omp_get_num_threads"))
        run_args = [t, n, tb.extract_value(data, 0), tb.extract_value(data, 1)]
        cres = context.compile_subroutine(tb, run, run_sig)
        # block cannot raise (error_model="numpy", no bounds checks): no status to propagate.
        context.call_internal_no_propagate(tb, cres.fndesc, run_sig, run_args)
        tb.ret_void()
        # (k, args) lives in this frame: GOMP_parallel returns only when the whole team is done.
        slot = cgutils.alloca_once(builder, data_ll)
        builder.store(context.make_tuple(builder, data_type, llargs[1:]), slot)
        gomp = _libgomp(mod, "GOMP_parallel", ir.VoidType(), team.type, voidp, i32, i32)
        threads = context.cast(builder, llargs[1], k, types.uint32)
        builder.call(gomp, [team, builder.bitcast(slot, voidp), threads, i32(0)])
        return context.get_dummy_value()
    return types.none(block, k, args), codegen
