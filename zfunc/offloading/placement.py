"""The placement of an offloaded state: ``OffloadSpec``, and how a checkpoint reads, saves and restores it.

An offloaded state is split as a sharded one (``ShardSpec``; a plain step's offload is sharded over
one process) and keeps each leaf in RAM or in a swap file (``OnDisk``). Its optimizer state is one
state per param leaf, ``opt_state/i/...``, made for ``{name_i: piece}``: a checkpoint stores it as
the plain state's (``logical_paths``), and loads it back leaf by leaf into where the step keeps it
(``restore``), so that at most one group of leaves is in RAM at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optree
import torch

from zfunc.core import placement, tree
from zfunc.core.state import TrainState
from zfunc.offloading.store import Store
from zfunc.sharding.layout import ShardPlacement, ShardSpec


@dataclass(frozen=True)
class OffloadSpec(ShardSpec):
    """A ``ShardSpec`` (a plain step's offload is sharded over one rank) plus where the state lives."""

    optimizer: str = "cpu"
    params: str | None = None
    path: str | None = None
    device: torch.device = torch.device("cpu")  # where forward and backward compute

    def __str__(self) -> str:
        return (f"stage {self.stage} over {self.world} ranks, optimizer on {self.optimizer}, params on "
                f"{self.params or 'the compute device'}")


def in_ram(state: TrainState) -> TrainState:
    """``state`` with every leaf kept in a swap file read back into (new) CPU tensors; the state
    itself is not consumed. What ``zf.checkpoint.save`` and ``full_params`` read an offloaded
    state through (so they need RAM for this rank's whole state). It writes nothing in the swap
    folder (a read-only engine): a state saves while that disk is full."""
    spec = state.placement
    if not isinstance(spec, OffloadSpec) or "nvme" not in (spec.optimizer, spec.params):
        return state  # nothing in files (the path is kept, but no folder was made)
    from zfunc.offloading.swap.engine import SwapEngine

    with SwapEngine(spec.path, read_only=True) as engine:  # a reader beside the step's engine, between steps
        store = Store(engine)
        futures = tree.map(store.fetch, (state.params, state.opt_state))  # RAM leaves come back as they are
        params, opt_state = tree.map(lambda f: f.result(), futures)
    return state.replace(params=params, opt_state=opt_state)


class OffloadPlacement(ShardPlacement):
    """A sharded state's placement, with the optimizer state one state per param leaf and leaves
    in swap files (module docstring)."""

    def logical_paths(self, state: TrainState, paths: list[str]) -> list[str]:
        """``opt_state/i/REST`` (leaf i's own optimizer state) is ``opt_state/REST`` with the param
        named by its tree path, not by the name its state was made for."""
        tree_paths = optree.tree_flatten_with_path(state.params, namespace=tree.NAMESPACE)[0]
        keys = ["/".join(map(str, p)) for p in tree_paths]
        names = [".".join(map(str, p)) for p in tree_paths]
        out = []
        for path in paths:
            if path.startswith("opt_state/"):
                _, i, *rest = path.split("/")
                name, rest = names[int(i)], "/".join(rest)
                if rest == name or rest.endswith("/" + name):
                    rest = rest[: len(rest) - len(name)] + keys[int(i)]
                path = "/".join(["opt_state", rest]) if rest else "opt_state"
            out.append(path)
        return out

    def in_memory(self, state: TrainState) -> TrainState:
        return in_ram(state)

    def restore(self, step: Any, leaves: TrainState, params: Any, device: str | torch.device) -> TrainState:
        """The offloaded step's state, each leaf read and placed before the next is read
        (``OffloadedStep.restore``): at most one group of leaves in RAM at once."""
        masters = tree.leaves(leaves.params)
        state = step.restore(params, lambda i: (masters[i](), tree.map(lambda read: read(), leaves.opt_state[i])),
                             device)
        return state.replace(step=leaves.step(), rng=leaves.rng(),
                             loss_scale=tree.map(lambda read: read(), leaves.loss_scale),
                             buffers={n: read().to(device) for n, read in leaves.buffers.items()})


placement.register(OffloadSpec, OffloadPlacement())
