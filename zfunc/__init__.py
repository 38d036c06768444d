"""zfunc: ZeRO, offload, tiling and pipelining as transformations of a pure training step.

    apply, params = zf.functionalize(model)
    step = zf.train_step(loss_fn, zf.optim.adamw(3e-4), precision="bf16", accum=4)
    state = step.init(params)
    state, metrics = step(state, batch)
"""
from zfunc import checkpoint, config, dist, materialize, module, optim, plan, precision, tree, units
from zfunc.dist import Mesh
from zfunc.module import ModuleChangedError, functionalize
from zfunc.offload import offload
from zfunc.parallelize import parallelize
from zfunc.pipeline import pipeline
from zfunc.remat import remat
from zfunc.shard import shard
from zfunc.step import ConsumedStateError, NonFiniteError, Step, TrainState, train_step, value_and_grad
from zfunc.tile import tile

__all__ = [
    "checkpoint",
    "config",
    "ConsumedStateError",
    "Mesh",
    "ModuleChangedError",
    "NonFiniteError",
    "dist",
    "Step",
    "TrainState",
    "functionalize",
    "materialize",
    "module",
    "offload",
    "optim",
    "parallelize",
    "pipeline",
    "plan",
    "precision",
    "remat",
    "shard",
    "tile",
    "train_step",
    "tree",
    "units",
    "value_and_grad",
]
__version__ = "0.1.0"
