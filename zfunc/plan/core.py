"""``plan(model, cluster, how) -> Estimate``: bytes per rank, communication, step time, fit, of
training ``model`` on ``cluster`` as the ``zf.config.Plan`` ``how`` says."""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

from zfunc.config.plan import Plan
from zfunc.plan import compression, cost
from zfunc.plan.hardware import Cluster
from zfunc.plan.memory import _bucket_elems, partition_params, rank_memory, remat_input_bytes
from zfunc.pipelining import build, check
from zfunc.pipelining.schedules import virtual_per_rank
from zfunc.plan.model import ModelSpec
from zfunc.plan.strategy import (BUCKET_MB, describe, elem, microbatches, offload_overlaps, resolve, shard_ranks,
                                  tiles)

GB = 1e9
CPU_RAM_USABLE = 0.9  # the OS, the framework and page cache keep the rest (assumption)


@dataclass
class Estimate:
    """One plan's prediction. Bytes are per rank (the busiest one) unless named per node. ``plan``
    is the plan as estimated (``dp``, ``seq`` and ``micro_batch`` filled in)."""

    model: ModelSpec
    cluster: Cluster
    plan: Plan
    memory: dict[str, dict[str, float]]
    comm: dict[str, float]
    time: dict[str, float]
    notes: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ derived figures
    def total(self, place: str) -> float:
        return sum(self.memory[place].values())

    @property
    def gpu_bytes(self) -> float:
        return self.total("gpu")

    @property
    def cpu_bytes_per_node(self) -> float:
        return self.total("cpu") * self.cluster.gpus_per_node

    @property
    def nvme_bytes_per_node(self) -> float:
        # the swap engine keeps a spare of each file of the state; the held grads' scratch files have none
        scratch = self.memory["nvme"].get("held_grads", 0.0)
        return (2 * self.total("nvme") - scratch) * self.cluster.gpus_per_node

    def component(self, name: str) -> float:
        return sum(place.get(name, 0.0) for place in self.memory.values())

    @property
    def params_bytes(self) -> float:
        return self.component("masters") + self.component("compute_params")

    @property
    def grads_bytes(self) -> float:
        return self.component("grad_shard") + self.component("whole_grads")

    @property
    def optimizer_bytes(self) -> float:
        return self.component("optimizer")

    @property
    def step_time(self) -> float:
        return self.time["step"]

    @property
    def tokens_per_step(self) -> int:
        s = self.plan
        return s.dp * s.micro_batch * s.seq * microbatches(s)

    @property
    def tflops_per_gpu(self) -> float:
        """FLOP/s each GPU runs (recomputation included, as DeepSpeed and Megatron report), in TFLOP/s."""
        flops = self.model.train_flops_per_token(self.plan.seq, self.plan.remat) * self.tokens_per_step
        return flops / self.cluster.gpus / self.step_time / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recomputation) per second over the datasheet peak."""
        flops = self.model.model_flops_per_token(self.plan.seq) * self.tokens_per_step
        return flops / self.cluster.gpus / self.step_time / self.cluster.device.flops(self.plan.precision)

    def why_not(self) -> list[str]:
        """Why it does not fit (empty when it fits)."""
        reasons = []
        hbm = self.cluster.device.hbm_bytes
        if self.gpu_bytes > hbm:
            reasons.append(f"GPU: {self.gpu_bytes / GB:.1f} GB per rank > {hbm / GB:.0f} GB "
                           f"of {self.cluster.device.name}")
        ram = self.cluster.node.cpu_ram * CPU_RAM_USABLE
        if self.cpu_bytes_per_node > ram:
            reasons.append(f"CPU RAM: {self.cpu_bytes_per_node / GB:.0f} GB per node > {ram / GB:.0f} GB usable")
        if self.nvme_bytes_per_node > self.cluster.node.nvme_bytes:
            reasons.append(f"NVMe: {self.nvme_bytes_per_node / GB:.0f} GB per node > "
                           f"{self.cluster.node.nvme_bytes / GB:.0f} GB")
        return reasons

    @property
    def fits(self) -> bool:
        return not self.why_not()

    def to_json(self) -> dict:
        """The machine-readable prediction (GB = 1e9 bytes, per rank unless named per node)."""
        return {
            "model": self.model.name or self.model.kind, "params": self.model.total_params,
            "gpu": self.cluster.device.name, "gpus": self.cluster.gpus,
            "plan": asdict(self.plan),
            "params_gb": self.params_bytes / GB, "grads_gb": self.grads_bytes / GB,
            "optimizer_gb": self.optimizer_bytes / GB,
            "model_states_gb": (self.params_bytes + self.grads_bytes + self.optimizer_bytes) / GB,
            "activations_gb": self.component("activations") / GB,
            "working_gb": (self.component("comm_buffers") + self.component("reserve") + self.component("staging")) / GB,
            "gpu_gb": self.gpu_bytes / GB, "cpu_gb": self.total("cpu") / GB, "nvme_gb": self.total("nvme") / GB,
            "cpu_gb_per_node": self.cpu_bytes_per_node / GB, "nvme_disk_gb_per_node": self.nvme_bytes_per_node / GB,
            "memory_bytes": self.memory,
            "comm_gb_per_step": sum(self.comm.values()) / GB,
            "comm_gb_by_collective": {k: v / GB for k, v in self.comm.items() if v},
            "step_time_s": self.step_time, "time_s": self.time,
            "tokens_per_step": self.tokens_per_step,
            "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
            "fits": self.fits, "why_not": self.why_not(), "notes": self.notes,
        }

    def table(self) -> str:
        """A human-readable summary."""
        j = self.to_json()
        lines = [f"{j['model']}: {self.model.total_params / 1e9:.3g}B params on {self.cluster.gpus} x "
                 f"{self.cluster.device.name} ({self.cluster.nodes} nodes)", f"plan: {describe(self.plan)}", ""]
        lines.append(f"{'per rank (GB)':<26}{'GPU':>10}{'CPU':>10}{'NVMe':>10}")
        names = sorted({n for place in self.memory.values() for n in place})
        for n in names:
            vals = [self.memory[p].get(n, 0.0) / GB for p in ("gpu", "cpu", "nvme")]
            lines.append(f"  {n:<24}" + "".join(f"{v:>10.3f}" for v in vals))
        lines.append(f"  {'total':<24}" + "".join(f"{self.total(p) / GB:>10.3f}" for p in ("gpu", "cpu", "nvme")))
        lines.append(f"model states: params {j['params_gb']:.3f} + grads {j['grads_gb']:.3f} + optimizer "
                     f"{j['optimizer_gb']:.3f} = {j['model_states_gb']:.3f} GB")
        lines.append("")
        lines.append("communication per rank per step (GB, as dist.Comm counts bytes): " + ", ".join(
            f"{k} {v:.3f}" for k, v in j["comm_gb_by_collective"].items()))
        lines.append("step time (s): " + ", ".join(f"{k} {v:.4g}" for k, v in self.time.items()))
        lines.append(f"throughput: {self.tokens_per_step / self.step_time:,.0f} tokens/s, "
                     f"{self.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {100 * self.mfu:.1f}%")
        lines.append(f"fits: {'yes' if self.fits else 'no: ' + '; '.join(self.why_not())}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan(model: ModelSpec, cluster: Cluster, how: Plan = Plan()) -> Estimate:
    """Predict memory, communication and step time of training ``model`` on ``cluster`` as the
    ``zf.config.Plan`` ``how`` says (``zfunc.plan.strategy.resolve`` fills and checks it)."""
    s, notes = resolve(how, cluster.gpus, model.max_seq)
    cluster.device.flops(s.precision)  # bf16 on a V100: an error, before anything else
    memory = rank_memory(model, s, cluster.device.kind)
    comm = compression.compressed_bytes(model, s, cost.comm_bytes(model, s))
    return Estimate(model, cluster, s, memory, comm, step_times(model, s, cluster), notes)


def compression_speedup(model: ModelSpec, cluster: Cluster, how: Plan) -> float:
    """The predicted step time of ``how`` without its compression (``compression.uncompressed``) over its
    step time with it: above 1 where compression pays (a slow link on the dp axis: ``Cluster.links`` or
    the nodes' network), below 1 where its codec costs more than the bytes it saves (NVLink)."""
    s, _ = resolve(how, cluster.gpus, model.max_seq)
    return step_times(model, compression.uncompressed(s), cluster)["step"] / step_times(model, s, cluster)["step"]


def step_times(model: ModelSpec, s: Plan, cluster: Cluster) -> dict[str, float]:
    """The step time and its parts (cost's module docstring)."""
    cpu = cluster.device.kind == "cpu"
    micro = cost.compute_times(model, s, cluster, logits=s.pp == 1)
    P, shared = partition_params(model, s)
    m, N = microbatches(s), shard_ranks(s)
    unit_frac = min(1.0, model.largest_unit_params(tiles(s)) / s.tp / max(P, 1))
    bucket_frac = min(1.0, _bucket_elems(BUCKET_MB) * N / max(P, 1))
    out = {}
    if s.pp == 1:
        out["compute"] = m * (micro.forward + micro.backward)
    else:
        out["compute"] = _pipeline_compute(model, s, cluster, micro)
    coll = lambda kind, nbytes: cost.collective_time(cluster, *compression.wire(model, s, kind, nbytes), N,  # noqa: E731
                                                     s.tp, "dp")
    e = elem(s)
    exposed = 0.0
    if N > 1:
        if s.zero_stage == 0:
            t = coll("all_reduce", 8 * P)
            exposed = t if cpu else max(t - micro.backward, 0) + t * bucket_frac
        elif s.zero_stage in (1, 2):
            exposed = coll("all_gather", e * P)
            rs = coll("reduce_scatter", 4 * P)
            if s.zero_stage == 1 and m > 1:
                exposed += rs
            else:
                n = m if s.zero_stage == 2 else 1
                exposed += n * (rs if cpu else max(rs - micro.backward, 0) + rs * bucket_frac)
        else:
            ag, rs = coll("all_gather", e * P), coll("reduce_scatter", 4 * P)
            if cpu:  # per unit (layers + the root) a gather in forward and backward and a reduce-scatter,
                # each with its latency: 2 ag + rs pay one each, the other ``layers`` units' come on top
                more = model.layers * (2 * cost.collective_latency(cluster, "all_gather", N)
                                       + cost.collective_latency(cluster, "reduce_scatter", N))
                per = 2 * ag + rs + more
            else:
                per = (max(ag - micro.forward, 0) + ag * unit_frac + max(ag + rs - micro.backward, 0)
                       + rs * unit_frac)
            exposed = m * per
        exposed += cost.collective_time(cluster, "all_reduce", 24, N, s.tp, "dp")  # the loss / grad norm: its latency
    out["dp_comm"] = exposed
    codec = compression.codec_time(model, s, cluster)
    if codec:
        out["codec"] = codec
    if s.tp > 1:  # Megatron's all-reduces of the layer's (T, h) activations, not overlapped
        count = 4 + (2 if s.remat else 0)
        one = cost.collective_time(cluster, "all_reduce", 2 * s.micro_batch * s.seq * model.hidden * e, s.tp, 1, "tp")
        out["tp_comm"] = m * math.ceil(model.layers / s.pp) * count * one
    if s.sp_size > 1:  # Ulysses' all-to-alls wait for each other; ring's blocks travel behind the attention
        moved = cost.sequence_bytes(model, s)
        if "all_to_all" in moved:
            out["sp_comm"] = cost.collective_time(cluster, "all_to_all", moved["all_to_all"], s.sp_size, s.tp, "sp")
        else:
            calls = math.ceil(model.layers / s.pp) * m * (3 if s.remat else 2) * (s.sp_size - 1)
            t = calls * cluster.latency + moved["send"] / cost.link_bandwidth(cluster, "sp", 2, s.tp)
            out["sp_comm"] = t if cpu else max(t - out["compute"], 0.0)
    if s.pp > 1 and s.pipeline_schedule != "zbv":  # ZB-V keeps the first and last stage on rank 0: nothing lent
        out["pp_shared"] = (e + 4) * shared / cost.link_bandwidth(cluster, "pp", 2, s.tp * s.dp)
    upd = cost.update_time(model, s, cluster)
    offloaded = s.offload_optimizer != "none" or s.offload_params != "none"
    if offloaded and offload_overlaps(s) and not cpu:
        out["update"] = max(upd - micro.backward, 0) + upd * unit_frac
    else:
        out["update"] = upd
    if s.remat_offload:  # layer inputs to CPU RAM in forward and back in backward, behind compute
        moved = 2 * m * remat_input_bytes(model, s, whole_model=True) / math.ceil(model.layers / s.pp) \
            * math.ceil(model.layers / s.pp)
        link = cluster.device.hbm_bw if cpu else cluster.node.pcie_bw
        out["remat_offload"] = moved / link if cpu else max(moved / link - out["compute"], 0)
    fetch = cost.fetch_time(model, s, cluster)
    if fetch:
        out["param_fetch"] = fetch if cpu else max(fetch - out["compute"], 0) + fetch * unit_frac
    out["step"] = sum(out.values())
    return out


def _pipeline_compute(model: ModelSpec, s: Plan, cluster: Cluster, busiest: cost.Compute) -> float:
    """``sum_s t_s + (m - 1) max_s t_s`` for GPipe and 1F1B, each slot with its activation's transfers
    both ways (``v`` of them per slot with ``v`` virtual stages per rank); for the other schedules
    ``m max_s t_s / (1 - bubble)``, their bubble simulated with unit op costs (``schedule_bubble``)."""
    p, m = s.pp, microbatches(s)
    per = -(-model.layers // p)
    first = cost.compute_times(model, s, cluster, layers=per, logits=False)
    last_layers = model.layers - per * (p - 1)
    last = cost.compute_times(model, s, cluster, layers=max(last_layers, 0), logits=True)
    act = s.micro_batch * s.seq * model.hidden * elem(s) / (s.tp if s.sp else 1)
    stride = s.tp * s.dp  # consecutive stages are a dp x tp block apart
    p2p = 2 * (cluster.latency + act / cost.link_bandwidth(cluster, "pp", 2, stride))
    if "send" in cluster.collectives and "pp" not in cluster.links:
        alpha, beta = cluster.collectives["send"]
        p2p = 2 * (alpha + act / beta)
    p2p *= virtual_per_rank(s.pipeline_schedule, s.virtual_stages)
    times = [first.forward + first.backward + p2p] + [busiest.forward + busiest.backward + p2p] * (p - 2) \
        + [last.forward + last.backward + p2p]
    if s.pipeline_schedule in ("gpipe", "1f1b"):
        return sum(times) + (m - 1) * max(times)
    return m * max(times) / (1 - schedule_bubble(s.pipeline_schedule, p, m, s.virtual_stages))


@functools.lru_cache(maxsize=256)
def schedule_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The busiest rank's idle fraction of pipeline schedule ``name`` (``zfunc.pipelining.check``:
    its simulated run, unit op costs): ``(p - 1) / (m + p - 1)`` for 1F1B."""
    return max(check(build(name, p, m, v)).bubble)
