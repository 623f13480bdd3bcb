"""Benchmarks: each module is also a script (see benchmarks/README.md)."""
