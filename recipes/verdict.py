"""A dry run's verdict: whether the run fits the machine it runs on, what binds, and a layout that fits.

The bytes are zfunc.plan's for this run's exact leaves and layout (``zp.plan`` of ``zp.from_module`` of
the meta-device model): one process's bytes by place (the device, CPU RAM, swap files) and component
(model states, activations, working memory). The machine (``this_machine``) is what it offers now: RAM
available (``MemAvailable``, within a cgroup's limit), free disk under ``--nvme-path`` (its nearest
existing folder: nothing is created), and on CUDA one GPU's memory. ``needs`` lays one on the other:

- on a CPU the device is RAM, which holds each process's device and CPU bytes; on CUDA one GPU holds
  one process's device bytes and RAM the CPU bytes of every process on the machine;
- the disk under ``--nvme-path`` holds twice the swap bytes of each process (a file keeps a spare);
- each of the job's processes on this machine (``LOCAL_WORLD_SIZE``) is counted as rank 0, the busiest:
  an upper bound.

When the run does not fit, ``zp.search`` ranks every layout it tries (ZeRO 0-3, offload none/cpu/nvme,
remat, the micro-batch split of the same ``--batch-size``, pipelines on several processes) by its
predicted tokens/s; the first that fits this machine by ``needs`` and that the recipe's layout flags
accept (``layout.resolve``) is given as the recipe's command line; with none, the leanest layout and
what it needs. On CUDA with a datasheet GPU the same search is given as ``python -m recipes.plan`` flags
(zfunc.plan's command line, the recipes' flavors known).
The time model of a CPU uses nominal rates (no measurement in a dry run): they order the layouts, the
bytes decide the fit.

Cost: one plan and one search of a few hundred layouts (about a second for a 70B model's 723 leaves);
nothing allocated, nothing written.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from recipes import layout
from recipes.layout import FlagError, flag

GB = 1e9
INF = float("inf")
# the layout flags a suggestion sets; the rest of the command line stays as given
LAYOUT_FLAGS = ("zero", "offload_optimizer", "offload_params", "nvme_path", "remat", "remat_offload", "pp",
                "microbatches", "accum", "deepspeed", "dry_run", "world_size")
MODEL_STATES = ("masters", "optimizer", "grad_shard", "compute_params", "whole_grads")
ACTIVATIONS = ("activations", "remat_inputs")


# ----------------------------------------------------------------------------- the machine
@dataclass(frozen=True)
class Machine:
    """What this machine offers a run, in bytes: RAM (total, available now), free disk in the nearest
    existing folder of --nvme-path (None: no --nvme-path), one GPU's memory (None: not on CUDA), and
    the job's processes on this machine."""

    ram_total: int
    ram_available: int
    disk_path: str | None = None
    disk_free: int | None = None
    gpu_name: str | None = None
    gpu_bytes: int | None = None
    local_ranks: int = 1


def ram() -> tuple[int, int]:
    """``(total, available)`` bytes of RAM: /proc/meminfo's MemTotal and MemAvailable (sysconf's
    physical and free pages elsewhere), within this process's cgroup v2 ``memory.max``."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        total, available = (int(info[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        total, available = page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")
    limit, used = _cgroup_memory()
    if limit is not None:
        total, available = min(total, limit), min(available, max(0, limit - used))
    return total, available


def _cgroup_memory() -> tuple[int | None, int]:
    """``(memory.max, memory.current)`` of this process's cgroup v2; ``(None, 0)`` without a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        rel = next(line.split("::", 1)[1] for line in lines if line.startswith("0::"))
        group = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit == "max":
            return None, 0
        return int(limit), int((group / "memory.current").read_text())
    except (OSError, StopIteration, ValueError, IndexError):
        return None, 0


def disk(path: str) -> tuple[str, int]:
    """``(folder, free bytes)``: the nearest existing folder of ``path`` (itself if it exists) and the
    bytes free there to this user (``shutil.disk_usage``); nothing is created."""
    there = Path(path).absolute()
    while not there.is_dir() and there != there.parent:
        there = there.parent
    return str(there), shutil.disk_usage(there).free


def this_machine(nvme_path: str | None, device: torch.device | str) -> Machine:
    """This machine as a run on ``device`` with swap files under ``nvme_path`` sees it now."""
    total, available = ram()
    folder, free = disk(nvme_path) if nvme_path is not None else (None, None)
    name = gpu = None
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))  # no CUDA context is made
        name, gpu = props.name, int(props.total_memory)
    return Machine(total, available, folder, free, name, gpu, local_ranks())


def local_ranks() -> int:
    """The job's processes on this machine: torchrun's LOCAL_WORLD_SIZE (else WORLD_SIZE, else 1)."""
    for key in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        try:
            return max(1, int(os.environ[key]))
        except (KeyError, ValueError):
            continue
    return 1


# ----------------------------------------------------------------------------- needs against the machine
@dataclass(frozen=True)
class Need:
    """One resource: bytes needed (``parts`` by what they hold), bytes there are (None: no such
    resource), and how it is named in the verdict."""

    resource: str
    need: float
    have: float | None
    parts: dict[str, float] = field(default_factory=dict)
    where: str = ""

    @property
    def over(self) -> float:
        return self.need - (self.have or 0.0)

    @property
    def fits(self) -> bool:
        return self.need <= 0 or (self.have is not None and self.need <= self.have)

    @property
    def load(self) -> float:
        """Fraction of the resource used (inf where there is none)."""
        if self.need <= 0:
            return 0.0
        return self.need / self.have if self.have else INF


def _parts(places: list[dict[str, float]], ranks: int) -> dict[str, float]:
    out = {"model states": 0.0, "activations": 0.0, "working memory": 0.0}
    for place in places:
        for name, n in place.items():
            part = ("model states" if name in MODEL_STATES else "activations" if name in ACTIVATIONS
                    else "working memory")
            out[part] += ranks * n
    return {k: v for k, v in out.items() if v}


def needs(memory: dict[str, dict[str, float]], device_type: str, machine: Machine) -> list[Need]:
    """``memory`` (one process's bytes by place "gpu", "cpu", "nvme" and component: ``Plan.memory``)
    laid on ``machine`` (module docstring): RAM, on CUDA one GPU's memory, and with swap files the disk."""
    n = machine.local_ranks
    gpu, cpu, nvme = (memory.get(k, {}) for k in ("gpu", "cpu", "nvme"))
    in_ram = [gpu, cpu] if device_type != "cuda" else [cpu]
    ram_parts = _parts(in_ram, n)
    out = [Need("RAM", sum(ram_parts.values()), machine.ram_available, ram_parts,
                f"of {_size(machine.ram_available)} available ({_size(machine.ram_total)} total)")]
    if device_type == "cuda":
        gpu_parts = _parts([gpu], 1)
        out.append(Need("GPU memory", sum(gpu_parts.values()), machine.gpu_bytes, gpu_parts,
                        f"of {_size(machine.gpu_bytes or 0)} on one {machine.gpu_name}"))
    scratch = n * nvme.get("held_grads", 0.0)  # the held grads' scratch files: no spares
    swap = n * sum(nvme.values()) - scratch
    if swap + scratch > 0:
        where = f"of {_size(machine.disk_free)} free" if machine.disk_free is not None else "(no --nvme-path)"
        parts = {"swap files": swap, "their spares": swap, **({"held grads": scratch} if scratch else {})}
        out.append(Need("disk", 2 * swap + scratch, machine.disk_free, parts, where))
    return out


def _size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def _name(need: Need, machine: Machine) -> str:
    return f"disk under {machine.disk_path}" if need.resource == "disk" and machine.disk_path else need.resource


def judge(found: list[Need], machine: Machine) -> tuple[bool, list[str]]:
    """``(fits, lines)``: the verdict on ``found`` (from ``needs``) and a line per resource."""
    fits = all(n.fits for n in found)
    over = [n for n in found if not n.fits]
    if fits:
        head = "verdict: fits this machine"
    else:
        head = "verdict: does not fit this machine: " + "; ".join(
            f"{n.resource} {_size(n.over)} over" if n.have is not None else f"{n.resource}: no --nvme-path for the "
            f"swap files" for n in over)
    lines = [head + (f" (zfunc.plan's bytes, {machine.local_ranks} processes here, each counted as rank 0)"
                     if machine.local_ranks > 1 and fits else "")]
    for n in found:
        parts = ", ".join(f"{k} {_size(v)}" for k, v in n.parts.items())
        verdict_of = (f"{n.load:.0%}" if n.fits else f"{_size(n.over)} over" if n.have is not None else "nowhere")
        lines.append(f"  {_name(n, machine)}: needs {_size(n.need)} ({parts}) {n.where}: {verdict_of}")
    if fits:
        tight = max(found, key=lambda n: n.load)
        lines.append(f"  tightest: {tight.resource}, {tight.load:.0%} of it used")
    return fits, lines


# ----------------------------------------------------------------------------- the run, in zfunc.plan's terms
def gpu_key(name: str | None, total: int | None) -> str | None:
    """The ``zp.GPUS`` entry of a CUDA device named ``name`` with ``total`` bytes, None if none."""
    if not name:
        return None
    big = (total or 0) > 60 * GB
    for part, key in (("H200", "H200"), ("H100", "H100-80GB"), ("A100", "A100-80GB" if big else "A100-40GB"),
                      ("V100", "V100-32GB" if (total or 0) > 20 * GB else "V100-16GB")):
        if part in name:
            return key
    return None


def cluster_of(machine: Machine, device_type: str, world: int):
    """``world`` processes, ``machine.local_ranks`` a node, for zfunc.plan's time model; memory without
    bounds (``needs`` decides the fit: a CPU's device and CPU bytes share one RAM)."""
    from zfunc import plan as zp

    gpn = min(world, machine.local_ranks)
    if device_type == "cuda":
        key = gpu_key(machine.gpu_name, machine.gpu_bytes)
        device = zp.GPUS.get(key) or zp.Device(machine.gpu_name or "GPU", {"bf16": 1e14, "fp16": 1e14, "fp32": 2e13},
                                               INF, 1e12, source="nominal")
        node = zp.NODES.get(key) or zp.NODES["H100-80GB"]
        return zp.Cluster(dataclasses.replace(device, hbm_bytes=INF), world,
                          dataclasses.replace(node, gpus_per_node=gpn, cpu_ram=INF, nvme_bytes=INF))
    rate = 5e10 * max(1, torch.get_num_threads() // gpn)  # nominal: what orders the layouts, not a measurement
    device = zp.Device("this machine's CPU (nominal rates)", {"fp32": rate, "bf16": rate, "fp16": rate}, INF, 1e10,
                       matmul_efficiency=1.0, kind="cpu", source="nominal")
    node = zp.Node(gpn, 5e9, 5e9, 1e10, INF, 1e10, INF, 1e9, 1e9, "this machine")
    return zp.Cluster(device, world, node)


def layout_flags(s, nvme_path: str | None) -> dict[str, object]:
    """The recipe's layout flags of the ``zf.config.Plan`` ``s`` (defaults left out but --zero;
    --nvme-path where something goes to NVMe)."""
    out: dict[str, object] = {"zero": s.zero_stage}
    if s.offload_optimizer != "none":
        out["offload_optimizer"] = s.offload_optimizer
    if s.offload_params != "none":
        out["offload_params"] = s.offload_params
    if "nvme" in (s.offload_optimizer, s.offload_params):
        out["nvme_path"] = nvme_path
    if s.remat:
        out["remat"] = True
    if s.remat_offload:
        out["remat_offload"] = True
    if s.pp > 1:
        out["pp"], out["microbatches"] = s.pp, s.microbatches
    elif s.accum > 1:
        out["accum"] = s.accum
    return out


def _argv(flags: dict[str, object]) -> list[str]:
    argv = []
    for name, value in flags.items():
        if value is True:
            argv.append(flag(name))
        elif value is not False and value is not None:
            argv += [flag(name), str(value)]
    return argv


def command(recipe: str, args: argparse.Namespace, layout: dict[str, object], world: int | None = None) -> str:
    """The command line of this run with ``layout`` in place of its layout flags (and of --deepspeed, whose
    precision and batch it keeps), without --dry-run; torchrun's where the job has several processes
    (torchrun's, else ``world``: the processes a dry run in one process plans)."""
    given = getattr(args, "given", frozenset())
    kept = {k: v for k, v in vars(args).items() if k in given and k not in LAYOUT_FLAGS}  # in the flags' order
    if "deepspeed" in given:
        kept.update(precision=args.precision, batch_size=args.batch_size)
    if world is None or "WORLD_SIZE" in os.environ:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    here = local_ranks() if "WORLD_SIZE" in os.environ else world  # a dry run plans its processes on this machine
    launcher = ["python", "-m", f"recipes.{recipe}"] if world == 1 else (
        ["torchrun"] + (["--nnodes", str(world // here)] if world > here else []) + ["--nproc_per_node", str(here),
                                                                                    "-m", f"recipes.{recipe}"])
    return shlex.join(launcher + _argv(kept) + _argv(layout))


def plan_command(recipe: str, args: argparse.Namespace, machine: Machine, world: int, precision: str) -> str | None:
    """The same search as ``python -m recipes.plan`` flags, where they can say this machine (a datasheet
    GPU, a --flavor or --hf-config model); None elsewhere."""
    key = gpu_key(machine.gpu_name, machine.gpu_bytes)
    if key is None or (args.flavor is None and args.hf_config is None):
        return None
    model = (["--flavor", args.flavor, "--recipe", recipe] if args.flavor is not None else
             ["--hf-config", args.hf_config])
    disk_gb = (machine.disk_free or 0) / GB
    argv = ["python", "-m", "recipes.plan", *model, "--gpu", key, "--gpus", str(world), "--gpus-per-node",
            str(min(world, machine.local_ranks)), "--cpu-ram", f"{machine.ram_available / GB:.0f}", "--nvme",
            f"{disk_gb:.0f}", "--seq", str(args.block_size), "--global-batch", str(args.batch_size),
            "--precision", precision, "--search"]
    return shlex.join(argv)


@dataclass
class Verdict:
    """Whether the run fits (None: zfunc.plan cannot model it), the lines to print, what it needs."""

    fits: bool | None
    lines: list[str]
    needs: dict[str, float] = field(default_factory=dict)


def of_run(recipe: str, args: argparse.Namespace, plan, built, device: torch.device, world: int) -> Verdict:
    """The verdict on the run ``args`` lays out as ``plan`` (``built``: its model on the meta device) on
    this machine, and a layout that fits when it does not (module docstring)."""
    from zfunc import plan as zp
    from zfunc.plan.model import KINDS

    machine = this_machine(args.nvme_path, device)
    if "WORLD_SIZE" not in os.environ:  # one process planning ``world`` (a dry run): all of them on this machine
        machine = dataclasses.replace(machine, local_ranks=world)
    try:
        spec = zp.from_module(built.module, kind=recipe if recipe in KINDS else "gpt", config=built.config)
        cluster = cluster_of(machine, device.type, world)
        base = dataclasses.replace(plan, seq=args.block_size)  # windows of --block-size tokens
        own = zp.plan(spec, cluster, base)
    except ValueError as e:
        return Verdict(None, [f"verdict: zfunc.plan cannot model this run ({e})"])
    found = needs(own.memory, device.type, machine)
    fits, lines = judge(found, machine)
    result = Verdict(fits, lines, {n.resource: n.need for n in found})
    if fits:
        return result
    ranked = zp.search(spec, cluster, base, global_batch=args.batch_size, top=1 << 30)
    leanest = None
    for p in ranked:
        theirs, flags = needs(p.memory, device.type, machine), layout_flags(p.plan, args.nvme_path)
        runs = None
        if leanest is None or _loads(theirs) < _loads(leanest[2]):
            runs = _runs(args, flags, world, built.units)
            leanest = (p, flags, theirs) if runs else leanest
        if all(n.fits for n in theirs) and (runs or runs is None and _runs(args, flags, world, built.units)):
            lines.append(f"  fits instead (zfunc.plan --search on this machine's RAM and disk, the fastest layout "
                         f"it predicts): {command(recipe, args, flags, world)}")
            break
    else:
        tried = (f"ZeRO 0-3, offload none/cpu/nvme, remat, micro-batches of --batch-size {args.batch_size}, "
                 f"--block-size {args.block_size}" + ("" if args.nvme_path is not None else
                                                      "; no --nvme-path: swap files not tried"))
        if leanest is not None:
            p, flags, theirs = leanest
            lines.append(f"  nothing zfunc.plan's search tries fits this machine ({tried}): the leanest, "
                         f"{shlex.join(_argv(flags))}, needs " + ", ".join(f"{n.resource} {_size(n.need)}"
                                                                            for n in theirs))
        else:
            lines.append(f"  nothing zfunc.plan's search tries fits this machine ({tried})")
    more = plan_command(recipe, args, machine, world, plan.precision)
    if more is not None:
        lines.append(f"  more layouts: {more}")
    return result


def _loads(found: list[Need]) -> tuple[float, ...]:
    """What orders layouts by leanness: the fullest resource's load first, then the next."""
    return tuple(sorted((n.load for n in found), reverse=True))


def _runs(args: argparse.Namespace, flags: dict[str, object], world: int, units: str | None) -> bool:
    """Whether the recipe takes these layout flags on ``world`` processes (``layout.resolve``)."""
    defaults = {k: v for k, v in layout.LAYOUT_DEFAULTS.items() if k in LAYOUT_FLAGS}
    trial = argparse.Namespace(**{**vars(args), **defaults, "accum": 1, **flags, "deepspeed": None})
    try:
        layout.resolve(trial, world, units, notices=False)
    except FlagError:
        return False
    return True
