"""Optimizers as pure ``GradientTransformation(init, update)`` pairs, in the shape of optax.

``init(params) -> state`` and ``update(grads, state, params) -> (updates, new_state)`` are pure: they
never modify their arguments, and ``params + updates`` is the new parameters (``apply_updates``).
``chain`` composes transformations left to right.

A third, optional member, ``apply(grads, state, params) -> (new_params, new_state)``, does the whole
update and is allowed to *consume* its arguments: it may write into their tensors, which is how the
training step avoids holding two copies of the state (JAX's buffer donation). ``adamw``/``adam``
implement it with one fused kernel per (device, dtype) group -- zfunc's CPU-Adam where the state
is contiguous fp32 in CPU RAM, zfunc's CUDA AdamW (``zfunc.ops.gpu``) where it is contiguous fp32 on
a GPU and CuPy is installed (``backend="auto"``: the placement picks), else ``torch._fused_adamw_``
(the kernel behind ``torch.optim.AdamW(fused=True)``); ``lion`` and ``lamb`` have CUDA kernels too --
and every other transformation gets it from ``update`` (see ``apply``). The step only ever calls
``apply`` on state it owns. Likewise ``update_`` (optional) is an ``update`` allowed to write into
the grads it is given; ``chain``'s ``apply`` uses it, so ``clip_by_global_norm`` scales the grads
in place there instead of allocating a second copy of them. Given ``apply(..., grad_scale=)`` (an
unscale: offload hands CPU-Adam autograd's own bf16/fp16 grads), ``chain(clip_by_global_norm(c),
adamw(...))`` does not even do that: the clip's factor joins the kernel's ``grad_scale``
(``GradientTransformation``'s ``grad_factor`` and ``scales_grads`` declarations).

Learning rates are floats or schedules ``count -> float``, where ``count`` is the number of updates
already applied (0 on the first step). Step counts are Python ints in the state. Hyperparameters are
checked when a transformation is built (finite and in range; errors name the argument and value);
a schedule's values are checked when used (finite and >= 0), naming the count.

A grad leaf may be ``None``: the param got no grad (the loss never used it). Every optimizer here
leaves such a param alone, as ``torch.optim`` does for a param whose ``.grad`` is None: no weight
decay, moments and momentum untouched, its update ``None`` (``apply_updates`` keeps the param).
Step counts stay global: ``count`` advances with every update, while torch keeps a step per param
(so Adam's bias correction of a param that gets its first grad late differs from torch's).

The optimizers live in modules of one concept each; every name is importable from here:

    base.py        GradientTransformation, KnownNorm, apply, apply_updates, chain, learning_rate, decay_mask
    norm.py        global_norm, clip_by_global_norm, known_norm, add_with_squares, squares_in_ram
    schedules.py   constant_schedule, linear_schedule, linear_warmup, warmup_cosine
    adam.py        adamw, adam, AdamState
    sgd.py         sgd, lion, TraceState
    lamb.py        lamb (layer-wise trust ratio)
    onebit.py      onebit_adam, zero_one_adam, onebit_lamb (1-bit compressed momentum)
    kernels.py     which fused kernel runs ``apply`` (``backend=``)
"""
from __future__ import annotations

from zfunc.optim.adam import AdamState, adam, adamw
from zfunc.optim.base import (EmptyState, GradientTransformation, KnownNorm, MaskOrFn, PyTree, ScalarOrSchedule,
                              Schedule, apply, apply_updates, chain, decay_mask, learning_rate)
from zfunc.optim.lamb import lamb
from zfunc.optim.onebit import OneBitLambState, ZeroOneAdamState, onebit_adam, onebit_lamb, zero_one_adam
from zfunc.optim.norm import add_with_squares, clip_by_global_norm, global_norm, known_norm, squares_in_ram
from zfunc.optim.schedules import constant_schedule, linear_schedule, linear_warmup, warmup_cosine
from zfunc.optim.sgd import TraceState, lion, sgd

__all__ = ["AdamState", "EmptyState", "GradientTransformation", "KnownNorm", "MaskOrFn", "OneBitLambState", "PyTree",
           "ScalarOrSchedule", "Schedule", "TraceState", "ZeroOneAdamState", "adam", "adamw", "add_with_squares",
           "apply", "apply_updates", "chain", "clip_by_global_norm", "constant_schedule", "decay_mask", "global_norm",
           "known_norm", "lamb", "learning_rate", "linear_schedule", "linear_warmup", "lion", "onebit_adam",
           "onebit_lamb", "sgd", "squares_in_ram", "warmup_cosine", "zero_one_adam"]
