"""Transformations of the model rather than the step: a module as a pure function (functional.py), initial
values for params built on the meta device (materialize.py), the groups ZeRO-3 gathers together (units.py),
activation checkpointing (``zf.remat``, rematerialize.py) and memory-centric tiling (``zf.tile``, tiling/; its
LM-head loss over a tensor-parallel vocab slice, vocab_slice.py).
"""
