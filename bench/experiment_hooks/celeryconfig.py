"""Bench-only stand-in for the top-level `celeryconfig`: the real one, then the experiments named
in MAILPIPE_BENCH_EXPERIMENTS (bench/experiments.py).

A benchmark worker finds this module first when started with PYTHONSAFEPATH=1 (no current
directory on sys.path) and this folder at the head of PYTHONPATH. Nothing in mailpipe changes:
the experiments exist only in the benchmark's worker processes.
"""

import importlib.util
import os
import sys
from pathlib import Path

_REAL = Path(__file__).resolve().parents[2] / "celeryconfig.py"
_spec = importlib.util.spec_from_file_location("_mailpipe_celeryconfig", _REAL)
assert _spec is not None and _spec.loader is not None
_real = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_real)
globals().update({k: v for k, v in vars(_real).items() if not k.startswith("_")})

from bench import experiments

_applied = experiments.apply(os.environ.get("MAILPIPE_BENCH_EXPERIMENTS", ""), globals())
print(f"bench experiments applied: {_applied}", file=sys.stderr, flush=True)
