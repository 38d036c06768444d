"""``search``: the strategies that fit, fastest first, like DeepSpeed's autotuner but without launching.

Candidates: ZeRO stage 0-3; optimizer offload none/cpu/nvme; params offload (stage 3) none/cpu/nvme;
remat none/full/offload; micro-batches 1, 2, 4, ... 64; tensor parallelism over the divisors of the node's GPU
count; pipelines of 1-16 stages (ZeRO 0/1 only, as zfunc composes them). With ``global_batch``
(sequences per step) the accumulation is what the rest leaves of it and candidates that cannot
reach it exactly are skipped, so every candidate trains on the same batch; without it ``accum``
stays as given. Ranked by tokens per second; ties by GPU bytes. Tensor/sequence parallelism is
modelled, not yet run by zfunc: ``allow_tp=False`` (the CLI's default) keeps to what zfunc runs.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

from zfunc.plan.core import Plan, plan
from zfunc.plan.hardware import Cluster
from zfunc.plan.model import ModelSpec
from zfunc.plan.strategy import Strategy

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PIPELINES = (1, 2, 4, 8, 16)


def candidates(model: ModelSpec, cluster: Cluster, base: Strategy, global_batch: int | None = None,
               allow_tp: bool = False):
    """Every strategy ``search`` tries (module docstring), as ``base`` with fields replaced."""
    gpn = cluster.gpus_per_node
    tps = [t for t in (1, 2, 4, 8, 16) if t <= gpn and gpn % t == 0 and model.heads % t == 0] if allow_tp else [1]
    pps = [p for p in PIPELINES if p <= model.layers and cluster.gpus % p == 0]
    for zero, opt, par, remat, mb, tp, pp in itertools.product(
            (0, 1, 2, 3), ("none", "cpu", "nvme"), ("none", "cpu", "nvme"), ("none", "full", "offload"),
            MICRO_BATCHES, tps, pps):
        if cluster.gpus % (tp * pp) or (pp > 1 and zero > 1) or (par != "none" and zero != 3):
            continue
        dp = cluster.gpus // (tp * pp)
        accum = base.accum
        if global_batch is not None:
            if global_batch % (dp * mb):
                continue
            accum = global_batch // (dp * mb)
        yield replace(base, dp=None, zero=zero, offload_optimizer=opt, offload_params=par, remat=remat,
                      micro_batch=mb, tp=tp, sp=tp > 1, pp=pp, accum=accum)


def search(model: ModelSpec, cluster: Cluster, base: Strategy = Strategy(), *, global_batch: int | None = None,
           allow_tp: bool = False, top: int = 5) -> list[Plan]:
    """The ``top`` fitting plans, highest predicted tokens/s first (module docstring)."""
    fitting = []
    for s in candidates(model, cluster, base, global_batch, allow_tp):
        try:
            p = plan(model, cluster, s)
        except ValueError:
            continue
        if p.fits:
            fitting.append(p)
    fitting.sort(key=lambda p: (-p.tokens_per_step / p.step_time, p.gpu_bytes))
    return fitting[:top]
