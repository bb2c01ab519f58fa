"""Benchmarks of the sparse FFN (shared/BENCHMARK.md): calibrated sparsity generator, timing, energy, memory.

CLI: ``python -m twell.bench ffn --help``. Modules: generator, ffn, registry, timing, energy, memory,
activity.
"""
