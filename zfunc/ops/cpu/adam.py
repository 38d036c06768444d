"""CPU optimizer kernels (AdamW/Adam, Lion, SGD) in Numba: one memory pass per step.

An optimizer step on CPU is memory-bound (AdamW moves 28 bytes/param; the arithmetic is free), so
these kernels win by moving fewer bytes than a chain of torch ops: one pass reads the gradient in
its training dtype (fp32, bf16 or fp16), unscales it, updates param and state, and writes the
low-precision param copy for the next forward.

Law: ``adamw_`` performs ``torch.optim.AdamW``/``Adam`` (foreach=False)'s fp32 ops in the same
order, with the same fused multiply-adds (torch's lerp/addcmul/add(alpha=) compile to fma) and
scalars rounded from float64 as torch rounds them, except that it multiplies by 1/sqrt(1-beta2^t)
where torch divides; m and v come out bit-equal, p within an ulp per step (torch's MKL sqrt is
not correctly rounded either): 200 steps agree to rtol = atol = 1e-6. ``sgd_`` likewise follows
``torch.optim.SGD``; ``lion_`` is Chen et al. 2023 ("Symbolic Discovery of Optimization
Algorithms", Alg. 2). ``param_out`` is bit-equal to ``param.to(bfloat16 | float16)``.
Cost: bytes/param = 8 per fp32 buffer updated (param and state) + 4 or 2 (grad) + 0 or 2 (out):
AdamW fp32 28, AdamW bf16 grad + bf16 out 28; no temporaries. Calls of ``_STREAM_MIN`` elements
or more write param_out with non-temporal stores, so that it costs no read either (``zfunc.ops.cpu.sweep``).

Tensors are 1-D contiguous CPU buffers (an offload engine's flat per-group buffers) that must not
overlap one another (unchecked); ``start`` and ``end`` restrict the update to ``[start, end)`` so
a caller can stream chunks. Large calls run on ``get_num_threads()`` threads, a libgomp team the
kernel starts itself (Numba's prange where libgomp cannot be loaded); the GIL is released.
Fixed cost per call: ~2.8 us on one thread (64 elements; the Python checks are ~1.5 of it, the
call into the compiled kernel ~0.3); a threaded call adds ~1.0 us to start its team.
"""
from __future__ import annotations

import os

import numba
import numpy as np
import torch

from zfunc.ops.cpu import gomp
from zfunc.ops.cpu.blocks import (_adamw_block, _adamw_table, _adamw_team, _lion_block, _lion_team, _sgd_block,
                                  _sgd_team)
from zfunc.ops.cpu.checks import _FLOAT32, _GRAD, _OUT, _UNIT, _check_range, _check_step, _leaf_ok, _reject
from zfunc.ops.cpu.intrinsics import _F64
from zfunc.ops.cpu.sweep import _STREAM_MIN

__all__ = ["adamw_", "adamw_many_", "get_num_threads", "lion_", "set_num_threads", "sgd_"]

# Below this many elements one thread is as fast as two: a team launch costs ~1 us, about the time
# of 8-16K elements of AdamW, Lion or SGD on one thread.
_PARALLEL_MIN = 1 << 14
_num_threads: int | None = None
_POOL_SIZE = numba.config.NUMBA_NUM_THREADS  # fixed once Numba starts (1 after a fork, below)


def set_num_threads(n: int | None) -> None:
    """Fix the kernels' thread count to ``n``; ``None`` (default) follows torch.get_num_threads()."""
    global _num_threads
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"set_num_threads: expected a positive int or None, got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    """Threads the next large kernel call will use (capped by Numba's pool size; 1 in a child
    made by ``os.fork``)."""
    return min(_num_threads or torch.get_num_threads(), _POOL_SIZE)


def _one_thread_after_fork() -> None:
    # A forked child has none of its parent's OpenMP worker threads, and a team started there
    # waits for them forever (torch's own parallel ops hang likewise; Numba's prange aborts).
    global _POOL_SIZE
    _POOL_SIZE = 1


os.register_at_fork(after_in_child=_one_thread_after_fork)


# ---- Python side: checks run on every call (~1.5 us, ~2.4 at 100K params where the kernel has
# just evicted the tensors' metadata from cache; the whole call takes ~20 us there), so the
# passing path is one chain of attribute reads and the error path finds and names the culprit ----
def _prepare(fn: str, names: tuple, param, grad, m, v, param_out, start, end):
    """Check every buffer (m, v: fp32 state called ``names`` in errors, or None where the kernel
    has fewer); return (threads, start, end, addresses of param, grad, m, v and param_out (0 for
    None), grad tag, param_out tag)."""
    # stride() == (1,) is 1-D and contiguous in one read; a 1-D tensor of <= 1 element may be
    # contiguous with another stride, so it takes the slow path, which lets it through. Each
    # buffer's reads are written out: a loop or a helper call costs ~0.04 us more per buffer.
    try:
        n = param.numel()
        g_tag = _GRAD.get(grad.dtype)
        out_tag = None if param_out is None else _OUT.get(param_out.dtype)
        ok = (param.dtype is _FLOAT32 and param.is_cpu and param.stride() == _UNIT
              and g_tag is not None and grad.is_cpu and grad.stride() == _UNIT and grad.numel() == n
              and (m is None or m.dtype is _FLOAT32 and m.is_cpu and m.stride() == _UNIT
                   and m.numel() == n)
              and (v is None or v.dtype is _FLOAT32 and v.is_cpu and v.stride() == _UNIT
                   and v.numel() == n)
              and (param_out is None or out_tag is not None and param_out.is_cpu
                   and param_out.stride() == _UNIT and param_out.numel() == n))
    except AttributeError:  # not a tensor
        ok = False
    if not ok:
        n = param.numel() if isinstance(param, torch.Tensor) else -1
        _reject(param, "param", (_FLOAT32,), n, fn)
        _reject(grad, "grad", _GRAD, n, fn)
        for name, t in zip(names, (m, v)):
            if t is not None:
                _reject(t, name, (_FLOAT32,), n, fn)
        if param_out is not None:
            _reject(param_out, "param_out", _OUT, n, fn)
        g_tag = _GRAD[grad.dtype]
        out_tag = None if param_out is None else _OUT[param_out.dtype]
    if end is None:
        end = n
    if type(start) is not int or type(end) is not int or not 0 <= start <= end <= n:
        start, end = _check_range(fn, start, end, n)
    k = 1
    if end - start >= _PARALLEL_MIN:  # get_num_threads(), inlined: the call costs ~0.1 us
        k = min(_num_threads or torch.get_num_threads(), _POOL_SIZE)
    return (k, start, end, param.data_ptr(), grad.data_ptr(), 0 if m is None else m.data_ptr(),
            0 if v is None else v.data_ptr(), 0 if param_out is None else param_out.data_ptr(),
            g_tag, out_tag)


_entry_points: dict = {}  # (kernel, grad tag type, param_out tag type) -> compiled entry point


def _run(block, threaded, k: int, args: tuple, g_tag, out_tag, sq_tag=None) -> None:
    """``block(*args)`` if k == 1, else ``threaded(k, args)``.

    Numba's dispatcher types every argument on every call (~0.5 us for the ~18 here); once the
    overload is compiled, its entry point is called directly, which only unboxes them. The tags
    are the only arguments whose types vary (the rest are always ints, floats, bools and tuples
    of them), so the kernel and their types pick the entry point."""
    kernel, args = (block, args) if k == 1 else (threaded, (k, args))
    key = (kernel, type(g_tag), type(out_tag), type(sq_tag))
    entry = _entry_points.get(key)
    if entry is not None:
        entry(*args)
        return
    kernel(*args)
    overload = kernel.overloads.get(tuple(map(numba.typeof, args)))
    if overload is not None:
        _entry_points[key] = overload.entry_point


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
           exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
           beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
           decoupled: bool = True, grad_scale: float = 1.0,
           param_out: torch.Tensor | None = None, start: int = 0, end: int | None = None,
           grad_sq: bool = False) -> float | None:
    """One AdamW (``decoupled=True``) or Adam-with-L2 (``decoupled=False``) step, in place.

    param, exp_avg, exp_avg_sq: fp32 [n]; grad: fp32/bf16/fp16 [n]; param_out: bf16/fp16 [n] or
    None. ``step`` counts from 1. With g = grad * grad_scale, on elements [start, end) only:
        p *= 1 - lr*wd (decoupled)  |  g += wd*p (L2);   m = lerp(m, g, 1 - beta1)
        v = beta2*v + (1 - beta2)*g*g;   p -= lr/(1 - beta1^step) * m / (sqrt(v / (1 - beta2^step)) + eps)
        param_out = p.to(param_out.dtype)
    ``grad_sq``: return the sum of the squares of g (grad * grad_scale, in fp64) over the
    elements updated, read in the same pass (``global_norm``'s square, without a second read of
    the grads); else None.
    """
    k, lo, hi, p, g, m, v, out, g_tag, out_tag = _prepare(
        "adamw_", ("exp_avg", "exp_avg_sq"), param, grad, exp_avg, exp_avg_sq, param_out, start,
        end)
    if type(step) is not int or step < 1:
        step = _check_step(step)
    # Scalars in float64 exactly as torch.optim computes them (the kernel rounds them to fp32);
    # float() first, because an int or numpy scalar would make Numba compile another signature.
    lr, beta1, beta2, wd = float(lr), float(beta1), float(beta2), float(weight_decay)
    decay, l2 = (1.0 - lr * wd, 0.0) if decoupled else (1.0, wd)
    sq, sq_at, sq_tag, per = _squares(grad_sq, k, lo, hi)
    args = (lo, hi, p, g, m, v, out, g_tag, out_tag, hi - lo >= _STREAM_MIN, sq_at, sq_tag, lo, per,
            float(grad_scale), decay, l2, 1.0 - beta1, beta2, 1.0 - beta2, (1.0 - beta2 ** step) ** 0.5, float(eps),
            -(lr / (1.0 - beta1 ** step)))
    _run(_adamw_block, _adamw_team, k, args, g_tag, out_tag, sq_tag)
    return None if sq is None else float(sq.sum())


def _slots(wanted: bool, rows: int) -> tuple:
    """``_squares``' answer for a table: a float64 slot per row."""
    slots = np.zeros(rows, dtype=np.float64) if wanted else None
    return slots, 0 if slots is None else slots.ctypes.data, _F64 if wanted else None, 1


def _squares(wanted: bool, k: int, lo: int, hi: int) -> tuple:
    """``(slots, address, tag, per)`` for a call over [lo, hi) on k threads: a float64 slot per
    chunk (``gomp.chunk_length``) when the sum of squares is ``wanted``, else nothing to write."""
    per = max(((hi - lo + k - 1) // k + gomp.ALIGN - 1) // gomp.ALIGN * gomp.ALIGN if k > 1 else hi - lo, 1)
    if not wanted:
        return None, 0, None, per
    slots = np.zeros(k, dtype=np.float64)
    return slots, slots.ctypes.data, _F64, per


def _adamw_scalars(step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale) -> tuple:
    """``(scale, decay, l2, 1-beta1, beta2, 1-beta2, sqrt(1-beta2^step), eps, -lr/(1-beta1^step))``
    in float64, exactly as torch.optim computes them (the kernel rounds them to fp32); float()
    first, because an int or numpy scalar would make Numba compile another signature."""
    if type(step) is not int or step < 1:
        step = _check_step(step)
    lr, beta1, beta2, wd = float(lr), float(beta1), float(beta2), float(weight_decay)
    decay, l2 = (1.0 - lr * wd, 0.0) if decoupled else (1.0, wd)
    return (float(grad_scale), decay, l2, 1.0 - beta1, beta2, 1.0 - beta2, (1.0 - beta2 ** step) ** 0.5, float(eps),
            -(lr / (1.0 - beta1 ** step)))


def adamw_many_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float = 0.9,
                beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, decoupled: bool = True,
                grad_scale: float = 1.0, param_outs: list[torch.Tensor | None] | None = None,
                grad_sq: bool = False) -> float | None:
    """``adamw_`` on every leaf of the lists, with the same hyperparameters: the multi-tensor form.

    Leaves may have any shape (each is updated as its flat elements) but must be contiguous CPU
    tensors, each ``grads[i]``/``exp_avgs[i]``/``param_outs[i]`` the size of ``params[i]``
    (dtypes as in ``adamw_``; ``param_outs[i]`` None: no copy). Same results, bit for bit, as
    ``adamw_`` leaf by leaf. Cost: leaves of ``_PARALLEL_MIN`` elements or more run one threaded
    call each; all smaller ones run in one call on the calling thread, over a table of their
    addresses, so a model's many biases and norms cost ~0.1 us each instead of ~3 us.
    ``grad_sq``: return the sum of squares of all the grads read (times ``grad_scale``, fp64,
    summed leaf by leaf in list order for the big leaves, then the small ones), else None.
    """
    outs = [None] * len(params) if param_outs is None else param_outs
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(outs):
        raise ValueError(f"adamw_many_: expected lists of one length, got params {len(params)}, grads {len(grads)}, "
                         f"exp_avgs {len(exp_avgs)}, exp_avg_sqs {len(exp_avg_sqs)}, param_outs {len(outs)}")
    consts = _adamw_scalars(step, lr, beta1, beta2, eps, weight_decay, decoupled, grad_scale)
    small: dict[tuple, list] = {}  # (grad tag type, out tag type) -> rows of small leaves
    total = 0.0
    for p, g, m, v, o in zip(params, grads, exp_avgs, exp_avg_sqs, outs):
        n = p.numel()
        g_tag, out_tag = _GRAD.get(g.dtype), None if o is None else _OUT.get(o.dtype)
        # ``_leaf_ok`` of each buffer, written out: four calls cost more than the rest of a leaf's checks
        if not (p.dtype is _FLOAT32 and p.is_cpu and p.is_contiguous()
                and g_tag is not None and g.is_cpu and g.is_contiguous() and g.numel() == n
                and m.dtype is _FLOAT32 and m.is_cpu and m.is_contiguous() and m.numel() == n
                and v.dtype is _FLOAT32 and v.is_cpu and v.is_contiguous() and v.numel() == n
                and (o is None or out_tag is not None and _leaf_ok(o, n, _OUT))):
            flat = [None if t is None else t.reshape(-1) if t.is_contiguous() else t for t in (p, g, m, v, o)]
            _prepare("adamw_many_", ("exp_avg", "exp_avg_sq"), *flat, 0, None)  # raises, naming the culprit
        if n >= _PARALLEL_MIN:
            k = min(_num_threads or torch.get_num_threads(), _POOL_SIZE)
            sq, sq_at, sq_tag, per = _squares(grad_sq, k, 0, n) if grad_sq or k > 1 else (None, 0, None, n)
            args = (0, n, p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if o is None else o.data_ptr(),
                    g_tag, out_tag, n >= _STREAM_MIN, sq_at, sq_tag, 0, per) + consts
            _run(_adamw_block, _adamw_team, k, args, g_tag, out_tag, sq_tag)
            if grad_sq:
                total += float(sq.sum())
        elif n:
            small.setdefault((type(g_tag), type(out_tag)), [g_tag, out_tag]).append(
                (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if o is None else o.data_ptr(), n))
    for g_tag, out_tag, *rows in small.values():
        sq, sq_at, sq_tag, _ = _squares(grad_sq, 1, 0, 0) if len(rows) == 1 else _slots(grad_sq, len(rows))
        if len(rows) == 1:  # one leaf: no table to build (~1 us)
            p, g, m, v, o, n = rows[0]
            args = (0, n, p, g, m, v, o, g_tag, out_tag, False, sq_at, sq_tag, 0, max(n, 1)) + consts
            _run(_adamw_block, None, 1, args, g_tag, out_tag, sq_tag)
        else:
            args = (np.array(rows, dtype=np.int64), g_tag, out_tag, sq_at, sq_tag) + consts
            _run(_adamw_table, None, 1, args, g_tag, out_tag, sq_tag)
        if grad_sq:
            total += float(sq.sum())
    return total if grad_sq else None


def lion_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float,
          beta1: float = 0.9, beta2: float = 0.99, weight_decay: float = 0.0,
          grad_scale: float = 1.0, param_out: torch.Tensor | None = None, start: int = 0,
          end: int | None = None) -> None:
    """One Lion step, in place.

    param, exp_avg: fp32 [n]; grad: fp32/bf16/fp16 [n]; param_out: bf16/fp16 [n] or None.
    With g = grad * grad_scale, on elements [start, end) only:
        p = p*(1 - lr*wd) - lr*sign(beta1*m + (1 - beta1)*g);   m = beta2*m + (1 - beta2)*g
    """
    k, lo, hi, p, g, m, _, out, g_tag, out_tag = _prepare(
        "lion_", ("exp_avg",), param, grad, exp_avg, None, param_out, start, end)
    lr, beta1, beta2, wd = float(lr), float(beta1), float(beta2), float(weight_decay)
    args = (lo, hi, p, g, m, out, g_tag, out_tag, hi - lo >= _STREAM_MIN, float(grad_scale), 1.0 - lr * wd, -lr,
            beta1, 1.0 - beta1, beta2, 1.0 - beta2)
    _run(_lion_block, _lion_team, k, args, g_tag, out_tag)


def sgd_(param: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor | None, *,
         lr: float, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
         weight_decay: float = 0.0, first_step: bool, grad_scale: float = 1.0,
         param_out: torch.Tensor | None = None, start: int = 0, end: int | None = None) -> None:
    """One SGD step with optional momentum / Nesterov, in place (``torch.optim.SGD`` semantics).

    param, momentum_buf: fp32 [n] (momentum_buf unused, may be None, when momentum == 0);
    grad: fp32/bf16/fp16 [n]; param_out: bf16/fp16 [n] or None. On elements [start, end) only,
    with g = grad * grad_scale + wd*p:
        buf = g if first_step else momentum*buf + (1 - dampening)*g
        p -= lr * (g + momentum*buf if nesterov else buf)          (p -= lr*g when momentum == 0)
    """
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"sgd_: nesterov needs momentum > 0 and dampening == 0, got "
                         f"momentum={momentum!r}, dampening={dampening!r}")
    k, lo, hi, p, g, buf, _, out, g_tag, out_tag = _prepare(
        "sgd_", ("momentum_buf",), param, grad, momentum_buf if momentum != 0 else None, None,
        param_out, start, end)
    buf = buf or p  # never read when momentum == 0, but a valid address all the same
    args = (lo, hi, p, g, buf, out, g_tag, out_tag, hi - lo >= _STREAM_MIN, float(grad_scale), -float(lr),
            float(weight_decay), float(momentum), 1.0 - float(dampening), bool(nesterov),
            bool(first_step))
    _run(_sgd_block, _sgd_team, k, args, g_tag, out_tag)
