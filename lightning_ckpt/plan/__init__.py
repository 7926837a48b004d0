"""Plans: what to checkpoint (frozen dataclasses and their versioned file format), the baseline plans, and
applying a plan to any ``nn.Module`` reversibly.
"""
