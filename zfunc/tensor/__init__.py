"""zf.tensor_parallel: Megatron-style tensor parallelism on an unchanged model class.

``zf.tensor_parallel(model, mesh, plan=None)`` (transform.py) slices the model's layers over the
mesh's tp ranks in place: column- then row-parallel projections (layers.py) over differentiable
collectives (collectives.py), a vocab-parallel embedding and LM head, attention heads split (plan.py:
an explicit plan and the head counts it patches; a head and embedding ``zf.tile`` split into vocab tiles: one
vocab-parallel layer per tile, ``transform.tiled_styles``); ``layout.py`` says how each param is sliced
(``zf.tensor_parallel.layout_of(model)``); ``zf.tensor_parallel.cross_entropy`` (loss.py) takes the
loss of vocab-sliced logits without gathering them; ``zf.tensor_parallel.step`` (step.py) is the step
over such a model: the grad norm over the tp group, a placed state that ``full_params`` makes whole and
``zf.checkpoint`` saves as pieces of the whole params (their slicing in the manifest), under ``zf.shard``
and ``zf.offload`` too.
"""
from zfunc.tensor.layout import Layout, Slicing, layout_of
from zfunc.tensor.loss import cross_entropy
from zfunc.tensor.step import TensorParallelSpec, TensorParallelStep, tensor_parallel_step
from zfunc.tensor.transform import tensor_parallel

tensor_parallel.cross_entropy = cross_entropy
tensor_parallel.layout_of = layout_of
tensor_parallel.step = tensor_parallel_step

__all__ = ["Layout", "Slicing", "TensorParallelSpec", "TensorParallelStep", "cross_entropy", "layout_of",
           "tensor_parallel", "tensor_parallel_step"]
