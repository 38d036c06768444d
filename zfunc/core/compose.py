"""compose: the rulebook. Which transformation may wrap which, and which plan settings go
together, stated once; every transformation, ``zf.config.Plan``, ``zf.config.check`` (so
``zf.parallelize``), the estimator (``zf.plan``) and ``zf.config.from_deepspeed`` ask it.

**Orders.** Two kinds of transformation exist. **Step transformations** take a ``Step`` and return
one (``zf.shard``, ``zf.offload``, ``zf.pipeline``); each records itself in the step's ``layers``
(innermost first: ``("train_step", "shard", "offload")`` for ``offload(shard(train_step(...)))``).
**Model transformations** take a model's function or layer and return one (``zf.remat``,
``zf.tile``, ``zf.sequence_parallel``): they act inside ``loss_fn``, below every step transformation,
so they compose with all of them and never take a step. ``zf.sequence_parallel`` asks one thing of
the step: its grads reduced over the ``dp x sp`` ranks, which ``zf.shard`` does over a mesh with ``sp``.

The table (rows: the transformation applied; columns: the outermost layer of the step it is given):

=============  ============  ==================  ==============  ==============
wraps ->       train_step    shard               offload         pipeline
=============  ============  ==================  ==============  ==============
shard          yes           no (once)           no [1]          no [2]
offload        yes           stages 1-3 [3]      no (once)       no [2]
pipeline       yes [5]       stages 1-3 [5]      yes [4]         no (once)
=============  ============  ==================  ==============  ==============

[1] offload places the state shard splits: ``zf.offload(zf.shard(step, mesh, stage), ...)``.
[2] the pipeline runs the whole step of a stage and must come last:
    ``zf.pipeline(zf.shard(step, Mesh(dp=d, pp=p), stage=1), ...)`` (docs/design.md, section 3:
    its schedule keeps several microbatches live, and it changes what a state and a loss are).
[3] stage 0 keeps every param whole on every rank; its replicas would each update a whole copy
    on the host: offload a plain step on one rank, or a stage 1-3 step. ``offload(params=...)``
    needs stage 3 (units fetched just in time); its ``units`` are the sharded step's.
[4] ``zf.pipeline(zf.offload(step, "cpu" | "nvme"), ...)``: each stage's optimizer state and fp32
    masters in CPU RAM or swap files, updated leaf by leaf by the offloaded step's update once the
    schedule ends; one rank per stage, or over a sharded step (``zf.offload(zf.shard(step,
    Mesh(dp=d, pp=p), stage))``, as [5]: each dp rank's slices); with ``params=``, the masters too,
    read at each step's start.
[5] the step accumulates nothing (``accum=1``: the pipeline splits the batch itself), and a mesh
    with ``dp > 1`` needs the dp axis sharded first (``zf.shard(step, mesh, stage)``, stage 1-3: each
    stage's params and optimizer state split over its dp ranks; stage 2/3 reduce-scatter each op's
    grads as it ends, stage 3 gathers the stage's params once per step); a sharded step pipelines
    over its own mesh.
``remat`` and ``tile`` wrap model functions under any row (a pipeline unit's own ``forward`` too:
the pipeline counts a unit's call within its call, which zf.remat makes, once); given a ``Step``,
they refuse it.

Every refused order is a ``ValueError`` naming both transformations (outer and inner) and the
order that works; a refused option (``offload(params=...)`` of a stage-2 step) names the option.

**Plan settings** (``RULES``; a plan is any object with ``zf.config.Plan``'s fields). Each rule is
one of two kinds:
- ``INCONSISTENT``: the settings contradict each other (pipeline microbatches
  without a pipeline; accumulation under a pipeline, which splits batches itself; params offload
  below stage 3 but for stage 0 on one rank; sequence parallelism without tensor parallelism).
  ``Plan(...)`` refuses them, so nothing else sees them.
- ``UNSUPPORTED``: consistent, but zfunc does not run it (optimizer
  offload at stage 0 over several ranks; params offload without optimizer offload; a pipeline over
  ``dp > 1`` or ``sp_size > 1`` at stage 0; ``sp_size > 1`` with Megatron's ``sp``; what
  ``zfunc.tensor`` does not run with tensor parallelism yet: its rows, registered by that package,
  replace the placeholder ``"tp"`` rows below, which refuse ``tp > 1`` where it is not imported).
  ``Plan`` holds them, ``zf.config.check`` and ``zf.parallelize`` refuse them, the estimator models
  them and says so in its notes, and its search skips them.
A refusal is one line naming the field, the value and what was expected (``"remat: ...; expected
remat=False with pp=2, got True"``).

**A new transformation** adds its row with ``register(name, wraps=..., wrapped_by=..., rules=...)``
(``unregister(name)`` takes it out), then calls ``check(name, step)`` when it is applied.

Cost: a dict lookup and a few comparisons per check.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

STEP_TRANSFORMS: tuple[str, ...] = ("shard", "offload", "pipeline")
MODEL_TRANSFORMS = ("remat", "tile", "sequence_parallel")
_PIPELINE_LAST = "zf.pipeline(zf.shard(step, zf.Mesh(dp=d, pp=p), stage=1), ...) or zf.pipeline(step, ...)"

Refusal = tuple[str, str]  # (why, the order that works)
# A verdict on (outer, inner): None (allowed), a Refusal, or a condition on the inner step and the
# outer's options, ``(step, options) -> None | Refusal | str``; a str is a whole refusal naming an option.
Verdict = Union[None, Refusal, Callable[[Any, Mapping[str, Any]], Union[None, Refusal, str]]]


def _offload_over_shard(step: Any, options: Mapping[str, Any]) -> Refusal | str | None:
    if step.stage == 0:
        return ("offloading a stage-0 (replicated) step is not supported yet: every rank would update a "
                "whole copy of the state on its host",
                "zf.offload(step, ...) of a plain step on one rank, or zf.offload(zf.shard(step, mesh, stage)) "
                "with stage 1, 2 or 3")
    if options.get("params") is not None and step.stage != 3:
        return f"params: offloading params needs stage 3 (units fetched just in time), the step is stage {step.stage}"
    if options.get("units") is not None:
        return "units: a sharded step brings its own units; pass them to zf.shard"
    return None


def _pipeline_over_step(step: Any, options: Mapping[str, Any]) -> str | None:
    if step.accum != 1:
        return (f"step: accum={step.accum}; the pipeline splits the batch into microbatches itself, build the step "
                "with accum=1")
    mesh = options.get("mesh")
    if getattr(mesh, "dp", 1) > 1:
        return (f"mesh: dp={mesh.dp}; shard the step over the dp axis first: "
                "zf.pipeline(zf.shard(step, mesh, stage=1), ...)")
    if getattr(mesh, "sp", 1) > 1:
        return (f"mesh: sp={mesh.sp}; the sequence ranks' grads are reduced by zf.shard over the dp x sp ranks: "
                "zf.pipeline(zf.shard(step, mesh, stage=1), ...)")
    return None


def _pipeline_over_shard(step: Any, options: Mapping[str, Any]) -> Refusal | str | None:
    talks = getattr(step.optimizer, "local_grads", None) is not None  # a 1-bit optimizer: stage 0, its own comm
    if step.stage not in (1, 2, 3) and not talks:
        return (f"pipeline composes with ZeRO stage 1, 2 or 3 over the dp axis, got stage {step.stage}",
                "zf.pipeline(zf.shard(step, zf.Mesh(dp=d, pp=p), stage=1), ...) (or stage 2, 3)")
    if options.get("mesh") is not None and options["mesh"] is not step.mesh:
        return "mesh: a sharded step pipelines over its own mesh; leave mesh out"
    return _pipeline_over_step(step, {})


def _pipeline_over_offload(step: Any, options: Mapping[str, Any]) -> Refusal | str | None:
    if "shard" in step.layers:
        return _pipeline_over_shard(step, options)
    return _pipeline_over_step(step, options)


def _shard_over_step(step: Any, options: Mapping[str, Any]) -> str | None:
    stage = options.get("stage", 0)
    if stage != 0 and getattr(step.optimizer, "local_grads", None) is not None:
        return (f"stage: the optimizer communicates itself (a 1-bit optimizer: it all-reduces its compressed "
                f"momentum over whole, replicated grads), which needs stage 0 (replicated data parallelism, where "
                f"DeepSpeed runs it too); got stage {stage}")
    return None


# (outer, inner) -> the verdict. Every pair of ``STEP_TRANSFORMS`` x ("train_step", *STEP_TRANSFORMS) has one.
TABLE: dict[tuple[str, str], Verdict] = {
    ("shard", "train_step"): _shard_over_step,
    ("shard", "shard"): ("the step is sharded already", "shard the plain step once: zf.shard(step, mesh, stage)"),
    ("shard", "offload"): ("offload places the state that shard splits, so it wraps the sharded step",
                           "zf.offload(zf.shard(step, mesh, stage), ...)"),
    ("shard", "pipeline"): ("the pipeline runs each stage's whole step and must be applied last", _PIPELINE_LAST),
    ("offload", "train_step"): None,
    ("offload", "shard"): _offload_over_shard,
    ("offload", "offload"): ("the step is offloaded already",
                             "offload the plain or sharded step once: zf.offload(step, ...)"),
    ("offload", "pipeline"): ("the pipeline runs each stage's whole step and must be applied last", _PIPELINE_LAST),
    ("pipeline", "train_step"): _pipeline_over_step,
    ("pipeline", "shard"): _pipeline_over_shard,
    ("pipeline", "offload"): _pipeline_over_offload,
    ("pipeline", "pipeline"): ("the step is pipelined already", "pipeline the plain or sharded step once"),
}


def layers(step: Any) -> tuple[str, ...]:
    """The transformations ``step`` was built from, innermost first (``()`` if not a ``Step``)."""
    return tuple(getattr(step, "layers", ()))


def applied(step: Any, name: str) -> bool:
    """Whether transformation ``name`` (``"shard"``, ``"offload"``, ``"pipeline"``) built ``step``."""
    return name in layers(step)


def outermost(step: Any) -> str | None:
    """The last transformation applied to ``step`` ("train_step" for a plain one)."""
    found = layers(step)
    return found[-1] if found else None


def spelled(step: Any) -> str:
    """How ``step`` was built, as code: ``zf.offload(zf.shard(step))``."""
    out = "step"
    for name in layers(step)[1:]:
        out = f"zf.{name}({out})"
    return out


def _no_row(outer: str, inner: str, works: str = "an order zfunc.core.compose.TABLE allows") -> Refusal:
    return (f"the rulebook has no row letting zf.{outer} wrap zf.{inner}", works)


def check(outer: str, step: Any, **options: Any) -> None:
    """Raise unless ``outer`` (a step transformation) may wrap ``step`` with ``options`` (the
    outer's arguments its verdict reads: offload's ``params`` and ``units``, the pipeline's ``mesh``): a
    ``TypeError`` for what is not a ``Step``, a ``ValueError`` naming both transformations and the
    order that works (or the option, its value and what was expected)."""
    from zfunc.core.step import Step

    if outer not in STEP_TRANSFORMS:
        raise ValueError(f"outer: expected one of {STEP_TRANSFORMS}, got {outer!r}")
    if not isinstance(step, Step) or not layers(step):
        raise TypeError(f"step: zf.{outer} transforms a Step from zf.train_step (or another step transformation), "
                        f"got {type(step).__name__}; zf.remat and zf.tile wrap the model's functions, which the "
                        f"loss_fn of zf.train_step runs: zf.{outer}(zf.train_step(loss_fn, ...), ...)")
    inner = outermost(step)
    verdict = TABLE.get((outer, inner), _no_row(outer, inner))
    if callable(verdict):
        verdict = verdict(step, options)
    if isinstance(verdict, str):
        raise ValueError(verdict)
    if verdict is not None:
        why, works = verdict
        raise ValueError(f"step: zf.{outer}({spelled(step)}) is refused: zf.{outer} cannot wrap zf.{inner}: "
                         f"{why}; the order that works: {works}")


def check_model_level(outer: str, fn: Any) -> None:
    """Raise a ``ValueError`` if a model transformation (``remat``, ``tile``) is given a step."""
    from zfunc.core.step import Step

    if isinstance(fn, Step):
        raise ValueError(f"{'fn' if outer == 'remat' else 'module_or_fn'}: zf.{outer}({spelled(fn)}) is refused: "
                         f"zf.{outer} wraps a model's function or layer, not a step ({outermost(fn)}); apply it to "
                         f"the model the loss runs, then build the step: "
                         + ("block.forward = zf.remat(block.forward)" if outer == "remat" else
                            "zf.tile(model, tiles=k, modules=['lm_head'])") + "; step = zf.train_step(loss_fn, ...)")


# ----------------------------------------------------------------------------- plan settings

INCONSISTENT = "inconsistent"  # the settings contradict each other: Plan(...) refuses them
UNSUPPORTED = "unsupported"    # consistent, but zfunc does not run it: check/parallelize refuse, the estimator notes
KINDS = (INCONSISTENT, UNSUPPORTED)


@dataclass(frozen=True)
class Rule:
    """One row of the plan table: ``refuses(plan)`` is None where ``plan`` keeps the rule, else the
    refusal, one line starting with the field it names (``"remat: ...; expected remat=False with
    pp=2, got True"``). ``owner``: the transformation whose row it is (``unregister`` removes it)."""

    name: str
    kind: str
    refuses: Callable[[Any], str | None]
    owner: str = ""


def _offloaded(p: Any) -> list[str]:
    return [f for f in ("offload_optimizer", "offload_params") if getattr(p, f) != "none"]


def _microbatches(p: Any) -> str | None:
    if p.pp == 1 and p.microbatches != 1:
        return (f"microbatches: pipeline microbatches need pp > 1 (without a pipeline use accum), "
                f"got {p.microbatches} with pp=1")
    return None


def _pipeline_accum(p: Any) -> str | None:
    if p.pp > 1 and p.accum != 1:
        return f"accum: a pipeline splits each batch into microbatches itself; expected 1 with pp={p.pp}, got {p.accum}"
    return None


def _params_stage(p: Any) -> str | None:
    if p.offload_params != "none" and not (p.zero_stage == 3 or (p.zero_stage == 0 and p.dp == 1)):
        return (f"offload_params: offloading params needs ZeRO stage 3 (or stage 0 on one rank), got "
                f"{p.offload_params!r} with zero_stage={p.zero_stage}, dp={p.dp}")
    return None


def _sequence_parallel(p: Any) -> str | None:
    if p.sp and p.tp == 1:
        return "sp: sequence parallelism splits along the tensor-parallel group; it needs tp > 1, got sp=True with tp=1"
    return None


def _sequence_pipeline(p: Any) -> str | None:
    sp = getattr(p, "sp_size", 1)
    if sp > 1 and p.pp > 1 and p.zero_stage == 0:
        return (f"zero_stage: a pipeline over sp_size={sp} ranks per stage reduces their grads through ZeRO stage 1 "
                f"(zf.pipeline composes with zf.shard stage 1-3 over the dp x sp ranks); expected 1 with pp={p.pp}, "
                f"got 0")
    return None


def _sequence_megatron(p: Any) -> str | None:
    sp = getattr(p, "sp_size", 1)
    if sp > 1 and p.sp:
        return (f"sp: Megatron's sequence parallelism of zf.tensor_parallel is not run with zf.sequence_parallel yet "
                f"(the step that reduces the sp ranks' grads does not sum its replicated grads over tp); expected "
                f"sp=False with sp_size={sp}, got sp=True")
    return None


def _replicated_offload(p: Any) -> str | None:
    if p.offload_optimizer != "none" and p.zero_stage == 0 and p.dp > 1:
        return (f"offload_optimizer: over dp={p.dp} ranks each rank offloads the shard it updates, which needs "
                f"zero_stage 1, 2 or 3 (as DeepSpeed); got {p.offload_optimizer!r} with zero_stage=0")
    return None


def _params_without_optimizer(p: Any) -> str | None:
    if p.offload_params != "none" and p.offload_optimizer == "none":
        return (f"offload_params: zf.offload keeps the optimizer state beside the offloaded masters; expected "
                f"offload_optimizer 'cpu' or 'nvme' with offload_params={p.offload_params!r}, got 'none'")
    return None


def _pipeline_replicas(p: Any) -> str | None:
    if p.pp > 1 and p.dp > 1 and p.zero_stage == 0:
        return (f"zero_stage: a pipeline over dp={p.dp} ranks per stage shards each stage with ZeRO stage 1 "
                f"(zf.pipeline composes with zf.shard stage 1); expected 1 with pp={p.pp}, got 0")
    return None


ONEBIT_OPTIMIZERS = ("onebit_adam", "zero_one_adam", "onebit_lamb")


def _onebit_zero(p: Any) -> str | None:
    if getattr(p, "optimizer", None) in ONEBIT_OPTIMIZERS and p.zero_stage != 0:
        return (f"zero_stage: {p.optimizer} all-reduces its compressed momentum over whole, replicated grads "
                f"(stage 0, where DeepSpeed runs it too); expected 0, got {p.zero_stage}")
    return None


def _tensor_parallel(p: Any) -> str | None:
    if p.tp > 1:
        return (f"tp: zfunc does not run tensor parallelism (zf.plan models it as Megatron-LM runs it); "
                f"expected tp=1, got {p.tp}")
    return None


# In the order they are checked: a plan breaking several gets the first one's refusal.
RULES: list[Rule] = [
    Rule("microbatches without a pipeline", INCONSISTENT, _microbatches, "pipeline"),
    Rule("params offload below stage 3", INCONSISTENT, _params_stage, "offload"),
    Rule("accumulation under a pipeline", INCONSISTENT, _pipeline_accum, "pipeline"),
    Rule("sequence without tensor parallelism", INCONSISTENT, _sequence_parallel, "tp"),
    Rule("optimizer offload of replicas", UNSUPPORTED, _replicated_offload, "offload"),
    Rule("params offload without optimizer offload", UNSUPPORTED, _params_without_optimizer, "offload"),
    Rule("pipeline over replicas", UNSUPPORTED, _pipeline_replicas, "pipeline"),
    Rule("1-bit optimizer with ZeRO 1-3", UNSUPPORTED, _onebit_zero, "shard"),
    Rule("tensor parallelism", UNSUPPORTED, _tensor_parallel, "tp"),
    Rule("sequence parallelism under a pipeline at stage 0", UNSUPPORTED, _sequence_pipeline, "sequence_parallel"),
    Rule("Ulysses or ring with Megatron's sequence parallelism", UNSUPPORTED, _sequence_megatron,
         "sequence_parallel"),
]


def _kinds(kinds: str | Sequence[str]) -> tuple[str, ...]:
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"kinds: expected a subset of {KINDS}, got {unknown}")
    return kinds


def broken(plan: Any, kinds: str | Sequence[str] = KINDS) -> list[tuple[Rule, str]]:
    """Every rule of ``kinds`` that ``plan`` breaks, with its refusal, in ``RULES`` order."""
    kinds = _kinds(kinds)
    out = []
    for rule in RULES:
        if rule.kind in kinds:
            refusal = rule.refuses(plan)
            if refusal is not None:
                out.append((rule, refusal))
    return out


def check_plan(plan: Any, kinds: str | Sequence[str] = KINDS) -> str | None:
    """The refusal of the first rule of ``kinds`` (default: both) that ``plan`` breaks, None if it
    breaks none. ``Plan(...)`` asks for ``INCONSISTENT``, ``zf.config.check`` for both."""
    found = broken(plan, kinds)
    return found[0][1] if found else None


# ----------------------------------------------------------------------------- new transformations


def register(name: str, *, wraps: Mapping[str, Verdict], wrapped_by: Mapping[str, Verdict] | None = None,
             rules: Sequence[Rule] = ()) -> None:
    """Add step transformation ``name`` to the rulebook: ``wraps[inner]`` is its verdict on each
    step it may be given (``"train_step"``, a transformation's name, or ``name`` itself),
    ``wrapped_by[outer]`` each other transformation's verdict on it; a pair left out is refused
    ("the rulebook has no row"). ``rules`` (plan settings) join ``RULES``, owned by ``name``.
    Registering ``name`` again replaces all of that; a built-in transformation's row is fixed.
    The placeholder rows owned by ``"tp"`` go when ``zfunc.tensor`` registers ``"tensor_parallel"``
    (it unregisters them)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name: expected a transformation's name (an identifier), got {name!r}")
    if name in _BUILT_IN:
        raise ValueError(f"name: {name!r} is a built-in transformation; its row is fixed")
    others = tuple(t for t in STEP_TRANSFORMS if t != name)
    wrapped_by = dict(wrapped_by or {})
    for what, verdicts, allowed in (("wraps", wraps, ("train_step", *others, name)),
                                    ("wrapped_by", wrapped_by, others)):
        unknown = sorted(set(verdicts) - set(allowed))
        if unknown:
            raise ValueError(f"{what}: expected names among {list(allowed)}, got {unknown}")
    for rule in rules:
        if not isinstance(rule, Rule) or rule.kind not in KINDS:
            raise ValueError(f"rules: expected compose.Rule of a kind in {KINDS}, got {rule!r}")
    unregister(name)
    _add(name, wraps, wrapped_by, rules)


def _add(name: str, wraps: Mapping[str, Verdict], wrapped_by: Mapping[str, Verdict], rules: Sequence[Rule]) -> None:
    global STEP_TRANSFORMS
    STEP_TRANSFORMS = (*STEP_TRANSFORMS, name)
    allowed = [inner for inner in ("train_step", *STEP_TRANSFORMS) if inner in wraps and wraps[inner] is None]
    works = "; ".join(f"zf.{name}({'step' if inner == 'train_step' else f'zf.{inner}(step, ...)'}, ...)"
                      for inner in allowed) or f"zf.{name} wraps no step transformation"
    for inner in ("train_step", *STEP_TRANSFORMS):
        TABLE[(name, inner)] = wraps.get(inner, _no_row(name, inner, works))
    for outer in STEP_TRANSFORMS[:-1]:
        TABLE[(outer, name)] = wrapped_by.get(outer, _no_row(outer, name, works))
    RULES.extend(Rule(r.name, r.kind, r.refuses, name) for r in rules)


def unregister(name: str) -> None:
    """Remove what ``register(name, ...)`` added: its row, its column and the rules it owns
    (nothing where there are none). A built-in transformation is refused."""
    global STEP_TRANSFORMS
    if name in _BUILT_IN:
        raise ValueError(f"name: {name!r} is a built-in transformation; its row is fixed")
    STEP_TRANSFORMS = tuple(t for t in STEP_TRANSFORMS if t != name)
    for pair in [pair for pair in TABLE if name in pair]:
        del TABLE[pair]
    RULES[:] = [r for r in RULES if r.owner != name]


_BUILT_IN = frozenset(("train_step", *STEP_TRANSFORMS, *MODEL_TRANSFORMS))
