"""offload: optimizer state and params in CPU RAM or on NVMe, updated by CPU-Adam as grads arrive.

``zf.offload(step, optimizer="cpu"|"nvme", params=None|"cpu"|"nvme", path=...)`` returns a step
that trains exactly like ``step`` (a plain step, or ``zf.shard(step, mesh, stage)``) while keeping,
between steps, the optimizer state (``optimizer=``) and the fp32 master params in CPU RAM (pinned
when there is a GPU) or in swap files under ``path`` (``zfunc.offloading.swap.engine``), each process
in its own folder (``path/rank00003/`` for global rank 3, ``path`` itself alone), locked while used;
``zf.offloading.release(step, state)`` removes the files, and the folders made for them, once done.

**Placement.** The fp32 masters always live with the optimizer state (``optimizer=``), or where
``params=`` puts them. The compute device holds compute-dtype params only: with ``params=None`` the
whole of this rank's params in the compute dtype (``ComputeCopies``, written by each update in the
kernel's own pass and copied to the device; stages 1/2 gather them whole), with ``params`` offloaded
the live units (stage 3's gatherer fetching from the store). Bytes by place and kind, and their
formulas: ``zfunc.offloading.accounting`` (``memory``).

**Law.** For the same optimizer and kernel (``backend="auto"`` runs zfunc's CPU-Adam on the
offloaded leaves and on a plain step's state on the CPU; a plain step on a GPU runs torch's kernel,
which agrees with it to about an ulp per step) the offloaded step gives the same params, optimizer
state, loss and grad norm as ``step``, up to the rounding of the global norm, which is summed leaf by
leaf. Never a stale or delayed update.
Module buffers (BatchNorm statistics, ``zfunc.model.functional``) are not offloaded: they stay in
``state.buffers`` where the forward computes, updated and averaged over ranks as ``zf.shard`` says.

**How a step runs** (one param *leaf* is the unit of update; each leaf has its own optimizer
state, ``optimizer.init({name: piece})``, so a leaf can be updated alone; on NVMe a *group* of
consecutive leaves, up to ``group_bytes`` of masters, is the unit of storage: its masters in one
swap file, its optimizer states in another, ``zfunc.offloading.store``'s packed files):
- forward/backward: exactly ``shard``'s machinery, over a one-process mesh for a plain step.
  With ``params`` offloaded, units are fetched just in time (stage 3's gatherer) from the store,
  reads running ahead in the order recorded on the first step; else params are gathered whole.
- update: each leaf's master and state are read (``chunk_bytes`` of reads kept in flight ahead;
  on NVMe a group's files are read whole by its first leaf, the next groups' read ahead),
  updated by the optimizer's fused kernel on the CPU in the read buffer, and written back
  asynchronously (a group's files once its last leaf is updated: write-behind): disk reads, CPU
  work and disk writes of consecutive groups overlap (a 3-deep pipeline). A swap file costs
  ~0.3 ms per transfer whatever its size, so a group's two large transfers replace 2-4 per leaf.
  Without overlap the reads of masters and states start as backward starts (they need no grad).
  A group's leaves whose optimizer states merge (per-param dicts, equal counts:
  ``zfunc.offloading.merge.merge_states``) go through the kernel in one call (in RAM too): one
  call per group, not per leaf; the kernel is elementwise, so the values are the same.
- overlap with backward: when the optimizer does not need the global grad norm (its
  ``needs_global_norm`` declaration is False: no ``clip_by_global_norm``), there is no fp16
  overflow check and ``accum == 1``, a unit is updated as soon as its reduced grads exist, during
  the rest of backward. Otherwise all grad slices (fp32, 4 B/param/N; alone, autograd's own grads
  in the compute dtype) are held until backward ends and the norm is known, off the device as
  backward produces them (``zfunc.offloading.grads``): in host RAM with the optimizer there, in swap
  files beside the moments with the optimizer on NVMe (each leaf's norm taken on the way, so the
  global norm needs no read-back), so neither the device nor RAM holds a whole-model grad then;
  with the optimizer on NVMe, grads that fit in ``chunk_bytes`` stay in RAM instead (no more RAM
  than a spill's ``2 * chunk_bytes`` of writes in flight, and no disk write and read-back per step).
- grads reach CPU-Adam unscaled: it multiplies them by 1/(loss scale x ranks x microbatches), and by
  a ``clip_by_global_norm`` factor in front of it, in its own pass (``optim.apply(grad_scale=)``).
  Alone (one rank) nothing is reduced, so the grads are autograd's own, in the compute dtype
  (bf16/fp16, read as such by the kernel): no fp32 copy is packed per step (fresh pages, which
  fault on a CPU device) and no separate unscale or clip pass runs. Over ranks the reduce-scatter
  stays fp32 (the sums need it). The grad norm, where wanted
  (``train_step(grad_norm=True)``, clipping, fp16), is then summed from the squares CPU-Adam
  computes in its own pass over each grad (``optim.apply(squares=)``): the grads are read once.
  With ``train_step(grad_norm=False)`` and nothing else needing it, no norm is computed at all,
  held or overlapped, and only the loss is checked (the plain step's rule).

**Non-finite steps** (``zfunc.core.step``'s rules): without overlap the update waits for the grad norm,
so a step whose loss or grads are inf/nan writes nothing: the state comes back unchanged and
``metrics["skipped"]`` is True, as in the plain step. With overlap, updates start before the norm
exists, and an update cannot be taken back, so **only a non-finite loss is caught**: it is checked
(summed over the ranks: one more scalar all-reduce per step when N > 1) between forward and
backward, and then no leaf is updated and the step is skipped. Non-finite grads behind a finite
loss reach the leaves; the step then raises ``NonFiniteError`` (the state is consumed: restart
from a checkpoint) rather than return nan params. Pass ``overlap=False`` to have such steps
skipped too. A param no rank produced a grad for is left alone by the optimizer, except with
overlap on N > 1 ranks, where it is updated with a zero grad (no rank can know before its update
that the others produced none: weight decay applies to it).

**A full or failing swap disk.** ``init`` (and ``zf.checkpoint.load``) allocates beside each swap
file the room of its next version (its spare, ``zfunc.offloading.swap.engine``), and each step first makes sure of it
(``SwapEngine.reserve``: two stats per file; where room is missing, ``SwapPathError`` naming the
folder, its free bytes and the bytes needed, raised before the state is touched). On a file system
that overwrites in place (ext4, xfs) a step on a full disk then allocates nothing and trains on. A
swap read or write that fails anyway (an I/O error, a short write; no room on a copy-on-write file
system) fails the step with the engine's ``SwapError`` (no room: ``SwapPathError``, ``errno``
ENOSPC or EDQUOT) once every file the step rewrote is back to its version before it
(``SwapEngine.restore``). With ``optimizer="nvme"`` and the masters with it (``params`` None or
"nvme") the state passed in is then whole and not consumed: save it, or call the step again once
there is room. Other placements update their RAM leaves in place, so the state stays consumed and
the error says so: restart from a checkpoint. The held grads' files (``zfunc.offloading.grads``) are
scratch, overwritten in place: ``init`` checks their room too (no spare), and after the first step they
need no more. Over several ranks only the
failing rank raises (the others may wait in a collective): restart them all from a checkpoint.
``zf.checkpoint.save`` and ``full_params`` read the swap files without writing in their folder
(``in_ram``), so a full swap disk does not stop a save elsewhere.

**Cost** per rank, Psi params over N ranks (fp32 masters, Adam; ``zfunc.offloading.accounting``):
RAM between steps holds nothing of what is offloaded to "nvme"; ``optimizer="cpu"`` holds 12 Psi/N
of masters and moments in host RAM. Disk traffic per step with all on NVMe: reads 4 Psi/N per
forward/backward fetch of params + 12 Psi/N for the update; writes 12 Psi/N; with held grads over
``chunk_bytes``, e Psi (alone) or 4 Psi/N more written and read; disk space up to 24 Psi/N (the swap engine keeps a
spare of each file), twice the held grads' on top. The device holds the compute-dtype params
(``params=None``: e Psi/N, plus stages 1/2's whole gather) or a few units, and a bounded number of
grad buckets; the host ``chunk_bytes`` of reads and twice that of writes in flight.

``init(params, materialize=...)`` starts from meta-device params one group of leaves at a time,
so a model larger than RAM can start; ``zf.checkpoint.load(path, step)`` places a checkpoint the
same way, one group at a time (``restore``); ``zf.checkpoint.save`` / ``full_params`` read an offloaded state back
(``in_ram``).

bf16/fp16: a master kept in RAM gets its compute-dtype copy written by the update in the same pass
(``optim.apply(out=)``; zfunc's CPU-Adam writes it while it updates), kept between steps
(``ComputeCopies``, 2 B/param; with ``params=None`` on a GPU, copied to the device's copy) and
gathered by the next forward instead of the master: no cast pass, and half the bytes gathered.
With ``params=None`` a master on NVMe keeps its copy too (at fp32 the updated master itself); with
``params="nvme"`` masters are cast at the gather.

Over ranks, grads cross PCIe as fp32 on CUDA (alone, in the compute dtype); the updated params
cross it once, in the compute dtype.

The transformation (``offload``) is here; the step it returns (``OffloadedStep``: ``init``, ``restore``,
``memory``) is in ``zfunc.offloading.offloaded``; ``release`` in ``zfunc.offloading.teardown``; its placement
(``OffloadSpec``, ``in_ram``, how a checkpoint saves and restores it) is in ``zfunc.offloading.placement``; the
roles of one call are ``StoredPieces`` (params from the stores, ``zfunc.offloading.pieces``) and ``LeafUpdate``
(the leaf-by-leaf update, ``zfunc.offloading.run``), a call's stores and writes in flight are in
``zfunc.offloading.call_stores``, the grad sinks (``HeldSlices``, ``SpilledGrads``, ``UpdateOnArrival``) in
``zfunc.offloading.grads``, ``ComputeCopies`` in ``zfunc.offloading.copies``; the run that drives them is
shard's (``zfunc.sharding.run.StepRun``).
"""
from __future__ import annotations

from zfunc.core import compose
from zfunc.core.step import Step
from zfunc.dist import Mesh
from zfunc.offloading.offloaded import OffloadedStep
from zfunc.sharding.step import ShardedStep

PLACES = ("cpu", "nvme")


def offload(step: Step, optimizer: str = "cpu", params: str | None = None, *, path: str | None = None,
            chunk_bytes: int = 64 << 20, overlap: bool | None = None, units=None, prefetch: int = 1,
            group_bytes: int | None = None) -> OffloadedStep:
    """``step`` with its optimizer state and its fp32 master params kept in CPU RAM or
    on NVMe between steps, and updated there by the optimizer's CPU kernel, leaf by leaf.

    Args:
      step: a plain ``Step`` from ``train_step`` or a sharded one from ``zf.shard`` (stage 1-3;
        offloading ``params`` needs stage 3 or a plain step).
      optimizer: "cpu" (host RAM, pinned with a GPU) or "nvme" (swap files under ``path``).
      params: ``None`` (masters with the optimizer state; the device keeps the params whole in the
        compute dtype), "cpu" or "nvme": masters there, and each unit of params fetched just
        before use (stage 3's gatherer; ``units`` and ``prefetch`` as in ``zf.shard`` for a plain step).
      path: directory of the swap files, for "nvme" (checked for room and writability by ``init``).
        Each process keeps its files in its own folder, ``path/rank00003/`` for global rank 3
        (``path`` itself for a process alone), and locks it while its step lives: ranks given one
        path never share a file, and a second run on a path in use is refused (``SwapInUseError``).
      chunk_bytes: bytes of reads kept in flight ahead of the update and of param fetches (plus
        the group a read reaches into); writes in flight are bounded by twice this. With the
        optimizer on NVMe, grads held for the norm stay in RAM when they fit in it, else go to swap files.
      group_bytes: on NVMe, the fp32 master bytes of a group of consecutive leaves kept in one
        pair of swap files (masters, optimizer state), as DeepSpeed's ``sub_group_size``; a larger
        leaf is a group alone. Default ``chunk_bytes // 4``: a group's master and Adam moments fit
        the reads in flight. RAM holds a group's files while its leaves are in use.
      overlap: update units during backward (default: whenever the optimizer allows it; see the
        module docstring); True insists (error if not possible), False never. With overlap only a
        non-finite loss skips a step; non-finite grads behind a finite one raise ``NonFiniteError``
        with the state consumed (module docstring): False makes them skip the step too.
    Law and cost: the module docstring. Needs ``donate=True`` (the default): the state is updated
    where it lives, in RAM or in its files.
    """
    compose.check("offload", step, params=params, units=units)
    if optimizer not in PLACES:
        raise ValueError(f"optimizer: expected one of {PLACES}, got {optimizer!r}")
    if params not in (None, *PLACES):
        raise ValueError(f"params: expected None, 'cpu' or 'nvme', got {params!r}")
    if "nvme" in (optimizer, params) and not path:
        raise ValueError("path: 'nvme' offload needs a directory for its swap files, got none")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 4096:
        raise ValueError(f"chunk_bytes: expected an int >= 4096, got {chunk_bytes!r}")
    if group_bytes is not None and (not isinstance(group_bytes, int) or group_bytes < 1):
        raise ValueError(f"group_bytes: expected None or an int >= 1, got {group_bytes!r}")
    if not step.donate:
        raise ValueError("step: offload updates the state where it lives (RAM or files), so it needs a donating "
                         "step; build it with train_step(..., donate=True)")
    if compose.applied(step, "shard"):
        sharded = step
    else:  # a plain step is sharded over one process: its machinery fetches units and delivers grads
        from zfunc.model import units as units_mod

        sharded = ShardedStep(step, Mesh.alone(), 3 if params is not None else 2, units or units_mod.auto(),
                              prefetch, 25 << 18, verify=False)
    return OffloadedStep(step, sharded, optimizer, params, path, chunk_bytes, overlap, group_bytes)
