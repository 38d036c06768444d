"""Pipeline parallelism (GPipe, 1F1B) as a transformation of the step (``zf.pipeline``, step.py); stage.py is
one stage's schedule for one step.
"""
