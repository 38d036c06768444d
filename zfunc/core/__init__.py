"""The functional core: pytrees (tree.py), the carried state (state.py), the pure step (step.py), mixed
precision (precision.py), the roles a transformed step's call is made of (roles.py), the rulebook of which
transformation may wrap which (compose.py), and settings read from the environment (env.py).
Nothing here knows any particular transformation.
"""
