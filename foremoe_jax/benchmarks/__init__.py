"""Benchmark bodies; experiments/bench_*.py are their thin entry points."""
