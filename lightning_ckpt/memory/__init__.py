"""Memory: the profile (each distinct block run once), the model predicting any plan's bytes, the optimizer step's."""
