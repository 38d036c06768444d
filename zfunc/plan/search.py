"""``search``: the plans that fit, fastest first, like DeepSpeed's autotuner but without launching.

Candidates: ZeRO stage 0-3; optimizer offload none/cpu/nvme; params offload (stage 3) none/cpu/nvme;
remat none/full/offload; micro-batches 1, 2, 4, ... 64; at stage 3, where the GPU is what does not
fit, the fewest ``zf.tile`` tiles (2 ... 64) of the largest Linears that make it fit; tensor
parallelism over the divisors of the node's GPU count; pipelines of 1-16 stages; each ``base`` with
those fields replaced. What
``zfunc.core.compose``'s rulebook refuses is skipped: what contradicts, and what zfunc does not run
(optimizer offload of replicas, ...), tensor/sequence
parallelism aside when ``allow_tp`` (modelled, not yet run by zfunc; the CLI's default keeps to what zfunc runs). With
``global_batch`` (sequences per step) the accumulation is what the rest leaves of it and candidates
that cannot reach it exactly are skipped, so every candidate trains on the same batch; without it
the accumulation (or the pipeline's microbatches) stays as given. Ranked by tokens per second; ties
by GPU bytes.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

from zfunc.config.plan import Plan
from zfunc.core import compose
from zfunc.plan.core import Estimate, plan
from zfunc.plan.hardware import Cluster
from zfunc.plan.model import ModelSpec
from zfunc.plan.strategy import NVME_PATH, microbatches

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PIPELINES = (1, 2, 4, 8, 16)
TILES = (2, 4, 8, 16, 32, 64)  # zf.tile's tiles, tried at stage 3 where a candidate does not fit the GPU
MODELLED_ONLY = frozenset({"tensor parallelism"})  # the rulebook's rules allow_tp lets through


def candidates(model: ModelSpec, cluster: Cluster, base: Plan, global_batch: int | None = None,
               allow_tp: bool = False):
    """Every plan ``search`` tries (module docstring), as ``base`` with fields replaced."""
    gpn = cluster.gpus_per_node
    tps = [t for t in (1, 2, 4, 8, 16) if t <= gpn and gpn % t == 0 and model.heads % t == 0] if allow_tp else [1]
    pps = [p for p in PIPELINES if p <= model.layers and cluster.gpus % p == 0]
    allowed = MODELLED_ONLY if allow_tp else frozenset()
    for zero, opt, par, remat, mb, tp, pp in itertools.product(
            (0, 1, 2, 3), ("none", "cpu", "nvme"), ("none", "cpu", "nvme"), ("none", "full", "offload"),
            MICRO_BATCHES, tps, pps):
        if cluster.gpus % (tp * pp) or (par != "none" and zero != 3):  # params offload: stage 3's grid
            continue
        dp = cluster.gpus // (tp * pp)
        accum = microbatches(base)
        if global_batch is not None:
            if global_batch % (dp * mb):
                continue
            accum = global_batch // (dp * mb)
        fields = dict(dp=dp, zero_stage=zero, offload_optimizer=opt, offload_params=par, remat=remat != "none",
                      remat_offload=remat == "offload", micro_batch=mb, tp=tp, sp=tp > 1, pp=pp,
                      accum=1 if pp > 1 else accum, microbatches=accum if pp > 1 else 1, global_batch=global_batch,
                      nvme_path=(base.nvme_path or NVME_PATH) if "nvme" in (opt, par) else None)
        try:
            s = replace(base, **fields)
        except ValueError:  # settings that contradict: Plan asks the rulebook
            continue
        if all(rule.name in allowed for rule, _ in compose.broken(s, compose.UNSUPPORTED)):
            yield s


def _fewest_tiles(model: ModelSpec, cluster: Cluster, s: Plan) -> Estimate | None:
    """``s`` with the fewest ``zf.tile`` tiles of ``TILES`` that fits its GPU, or None: stage 3
    gathers a unit at a time, and tiling the largest Linears shrinks the largest unit."""
    for k in TILES:
        p = plan(model, cluster, replace(s, tile_lm_head=k))
        if p.gpu_bytes <= cluster.device.hbm_bytes:
            return p if p.fits else None
    return None


def search(model: ModelSpec, cluster: Cluster, base: Plan = Plan(), *, global_batch: int | None = None,
           allow_tp: bool = False, top: int = 5) -> list[Estimate]:
    """The ``top`` fitting estimates, highest predicted tokens/s first (module docstring)."""
    fitting = []
    for s in candidates(model, cluster, base, global_batch, allow_tp):
        try:
            p = plan(model, cluster, s)
            if not p.fits and s.zero_stage == 3 and s.tile_lm_head == base.tile_lm_head:
                p = _fewest_tiles(model, cluster, s) or p
        except ValueError:
            continue
        if p.fits:
            fitting.append(p)
    fitting.sort(key=lambda p: (-p.tokens_per_step / p.step_time, p.gpu_bytes))
    return fitting[:top]
