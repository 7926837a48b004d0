"""The search: the space of plans, trial runners (eager and compiled), the Optuna study, the side-by-side
confirmation and the one choice rule, ``tune``, and the joint micro-batch search. Optuna is imported only here.
"""
