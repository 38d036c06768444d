"""zfunc: ZeRO, offload, tiling and pipelining as transformations of a pure training step.

    apply, params = zf.functionalize(model)
    step = zf.train_step(loss_fn, zf.optim.adamw(3e-4), precision="bf16", accum=4)
    state = step.init(params)
    state, metrics = step(state, batch)

The packages: core/ (pytrees, the state, the pure step, precision, roles, the composition rulebook),
optim/, sharding/ (``zf.shard``), offloading/ (``zf.offload``), pipelining/ (``zf.pipeline``), model/
(``zf.functionalize``, ``zf.materialize``, ``zf.units``, ``zf.remat``, ``zf.tile``), sequence/
(``zf.sequence_parallel``), tensor/ (``zf.tensor_parallel``), checkpoint/, config/ (``zf.config``,
``zf.parallelize``), plan/ (the estimator), dist/, ops/ (kernels).
"""
from zfunc import checkpoint, config, dist, offloading, ops, optim, plan, sequence
from zfunc.config.apply import parallelize
from zfunc.core import precision, tree
from zfunc.core.state import ConsumedStateError, TrainState
from zfunc.core.grads import value_and_grad
from zfunc.core.step import NonFiniteError, Step, train_step
from zfunc.dist import Mesh
from zfunc.model import functional, materialize, tiling, units
from zfunc.model.functional import ModuleChangedError, functionalize
from zfunc.model.rematerialize import remat
from zfunc.model.tiling import tile
from zfunc.offloading.step import offload
from zfunc.pipelining.step import pipeline
from zfunc.sequence.parallel import sequence_parallel
from zfunc.sharding.step import shard
from zfunc.tensor import tensor_parallel
from zfunc.version import __version__  # noqa: F401 - zf.__version__

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
    "functional",
    "functionalize",
    "materialize",
    "offload",
    "offloading",
    "ops",
    "optim",
    "parallelize",
    "pipeline",
    "plan",
    "precision",
    "remat",
    "sequence",
    "sequence_parallel",
    "shard",
    "tensor_parallel",
    "tile",
    "tiling",
    "train_step",
    "tree",
    "units",
    "value_and_grad",
]
