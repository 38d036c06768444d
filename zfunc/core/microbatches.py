"""The microbatch loop: the one loop every step (plain, sharded, offloaded, pipelined) runs its
forwards and backwards through.

``run_microbatches(schedule, batch, ...)`` casts the batch's floating tensors to the compute dtype,
cuts it into the schedule's microbatches (``schedule.split``) and runs the schedule's ops
(``schedule.ops(stages, stage)``: ``("F", i)``, ``("B", i)``) in order, each forward by
``forward(i, microbatch)`` and each backward by ``backward(i)``, under the step's seed (``seeded``:
the step's randomness is a function of the state alone). What a forward and a backward do is the
step's: the plain step differentiates its compute params with ``torch.autograd.grad``, a sharded or
offloaded step gathers params and hooks its grad reducer (``zfunc.sharding.run``), a pipeline stage
receives and sends activations (``zfunc.pipelining.stage``). The loop knows none of it.

A schedule has ``count`` (microbatches), ``split(batch)`` and ``ops(stages, stage)``:
``roles.Accumulation`` (each backward right after its forward, on one stage) and the pipeline's
``PipelineSchedule`` (GPipe, 1F1B). Also here: ``split_batch`` (cut along dim 0), ``accumulate``
(the fp32 sum of per-microbatch grads) and the step's seed. Cost: two Python calls per microbatch
beyond the work itself.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from zfunc.core import precision as mp, tree

PyTree = Any


class Schedule(Protocol):
    """How a batch becomes microbatches and in which order their forwards and backwards run."""

    count: int

    def split(self, batch: PyTree) -> list[PyTree]: ...

    def ops(self, stages: int = 1, stage: int = 0) -> Sequence[tuple[str, int]]: ...


def run_microbatches(schedule: Schedule, batch: PyTree, dtype: torch.dtype, seed: int, params: PyTree,
                     forward: Callable[[int, PyTree], tuple[torch.Tensor, Any] | None],
                     backward: Callable[[int], None], stages: int = 1,
                     stage: int = 0) -> tuple[torch.Tensor | None, Any]:
    """Run ``schedule``'s ops on ``batch`` (its floating tensors cast to ``dtype``), seeded by ``seed``
    (the CPU generator and those of the CUDA devices ``params`` live on).

    ``forward(i, microbatch)`` returns microbatch ``i``'s ``(loss, aux)``, or None where this stage
    computes no loss (a pipeline stage before the last); ``backward(i)`` runs its backward.
    Returns the mean of the losses (fp32, detached; None if no forward returned one) and the aux:
    the one microbatch's, or the list of them (None if no forward returned one).
    """
    micros = schedule.split(cast_batch(batch, dtype))
    losses, auxes = [], []
    with seeded(seed, cuda_devices(params)):
        for kind, i in schedule.ops(stages, stage):
            if kind == "B":
                backward(i)
                continue
            out = forward(i, micros[i])
            if out is not None:
                loss = out[0].detach()
                losses.append(loss if loss.dtype is torch.float32 else loss.float())
                auxes.append(out[1])
    if not losses:
        return None, None
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
    return loss, (auxes[0] if schedule.count == 1 else auxes)


def split_batch(batch: PyTree, count: int) -> list[PyTree]:
    """``count`` microbatches of ``batch``: every tensor split along dim 0 into equal parts (other
    leaves repeated); ``ValueError`` naming the shape where ``count`` does not divide it."""
    if count == 1:
        return [batch]
    leaves, treespec = tree.flatten(batch)
    pieces = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 or x.shape[0] % count:
                raise ValueError(
                    f"batch: accum={count} splits each tensor's leading dim, got a tensor of shape {tuple(x.shape)}"
                )
            pieces.append(x.chunk(count))
        else:
            pieces.append([x] * count)
    return [tree.unflatten(treespec, parts) for parts in zip(*pieces)]


def cast_batch(batch: PyTree, dtype: torch.dtype) -> PyTree:
    """``batch`` with its floating tensors cast to ``dtype`` (a lone tensor checked without a tree walk)."""
    if isinstance(batch, torch.Tensor) and (batch.dtype is dtype or not batch.is_floating_point()):
        return batch
    return mp.cast_floating(batch, dtype)


def accumulate(acc: list | None, grads: Sequence[torch.Tensor | None]) -> list:
    """``acc`` (a list of fp32 sums, None: none yet) plus this microbatch's ``grads``, in place; the
    first grad of a leaf is taken as it is where it is fp32 (else as an fp32 copy). ``None`` (no grad
    in this microbatch) adds nothing; a leaf stays ``None`` until some microbatch has one."""
    if acc is None:  # the first microbatch (the only one without accumulation)
        return [g if g is None or g.dtype is torch.float32 else g.float() for g in grads]
    pairs = [(a, g) for a, g in zip(acc, grads) if a is not None and g is not None]
    if pairs:
        torch._foreach_add_([a for a, _ in pairs], [g for _, g in pairs])
    for j, g in enumerate(grads):
        if g is not None and acc[j] is None:
            acc[j] = g if g.dtype is torch.float32 else g.float()
    return acc


def step_seed(rng: int, step: int) -> int:
    """The seed of step ``step`` of a state whose ``rng`` is ``rng``."""
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
    """The CUDA devices ``params``' tensors live on (none while CUDA is not initialized)."""
    if not torch.cuda.is_initialized():  # no CUDA tensor can exist yet: skip the walk over the leaves
        return []
    return sorted({t.device.index or 0 for t in tree.tensors(params) if t.device.type == "cuda"})
