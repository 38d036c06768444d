"""compose: which transformation may wrap which, stated once.

Two kinds of transformation exist. **Step transformations** take a ``Step`` and return one
(``zf.shard``, ``zf.offload``, ``zf.pipeline``); each records itself in the step's ``layers``
(innermost first: ``("train_step", "shard", "offload")`` for ``offload(shard(train_step(...)))``).
**Model transformations** take a model's function or layer and return one (``zf.remat``,
``zf.tile``): they act inside ``loss_fn``, below every step transformation, so they compose with all
of them and never take a step.

The table (rows: the transformation applied; columns: the outermost layer of the step it is given):

=============  ============  ==================  ==============  ==============
wraps ->       train_step    shard               offload         pipeline
=============  ============  ==================  ==============  ==============
shard          yes           no (once)           no [1]          no [2]
offload        yes           stages 1-3 [3]      no (once)       no [2]
pipeline       yes           stage 1             no [4]          no (once)
=============  ============  ==================  ==============  ==============

[1] offload places the state shard splits: ``zf.offload(zf.shard(step, mesh, stage), ...)``.
[2] the pipeline runs the whole step of a stage and must come last:
    ``zf.pipeline(zf.shard(step, Mesh(dp=d, pp=p), stage=1), ...)`` (docs/design.md, section 3:
    its schedule keeps several microbatches live, and it changes what a state and a loss are).
[3] stage 0 keeps every param whole on every rank; its replicas would each update a whole copy
    on the host: offload a plain step on one rank, or a stage 1-3 step.
[4] a pipeline stage differentiates and updates its own params in place on its device; it has no
    leaf-by-leaf update from a store (not yet).
``remat`` and ``tile`` wrap model functions under any row; given a ``Step``, they refuse it. One
exception: ``zf.pipeline`` refuses a model whose pipeline *unit* runs a rematerialized ``forward``
(it checks that each unit runs once per microbatch; remat runs it again in backward): remat the
unit's submodules instead (``block.fc.forward = zf.remat(block.fc.forward)``), which composes.

Every refusal is a ``ValueError`` naming both transformations (outer and inner) and the order
that works. Options that depend on the inner step (``offload(params=...)`` needs stage 3) stay
with the transformation that owns them.

A new step transformation adds its row and column with ``register`` where it is defined; a pair it
leaves out is refused, naming the orders its row allows.
"""
from __future__ import annotations

from typing import Any

STEP_TRANSFORMS = ("shard", "offload", "pipeline")
MODEL_TRANSFORMS = ("remat", "tile")
_PIPELINE_LAST = "zf.pipeline(zf.shard(step, zf.Mesh(dp=d, pp=p), stage=1), ...) or zf.pipeline(step, ...)"

# (outer, inner) -> None (allowed) or (why, the order that works). Conditions on the inner step's
# options are in ``_CONDITIONS``.
TABLE: dict[tuple[str, str], tuple[str, str] | None] = {
    ("shard", "train_step"): None,
    ("shard", "shard"): ("the step is sharded already", "shard the plain step once: zf.shard(step, mesh, stage)"),
    ("shard", "offload"): ("offload places the state that shard splits, so it wraps the sharded step",
                           "zf.offload(zf.shard(step, mesh, stage), ...)"),
    ("shard", "pipeline"): ("the pipeline runs each stage's whole step and must be applied last", _PIPELINE_LAST),
    ("offload", "train_step"): None,
    ("offload", "shard"): None,
    ("offload", "offload"): ("the step is offloaded already",
                             "offload the plain or sharded step once: zf.offload(step, ...)"),
    ("offload", "pipeline"): ("the pipeline runs each stage's whole step and must be applied last", _PIPELINE_LAST),
    ("pipeline", "train_step"): None,
    ("pipeline", "shard"): None,
    ("pipeline", "offload"): ("a pipeline stage updates its params in place on its device; offloading a "
                              "stage's state is not supported", _PIPELINE_LAST + ", without zf.offload"),
    ("pipeline", "pipeline"): ("the step is pipelined already", "pipeline the plain or sharded step once"),
}


def _offload_over_shard(step: Any) -> tuple[str, str] | None:
    if step.stage == 0:
        return ("offloading a stage-0 (replicated) step is not supported yet: every rank would update a "
                "whole copy of the state on its host",
                "zf.offload(step, ...) of a plain step on one rank, or zf.offload(zf.shard(step, mesh, stage)) "
                "with stage 1, 2 or 3")
    return None


def _pipeline_over_shard(step: Any) -> tuple[str, str] | None:
    if step.stage != 1:
        return (f"pipeline composes with ZeRO stage 1 over the dp axis, got stage {step.stage}",
                "zf.pipeline(zf.shard(step, zf.Mesh(dp=d, pp=p), stage=1), ...)")
    return None


_CONDITIONS = {("offload", "shard"): _offload_over_shard, ("pipeline", "shard"): _pipeline_over_shard}


def register(name: str, may_wrap: dict[str, tuple[str, str] | None],
             wrapped_by: dict[str, tuple[str, str] | None] | None = None) -> None:
    """Add step transformation ``name`` to the table: its row ``may_wrap`` (inner -> None where
    ``zf.<name>`` may wrap it, else ``(why, the order that works)``) and its column ``wrapped_by``
    (outer -> the same, for the step transformations already in the table). A pair left out is
    refused, naming the orders the row allows. Called once, beside the transformation's definition."""
    global STEP_TRANSFORMS
    if not isinstance(name, str) or not name.isidentifier() or name in ("train_step", *STEP_TRANSFORMS,
                                                                         *MODEL_TRANSFORMS):
        raise ValueError(f"name: expected a new transformation's name, got {name!r} (taken: train_step, "
                         f"{', '.join(STEP_TRANSFORMS + MODEL_TRANSFORMS)})")
    wrapped_by = wrapped_by or {}
    inners, outers = ("train_step", *STEP_TRANSFORMS, name), (*STEP_TRANSFORMS, name)
    for argument, given, known in (("may_wrap", may_wrap, inners), ("wrapped_by", wrapped_by, outers)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"{argument}: {unknown} are not step transformations (expected some of {known})")
    allowed = [inner for inner in inners if inner in may_wrap and may_wrap[inner] is None]
    works = "; ".join(f"zf.{name}({'step' if inner == 'train_step' else f'zf.{inner}(step, ...)'}, ...)"
                      for inner in allowed) or f"zf.{name} wraps no step transformation"
    for inner in inners:
        TABLE[(name, inner)] = may_wrap.get(inner, (f"no rule lets zf.{name} wrap zf.{inner}", works))
    for outer in STEP_TRANSFORMS:
        TABLE[(outer, name)] = wrapped_by.get(outer, (f"no rule lets zf.{outer} wrap zf.{name}", works))
    STEP_TRANSFORMS = (*STEP_TRANSFORMS, name)


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


def check(outer: str, step: Any) -> None:
    """Raise unless ``outer`` (a step transformation) may wrap ``step``: a ``TypeError`` for what
    is not a ``Step``, a ``ValueError`` naming both transformations and the order that works."""
    from zfunc.core.step import Step

    if outer not in STEP_TRANSFORMS:
        raise ValueError(f"outer: expected one of {STEP_TRANSFORMS}, got {outer!r}")
    if not isinstance(step, Step) or not layers(step):
        raise TypeError(f"step: zf.{outer} transforms a Step from zf.train_step (or another step transformation), "
                        f"got {type(step).__name__}; zf.remat and zf.tile wrap the model's functions, which the "
                        f"loss_fn of zf.train_step runs: zf.{outer}(zf.train_step(loss_fn, ...), ...)")
    inner = outermost(step)
    refusal = TABLE[(outer, inner)]
    if refusal is None and (outer, inner) in _CONDITIONS:
        refusal = _CONDITIONS[(outer, inner)](step)
    if refusal is not None:
        why, works = refusal
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


def check_pipeline_units(model: Any, unit_names: Any) -> None:
    """Raise a ``ValueError`` if a pipeline unit of ``model`` runs ``zf.remat(forward)`` itself."""
    for name in unit_names:
        forward = vars(model.get_submodule(name)).get("forward")
        if getattr(forward, "zfunc_transform", None) == "remat":
            raise ValueError(
                f"model: zf.pipeline of a model whose pipeline unit '{name}' runs zf.remat(forward) is refused: "
                "the pipeline checks that each unit runs once per microbatch, in order, and remat runs the unit "
                f"again in backward; the order that works: remat the unit's submodules ({name}.fc.forward = "
                f"zf.remat({name}.fc.forward)), or the pipeline without zf.remat")
