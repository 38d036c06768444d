"""Pipeline schedules as plain data: per rank, the list of ops it runs, in order.

An ``Op`` is ``(kind, microbatch, stage)``: ``"F"`` forward, ``"B"`` backward, or the backward
split in two (zero-bubble): ``"I"`` the grad of the stage's input only (what the previous stage
waits for), ``"W"`` the grads of its params (what nobody waits for, run later to fill the
bubble). ``stage`` is the *virtual* stage: with ``v`` virtual stages per rank the model's units
are cut into ``p * v`` consecutive stages and ``Schedule.ranks[k]`` is the rank that runs stage
``k``. Sends and receives are not ops: the runner sends a stage's output (or its input's grad) as
the op that makes it ends, and receives it when the op that needs it starts (``check``
simulates exactly that).

Built-in schedules (``build(name, p, m, v)``), each a pure function of ``(p, m[, v])``, its peak
of live microbatches per rank (forwards whose activations are held: from ``F`` to its ``B`` or
``W``; with ``v > 1`` counted per virtual stage, each ``1/v`` of the rank's layers) stated in its
docstring and returned by ``peak_live(name, p, m, rank, v)``:

- ``gpipe``: every forward, then every backward.
- ``1f1b``: ``p - 1 - r`` forwards, then one forward and one backward alternately (PipeDream-flush).
- ``interleaved-1f1b``: 1F1B over ``v`` virtual stages per rank, placed round-robin (stage ``k``
  on rank ``k % p``), as torch's ``ScheduleInterleaved1F1B`` and Megatron-LM.
- ``zero-bubble``: ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each
  backward split into ``I`` and ``W``, rank ``r`` deferring ``r`` weight-grad ops to fill the
  cool-down, as torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank.
- ``zbv``: ZB-V, two virtual stages per rank in a V (rank ``r`` runs stages ``r`` and ``2p - 1 - r``),
  backwards split into ``I`` and ``W``, as torch's ``ScheduleZBVZeroBubble``.

A user's schedule is the same data (``Schedule.from_rows``, ``from_csv``: torchtitan's
``stage kind microbatch`` cells, ``0F1``), checked (``zfunc.pipelining.check``) before it runs.
Cost: O(p m v) to build.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

KINDS = ("F", "B", "I", "W")


class Op(NamedTuple):
    """One op of a rank's schedule: ``kind`` ("F", "B", "I" or "W") of ``microbatch`` on virtual ``stage``."""

    kind: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``ops[r]`` the ops rank ``r`` runs, in order; ``ranks[k]`` the rank of
    virtual stage ``k`` (``p * virtual`` of them); ``microbatches`` per batch."""

    name: str
    ranks: tuple[int, ...]
    microbatches: int
    ops: tuple[tuple[Op, ...], ...]

    @property
    def stages(self) -> int:
        """Ranks (pipeline stages) ``p``."""
        return len(self.ops)

    @property
    def virtual(self) -> int:
        """Virtual stages per rank ``v``."""
        return len(self.ranks) // max(1, len(self.ops))

    def stages_of(self, rank: int) -> list[int]:
        """The virtual stages rank ``rank`` runs, in order."""
        return [k for k, r in enumerate(self.ranks) if r == rank]

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[Op | tuple[str, int, int]]], name: str = "custom") -> Schedule:
        """A schedule from its ops per rank; each stage's rank is where its ops are, the microbatch
        count one more than the largest. ``ValueError`` (naming the op) where a stage's ops are on
        two ranks or the ranks hold different numbers of stages."""
        ops = tuple(tuple(Op(*op) for op in row) for row in rows)
        placed: dict[int, int] = {}
        for r, row in enumerate(ops):
            for op in row:
                if op.kind not in KINDS or min(op.microbatch, op.stage) < 0:
                    raise ValueError(f"schedule: op {tuple(op)} on rank {r}: expected (kind in {KINDS}, microbatch "
                                     ">= 0, stage >= 0)")
                if placed.setdefault(op.stage, r) != r:
                    raise ValueError(f"schedule: stage {op.stage} has ops on ranks {placed[op.stage]} and {r} "
                                     f"(op {op}); a virtual stage runs on one rank")
        count = max(placed, default=-1) + 1
        missing = [k for k in range(count) if k not in placed]
        per_rank = [sum(1 for k in placed.values() if k == r) for r in range(len(ops))]
        if missing or len(set(per_rank)) > 1 or not ops:
            raise ValueError(f"schedule: every rank must run the same number of virtual stages 0..{count - 1}; stages "
                             f"per rank {per_rank}" + (f", no ops for stages {missing}" if missing else ""))
        m = 1 + max((op.microbatch for row in ops for op in row), default=-1)
        return cls(name, tuple(placed[k] for k in range(count)), m, ops)

    def to_csv(self) -> str:
        """One line per rank, its ops as torchtitan writes them (``0F1,1F0,...``)."""
        return "\n".join(",".join(str(op) for op in row) for row in self.ops) + "\n"


_CELL = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


def from_csv(text: str, name: str = "custom") -> Schedule:
    """A schedule from CSV text: a line per rank, a cell per op, ``<stage><kind><microbatch>``
    (torchtitan's ``_Action`` spelling: ``0F1``, ``3I0``, ``2W5``; ``B`` is a whole backward);
    empty cells are skipped. ``ValueError`` naming the line and cell it cannot read."""
    rows = []
    for n, line in enumerate(text.strip().splitlines(), 1):
        row = []
        for cell in line.split(","):
            if not cell.strip():
                continue
            found = _CELL.match(cell)
            if found is None:
                raise ValueError(f"schedule: line {n}, cell {cell.strip()!r}: expected <stage><F|B|I|W><microbatch>, "
                                 "e.g. 0F1")
            row.append(Op(found[2], int(found[3]), int(found[1])))
        rows.append(row)
    return Schedule.from_rows(rows, name)


# ----------------------------------------------------------------------------- built-in schedules


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: rank ``r`` runs ``F`` of microbatches ``0..m-1``, then their ``B``. Peak live: ``m``."""
    return Schedule("gpipe", tuple(range(p)), m, tuple(
        tuple([Op("F", i, r) for i in range(m)] + [Op("B", i, r) for i in range(m)]) for r in range(p)))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: rank ``r`` runs ``w = min(p - 1 - r, m)`` forwards, then one forward and one backward
    alternately, then the remaining backwards. Peak live: ``min(p - r, m)``."""
    rows = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        ops = [Op("F", i, r) for i in range(warm)]
        for i in range(m - warm):
            ops += [Op("F", warm + i, r), Op("B", i, r)]
        rows.append(tuple(ops + [Op("B", i, r) for i in range(m - warm, m)]))
    return Schedule("1f1b", tuple(range(p)), m, tuple(rows))


def _rounds(p: int, m: int) -> list[list[int]]:
    """The microbatches cut into ``max(1, m // p)`` rounds of consecutive ones, sizes differing by
    at most one, the larger first: each of at least ``p`` microbatches when ``m >= p``."""
    count = max(1, m // p)
    base, extra = divmod(m, count)
    out, start = [], 0
    for j in range(count):
        size = base + (j < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021; torch's ``ScheduleInterleaved1F1B``): virtual
    stage ``k`` on rank ``k % p``. The microbatches go in rounds (``_rounds``: ``max(1, m // p)``
    of them, the first of ``q`` microbatches); a rank's forwards run round by round, each round
    through its stages in order, its backwards alike with the stages reversed. Rank ``r`` runs
    ``w = min((v - 1) q + 2 (p - 1 - r), m v)`` forwards, then one forward and one backward
    alternately, then the remaining backwards. Peak live (per virtual stage): ``min(w + 1, m v)``.
    Bubble with unit op costs: ``(p - 1) / (v m + p - 1)`` for ``m`` a multiple of ``p``."""
    rounds = _rounds(p, m)
    rows = []
    for r in range(p):
        forwards = [Op("F", i, c * p + r) for micro in rounds for c in range(v) for i in micro]
        backwards = [Op("B", i, c * p + r) for micro in rounds for c in reversed(range(v)) for i in micro]
        warm = min((v - 1) * len(rounds[0]) + 2 * (p - 1 - r), m * v)
        ops = forwards[:warm]
        for j in range(m * v - warm):
            ops += [forwards[warm + j], backwards[j]]
        rows.append(tuple(ops + backwards[m * v - warm :]))
    return Schedule("interleaved-1f1b", tuple(k % p for k in range(p * v)), m, tuple(rows))


def zero_bubble(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B whose backwards are split into ``I`` (input grad) then ``W``
    (weight grads). Rank ``r`` runs ``w = min(p - 1 - r, m)`` forwards, then per remaining
    microbatch ``F``, ``I`` and, from the ``r + 1``-th such pair on, the oldest pending ``W``;
    then each remaining ``I`` followed by the oldest pending ``W``, then the pending ``W``s. So
    rank ``r`` keeps up to ``r`` weight-grad ops back to fill the cool-down bubble. Peak live (a
    microbatch lives from ``F`` to its ``W``): ``min(m, p)``.
    Bubble with unit op costs (F = I = W): about a third of 1F1B's at ``m = p``."""
    rows = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        ops = [Op("F", i, r) for i in range(warm)]
        pending, done = [], 0
        for j in range(m - warm):
            ops += [Op("F", warm + j, r), Op("I", done, r)]
            pending.append(done)
            done += 1
            if j >= r:
                ops.append(Op("W", pending.pop(0), r))
        for i in range(done, m):
            ops.append(Op("I", i, r))
            pending.append(i)
            ops.append(Op("W", pending.pop(0), r))
        rows.append(tuple(ops + [Op("W", i, r) for i in pending]))
    return Schedule("zero-bubble", tuple(range(p)), m, tuple(rows))


def zbv(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", section 6; torch's
    ``ScheduleZBVZeroBubble``): two virtual stages per rank in a V, stage ``r`` and stage
    ``2p - 1 - r`` on rank ``r`` (rank 0 holds the first and the last, so a tied embedding and head
    stay on one rank and the turn of the V, stages ``p - 1`` and ``p``, passes no message), each
    backward split into ``I`` then ``W``. Rank ``r``: ``2(p - r) - 1`` forwards of its first stage;
    ``r`` pairs (second stage's F, first stage's F); ``p - r`` triples (second stage's F, I, W); then
    per microbatch left the first stage's F, I, W and the second stage's F, I, W; then the cool-down,
    ``r`` pairs of the two stages' I, ``p - r`` of the first stage's I and its oldest W, and the
    W's still pending. Built for ``max(m, 2p - 1)`` microbatches, the ops of those beyond ``m``
    dropped. Peak live (per virtual stage, each half the rank's layers; a microbatch lives from its F
    to its W): ``min(m + 1 + r, 2m, 2p)``, at most ``2p`` halves, the ``p`` whole microbatches 1F1B
    holds on rank 0. Bubble with unit op costs: ZB-H1's for ``m <= p``, about half of it from
    ``m = 2p`` on (0.06 vs 0.11 at p = 4, m = 8)."""
    n = max(m, 2 * p - 1)
    rows = []
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        count = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}
        ops: list[Op] = []

        def forward(chunk: int) -> None:
            ops.append(Op("F", count[f"F{chunk}"], (first, second)[chunk]))
            count[f"F{chunk}"] += 1

        def backward(chunk: int, weights: bool = True) -> None:
            i, stage = count[f"B{chunk}"], (first, second)[chunk]
            ops.extend([Op("I", i, stage)] + ([Op("W", i, stage)] if weights else []))
            count[f"B{chunk}"] += 1

        for _ in range(2 * (p - r) - 1):
            forward(0)
        for _ in range(r):
            forward(1)
            forward(0)
        for _ in range(p - r):
            forward(1)
            backward(1)
        while count["F1"] < count["F0"] or count["F0"] < n:
            if count["F0"] < n:
                forward(0)
            backward(0)
            forward(1)
            backward(1)
        weights = {0: count["B0"], 1: count["B1"]}  # the next W of each stage
        for _ in range(r):
            backward(0, weights=False)
            backward(1, weights=False)
        for _ in range(p - r):
            backward(0, weights=False)
            ops.append(Op("W", weights[0], first))
            weights[0] += 1
        ops += [Op("W", i, second) for i in range(weights[1], count["B1"])]
        ops += [Op("W", i, first) for i in range(weights[0], count["B0"])]
        rows.append(tuple(op for op in ops if op.microbatch < m))
    return Schedule("zbv", tuple(k if k < p else 2 * p - 1 - k for k in range(2 * p)), m, tuple(rows))


BUILT_IN = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Built-in schedule ``name`` for ``p`` ranks, ``m`` microbatches and ``v`` virtual stages per
    rank (``v > 1`` only with "interleaved-1f1b")."""
    if name not in BUILT_IN:
        raise ValueError(f"schedule: expected one of {BUILT_IN} or a zfunc.pipelining.Schedule, got {name!r}")
    if name == "zbv" and v in (1, 2):  # its two stages per rank are implied
        return zbv(p, m)
    if not isinstance(v, int) or v < 1 or (v > 1 and name != "interleaved-1f1b"):
        raise ValueError(f"virtual_stages: expected 1 with schedule {name!r} (more with 'interleaved-1f1b'; 'zbv' "
                         f"has 2), got {v!r}")
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "zero-bubble":
        return zero_bubble(p, m)
    return interleaved_1f1b(p, m, v)


def virtual_per_rank(name: str, v: int = 1) -> int:
    """Virtual stages per rank of built-in schedule ``name`` asked with ``virtual_stages=v``: 2 for "zbv"."""
    return 2 if name == "zbv" else v


def peak_live(name: str, p: int, m: int, rank: int, v: int = 1) -> int:
    """The peak of live microbatches on ``rank`` that built-in schedule ``name``'s docstring states."""
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(p - rank, m)
    if name == "zero-bubble":
        return min(m, p)
    if name == "zbv":
        return min(m + 1 + rank, 2 * m, 2 * p)
    q = len(_rounds(p, m)[0])
    return min((v - 1) * q + 2 * (p - 1 - rank) + 1, m * v)
