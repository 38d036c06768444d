"""zf.plan: memory, communication and step time of a training run, before it runs.

    import zfunc as zf
    from zfunc import plan as zp
    model = zp.from_params(70e9, kind="llama")            # or from_shape / from_module / from_hf_config / from_flavor
    cluster = zp.cluster("H100-80GB", gpus=64)            # datasheet peaks, DGX-like nodes; every field overridable
    run = zf.config.Plan(zero_stage=3, offload_optimizer="cpu", micro_batch=2, seq=4096, precision="bf16")
    e = zp.plan(model, cluster, run)                      # an Estimate; dp=1 in the plan: all 64 GPUs data-parallel
    e.fits, e.step_time, e.tflops_per_gpu, e.to_json()
    best = zp.search(model, cluster, run)[0]              # the fastest plan that fits
    zp.from_flags(zero=3, offload_optimizer="cpu", micro_batch=2, seq=4096)  # the CLI's flag names, as a Plan

    python -m zfunc.plan --params 70e9 --gpu H100-80GB --gpus 64 --zero 3 --offload-optimizer cpu --json
    python -m zfunc.plan --params 70e9 --gpus 64 --search
    python -m zfunc.plan --calibrate        # this machine's constants, into a JSON file
    python -m zfunc.plan --validate         # predicted vs measured on this machine's benchmarks
    python -m zfunc.plan --papers           # the published headline runs, predicted

The estimator takes the plan a run takes (``zf.config.Plan``, the one type: ``zf.parallelize``
runs it) and returns an ``Estimate``; ``zfunc.core.compose``'s rulebook says what zfunc does not run
(the estimate models it and says so in ``notes``; ``search`` skips it).

**Law.** The model states predicted per rank are the bytes zfunc's engine holds: for a model whose
leaves are known (``from_module``), ``engine_bytes`` / ``offload_bytes`` equal what
``step.memory(state)`` reports on every rank, for every ZeRO stage and offload placement, and
``engine_comm`` the bytes its collectives count (tests/test_plan.py runs both on 1, 2 and 4 ranks).
In the ZeRO paper's own accounting (``zero_paper``) the same code gives its Figure 1: 120, 31.4,
16.6 and 1.9 GB per device for 7.5B params on 64 GPUs.

**What is predicted, and how** (details in each module's docstring): bytes per rank by place (GPU,
CPU RAM, NVMe) and component (``memory``), communication per collective and step (``cost``), step
time as a roofline over compute, collectives and offload traffic that overlaps what the engine
overlaps (``cost``), TFLOP/s per GPU and MFU, and whether it fits (``core``). The constants are the
datasheets' (``hardware``) times stated efficiencies; ``--calibrate`` measures this machine's
(``calibrate``) and ``--validate`` checks the time model against its benchmarks (``validate``).

**Cost.** Nothing is allocated or launched: a plan takes ~0.1 ms, ``search`` a few thousand plans.
"""
from __future__ import annotations

from zfunc.plan.core import Estimate, compression_speedup, plan
from zfunc.plan.hardware import GPUS, NODES, Cluster, Device, Node, cluster
from zfunc.plan.cost import engine_comm
from zfunc.plan.memory import (engine_bytes, local_numel, offload_bytes, offload_holds_grads, working_bound,
                               zero_paper)
from zfunc.plan.model import (ModelSpec, from_flavor, from_hf_config, from_module, from_params, from_shape,
                              register_flavors)
from zfunc.plan.search import search
from zfunc.plan.strategy import describe, from_flags


__all__ = [
    "GPUS", "NODES", "Cluster", "Device", "Estimate", "ModelSpec", "Node", "cluster", "compression_speedup", "describe",
    "engine_bytes", "engine_comm", "from_flags", "from_flavor", "from_hf_config", "from_module", "from_params",
    "from_shape", "local_numel", "offload_bytes", "offload_holds_grads", "plan", "register_flavors", "search",
    "working_bound", "zero_paper",
]
