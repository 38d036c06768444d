"""The functional core: pytrees (tree.py), the carried state (state.py), the pure step (step.py), the grads of a
loss (grads.py), a step's totals over the ranks (totals.py), the base of transformed steps (transformed.py), mixed
precision (precision.py), the microbatch loop every step runs (microbatches.py), the roles a transformed
step's call is made of and the context they read (roles.py), the rulebook of which transformation may wrap
which (compose.py), the registry of how each transformation's placement of a state is saved, loaded and made
whole (placement.py), and settings read from the environment (env.py).
Nothing here knows any particular transformation.
"""
