"""The training step as a pure function: ``state, metrics = step(state, batch)``.

``train_step(loss_fn, optimizer, precision, accum)`` returns a ``Step``: a callable plus
``init(params, materialize=None) -> TrainState``. One call computes the loss and grads of ``loss_fn(params, batch)``
(in the compute dtype, over ``accum`` microbatches), unscales them, applies the optimizer to the
fp32 master params and returns the new state with its metrics.

Purity without doubling memory (JAX's buffer donation): by default a step *consumes* its input
state -- the optimizer writes into its tensors -- and marks it, so touching it afterwards raises
``ConsumedStateError`` instead of showing changed values. With ``donate=False`` the step works on a
copy and the input state stays intact. ``init`` copies the caller's tensors. The batch is never
written to.

Gradients use ``torch.autograd.grad`` over ``torch.func.functional_call`` with detached leaves
that require grad: it supports saved-tensor hooks and non-reentrant checkpointing, which
``torch.func.grad`` refuses (docs/design.md, section 1), and costs the same as ``loss.backward()``. A param
the loss never uses gets no grad (``None``), and the optimizer leaves it alone, as torch does.

Non-finite steps: when the loss or the grads hold an inf or a nan, the step does not update. It
returns a state with the same params and optimizer state, ``step + 1`` (a skipped step counts, as
in torch's ``GradScaler`` and DeepSpeed, so the next step draws new random numbers), fp16's scale
halved, and ``metrics["skipped"] = True``. The decision comes before any write, so with donation
too the returned state holds the old values. ``max_skips`` such steps in a row are tolerated; the
next one raises ``NonFiniteError`` naming the step and the cause, the state passed in still intact.
Cost: the loss (computed anyway) and the grad norm (computed for the metrics and for clipping)
are checked, one host sync of two scalars per step; no second read of the grads. With
``train_step(grad_norm=False)`` and nothing else needing the norm (no clipping, not fp16), the step
reads the grads only in the optimizer's pass, and only the loss is checked: non-finite grads behind
a finite loss are not caught (they reach the params, as in torch without a ``GradScaler``).
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import optree
import torch

from zfunc import optim
from zfunc.model import functional as module
from zfunc.model.materialize import Materializer, leaf as materialize_leaf
from zfunc.core import precision as mp, tree
from zfunc.ops.cpu import hostmem
from zfunc.core.state import TrainState, require_train_state

PyTree = Any


class NonFiniteError(FloatingPointError):
    """More non-finite steps (loss or grads inf/nan) in a row than ``train_step(max_skips=)``."""


def split_loss(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    """``(loss, aux)`` from what a loss function returned, the loss checked to be a scalar tensor."""
    loss, aux = out if has_aux else (out, None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        got = f"shape {tuple(loss.shape)} {loss.dtype}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn: expected a 0-d floating-point tensor (a scalar loss), got {got}")
    return loss, aux


def _grad_leaves(params: PyTree, loss_fn: Callable, args: tuple, scale: float | None, has_aux: bool):
    """``(loss, aux, grads, treespec)`` of ``loss_fn(params, *args)``; grads a list in leaf order
    (``params``' ``treespec``), ``None`` for a leaf that is not floating or that the loss did not use."""
    leaves, treespec = tree.flatten(params)
    flags = [isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves]
    diff = [x.detach().requires_grad_() if f else x for x, f in zip(leaves, flags)]
    with torch.enable_grad():
        loss, aux = split_loss(loss_fn(tree.unflatten(treespec, diff), *args), has_aux)
        wrt = diff if all(flags) else [x for x, f in zip(diff, flags) if f]
        grads = _grads(loss * scale if scale is not None else loss, wrt)
    if len(grads) != len(diff):
        it = iter(grads)
        grads = [next(it) if f else None for f in flags]
    return loss.detach(), aux, list(grads), treespec


_ENGINE = torch.autograd.Variable._execution_engine


def _grads(loss: torch.Tensor, wrt: list) -> tuple:
    """``torch.autograd.grad(loss, wrt, allow_unused=True)``. In a process without CUDA, whose
    graphs run on the calling thread, on plain tensors: torch's engine called directly, as that
    function ends up calling it, without its argument handling, ``__torch_function__`` dispatch
    and stash of the caller's context for device threads (6 of the 16 us it takes, at 1e3 params,
    of a plain CPU step's ~47)."""
    if (type(loss) is torch.Tensor and loss.grad_fn is not None and not torch.cuda.is_initialized()
            and all(type(x) is torch.Tensor for x in wrt)):
        return _ENGINE.run_backward((loss,), (torch.ones_like(loss),), False, False, tuple(wrt), True, False)
    return torch.autograd.grad(loss, wrt, allow_unused=True)


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


def value_and_grad(fn: Callable[..., Any], has_aux: bool = False) -> Callable[..., Any]:
    """``fn(params, *args) -> loss`` becomes ``(params, *args) -> (loss, grads)``.

    ``loss`` must be a 0-d floating tensor; it comes back detached. ``grads`` has the structure of
    ``params``, a tensor (zeros where unused) for each floating leaf and ``None`` elsewhere. With
    ``has_aux`` ``fn`` returns ``(loss, aux)`` and the result is ``((loss, aux), grads)``. Pure:
    ``params`` are read, never written.
    """

    def wrapped(params: PyTree, *args: Any):
        loss, aux, grads, treespec = _grad_leaves(params, fn, args, None, has_aux)
        leaves = tree.leaves(params)
        grads = [_or_zeros(g, x) if _differentiable(x) else None for g, x in zip(grads, leaves)]
        grads = tree.unflatten(treespec, grads)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def split_batch(batch: PyTree, accum: int) -> list[PyTree]:
    """``batch`` cut into ``accum`` microbatches along each tensor's leading dim (other leaves
    repeated); ``[batch]`` itself when ``accum`` is 1. Views (``chunk``), no copies. Raises
    ``ValueError`` naming ``accum`` and the shape when a tensor's leading dim does not divide."""
    if accum == 1:
        return [batch]
    leaves, treespec = tree.flatten(batch)
    pieces = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 or x.shape[0] % accum:
                raise ValueError(
                    f"batch: accum={accum} splits each tensor's leading dim, got a tensor of shape {tuple(x.shape)}"
                )
            pieces.append(x.chunk(accum))
        else:
            pieces.append([x] * accum)
    return [tree.unflatten(treespec, parts) for parts in zip(*pieces)]


def check_single_device(params: PyTree) -> torch.device:
    """The one device every tensor of ``params`` lies on; ``ValueError`` naming a leaf on each
    device when there are several, or when ``params`` holds no tensor. One walk over the leaves."""
    paths, leaves, _ = optree.tree_flatten_with_path(params, namespace=tree.NAMESPACE)
    devices: dict[torch.device, Any] = {}
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor):
            devices.setdefault(leaf.device, path)
    if not devices:
        raise ValueError("params: expected a pytree with at least one tensor, got none")
    if len(devices) > 1:
        where = ", ".join(f"{'/'.join(map(str, p))} on {d}" for d, p in devices.items())
        raise ValueError(f"params: expected all tensors on one device, got mixed devices ({where})")
    return next(iter(devices))


def _takes_params_and_batch(fn: Callable) -> None:
    if not callable(fn):
        raise TypeError(f"loss_fn: expected a callable loss_fn(params, batch), got {type(fn).__name__}")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise TypeError("loss_fn: expected a callable taking (params, batch), "
                        f"got signature {inspect.signature(fn)}") from None
    except ValueError:  # builtins without a signature: trust them
        pass


class Step:
    """A training step: ``state, metrics = step(state, batch)`` and ``state = step.init(params)``.

    Built by ``train_step``; transformations (shard, offload, ...) read its attributes and build a
    new ``Step``. ``metrics`` holds 0-d tensors ``loss`` and ``grad_norm`` (of the unscaled, unclipped
    fp32 grads; None where the step did not compute it, see ``train_step(grad_norm=)``), floats ``lr``
    (None if the optimizer has no schedule) and ``loss_scale`` (fp16),
    ``skipped`` (bool: the loss or the grads were inf/nan, so the update was not applied: params
    and optimizer state are returned unchanged; see the module docstring) and ``step`` (int,
    steps taken, skipped ones included).
    """

    layers: tuple[str, ...] = ("train_step",)  # the transformations that built it (``zfunc.core.compose``)

    def __init__(self, loss_fn, optimizer, precision, accum, donate, has_aux, seed, max_skips=None, grad_norm=True):
        self.loss_fn, self.optimizer, self.precision = loss_fn, optimizer, precision
        self.accum, self.donate, self.has_aux, self.seed = accum, donate, has_aux, seed
        self.grad_norm = grad_norm
        self.compute_dtype = mp.compute_dtype(precision)
        self.max_skips = mp.default_max_skips(precision) if max_skips is None else max_skips

    def init(self, params: PyTree, materialize: Materializer | None = None) -> TrainState:
        """A fresh state: fp32 copies of ``params`` (the caller's tensors are never aliased), the
        optimizer's initial state, step 0, ``rng = seed`` and fp16's initial loss scale. On the
        CPU, also ``hostmem.reuse_freed_memory()`` (the process keeps freed heap memory).

        ``materialize``: for params on the meta device (``with torch.device("meta"): model =
        GPT(cfg)``), what makes each leaf's whole value (``zfunc.model.materialize``: ``leaf``),
        one leaf at a time, its fp32 copy made before the next; the state then lives on CUDA when
        there is a GPU, else on the CPU. Ignored for params not on the meta device; meta params
        without it give a meta state, a template of shapes only (``init_meta``).
        Every step's ``init`` takes these two arguments (``zf.shard``'s, ``zf.offload``'s and
        ``zf.pipeline``'s say where the values they make go).
        """
        device = check_single_device(params)
        make = device.type == "meta" and materialize is not None
        if make:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":  # each step's grads and temporaries reuse the last one's memory
            hostmem.reuse_freed_memory()
        self.initialized_with = tree.map(lambda x: x.to("meta") if torch.is_tensor(x) else x, params)  # for load
        paths, leaves, treespec = optree.tree_flatten_with_path(params, namespace=tree.NAMESPACE)
        master = tree.unflatten(treespec, [
            _master_copy(materialize_leaf(materialize, ".".join(map(str, path)), x)
                         if make and isinstance(x, torch.Tensor) else x, device)
            for path, x in zip(paths, leaves)])
        return TrainState(master, self.optimizer.init(master), 0, self.seed, mp.init_loss_scale(self.precision))

    def init_meta(self, params: PyTree) -> TrainState:
        """The state ``init(params)`` would return, on the meta device: its structure, shapes,
        dtypes and placement, with no values (nothing allocated, no file written). What
        ``zf.checkpoint.load`` reads a checkpoint into."""
        return self.init(tree.map(lambda x: x.to("meta") if torch.is_tensor(x) else x, params))

    def own_buffers(self, buffers: dict[str, Any]) -> dict[str, Any]:
        """The module buffers among ``buffers`` that this step's state carries (all of them, but on
        a pipeline stage: those of its own units)."""
        return buffers

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        self._check_state(state)
        params, _, step, rng, loss_scale, buffers = _values(state)
        with module.carrying(buffers) as carried:  # apply reads and updates the state's buffers
            loss, aux, grads = self._loss_and_grads(params, batch, step, rng, loss_scale)
        return self._update(state, grads, loss, aux, carried.buffers)

    def _check_state(self, state: Any) -> None:
        require_train_state(state)
        if state.placement is not None:
            raise ValueError(f"state: this state is sharded ({state.placement}); feed it to the sharded step "
                             "it came from, not to the plain step")

    def _update(self, state: TrainState, grads: PyTree, loss: torch.Tensor, aux: Any, buffers: dict | None = None):
        """Apply the optimizer to ``state`` with fp32, unscaled ``grads`` unless the step is not
        finite; the new state (holding ``buffers``, None: empty) and metrics."""
        params, opt_state, step, rng, loss_scale, _ = _values(state)
        # sharded: the all-reduce that also sums the loss
        norm = optim.global_norm(grads) if self._needs_norm() else None
        finite = self._finite(loss, norm, step, loss_scale)  # may raise: nothing written yet
        grads = self._without_missing_grads(grads)
        lr = optim.learning_rate(self.optimizer, opt_state)
        if self.donate:
            state._consumed = True
        else:
            params, opt_state = tree.clone(params), tree.clone(opt_state)
        if finite and norm is None:
            params, opt_state = optim.apply(self.optimizer, grads, opt_state, params)
        elif finite:
            with optim.known_norm(grads, norm):  # clipping reuses it: sharded, each norm is an all-reduce
                params, opt_state = optim.apply(self.optimizer, grads, opt_state, params)
        loss_scale = mp.next_loss_scale(loss_scale, finite)
        metrics = self._metrics(loss, norm, lr, finite, step, loss_scale, aux)
        return TrainState(params, opt_state, step + 1, rng, loss_scale, state.placement, buffers=buffers), metrics

    def _needs_norm(self) -> bool:
        """Whether this step computes the global grad norm: asked for (``train_step(grad_norm=)``),
        read by the optimizer (``needs_global_norm``: clipping) or fp16's overflow check."""
        return self.grad_norm or self.optimizer.needs_global_norm or self.precision == "fp16"

    def _finite(self, loss: torch.Tensor, norm: torch.Tensor | None, step: int, loss_scale) -> bool:
        """Whether the loss and the grad norm (inf/nan iff a grad is; None: not computed, the loss
        alone) are finite: one host sync. Sharded or pipelined, both are already sums over the
        ranks, so every rank decides alike. A non-finite step after ``max_skips`` skipped in a row
        raises ``NonFiniteError``."""
        if loss.is_cpu and (norm is None or norm.is_cpu):  # two reads of CPU scalars: no kernel launches
            if math.isfinite(loss.item()) and (norm is None or math.isfinite(norm.item())):
                return True
        elif bool(torch.isfinite(loss) if norm is None
                  else torch.isfinite(norm) & torch.isfinite(loss.to(norm.device))):
            return True
        skips = loss_scale.skips if loss_scale is not None else 0
        if skips >= self.max_skips:
            raise NonFiniteError(
                f"step: {skips + 1} non-finite step{'s' if skips else ''} in a row, the last at state.step={step}: "
                f"{_cause(loss, norm, loss_scale)}; train_step(max_skips={self.max_skips}) allows {self.max_skips}. "
                "Nothing was updated: the state passed in is intact. Look for the cause in the batch, the learning "
                "rate or the loss")
        return False

    def _without_missing_grads(self, grads: PyTree) -> PyTree:
        """``grads`` with ``None`` for params no rank produced a grad for (plain: already so)."""
        return grads

    def _metrics(self, loss, norm, lr, finite: bool, step: int, loss_scale, aux) -> dict[str, Any]:
        """The step's metrics (see the class docstring); ``loss_scale`` is the next one."""
        metrics = {"loss": loss, "grad_norm": norm, "lr": lr, "skipped": not finite, "step": step + 1}
        if loss_scale is not None and loss_scale.dynamic:
            metrics["loss_scale"] = loss_scale.scale
        if self.has_aux:
            metrics["aux"] = aux
        return metrics

    def _loss_and_grads(self, params, batch, step, rng, loss_scale):
        """Mean loss over microbatches and the fp32, unscaled, averaged grads (a pytree)."""
        # fp32: the masters themselves (fp32 by construction), not a copy made by a tree map
        dtype = self.compute_dtype
        compute = params if dtype is torch.float32 else mp.cast_floating(params, dtype)
        scale = mp.scale_of(loss_scale)
        losses, auxes, acc = [], [], None
        with seeded(step_seed(rng, step), cuda_devices(params)):
            for micro in split_batch(_cast_batch(batch, dtype), self.accum):
                loss, aux, grads, treespec = _grad_leaves(compute, self.loss_fn, (micro,), scale, self.has_aux)
                losses.append(loss if loss.dtype is torch.float32 else loss.float())
                auxes.append(aux)
                acc = _accumulate(acc, grads)
        divisor = self.accum * (scale or 1.0)
        if divisor != 1.0:
            tensors = [g for g in acc if g is not None]
            if tensors:
                torch._foreach_mul_(tensors, 1.0 / divisor)
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        return loss, (auxes[0] if self.accum == 1 else auxes), tree.unflatten(treespec, acc)


class Transformed(Step):
    """Base of the steps that transformations return: it *wraps* ``inner``, the step it was given,
    keeps the roles its transformation owns (where params come from, where grads go, how the
    update runs, the microbatch schedule; docs/design.md) and reads everything else from ``inner``:
    the loss, the optimizer, precision, accumulation, donation, seed and skip policy, and what the
    inner transformation learned. Nothing is copied, so a chain of wrappers has one source for
    each field. ``layers`` records the transformation (``zfunc.core.compose``).

    Attribute lookup falls through to ``inner`` only for names this step does not have; setting
    one (``step.loss_fn = ...``) sets it on this step only.
    """

    def __init__(self, inner: Step, layer: str):  # no Step.__init__: its fields are inner's
        self.inner = inner
        self.layers = (*inner.layers, layer)

    def __getattr__(self, name: str) -> Any:
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def _values(state: TrainState) -> tuple:
    """``state``'s fields in ``FIELDS`` order, read at once (raises ``ConsumedStateError`` as each field would)."""
    state.step  # noqa: B018 - the consumed check
    return state._values


def _cause(loss: torch.Tensor, norm: torch.Tensor, loss_scale) -> str:
    """Why a step is not finite, in words."""
    if not torch.isfinite(loss):
        return f"non-finite loss ({loss.item()})"
    at = f" at loss scale {loss_scale.scale}" if loss_scale is not None and loss_scale.dynamic else ""
    return f"non-finite grads (grad norm {norm.item()}{at})"


def _master_copy(p: Any, device: torch.device) -> Any:
    if not isinstance(p, torch.Tensor):
        return p
    return hostmem.copy_to(p.detach(), device, torch.float32 if p.is_floating_point() else p.dtype)


def _accumulate(acc: list | None, grads: list) -> list:
    """Sum per-microbatch grads in fp32; the first fp32 grad of a leaf is used as it is. ``None``
    (no grad in this microbatch) adds nothing; a leaf stays ``None`` until some microbatch has one."""
    if acc is None:  # the first microbatch (the only one without accumulation)
        return [_fp32(g) for g in grads]
    pairs = [(a, g) for a, g in zip(acc, grads) if a is not None and g is not None]
    if pairs:
        torch._foreach_add_([a for a, _ in pairs], [g for _, g in pairs])
    return [_fp32(g) if a is None else a for a, g in zip(acc, grads)]


def _fp32(g: torch.Tensor | None) -> torch.Tensor | None:
    return g if g is None or g.dtype == torch.float32 else g.float()


def step_seed(rng: int, step: int) -> int:
    """The seed of step ``step`` of a state whose ``rng`` is ``rng``: a function of the two alone,
    so a step taken again (after a load, on another rank layout) draws the same randomness."""
    return (rng * 1_000_003 + step) % (2**63)


class seeded:  # noqa: N801 - used as a function: ``with seeded(seed, devices):``
    """Run the block with torch's CPU generator (and those of ``cuda_devices``) seeded by ``seed``,
    restoring their states after: the step's randomness is a function of the state alone.
    Cheaper than ``fork_rng`` + ``manual_seed``, which also seed every other backend; a class,
    not a generator-based context manager, which costs ~1 us more per step."""

    __slots__ = ("seed", "cuda_devices", "cpu", "cuda")

    def __init__(self, seed: int, cuda_devices: list[int]):
        self.seed, self.cuda_devices = seed, cuda_devices

    def __enter__(self) -> None:
        cpu = torch.default_generator
        self.cpu = cpu.get_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        cpu.manual_seed(self.seed)
        for d in self.cuda_devices:
            torch.cuda.default_generators[d].manual_seed(self.seed)

    def __exit__(self, *exc) -> None:
        torch.default_generator.set_state(self.cpu)
        for d, st in zip(self.cuda_devices, self.cuda):
            torch.cuda.set_rng_state(st, d)


def cuda_devices(params: PyTree) -> list[int]:
    """The CUDA device indices ``params``' tensors lie on, sorted (what ``seeded`` seeds); ``[]``
    without a leaf walk while CUDA is not initialized."""
    if not torch.cuda.is_initialized():  # no CUDA tensor can exist yet: skip the walk over the leaves
        return []
    return sorted({t.device.index or 0 for t in tree.tensors(params) if t.device.type == "cuda"})


def _cast_batch(batch: PyTree, dtype: torch.dtype) -> PyTree:
    """``batch`` with its floating tensors cast to ``dtype`` (a lone tensor checked without a tree walk)."""
    if isinstance(batch, torch.Tensor) and (batch.dtype is dtype or not batch.is_floating_point()):
        return batch
    return mp.cast_floating(batch, dtype)


def train_step(
    loss_fn: Callable[[PyTree, PyTree], torch.Tensor],
    optimizer: optim.GradientTransformation,
    precision: str = "fp32",
    accum: int = 1,
    *,
    donate: bool = True,
    has_aux: bool = False,
    seed: int = 0,
    max_skips: int | None = None,
    grad_norm: bool = True,
) -> Step:
    """Build the step that trains ``loss_fn`` with ``optimizer``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> 0-d tensor`` (``(loss, aux)`` with ``has_aux``); pure.
      optimizer: a ``zf.optim.GradientTransformation``.
      precision: "fp32", "bf16" or "fp16": the compute dtype of forward and backward. The params
        and the batch's floating tensors are cast to it (integer tokens are left alone); params are
        kept as fp32 masters in the state; fp16 adds a dynamic loss scale (``precision.LossScale``),
        halved at every skipped step. In every precision a step whose loss or grads hold an inf or
        a nan is skipped: no update, ``metrics["skipped"]`` (see the module docstring).
      accum: microbatches per step; every tensor in the batch is split along dim 0 into ``accum``
        equal parts and the grads are averaged, so ``accum=k`` on a batch of ``k*B`` equals
        ``accum=1`` on it (for a loss that is a mean over the batch).
      donate: consume the input state (update its buffers in place) -- see the module docstring.
      seed: base seed stored in the state as ``rng``.
      max_skips: non-finite steps tolerated in a row (skipped); the next one raises
        ``NonFiniteError`` naming the step and the cause, leaving the state passed in intact. 0
        raises at the first. Default ``precision.default_max_skips``: 10, and 26 for fp16, whose
        scale may overflow from 2**16 down to 1 (16 skips) before it fits.
      grad_norm: compute the global norm of the grads every step (one more read of every grad,
        before the update): ``metrics["grad_norm"]``, and a step with non-finite grads is skipped.
        False: computed only where the update needs it anyway (the optimizer's
        ``needs_global_norm``, e.g. clipping; fp16's overflow check), else ``metrics["grad_norm"]``
        is None and only a non-finite loss skips a step. Every step honours False: plain, sharded
        (the loss is then summed in an all-reduce of its own, with no norm), pipelined and offloaded.
    Memory: params 4 B/param (fp32 masters) + the optimizer's state + grads 4 B/param (+ the compute
    copy: 2 B/param for bf16/fp16).
    """
    _takes_params_and_batch(loss_fn)
    if not isinstance(optimizer, optim.GradientTransformation):
        raise TypeError(f"optimizer: expected a zf.optim.GradientTransformation, got {type(optimizer).__name__}")
    if not isinstance(accum, int) or accum < 1:
        raise ValueError(f"accum: expected an int >= 1, got {accum!r}")
    if max_skips is not None and (not isinstance(max_skips, int) or isinstance(max_skips, bool) or max_skips < 0):
        raise ValueError(f"max_skips: expected None or an int >= 0, got {max_skips!r}")
    if not isinstance(grad_norm, bool):
        raise ValueError(f"grad_norm: expected a bool, got {grad_norm!r}")
    return Step(loss_fn, optimizer, precision, accum, donate, has_aux, seed, max_skips, grad_norm)
