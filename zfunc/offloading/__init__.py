"""Optimizer state and params in CPU RAM or on NVMe, updated as grads arrive (``zf.offload``, step.py).

offloaded.py is the step it returns (placing a state, its swap engine, memory()); teardown.py removes its swap
files; run.py is one call of an offloaded step; placement.py is how a checkpoint saves and restores its state;
store.py is where offloaded tensors live between steps (packed in groups on NVMe); merge.py joins a group's
optimizer states for one kernel call; swap/ is the async file engine behind NVMe offload.
"""
from zfunc.offloading.teardown import release

__all__ = ["release"]
