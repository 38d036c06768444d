"""Read a DeepSpeed ZeRO checkpoint (stages 1-3, any data-parallel world size) without deepspeed.

What ``engine.save_checkpoint(root)`` writes and its ``zero_to_fp32`` reads::

    root/latest                                          the tag, e.g. "global_step100"
    root/TAG/mp_rank_00_model_states.pt                  stages 1/2: module state dict, param_shapes, ...
    root/TAG/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: the same per rank (module tensors empty)
    root/TAG/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   rank R's fp32 partition and Adam state

Where a param's fp32 master lives (``zero_to_fp32``'s rules, which this module follows):

- **Stages 1/2**: per param group ``g``, the params (``param_shapes[g]``, in order, each followed by
  ``param_alignment_paddings[g][i]`` elements) are one flat vector, cut into one contiguous
  partition per rank (``single_partition_of_fp32_groups[g]``, saved without the padding at the
  end); the whole vector is the ranks' partitions concatenated.
- **Stage 3**: each param is flattened, padded to ``ceil(numel / world) * world`` and rank R holds
  elements ``[R * p, (R + 1) * p)`` of it (``p = ceil(numel / world)``); a rank's flat vector
  (``fp32_flat_groups``, concatenated over its sub-groups) holds its piece of every param, in
  order, with no other padding.

The Adam moments (``exp_avg``, ``exp_avg_sq``) are laid out as the fp32 partitions they belong to,
in the wrapped torch optimizer's state (one flat "param" per group); ``step`` is the count.

Reading rows ``[a, b)`` of a param therefore touches only the ranks' files holding those
elements: each file is opened with ``torch.load(mmap=True)``, so only its pickle (a few KB of
metadata) and the pages of the slices read come from disk, and they are given back once copied
(``release``), so a rank's RSS grows by what it keeps, not also by the file pages it read.

Their pickles are read by ``safe_unpickle.DEEPSPEED``, never by a bare ``pickle`` or
``torch.load``: tensors, torch's containers and sizes are built as usual, DeepSpeed's own classes
(its enums, its loss scaler, ``fragment_address``) as inert stand-ins (``Opaque``), so deepspeed
need not be installed and none of its code runs; any other global (``os.system``, ``exec``,
``getattr``, numpy's, another framework's ``client_state`` objects such as an
``argparse.Namespace``) is a ``CheckpointError`` naming the file and the global, raised before
anything can call it. A checkpoint from someone else can give wrong values, which the reader
checks against each other (sizes, partition counts), but cannot run code.

Not read: tensor-parallel checkpoints (``mp_rank_01``: refused), frozen params (refused, naming
them), the loss scaler (fp16 runs restart from zfunc's scale), the LR scheduler and the RNG.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import re
from pathlib import Path
from typing import Any

import torch

from zfunc.checkpoint.files import CheckpointError
from zfunc.checkpoint.importers import safe_unpickle
from zfunc.checkpoint.importers.safe_unpickle import Opaque

OPTIM_GLOB = "*_optim_states.pt"
MODEL_GLOB = "*_model_states.pt"


def torch_load(path: Path) -> dict:
    """A DeepSpeed ``.pt`` file, memory-mapped (tensors are read when sliced), without deepspeed,
    through ``safe_unpickle.DEEPSPEED``: a global it does not hold is a ``CheckpointError`` naming it."""
    try:
        out = torch.load(path, map_location="cpu", mmap=True, weights_only=False,
                         pickle_module=safe_unpickle.pickle_module(safe_unpickle.DEEPSPEED))
    except safe_unpickle.Refused as e:
        raise CheckpointError(f"{path}: {e}") from None
    except Exception as e:  # noqa: BLE001  (torch raises many kinds on a file that is not its own)
        raise CheckpointError(f"{path}: not a readable torch checkpoint file ({type(e).__name__}: {e})") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{path}: expected a dict, found a {type(out).__name__}")
    return out


_libc = ctypes.CDLL(None, use_errno=True) if hasattr(mmap, "MADV_DONTNEED") else None


def release(t: torch.Tensor) -> None:
    """Drop the pages of the file mapping ``t`` lies in, once copied out (they count in RSS until
    the kernel reclaims them). Only for tensors of ``torch_load``: ``mmap=True`` maps the file
    private and nothing writes to it, so a dropped page touched again (another tensor sharing it)
    is read back from the file. ``MADV_DONTNEED`` costs a page-table walk; ``MADV_PAGEOUT``, safe
    on any memory, took ~2x the load time here."""
    if _libc is None or t.numel() == 0:
        return
    start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    stop = t.data_ptr() + t.numel() * t.element_size()
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), mmap.MADV_DONTNEED)


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def named_tag(root: Path) -> str | None:
    """The tag ``root/latest`` names (None without a ``latest``): the name of a directory in
    ``root``, never a path leading out of it (``..``, ``/x``), else a ``CheckpointError``."""
    latest = root / "latest"
    if not latest.is_file():
        return None
    raw = latest.read_bytes()
    try:
        named = raw.decode().strip()
    except UnicodeDecodeError:
        named = raw[:80]
    if not (isinstance(named, str) and named not in ("", ".", "..") and not re.search(r"[/\\\0]", named)
            and (root / named).is_dir()):
        raise CheckpointError(f"{latest} names {named!r}; expected the name of a directory in {root} (a tag such "
                              "as 'global_step100')")
    return named


def find_tag_dir(root: Path, tag: str | None) -> Path:
    """The directory holding the ``*_optim_states.pt`` files: ``root/tag``, ``root/<latest>``, or root."""
    if tag is not None:
        if not (root / tag).is_dir():
            raise CheckpointError(f"tag: {root / tag} is not a directory")
        return root / tag
    named = named_tag(root)
    if named is not None:
        return root / named
    if any(root.glob(OPTIM_GLOB)):
        return root
    raise CheckpointError(f"{root}: not a DeepSpeed checkpoint (no 'latest' file and no {OPTIM_GLOB} files)")


def _int(x: Any) -> int:
    return int(x.value if isinstance(x, Opaque) else getattr(x, "value", x))


def _count(x: Any) -> int:
    return int(x.item() if isinstance(x, torch.Tensor) else x)


class DeepSpeedSource:
    """A DeepSpeed ZeRO checkpoint as a ``common.Source``: reads rows of params and moments."""

    def __init__(self, root: Path, tag: str | None = None) -> None:
        self.tag_dir = find_tag_dir(root, tag)
        self.where = str(self.tag_dir)
        d = self.tag_dir
        if any(d.glob("*mp_rank_01*")):
            raise CheckpointError(f"{d}: a tensor-parallel DeepSpeed checkpoint (mp_rank_01 files); zfunc reads "
                                  "data-parallel ZeRO checkpoints (mp_rank_00 only)")
        self.optim_files = sorted(d.glob(OPTIM_GLOB), key=_natural)
        model_files = sorted(d.glob(MODEL_GLOB), key=_natural)
        if not self.optim_files or not model_files:
            raise CheckpointError(f"{d}: not a DeepSpeed ZeRO checkpoint (found {len(model_files)} {MODEL_GLOB} "
                                  f"and {len(self.optim_files)} {OPTIM_GLOB} files, expected both)")
        self._open: dict[int, dict] = {}
        first = self._optim(0)
        self.stage = _int(first["zero_stage"])
        world = first.get("partition_count")
        self.world = max(world) if isinstance(world, (list, tuple)) else int(world)
        if self.world != len(self.optim_files):
            raise CheckpointError(f"{d}: the checkpoint was written by {self.world} data-parallel ranks but holds "
                                  f"{len(self.optim_files)} {OPTIM_GLOB} files (an overwritten or partial save?)")
        self._model_states(model_files[0])
        self._layout()

    # -- the files

    def _optim(self, rank: int) -> dict:
        if rank not in self._open:
            sd = torch_load(self.optim_files[rank])
            if "optimizer_state_dict" not in sd or "zero_stage" not in sd["optimizer_state_dict"]:
                raise CheckpointError(f"{self.optim_files[rank]}: not a ZeRO optimizer state file "
                                      "(no optimizer_state_dict.zero_stage)")
            self._open[rank] = sd["optimizer_state_dict"]
        return self._open[rank]

    def _model_states(self, path: Path) -> None:
        sd = torch_load(path)
        if "param_shapes" not in sd or "buffer_names" not in sd:
            raise CheckpointError(f"{path}: not a DeepSpeed model states file (no param_shapes, buffer_names)")
        frozen = sd.get("frozen_param_shapes") or {}
        if frozen:
            raise CheckpointError(f"{path}: the checkpoint has frozen params {list(frozen)[:5]}, which zfunc's "
                                  "import does not read yet")
        self.groups = [[(str(n), tuple(int(x) for x in s)) for n, s in g.items()] for g in sd["param_shapes"]]
        self.params = {n: (s, torch.float32) for g in self.groups for n, s in g}
        self.shared = {str(k): str(v) for k, v in (sd.get("shared_params") or {}).items()}
        module = sd.get("module") or {}
        names = [n for n in sd["buffer_names"] if n in module]
        self._buffers = {n: module[n] for n in names}
        self.buffers = {n: (tuple(t.shape), t.dtype if not t.is_floating_point() else torch.float32)
                        for n, t in self._buffers.items()}
        self.step = int(sd.get("global_steps", 0))
        self.config = sd.get("ds_config") if isinstance(sd.get("ds_config"), dict) else None

    # -- where each param lives

    def _layout(self) -> None:
        """``self.place[name] = (group, offset)``: stages 1/2: the offset in group g's whole flat
        vector; stage 3: the offset of its piece in every rank's flat vector."""
        self.place: dict[str, tuple[int, int]] = {}
        if self.stage in (1, 2):
            paddings = self._optim(0).get("param_alignment_paddings")
            sizes = [[t.numel() for t in self._optim(r)["single_partition_of_fp32_groups"]] for r in range(self.world)]
            self.rank_starts = [[sum(sizes[q][g] for q in range(r)) for r in range(self.world + 1)]
                                for g in range(len(self.groups))]
            for g, group in enumerate(self.groups):
                offset = 0
                for i, (name, shape) in enumerate(group):
                    self.place[name] = (g, offset)
                    offset += math.prod(shape) + (paddings[g][i] if paddings else 0)
                if offset > self.rank_starts[g][-1]:
                    raise CheckpointError(f"{self.where}: param group {g} needs {offset} elements, its partitions "
                                          f"hold {self.rank_starts[g][-1]}")
        elif self.stage == 3:
            flats = [t.numel() for t in self._optim(0)["fp32_flat_groups"]]
            self.group_starts = [sum(flats[:g]) for g in range(len(flats) + 1)]
            offset = 0
            for group in self.groups:
                for name, shape in group:
                    self.place[name] = (0, offset)
                    offset += math.ceil(math.prod(shape) / self.world)
            if offset != self.group_starts[-1]:
                raise CheckpointError(f"{self.where}: the params' stage-3 pieces need {offset} elements per rank, "
                                      f"the flat groups hold {self.group_starts[-1]}")
        else:
            raise CheckpointError(f"{self.where}: ZeRO stage {self.stage}; zfunc reads stages 1, 2 and 3")
        state = self._adam_state(0, 0)
        self.optimizer_step = _count(state["step"]) if state and "step" in state else None

    def _adam_state(self, rank: int, group: int) -> dict | None:
        sd = self._optim(rank)
        base = sd.get("optimizer_state_dict") if self.stage == 3 else sd.get("base_optimizer_state")
        if isinstance(base, dict) and "state" in base:  # a torch optimizer's state_dict: one flat param per group
            return base["state"].get(group)
        if isinstance(base, (list, tuple)) and group < len(base):  # stage 1/2 "elastic": per group, unpadded
            state = dict(base[group])
            if "step" not in state and "base_optimizer_state_step" in sd:
                state["step"] = sd["base_optimizer_state_step"]
            return state
        return None

    def _flat(self, rank: int, group: int, kind: str) -> torch.Tensor:
        if kind == "param":
            key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
            return self._optim(rank)[key][group]
        state = self._adam_state(rank, group)
        if not state or kind not in state:
            raise CheckpointError(f"{self.optim_files[rank]}: no {kind} for param group {group} (expected the "
                                  "state of Adam/AdamW)")
        return state[kind]

    def _segments(self, name: str, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """Elements ``[lo, hi)`` of the flattened param as ``(rank, group, start, stop)`` slices."""
        group, offset = self.place[name]
        out = []
        if self.stage in (1, 2):
            starts = self.rank_starts[group]
            a, b = offset + lo, offset + hi
            for r in range(self.world):
                s, e = max(a, starts[r]), min(b, starts[r + 1])
                if s < e:
                    out.append((r, group, s - starts[r], e - starts[r]))
            return out
        piece = math.ceil(math.prod(self.params[name][0]) / self.world)
        for r in range(self.world):
            s, e = max(lo, r * piece), min(hi, (r + 1) * piece)
            if s < e:  # position in rank r's flat vector, then in its sub-group
                flat_s, flat_e = offset + s - r * piece, offset + e - r * piece
                for g in range(len(self.group_starts) - 1):
                    gs, ge = max(flat_s, self.group_starts[g]), min(flat_e, self.group_starts[g + 1])
                    if gs < ge:
                        out.append((r, g, gs - self.group_starts[g], ge - self.group_starts[g]))
        return out

    def read(self, name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of param ``name``'s whole ``kind`` tensor, fp32, a new CPU tensor."""
        shape = self.params[name][0] or (1,)
        tail = math.prod(shape[1:])
        parts = [self._flat(r, g, kind)[s:e] for r, g, s, e in self._segments(name, start * tail, stop * tail)]
        out = torch.cat(parts) if parts else torch.empty(0)
        for part in parts:
            release(part)
        if out.numel() != (stop - start) * tail:
            raise CheckpointError(f"{self.where}: {kind} of {name} rows [{start}, {stop}) has {out.numel()} elements "
                                  f"in the partitions, expected {(stop - start) * tail}")
        return out.float().reshape(stop - start, *shape[1:])

    def read_buffer(self, name: str) -> torch.Tensor:
        return self._buffers[name].clone()
