"""The benchmarks' timing helpers; they live in :mod:`twell.timing` (the model's path choosers use them too)."""
from twell.timing import L2Flusher, Timing, graphed, run_for, time_alternating

__all__ = ["L2Flusher", "Timing", "graphed", "run_for", "time_alternating"]
