"""A pipeline stage's grads over its dp ranks (ZeRO 1-3 under ``zf.pipeline``): this rank's fp32
slices of the dp-summed whole grads, one reduce-scatter per bucket (``reduce_scatter``), at the
end of the step (stage 1) or as each op ends (``OpGradSlices``, stages 2 and 3: no whole grads
outlive an op). The law and the costs are in ``zfunc.pipelining.step``'s docstring.
"""
from __future__ import annotations

import torch

from zfunc.core.microbatches import accumulate
from zfunc.sharding.layout import ShardSpec
from zfunc.sharding.reduce import GradSlices


class OpGradSlices:
    """ZeRO 2/3 over a stage's dp ranks: each op's grads, whole, reduce-scattered as the op ends
    (``reduce_scatter``, divided by ``divisor``) and this rank's fp32 slices summed over the ops: no
    whole grads outlive an op. Every dp rank of a stage runs the same ops, so the collectives match."""

    def __init__(self, pieces, whole, spec: ShardSpec, buckets, comm, step: int, divisor: float):
        self.pieces, self.whole, self.spec, self.buckets, self.comm = pieces, whole, spec, buckets, comm
        self.step, self.divisor, self.slices = step, divisor, None

    def __call__(self, grads: list[torch.Tensor | None]) -> None:
        if all(g is None for g in grads):  # the same on every dp rank of the stage: skipped by all
            return
        grads = [torch.zeros(w.shape, device=w.device) if g is None else g for g, w in zip(grads, self.whole)]
        self.slices = accumulate(self.slices, reduce_scatter(grads, self.pieces, self.spec, self.buckets, self.comm,
                                                              self.step, self.divisor))

    def result(self) -> list[torch.Tensor]:
        if self.slices is None:
            return [torch.zeros(p.shape, device=p.device) for p in self.pieces]
        return self.slices


def reduce_scatter(grads, pieces, spec: ShardSpec, buckets, comm, step: int, divisor: float) -> list[torch.Tensor]:
    """This rank's fp32 slices of the dp-summed whole ``grads`` divided by ``divisor`` (one
    reduce-scatter per bucket)."""
    sink = GradSlices(lambda i: torch.zeros_like(pieces[i], dtype=torch.float32), len(pieces), divisor)
    works = []
    for unit in buckets:
        full = torch.empty(spec.world, unit.segment, dtype=torch.float32, device=pieces[0].device)
        unit.pack_full([grads[i] for i in unit.indices], spec.leaves, spec.world, full)
        out = torch.empty(unit.segment, dtype=torch.float32, device=full.device)
        label = f"reduce-scatter of {unit.name} at step {step}"
        works.append((comm.reduce_scatter(out, full.view(-1), label=label, async_op=True), out, unit))
    for work, out, unit in works:
        work.wait()
        sink.deliver(unit, unit.local_views(out, spec.leaves, spec.rank))
    return sink.result()
