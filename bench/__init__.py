"""Benchmarks of refill: `python -m bench fill ...` (see bench/README.md)."""
