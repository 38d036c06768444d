"""``zf.offloading.release``: an offloaded state's swap files removed, its step's engine closed and the
folders made for them removed."""
from __future__ import annotations

from zfunc.core import tree
from zfunc.core.step import Step
from zfunc.core.state import TrainState
from zfunc.offloading.grads import grad_file
from zfunc.offloading.offloaded import OffloadedStep
from zfunc.offloading.placement import OffloadSpec
from zfunc.offloading.store import OnDisk


def release(step: Step, state: TrainState) -> int:
    """Remove the swap files of ``state``, the state ``step`` last returned (or placed: ``init``,
    ``zf.checkpoint.load``), their spares with them, then close the step's swap engine (its folder's
    lock goes with it) and remove the folders it created for them, if nothing else is in them.
    ``state`` is consumed: its leaves were those files (``ConsumedStateError`` if read). Returns the
    bytes the files held; 0, touching nothing, for a step with no swap engine (not offloaded,
    offloaded to "cpu", or released already). A pipeline over an offloaded step releases its stage's.
    Files and folders zfunc did not write stay. The
    step may ``init`` again afterwards, on a new engine. Cost: waits for the I/O issued on the
    files, then an unlink per file and spare."""
    from zfunc.offloading.swap.directory import spare_path

    within = getattr(getattr(state, "placement", None), "within", None)
    if isinstance(getattr(step, "inner", None), OffloadedStep) and isinstance(within, OffloadSpec):
        stage = TrainState(state.params, state.opt_state, state.step, state.rng, state.loss_scale, within)
        state._consumed = True  # a pipeline stage's offloaded state (``PipelineSpec.within``): its files go
        step, state = step.inner, stage
    if not isinstance(step, OffloadedStep) or step.engine is None:
        return 0
    step._check_state(state)
    engine = step.engine
    names = list(dict.fromkeys(x.name for x in tree.leaves((state.params, state.opt_state)) if isinstance(x, OnDisk)))
    names += [grad_file(i) for i in range(len(tree.leaves(state.params))) if engine.file(grad_file(i)).exists()]
    state._consumed = True  # before anything goes: a background save of it finishes first
    freed = 0
    for name in names:  # under the engine's lock: no other engine writes here meanwhile
        file = engine.file(name)
        freed += sum(f.stat().st_size for f in (file, spare_path(file)) if f.exists())
        engine.remove(name)  # waits for the operations issued on it
    engine.close()
    step.engine = None
    for folder in step._made:
        try:
            folder.rmdir()  # only empty: what else is there (another rank's folder) keeps it
        except OSError:
            break
    step._made = []
    return freed
