"""The machines a plan runs on: accelerators from their datasheets, nodes, and a cluster of them.

**Accelerators** (``GPUS``): dense (no 2:4 sparsity) tensor-core peak FLOP/s, HBM size and
bandwidth, as the vendor's datasheet gives them. Sparsity figures are twice the dense ones and are
never used here. V100 has no bf16: its fp16 tensor-core peak is used for fp16, and asking for bf16
on it is an error.

- H100-80GB (SXM5): 989 TFLOP/s bf16/fp16, 67 fp32, 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s
  (both directions). NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/
- H200 (SXM): 989 TFLOP/s bf16/fp16, 67 fp32, 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
  NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/
- A100-80GB (SXM4): 312 TFLOP/s bf16/fp16, 19.5 fp32, 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s.
  NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/
- A100-40GB (SXM4): 312 TFLOP/s bf16/fp16, 19.5 fp32, 40 GB HBM2 at 1,555 GB/s; NVLink 600 GB/s.
  Same datasheet.
- V100-32GB / V100-16GB (SXM2): 125 TFLOP/s fp16 tensor core, 15.7 fp32, 32 / 16 GB HBM2 at
  900 GB/s; NVLink 300 GB/s. NVIDIA Tesla V100 datasheet, https://www.nvidia.com/en-us/data-center/v100/

**Nodes** (``NODES``): the server each accelerator usually comes in, for what the datasheets of the
accelerators do not say: GPUs per node, NVLink/NVSwitch bandwidth per GPU (one direction), the
node's aggregate network bandwidth (one direction), PCIe bandwidth per GPU, CPU RAM, the CPU's
memory bandwidth (what CPU-Adam is bound by) and NVMe. DGX H100/H200 (8 GPUs, 8x400 Gb/s
InfiniBand, 2 TB RAM), DGX A100 (8 GPUs, 8x200 Gb/s, 1 TB; Azure's NDm A100 v4 has 1.7 TB), DGX-2
(16 V100, 8x100 Gb/s, 1.5 TB, 30 TB NVMe). PCIe, CPU memory bandwidth and NVMe speed are typical
values, not measurements: every field is a flag of ``python -m zfunc.plan``, and ``--calibrate``
measures this machine's own.

**Efficiencies** (one place): a large GEMM reaches ``matmul_efficiency`` of the datasheet peak,
what published large-model runs reach (0.47 on H100/H200, 0.52 on A100, 0.48 on V100:
``H100_MATMUL``, ``A100_MATMUL``, ``V100_MATMUL``, each with its source; ``--calibrate`` on a GPU
machine records its bf16 GEMM rate: pass rate / peak as ``--matmul-efficiency``), attention 0.6 of it,
memory-bound kernels 0.8 of the HBM bandwidth, NCCL collectives 0.8 of the link bandwidth, CPU-Adam
0.6 of the CPU's memory bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

GB = 1e9
AXES = ("dp", "pp", "sp", "tp")  # the mesh axes a link bandwidth is given for (``Cluster.links``)


@dataclass(frozen=True)
class Device:
    """One accelerator (or, calibrated, this machine's CPU acting as one).

    ``peak``: dense FLOP/s by compute dtype (None: not supported). ``hbm_bytes`` / ``hbm_bw``: memory
    size (bytes) and bandwidth (bytes/s). ``matmul_efficiency``: the fraction of ``peak`` a large GEMM
    reaches; ``attention_efficiency`` the same for fused attention; ``memory_efficiency`` the fraction
    of ``hbm_bw`` elementwise kernels reach. ``activation_rate``: elements per second of the MLP's
    activation function where it is bound by arithmetic (a CPU's erf/exp), None where by memory (a
    GPU). ``first_touch_bw``: bytes per second of the first write into memory fresh from the
    allocator (a CPU: each new page faults and the kernel clears it); None where the allocator caches
    (a GPU). ``source``: where the numbers come from.
    """

    name: str
    peak: dict[str, float | None]
    hbm_bytes: float
    hbm_bw: float
    matmul_efficiency: float = 0.8
    attention_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    kind: str = "cuda"  # "cuda": compute overlaps communication and host traffic; "cpu": it does not
    source: str = ""
    activation_rate: float | None = None  # GELU/SiLU elements per second; None: bound by memory bandwidth
    first_touch_bw: float | None = None  # bytes/s of first writes to fresh pages; None: no page faults (a GPU)

    def flops(self, precision: str) -> float:
        """Peak FLOP/s for ``precision``; raises if the device has no such arithmetic."""
        value = self.peak.get(precision)
        if not value:
            supported = [p for p, v in self.peak.items() if v]
            raise ValueError(f"precision: {self.name} has no {precision} arithmetic (supported: {supported})")
        return value


def _gpu(name, half, fp32, mem_gb, bw_gbs, source, bf16=True, matmul=0.8) -> Device:
    peak = {"bf16": half * 1e12 if bf16 else None, "fp16": half * 1e12, "fp32": fp32 * 1e12}
    return Device(name, peak, mem_gb * GB, bw_gbs * GB, matmul_efficiency=matmul, source=source)


# Large-model training efficiencies, as published (the fraction of the half-precision peak a whole step
# of a large transformer reaches; the roofline applies it to the GEMMs, whose time dominates such steps),
# each from a source none of ``--papers``' rows is:
# H100 0.47: Megatron-LM's README, "up to 47% Model FLOP Utilization (MFU) on H100 clusters" (2B-462B params,
#   sequence 4096; H200 assumed the same: the same tensor cores);
# A100 0.52: Narayanan et al., SC21 (arXiv:2104.04473), 1T params on 3072 A100 at 163 TFLOP/s per GPU;
# V100 0.48: Megatron-LM v1.0 (NVIDIA ADLR, 2020-05-15), 62.4 TFLOP/s sustained end to end by a 1.2B GPT,
#   "48% of the theoretical peak FLOPS for a single GPU in a DGX2-H server".
H100_MATMUL, A100_MATMUL, V100_MATMUL = 0.47, 0.52, 0.48


_H100 = "NVIDIA H100 datasheet (SXM5), nvidia.com/en-us/data-center/h100"
_H200 = "NVIDIA H200 datasheet (SXM), nvidia.com/en-us/data-center/h200"
_A100 = "NVIDIA A100 datasheet (SXM4), nvidia.com/en-us/data-center/a100"
_V100 = "NVIDIA V100 datasheet (SXM2), nvidia.com/en-us/data-center/v100"
GPUS: dict[str, Device] = {
    "H100-80GB": _gpu("H100-80GB", 989, 67, 80, 3350, _H100, matmul=H100_MATMUL),
    "H200": _gpu("H200", 989, 67, 141, 4800, _H200, matmul=H100_MATMUL),
    "A100-80GB": _gpu("A100-80GB", 312, 19.5, 80, 2039, _A100, matmul=A100_MATMUL),
    "A100-40GB": _gpu("A100-40GB", 312, 19.5, 40, 1555, _A100, matmul=A100_MATMUL),
    "V100-32GB": _gpu("V100-32GB", 125, 15.7, 32, 900, _V100, bf16=False, matmul=V100_MATMUL),
    "V100-16GB": _gpu("V100-16GB", 125, 15.7, 16, 900, _V100, bf16=False, matmul=V100_MATMUL),
}


@dataclass(frozen=True)
class Node:
    """What a server adds around its accelerators (bandwidths in bytes/s, one direction)."""

    gpus_per_node: int
    intra_bw: float  # NVLink/NVSwitch per GPU
    inter_bw: float  # the node's network, all NICs together
    pcie_bw: float  # host <-> one GPU, achievable
    cpu_ram: float  # bytes
    cpu_mem_bw: float  # the CPUs' memory bandwidth, all sockets
    nvme_bytes: float
    nvme_read_bw: float
    nvme_write_bw: float
    name: str = ""


NODES: dict[str, Node] = {
    "H100-80GB": Node(8, 450 * GB, 400 * GB, 50 * GB, 2000 * GB, 600 * GB, 30e12, 25 * GB, 15 * GB, "DGX H100"),
    "H200": Node(8, 450 * GB, 400 * GB, 50 * GB, 2000 * GB, 600 * GB, 30e12, 25 * GB, 15 * GB, "DGX H200"),
    "A100-80GB": Node(8, 300 * GB, 200 * GB, 25 * GB, 1000 * GB, 400 * GB, 15e12, 25 * GB, 12 * GB, "DGX A100"),
    "A100-40GB": Node(8, 300 * GB, 200 * GB, 25 * GB, 1000 * GB, 400 * GB, 15e12, 25 * GB, 12 * GB, "DGX A100"),
    "V100-32GB": Node(16, 150 * GB, 100 * GB, 12 * GB, 1500 * GB, 250 * GB, 30e12, 25 * GB, 12 * GB, "DGX-2"),
    "V100-16GB": Node(16, 150 * GB, 100 * GB, 12 * GB, 1500 * GB, 250 * GB, 30e12, 25 * GB, 12 * GB, "DGX-2"),
}


@dataclass(frozen=True)
class Cluster:
    """``gpus`` devices in nodes of ``node.gpus_per_node``, and the constants the time model uses.

    ``collective_efficiency``: the fraction of link bandwidth a large collective reaches;
    ``latency``: seconds per collective hop (a ring of N ranks pays ``N - 1`` of them);
    ``cpu_adam_efficiency``: the fraction of the CPU's memory bandwidth CPU-Adam reaches;
    ``collectives``: calibrated ``{"all_gather": (alpha_s, bytes_per_s), ...}`` that replace the
    link model (this machine's loopback gloo).
    ``links``: a link bandwidth per mesh axis (``"dp"``, ``"pp"``, ``"sp"``, ``"tp"``; bytes/s one rank
    moves in that axis's collectives and transfers), where the node model (``intra_bw`` inside a node,
    ``inter_bw`` shared across) does not say it: a dp axis on 1 Gbit/s Ethernet, ``{"dp": 1.25e8}``. It
    replaces both the node model and a calibrated rate for that axis.
    """

    device: Device
    gpus: int
    node: Node
    collective_efficiency: float = 0.8
    latency: float = 10e-6
    cpu_adam_efficiency: float = 0.6
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)
    links: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        for axis, bw in self.links.items():
            if axis not in AXES or isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
                raise ValueError(f"links: expected {{axis: bytes/s > 0}} with axes from {AXES}, got {axis!r}: {bw!r}")

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.node.gpus_per_node)

    @property
    def gpus_per_node(self) -> int:
        return min(self.gpus, self.node.gpus_per_node)


def cluster(gpu: str = "H100-80GB", gpus: int = 8, **overrides) -> Cluster:
    """A cluster of ``gpus`` of ``gpu`` in its usual nodes; ``overrides`` replace node fields
    (``gpus_per_node``, ``intra_bw``, ``inter_bw``, ``pcie_bw``, ``cpu_ram``, ``cpu_mem_bw``,
    ``nvme_bytes``, ``nvme_read_bw``, ``nvme_write_bw``), device fields (``matmul_efficiency``,
    ``hbm_bytes``, ...) or cluster fields (``collective_efficiency``, ``latency``, ...)."""
    if gpu not in GPUS:
        raise ValueError(f"gpu: expected one of {sorted(GPUS)}, got {gpu!r}")
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus: expected an int >= 1, got {gpus!r}")
    device, node = GPUS[gpu], NODES[gpu]
    split = {"device": {}, "node": {}, "cluster": {}}
    for key, value in overrides.items():
        if value is None:
            continue
        where = ("device" if key in Device.__dataclass_fields__ else "node" if key in Node.__dataclass_fields__
                 else "cluster" if key in Cluster.__dataclass_fields__ else None)
        if where is None:
            raise ValueError(f"{key}: not a device, node or cluster field")
        split[where][key] = value
    return Cluster(replace(device, **split["device"]), gpus, replace(node, **split["node"]), **split["cluster"])
