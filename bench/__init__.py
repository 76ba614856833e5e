"""The benchmarks (docs/benchmarks.md), run from the repository root as `python -m bench.<name>`."""
