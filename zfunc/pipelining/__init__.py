"""Pipeline parallelism as a transformation of the step (``zf.pipeline``, step.py): schedules as
plain data (schedules.py: GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1 and ZB-V, a user's), checked before
they run (check.py), run by one rank's schedule for one step (stage.py), with the backward split
in two where a schedule asks (split_backward.py), a stage's grads over its dp ranks (dp_grads.py);
a run's measured bubble in the theory's terms (measured.py).
"""
from zfunc.pipelining import measured
from zfunc.pipelining.check import Timeline, check
from zfunc.pipelining.schedules import BUILT_IN, Op, Schedule, build, from_csv

__all__ = ["BUILT_IN", "Op", "Schedule", "Timeline", "build", "check", "from_csv", "measured"]
