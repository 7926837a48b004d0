"""Plans: what to checkpoint, its file format, the baseline plans, and applying a plan to a model reversibly."""
