"""What upstream code pays to enqueue: a fresh interpreter that imports `mailpipe.enqueue` and
enqueues one email, against a baseline checkout in the same run.

    .venv/bin/python -m bench.imports --repeat 15 --baseline-src /tmp/mailpipe-base

Each repetition starts a new interpreter per variant (interleaved) that times, on its own clock,
`from mailpipe.enqueue import enqueue_email` and then the first `enqueue_email(...)` call (which
may import more), and reports whether a document converter (pypdf, python-docx, openpyxl),
SQLAlchemy or boto3 was loaded by then. The enqueue goes to the local Redis under a key prefix of
this run, deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

from bench import harness
from tests.support.services import delete_prefix

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("pypdf", "docx", "openpyxl", "sqlalchemy", "boto3")

PROBE = """
import json, sys, time
started = time.perf_counter()
from mailpipe.enqueue import enqueue_email
imported = time.perf_counter()
enqueue_email(987654321)
sent = time.perf_counter()
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:]))
print(json.dumps({"import_s": imported - started, "first_enqueue_s": sent - imported, "heavy": heavy}))
"""


def probe(src: Path, env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *HEAVY],
        cwd=src,
        env={**env, "PYTHONPATH": str(src)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result: dict[str, object] = json.loads(out)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--baseline-src", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prefix = f"benchimports{uuid.uuid4().hex[:8]}:"
    env = {
        **harness.env_without_settings(),
        "MAILPIPE_BROKER_URL": harness.REDIS_URL,
        "MAILPIPE_REDIS_PREFIX": prefix,
    }
    variants = {"mailpipe": REPO}
    if args.baseline_src:
        variants = {"baseline": args.baseline_src.resolve(), **variants}
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in variants}
    try:
        for repetition in range(args.repeat):
            for name in harness.rotated(list(variants), repetition):
                runs[name].append(probe(variants[name], env))
    finally:
        delete_prefix(harness.REDIS_URL, prefix)
    print(f"{'':>10} {'import (ms)':>12} {'first enqueue (ms)':>19} {'both (ms)':>10}  loaded")
    report = {}
    for name, results in runs.items():
        imports = [1000 * float(r["import_s"]) for r in results]  # type: ignore[arg-type]
        firsts = [1000 * float(r["first_enqueue_s"]) for r in results]  # type: ignore[arg-type]
        both = [a + b for a, b in zip(imports, firsts, strict=True)]
        heavy = sorted({m for r in results for m in r["heavy"]})  # type: ignore[attr-defined]
        report[name] = {
            "import_ms": statistics.median(imports),
            "first_enqueue_ms": statistics.median(firsts),
            "both_ms": statistics.median(both),
            "loaded": heavy,
        }
        print(
            f"{name:>10} {report[name]['import_ms']:>12.0f} {report[name]['first_enqueue_ms']:>19.0f} "
            f"{report[name]['both_ms']:>10.0f}  {', '.join(heavy) or '-'}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"machine": harness.machine(), "medians": report, "runs": runs}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
