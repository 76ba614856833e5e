"""What `parse_email` costs per email, against a baseline checkout in the same run.

    .venv/bin/python -m bench.parse [--workload plain|mixed] [--jobs 1100] [--repeat 7]
                                    [--baseline-src DIR] [--json FILE]

The workload's emails (bench/workload.py) are written to a folder once; each repetition starts
a new interpreter per variant (interleaved), which imports that checkout's `mailpipe.mail.parse`,
parses every email three times with the settings' default limits, and reports its best pass in
CPU time (`time.process_time`) per email. Emails the parser rejects count too, as a job pays for
them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import harness

PROBE = """
import json, sys, time
from pathlib import Path
from mailpipe.mail.parse import ParseLimits, parse_email
from mailpipe.settings import Settings
s = Settings()
limits = ParseLimits(max_bytes=s.max_email_bytes, max_depth=s.max_mime_depth,
                     max_parts=s.max_mime_parts, body_max_chars=s.body_text_max_chars)
emails = [p.read_bytes() for p in sorted(Path(sys.argv[1]).iterdir())]
best = None
for _ in range(3):
    started = time.process_time()
    for raw in emails:
        try:
            parse_email(raw, limits)
        except Exception:
            pass
    spent = time.process_time() - started
    best = spent if best is None else min(best, spent)
print(json.dumps({"us_per_email": 1e6 * best / len(emails)}))
"""


def probe(src: Path, folder: Path) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(folder)],
        cwd=src,
        env={**harness.env_without_settings(), "PYTHONPATH": str(src)},  # the defaults
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(json.loads(out)["us_per_email"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("plain", "mixed"), default="plain")
    parser.add_argument("--jobs", type=int, default=1100)
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--baseline-src", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from bench.workload import mixed_workload, plain_workload

    workload = mixed_workload if args.workload == "mixed" else plain_workload
    emails, kinds = workload(args.jobs, seed=args.seed)
    variants = {"mailpipe": harness.REPO}
    if args.baseline_src:
        variants = {"baseline": args.baseline_src.resolve(), **variants}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="mailpipe-parse-") as tmp:
        folder = harness.write_emails(Path(tmp), emails)
        for repetition in range(args.repeat):
            for name in harness.rotated(list(variants), repetition):
                runs[name].append(probe(variants[name], folder))
    print(f"workload: {len(emails)} emails {kinds}")
    print(f"{'':>10} {'µs per email (median)':>22}  runs")
    medians = {name: statistics.median(values) for name, values in runs.items()}
    for name, values in runs.items():
        print(f"{name:>10} {medians[name]:>22.0f}  {', '.join(f'{v:.0f}' for v in values)}")
    if "baseline" in runs:
        paired = statistics.median(
            m / b for m, b in zip(runs["mailpipe"], runs["baseline"], strict=True)
        )
        ratio = medians["mailpipe"] / medians["baseline"]
        print(f"mailpipe / baseline: {ratio:.3f} (paired {paired:.3f})")
    if args.json:
        args.json.write_text(
            json.dumps({"machine": harness.machine(), "medians": medians, "runs": runs}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
