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

Gradients come from ``zfunc.core.grads`` (``torch.autograd.grad`` over detached leaves that require
grad); a param the loss never uses gets no grad (``None``), and the optimizer leaves it alone, as torch does.
Transformations wrap a ``Step`` in a ``zfunc.core.transformed.Transformed``.

Non-finite steps: when the loss or the grads hold an inf or a nan, the step does not update. It
returns a state with the same params and optimizer state, ``step + 1`` (a skipped step counts, as
in torch's ``GradScaler`` and DeepSpeed, so the next step draws new random numbers), fp16's scale
halved, and ``metrics["skipped"] = True``. The decision comes before any write, so with donation
too the returned state holds the old values. ``max_skips`` such steps in a row are tolerated; the
next one raises ``NonFiniteError`` naming the step and the cause, the state passed in still intact.
Cost: the loss (computed anyway) and the grad norm (computed for the metrics and for clipping)
are checked, one host sync of two scalars per step. The norm is one read of the grads before the
update (CPU grads: zfunc's kernel over the flat list of grads, ``optim.squares_in_ram``; elsewhere
``local_norm``; 4 B/param of fp32 grads, where AdamW's update moves 28): for a skipped step to write
nothing, every grad is read before the first write. The update then reads each grad again, from
the cache only where the grads fit in what the cache keeps between the two passes; past that the
read runs at DRAM rate (a 100M-param step: ~20 ms of ~500, most of the rest faulting in the fresh
grad and temporaries, as in any torch loop).
Accumulated over microbatches on the CPU, that read is the last microbatch's add to the sums, which
sums the squares in its own pass (``optim.add_with_squares``): no read of its own. The grads'
unscale (1/(microbatches x loss scale)) is multiplied in the optimizer's pass, not in one of its own.
The update's own pass cannot take its place: its in-place writes cannot be undone bit for bit
(the roundings of ``p*decay + u`` and of the moments lose the old values), and holding them
elsewhere until the last grad is read costs 12 B/param of memory (p, m and v written out of
place) or of undo copies. With
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
from zfunc.core.grads import _LocalGrads, one_microbatch
from zfunc.core.microbatches import run_microbatches, step_seed
from zfunc.core.roles import Accumulation
from zfunc.core.totals import without_missing_grads
from zfunc.ops.cpu import hostmem
from zfunc.core.state import TrainState, require_train_state

PyTree = Any


class NonFiniteError(FloatingPointError):
    """More non-finite steps (loss or grads inf/nan) in a row than ``train_step(max_skips=)``."""


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

    Built by ``train_step``; transformations (shard, offload, ...) wrap it (``Transformed``) and
    build a new ``Step``. ``metrics`` holds 0-d tensors ``loss`` and ``grad_norm`` (of the unscaled,
    unclipped fp32 grads; None where the step did not compute it, see ``train_step(grad_norm=)``),
    floats ``lr`` (None if the optimizer has no schedule) and ``loss_scale`` (fp16), ``skipped``
    (bool: the loss or the grads were inf/nan, so the update was not applied: params and optimizer
    state are returned unchanged; see the module docstring) and ``step`` (int, steps taken, skipped
    ones included).
    """

    layers: tuple[str, ...] = ("train_step",)  # the transformations that built it (``zfunc.core.compose``)

    def __init__(self, loss_fn, optimizer, precision, accum, donate, has_aux, seed, max_skips=None, grad_norm=True):
        self.loss_fn, self.optimizer, self.precision = loss_fn, optimizer, precision
        self.accum, self.donate, self.has_aux, self.seed = accum, donate, has_aux, seed
        self.grad_norm = grad_norm
        self.compute_dtype = mp.compute_dtype(precision)
        self.max_skips = mp.default_max_skips(precision) if max_skips is None else max_skips
        self.schedule = Accumulation(accum)  # the microbatch loop's schedule

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

    def placement_of(self, params: PyTree) -> Any:
        """The placement spec of the state ``init(params)`` returns, without making it: None, every
        param whole (a tensor-parallel step's: its slices). A transformation that splits this step's
        params further records it (``zf.shard``'s ``ShardSpec.within``), so a checkpoint knows each
        piece's place in the whole param."""
        return None

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        self._check_state(state)
        params, _, step, rng, loss_scale, buffers = _values(state)
        if self._direct(loss_scale):  # one fp32 microbatch, nothing scaled: the loop's work written out
            with module.carrying(buffers) as carried:
                loss, aux, grads, treespec = one_microbatch(params, self.loss_fn, self.has_aux, batch,
                                                            step_seed(rng, step))
            squares = optim.squares_in_ram(grads) if self.needs_norm() else None
            grads, divisor = treespec.unflatten(grads), 1.0
        else:
            # The grads' unscale (1/(microbatches x loss scale)) rides in the update's own pass
            # (``update(grad_scale=)``) instead of a pass of its own, unless a subclass reworks the grads (its
            # ``_loss_and_grads``) or clipping reads them (its factor is folded into the same multiply, which would
            # round differently).
            fold = type(self)._loss_and_grads is Step._loss_and_grads and not self.optimizer.needs_global_norm
            with module.carrying(buffers) as carried:  # apply reads and updates the state's buffers
                if fold:
                    loss, aux, grads, divisor, squares = self._summed_loss_and_grads(
                        params, batch, step, rng, loss_scale, self.needs_norm(),
                        type(self).local_norm is Step.local_norm)
                else:
                    loss, aux, grads = self._loss_and_grads(params, batch, step, rng, loss_scale)
                    divisor, squares = 1.0, None
        # CPU grads: the norm came with the last microbatch's add or from the kernel's read of the flat grads
        # (``_summed_loss_and_grads``, ``squares_in_ram``); else ``local_norm`` reads them
        norm = (self.local_norm(grads) if squares is None
                else torch.scalar_tensor(math.sqrt(squares), dtype=torch.float32))
        if divisor == 1.0:
            return self.update(state, grads, loss, aux, norm, carried.buffers)
        if norm is not None:  # the norm of the unscaled grads: a multiply of one scalar
            norm = norm * (1.0 / divisor)
        return self.update(state, grads, loss, aux, norm, carried.buffers, grad_scale=1.0 / divisor)

    def _direct(self, loss_scale) -> bool:
        """Whether this call is the plain step's one fp32 microbatch in a process without CUDA, with
        nothing scaled or reworked (no loss scale; ``_loss_and_grads``, ``_summed_loss_and_grads`` and
        ``local_norm`` not overridden). Then ``__call__`` runs the microbatch loop's work for it written out
        (``grads.one_microbatch``: the same loss and grads, bit for bit, in ~7 Python calls
        where the loop's layers make ~30) and takes the norm from the flat list of grads
        (``optim.squares_in_ram``: the same kernel over the same tensors as ``global_norm``'s). With
        nothing to divide, folding the unscale into the update or not is the same step, clipping
        included. Read on every call, from the fields as they are now (a transformation or a test
        may set ``schedule`` on a step)."""
        schedule, cls = self.schedule, type(self)
        return (type(schedule) is Accumulation and schedule.count == 1 and self.compute_dtype is torch.float32
                and (loss_scale is None or loss_scale.scale == 1.0) and cls._loss_and_grads is Step._loss_and_grads
                and cls._summed_loss_and_grads is Step._summed_loss_and_grads and cls.local_norm is Step.local_norm
                and not torch.cuda.is_initialized())

    def _check_state(self, state: Any) -> None:
        if type(state) is not TrainState:  # the exact class needs no further call
            require_train_state(state)
        if state.placement is not None:
            raise ValueError(f"state: this state is sharded ({state.placement}); feed it to the sharded step "
                             "it came from, not to the plain step")

    def update(self, state: TrainState, grads: PyTree, loss: torch.Tensor, aux: Any, norm: torch.Tensor | None,
               buffers: dict | None = None, produced: torch.Tensor | None = None,
               grad_scale: float | None = None) -> tuple[TrainState, dict[str, Any]]:
        """Apply the optimizer to ``state`` with fp32, unscaled ``grads`` (``grads * grad_scale``
        where given: ``optim.apply(grad_scale=)``, the multiply in the kernel's pass; ``norm`` is
        then that product's, and the optimizer must not read the global norm) unless the step is
        not finite; the new state (holding ``buffers``, None: empty) and metrics.

        ``loss`` and ``norm`` (the grads' global norm, None: not computed; ``local_norm``) are the
        step's totals: where the grads are one rank's share, the caller has summed them over the
        ranks (``sum_over_ranks``), so that every rank decides alike. ``produced`` (None: not
        tracked): per leaf, the ranks that produced a grad for it; a leaf none did gets no grad,
        which the optimizer leaves alone. Clipping takes ``norm`` as it is (``optim.known_norm``):
        no second read of the grads, no second collective."""
        params, opt_state, step, rng, loss_scale, _ = _values(state)
        finite = self.finite(loss, norm, step, loss_scale)  # may raise: nothing written yet
        if produced is not None:
            grads = without_missing_grads(grads, produced)
        rate = self.optimizer.learning_rate  # ``optim.learning_rate``, inlined: every step reads it
        lr = None if rate is None else float(rate(opt_state))
        if self.donate:
            state._consumed = True
        else:
            params, opt_state = tree.clone(params), tree.clone(opt_state)
        if finite and (norm is None or not self.optimizer.needs_global_norm):  # the norm: metrics and the skip only
            params, opt_state = optim.apply(self.optimizer, grads, opt_state, params, grad_scale=grad_scale)
        elif finite:
            params, opt_state = optim.apply(self.optimizer, grads, opt_state, params,
                                            norm=optim.known_norm(grads, norm))
        loss_scale = mp.next_loss_scale(loss_scale, finite)
        metrics = self.metrics(loss, norm, lr, finite, step, loss_scale, aux)
        return TrainState(params, opt_state, step + 1, rng, loss_scale, state.placement, buffers=buffers), metrics

    def needs_norm(self) -> bool:
        """Whether this step computes the global grad norm: asked for (``train_step(grad_norm=)``),
        read by the optimizer (``needs_global_norm``: clipping) or fp16's overflow check."""
        return self.grad_norm or self.optimizer.needs_global_norm or self.precision == "fp16"

    def local_norm(self, grads: PyTree) -> torch.Tensor | None:
        """The L2 norm of ``grads`` as this process holds them (``optim.global_norm``), None where
        the step needs none (``needs_norm``)."""
        return optim.global_norm(grads) if self.needs_norm() else None

    def finite(self, loss: torch.Tensor, norm: torch.Tensor | None, step: int, loss_scale) -> bool:
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

    def metrics(self, loss, norm, lr, finite: bool, step: int, loss_scale, aux) -> dict[str, Any]:
        """The step's metrics (see the class docstring); ``loss_scale`` is the next one."""
        metrics = {"loss": loss, "grad_norm": norm, "lr": lr, "skipped": not finite, "step": step + 1}
        if loss_scale is not None and loss_scale.dynamic:
            metrics["loss_scale"] = loss_scale.scale
        if self.has_aux:
            metrics["aux"] = aux
        return metrics

    def _loss_and_grads(self, params, batch, step, rng, loss_scale):
        """Mean loss over microbatches and the fp32, unscaled, averaged grads (a pytree)."""
        loss, aux, grads, divisor, _ = self._summed_loss_and_grads(params, batch, step, rng, loss_scale)
        if divisor != 1.0:
            tensors = tree.tensors(grads)
            if tensors:
                torch._foreach_mul_(tensors, 1.0 / divisor)
        return loss, aux, grads

    def _summed_loss_and_grads(self, params, batch, step, rng, loss_scale, norm: bool = False, read: bool = False):
        """Mean loss over microbatches, the fp32 grads summed over them as the loss scale left
        them (a pytree), the divisor that makes them the unscaled average (microbatches x loss
        scale) and, where ``norm``, the sum of their squares where zfunc's CPU kernel takes them:
        accumulated over microbatches, the last add's own pass; else, where ``read``, one read of
        the flat list of grads (``optim.squares_in_ram``: no walk over the grads' tree); else None."""
        # fp32: the masters themselves (fp32 by construction), not a copy made by a tree map
        dtype = self.compute_dtype
        compute = params if dtype is torch.float32 else mp.cast_floating(params, dtype)
        scale = mp.scale_of(loss_scale)
        count = self.schedule.count
        local = _LocalGrads(compute, self.loss_fn, scale, self.has_aux, count if norm and count > 1 else 0)
        loss, aux = run_microbatches(self.schedule, batch, dtype, step_seed(rng, step), params, local.forward,
                                     local.backward)
        squares = local.squares
        if squares is None and norm and read and local.acc is not None:
            squares = optim.squares_in_ram(local.acc)
        return loss, aux, tree.unflatten(local.treespec, local.acc), count * (scale or 1.0), squares


def _values(state: TrainState) -> tuple:
    """``state``'s fields in ``FIELDS`` order, read at once (raises ``ConsumedStateError`` as each field would)."""
    if state._taken:
        state.step  # noqa: B018 - raises
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
        before the update; see the module docstring): ``metrics["grad_norm"]``, and a step with
        non-finite grads is skipped.
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
