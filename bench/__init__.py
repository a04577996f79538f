"""Benchmarks: ``python -m bench <name>`` (see bench/__main__.py and BENCHMARKS.md)."""
