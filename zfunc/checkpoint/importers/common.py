"""Fill any zfunc step's state from another tool's checkpoint, reading only the rows each rank holds.

A *source* (``deepspeed_zero.DeepSpeedSource``, ``dcp.DCPSource``) describes what the foreign
checkpoint holds as a zfunc manifest would (each param's whole shape and dtype, the module
buffers) and answers ``read(name, kind, start, stop)``: rows ``[start, stop)`` along dim 0 of a
param's whole tensor (``kind="param"``) or of its Adam moments (``"exp_avg"``, ``"exp_avg_sq"``),
fp32 on the CPU. ``fill`` builds the target state exactly as ``zf.checkpoint.load`` does (the
step's ``init`` on the meta device, so any layout: plain, ZeRO 0-3 on any ranks, offloaded,
pipelined), checks the model against the source (missing, unexpected and mis-shaped names, one
``CheckpointError``), and asks the source, leaf by leaf, for the rows this rank's leaf holds:

- ``params/NAME`` -> ``read(NAME, "param", rows)``;
- an ``AdamState(count, mu, nu)`` anywhere in the optimizer state (``zf.optim.adam``/``adamw``,
  also inside ``chain``): ``mu`` -> ``exp_avg``, ``nu`` -> ``exp_avg_sq``, ``count`` -> the source's
  optimizer step count (torch and DeepSpeed keep one per param group or param: they agree);
- ``step`` -> the source's training step; ``buffers/NAME`` -> the buffer, whole;
- ``rng`` and ``loss_scale`` stay as the step's ``init`` made them (the other tools' RNG and loss
  scaler do not map onto zfunc's).

Any other optimizer leaf (SGD momentum, Lion) is refused, naming it; with ``optimizer=False`` the
optimizer state starts fresh (counts 0, moments and momenta zero: what ``init`` gives Adam, SGD and
Lion) and only params, buffers and ``step`` load.

Cost: each rank reads the bytes of its own rows (plus the page or chunk around them), one leaf at
a time; no rank ever holds another rank's rows or the whole model, unless its layout holds it.
A tensor-parallel rank's sliced leaves (``Rows.slicing``) are read whole, one at a time, and its slice cut
from each.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Protocol

import optree
import torch

from zfunc.checkpoint import restore
from zfunc.checkpoint import layout as cl
from zfunc.core import tree
from zfunc.checkpoint.files import CheckpointError
from zfunc.optim import AdamState
from zfunc.core.step import Step
from zfunc.core.state import TrainState

KINDS = ("param", "exp_avg", "exp_avg_sq")
ADAM_FIELDS = {1: "exp_avg", 2: "exp_avg_sq"}  # AdamState(count, mu, nu) field index -> torch's name


class Source(Protocol):
    """What a foreign checkpoint holds, as zfunc sees it."""

    where: str  # the path, for errors
    params: dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> whole shape, dtype (fp32 masters)
    buffers: dict[str, tuple[tuple[int, ...], torch.dtype]]
    step: int  # training steps taken
    optimizer_step: int | None  # optimizer updates applied; None: the checkpoint has no optimizer state

    def read(self, name: str, kind: str, start: int, stop: int) -> torch.Tensor: ...

    def read_buffer(self, name: str) -> torch.Tensor: ...


WRAPPERS = ("module.", "_orig_mod.")  # DDP / DeepSpeed's engine, torch.compile: on every name


def strip_wrappers(names: list[str]) -> dict[str, str]:
    """The model's name for each of ``names``: a wrapper's prefix shared by all of them dropped."""
    out = {n: n for n in names}
    changed = True
    while changed and out:
        changed = False
        for prefix in WRAPPERS:
            if all(k.startswith(prefix) for k in out):
                out, changed = {k[len(prefix):]: v for k, v in out.items()}, True
    return out


def _manifest(source: Source, names: dict[str, str], buffers: dict[str, str]) -> dict:
    """The source described as a zfunc manifest (what ``restore.template``/``check_model`` read)."""
    dt = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    leaves = [{"path": cl.PARAMS + n, "full_shape": list(source.params[o][0]), "shape": list(source.params[o][0]),
               "dtype": dt(source.params[o][1])} for n, o in names.items()]
    leaves += [{"path": cl.BUFFERS + n, "shape": list(source.buffers[o][0]), "dtype": dt(source.buffers[o][1])}
               for n, o in buffers.items()]
    return {"leaves": leaves}


def _adam_nodes(template: TrainState) -> set[tuple[str, ...]]:
    """The tree paths (under ``opt_state``) of the state's ``AdamState`` nodes."""
    paths, nodes, _ = optree.tree_flatten_with_path(template.opt_state, is_leaf=lambda x: isinstance(x, AdamState),
                                                     namespace=tree.NAMESPACE)
    return {tuple(map(str, p)) for p, x in zip(paths, nodes) if isinstance(x, AdamState)}


def _role(physical: tuple, adam: set[tuple[str, ...]]) -> tuple[str, int | None]:
    """What a leaf of the target state is: ("param"|"buffer"|"step"|"keep"|"count"|"moment"|"other", field)."""
    head, rest = physical[0], tuple(physical[1:])
    if head == "params":
        return "param", None
    if head == "buffers":
        return "buffer", None
    if head == "step":
        return "step", None
    if head in ("rng", "loss_scale"):
        return "keep", None
    if head == "opt_state":
        for n in range(len(rest), -1, -1):
            if rest[:n] in adam and len(rest) > n:
                field = int(rest[n])
                return ("count", None) if field == 0 else ("moment", field)
        return "other", None
    return "other", None


def _reader(source: Source, names: dict[str, str], slot: cl.Slot, role: str, field: int | None, like: Any,
            optimizer: bool) -> Callable[[], Any]:
    """A function returning the leaf's value (a CPU tensor shaped like ``like``, or a number)."""
    def read() -> Any:
        if role == "keep":
            return like
        if role == "step":
            return source.step
        if role == "count":
            return source.optimizer_step if optimizer else 0
        if role == "buffer":
            return source.read_buffer(names[slot.path]).reshape(like.shape)
        if role in ("moment", "other") and not optimizer:  # fresh: zero moments, zero counts
            return torch.zeros(like.shape, dtype=like.dtype) if isinstance(like, torch.Tensor) else 0
        kind = "param" if role == "param" else ADAM_FIELDS[field]
        if slot.slicing is None:
            value = source.read(names[slot.split_like], kind, *slot.rows)
        else:  # a tensor-parallel slice: the whole leaf read, this rank's slice and rows cut from it
            full = slot.full_shape
            whole = source.read(names[slot.split_like], kind, 0, full[0] if full else 1).reshape(full)
            value = slot.slicing.piece(whole, slot.index).reshape(-1, *slot.cut_shape[1:])[slice(*slot.rows)]
        return value.reshape(like.shape).to(like.dtype)

    return read


def _check_optimizer(source: Source, slots: list[cl.Slot], roles: list[tuple[str, Any]], optimizer: bool) -> None:
    others = [s.path for s, (r, _) in zip(slots, roles) if r == "other"]
    if optimizer and others:
        raise CheckpointError(f"{source.where}: the step's optimizer state has leaves an imported checkpoint cannot "
                              f"fill: {others[:5]} (imports read Adam/AdamW moments: zf.optim.adam or adamw, "
                              "optionally inside chain); pass optimizer=False to start the optimizer state fresh")
    if optimizer and source.optimizer_step is None and any(r in ("count", "moment") for r, _ in roles):
        raise CheckpointError(f"{source.where}: the checkpoint holds no optimizer state (no Adam moments); "
                              "pass optimizer=False to load params only and start the optimizer state fresh")
    wrong = [s.split_like for s, (r, _) in zip(slots, roles) if r == "param" and s.split_like is None]
    if wrong:
        raise CheckpointError(f"{source.where}: params {wrong[:5]} are not tensors in the step's state")


def fill(source: Source, step_or_template: Step | TrainState, *, params: Any = None,
         device: str | torch.device = "cpu", optimizer: bool = True) -> TrainState:
    """The state of ``step_or_template``'s layout with the values ``source`` holds (see module docstring)."""
    names, buffers = strip_wrappers(list(source.params)), strip_wrappers(list(source.buffers))
    manifest = _manifest(source, names, buffers)
    where = Path(source.where)
    template, said, model = restore.template(manifest, step_or_template, params)
    slots, leaves, treespec = cl.slots(template)
    restore.check_model(where, manifest, template, slots, leaves, said)
    physical = [tuple(map(str, p)) for p in optree.tree_flatten_with_path(template, namespace=tree.NAMESPACE)[0]]
    adam = _adam_nodes(template)
    roles = [_role(p, adam) for p in physical]
    _check_optimizer(source, slots, roles, optimizer)
    lookup = {**names, **{cl.BUFFERS + n: o for n, o in buffers.items()}}
    lazy = tree.unflatten(treespec, [_reader(source, lookup, s, r, f, x, optimizer)
                                     for s, (r, f), x in zip(slots, roles, leaves)])
    restored = restore.restored(step_or_template, template, lazy, model, device)
    if restored is not None:
        return restored
    return tree.map(lambda read, like: restore.to_device(read(), like, device), lazy, template)


def directory(path: str | os.PathLike, argument: str = "path") -> Path:
    """``path`` as an existing directory, else a ``CheckpointError`` naming it."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{argument}: expected a path, got {type(path).__name__}")
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{argument}: {str(path)!r} is not a directory" + (" (it does not exist)"
                                                                                 if not p.exists() else ""))
    return p
