"""ZeRO stages 0-3 as a transformation of the step (``zf.shard``, step.py).

layout.py splits each param over ranks; reduce.py moves grads across ranks as backward produces them;
prefetch.py gathers ZeRO-3 units just in time; run.py is one call of a sharded step.
"""
