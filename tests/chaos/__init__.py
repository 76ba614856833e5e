"""The chaos run (docs/chaos.md): `python -m tests.chaos.run`, on services of its own."""
