"""Measuring one training step: its time and memory (live-tensor tracker on CPU, the allocator on CUDA), the state a
step may disturb and its restore, and the status vocabulary of a measured candidate."""
