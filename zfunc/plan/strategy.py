"""How a model is trained: parallelism, ZeRO stage, offload, remat, batch and precision.

``Strategy`` holds the flags of ``python -m zfunc.plan`` (the recipes' names). ``resolve`` fills
``dp`` from what tp and pp leave of the GPUs and checks the combination against what zfunc runs:
the engine's own refusals are errors (ZeRO 2/3 under a pipeline; params offload below stage 3 on
more than one rank; bf16 on a V100), and what the planner models but zfunc does not run yet (tensor
and sequence parallelism, offload under a pipeline) is kept and listed in ``notes``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

PLACES = ("none", "cpu", "nvme")
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("1f1b", "gpipe")
REMATS = ("none", "full", "offload")
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "lion": 4, "sgd": 4}  # fp32 moments per param


@dataclass(frozen=True)
class Strategy:
    """``micro_batch`` sequences of ``seq`` tokens per data-parallel rank per microbatch; ``accum``
    microbatches per step (the pipeline's microbatches when ``pp > 1``). ``remat``: "none", "full"
    (``zf.remat`` on every layer: only layer inputs kept) or "offload" (``zf.remat(offload=True)``:
    those inputs in CPU RAM); True/False mean "full"/"none". ``clip``: a global-norm clip (it keeps
    offload from updating during backward). ``fused_attention``: None is what
    ``scaled_dot_product_attention`` does (a flash kernel, on CUDA and on CPU). ``tiles``: ``zf.tile(k)`` on
    the largest Linears, so a stage-3 unit is 1/k of one."""

    dp: int | None = None
    pp: int = 1
    tp: int = 1
    sp: bool = False
    zero: int = 1
    offload_optimizer: str = "none"
    offload_params: str = "none"
    remat: str = "none"
    micro_batch: int = 1
    accum: int = 1
    seq: int | None = None
    precision: str = "bf16"
    optimizer: str = "adamw"
    clip: bool = True
    prefetch: int = 1
    bucket_mb: float = 25.0
    schedule: str = "1f1b"
    fused_attention: bool | None = None
    tiles: int = 1

    @property
    def elem(self) -> int:
        """Bytes of the compute dtype."""
        return 4 if self.precision == "fp32" else 2

    @property
    def opt_bytes(self) -> int:
        return OPTIMIZER_STATE_BYTES[self.optimizer]

    @property
    def recompute(self) -> bool:
        return self.remat != "none"

    def offload_overlaps(self) -> bool:
        """Whether offload updates units during backward (zfunc.offloading.step: no clip, no fp16, accum 1)."""
        return not self.clip and self.precision != "fp16" and self.accum == 1 and self.pp == 1

    def describe(self) -> str:
        par = f"dp={self.dp} pp={self.pp} tp={self.tp}" + (" sp" if self.sp else "")
        off = "" if self.offload_optimizer == "none" else f" offload optimizer={self.offload_optimizer}"
        off += "" if self.offload_params == "none" else f" params={self.offload_params}"
        extra = ("" if self.remat in ("none", False) else f" remat={self.remat}") + \
            ("" if self.tiles == 1 else f" tiles={self.tiles}")
        return (f"{par} zero={self.zero}{off}{extra} micro_batch={self.micro_batch} accum={self.accum} "
                f"seq={self.seq} {self.precision}")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


def resolve(strategy: Strategy, gpus: int, max_seq: int, device_kind: str = "cuda") -> tuple[Strategy, list[str]]:
    """``strategy`` with ``dp`` and ``seq`` filled in, checked; and notes on what zfunc does not run."""
    s = strategy
    if isinstance(s.remat, bool):
        s = replace(s, remat="full" if s.remat else "none")
    if s.remat not in REMATS:
        raise ValueError(f"remat: expected one of {REMATS} (or a bool), got {s.remat!r}")
    for name in ("pp", "tp", "micro_batch", "accum", "prefetch", "tiles"):
        if name == "prefetch":
            if not isinstance(s.prefetch, int) or s.prefetch < 0:
                raise ValueError(f"prefetch: expected an int >= 0, got {s.prefetch!r}")
            continue
        _positive(name, getattr(s, name))
    if s.zero not in (0, 1, 2, 3):
        raise ValueError(f"zero: expected 0, 1, 2 or 3, got {s.zero!r}")
    for name in ("offload_optimizer", "offload_params"):
        if getattr(s, name) not in PLACES:
            raise ValueError(f"{name}: expected one of {PLACES}, got {getattr(s, name)!r}")
    if s.precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {s.precision!r}")
    if s.optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer: expected one of {sorted(OPTIMIZER_STATE_BYTES)}, got {s.optimizer!r}")
    if s.schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {s.schedule!r}")
    if gpus % (s.tp * s.pp):
        raise ValueError(f"tp, pp: tp * pp = {s.tp * s.pp} does not divide the {gpus} GPUs")
    dp = gpus // (s.tp * s.pp) if s.dp is None else s.dp
    _positive("dp", dp)
    if dp * s.tp * s.pp != gpus:
        raise ValueError(f"dp, tp, pp: dp * tp * pp = {dp} * {s.tp} * {s.pp} = {dp * s.tp * s.pp}, but there are "
                         f"{gpus} GPUs")
    seq = s.seq or max_seq
    _positive("seq", seq)
    if s.sp and s.tp == 1:
        raise ValueError("sp: sequence parallelism splits along the tensor-parallel group; it needs tp > 1")
    if s.pp > 1 and s.zero > 1:
        raise ValueError(f"zero: under a pipeline zfunc shards with ZeRO 0 or 1 only (pipeline must be the "
                         f"outermost transformation), got zero={s.zero} with pp={s.pp}")
    if s.offload_params != "none" and s.zero != 3 and dp > 1:
        raise ValueError(f"offload_params: offloading params needs zero=3 (units fetched just in time) on more than "
                         f"one rank, got zero={s.zero}")
    notes = []
    if s.tp > 1:
        notes.append(f"tp={s.tp}: tensor parallelism is modelled as Megatron-LM runs it; zfunc does not run it yet")
    if s.sp:
        notes.append("sp: sequence parallelism is modelled as Megatron-LM runs it; zfunc does not run it yet")
    if s.pp > 1 and "none" != s.offload_optimizer:
        notes.append("offload under a pipeline is modelled; zfunc does not compose them yet")
    if dp == 1 and s.zero != 0 and s.offload_optimizer == "none" and s.offload_params == "none":
        notes.append("dp=1: ZeRO has no ranks to shard over; the plain step is what runs")
    fused = True if s.fused_attention is None else s.fused_attention  # SDPA's flash kernels, CUDA and CPU alike
    return replace(s, dp=dp, seq=seq, fused_attention=fused), notes
