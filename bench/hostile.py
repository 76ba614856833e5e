"""Hostile emails through `parse_email`: time and peak memory, against a baseline checkout.

    .venv/bin/python -m bench.hostile [--baseline-src /tmp/mailpipe-pre16] [--repeat 1]
        [--only NAME]... [--timeout 120] [--tracemalloc] [--json FILE]

Each input is built once and written to a file; then, per repetition and per checkout
(interleaved), a fresh interpreter started in the checkout (`cwd` and `PYTHONPATH` set to it)
reads the file and times one `parse_email(raw, limits)` call with the settings' default limits.
A checkout's parser is `mailpipe.mail.parse` or, in older layouts, `mailpipe.pipeline.parse`.

Memory is the child's peak RSS (VmHWM) after the call minus the peak before it (the interpreter,
the imports and the input already read): the growth the parse caused. With --tracemalloc the
child also reports tracemalloc's peak in a second, separate call (tracemalloc slows Python code
down, so the time is always taken without it). A child still running after --timeout seconds is
killed and reported as such.

The outcome says what the run would have made of the email: rejected (with the reason), failed
(an exception other than a rejection), or parsed; a parse whose text fields hold a lone surrogate
or a NUL is marked, since PostgreSQL refuses both and the run fails when it stores them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import harness
from tests.support.hostile import INPUTS

CHILD = r"""
import dataclasses, importlib, json, sys, time

def peak_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM: Linux only")

module = importlib.import_module(sys.argv[1])
raw = open(sys.argv[2], "rb").read()
wanted = {"max_bytes": 50 << 20, "max_depth": 25, "max_parts": 1000, "body_max_chars": 200_000}
fields = {f.name for f in dataclasses.fields(module.ParseLimits)}
limits = module.ParseLimits(**{k: v for k, v in wanted.items() if k in fields})

def outcome():
    try:
        parsed = module.parse_email(raw, limits)
    except Exception as exc:
        kind = "rejected" if type(exc).__name__ == "InputRejected" else "failed"
        return f"{kind}: {type(exc).__name__ if kind == 'failed' else ''}{exc}"[:110]
    texts = [parsed.subject, parsed.sender, parsed.body_text, *parsed.recipients]
    texts += [a.filename or "" for a in parsed.attachments]
    note = ""
    if any("\0" in t for t in texts):
        note = ", NUL in text"
    try:
        for t in texts:
            t.encode("utf-8")
    except UnicodeEncodeError:
        note += ", lone surrogates (fails when stored)"
    return f"parsed: {parsed.part_count} parts, subject {parsed.subject[:24]!r}{note}"

before = peak_kib()
started = time.perf_counter()
result = {"outcome": outcome()}
result["seconds"] = time.perf_counter() - started
result["growth_mib"] = (peak_kib() - before) / 1024
if "--tracemalloc" in sys.argv:
    import tracemalloc
    tracemalloc.start()
    outcome()
    result["tracemalloc_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
print(json.dumps(result))
"""


# --- Running -----------------------------------------------------------------------------------


def parser_module(src: Path) -> str:
    for module in ("mailpipe.mail.parse", "mailpipe.pipeline.parse"):
        if (src / (module.replace(".", "/") + ".py")).exists():
            return module
    raise SystemExit(f"no parser in {src}: neither mailpipe/mail/parse.py nor pipeline/parse.py")


def measure(
    src: Path, module: str, path: Path, timeout: float, tracemalloc: bool
) -> dict[str, object]:
    env = harness.env_without_settings()
    command = [sys.executable, "-c", CHILD, module, str(path)]
    if tracemalloc:
        command.append("--tracemalloc")
    try:
        done = subprocess.run(
            command,
            cwd=src,
            env={**env, "PYTHONPATH": str(src)},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"outcome": f"killed after {timeout:.0f} s", "seconds": None, "growth_mib": None}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"outcome": f"child died: {last}"[:110], "seconds": None, "growth_mib": None}
    result: dict[str, object] = json.loads(done.stdout)
    return result


def summarise(runs: list[dict[str, object]]) -> dict[str, object]:
    """Median time, largest growth, the outcome of the first run."""
    times = [float(r["seconds"]) for r in runs if r.get("seconds") is not None]  # type: ignore[arg-type]
    growths = [float(r["growth_mib"]) for r in runs if r.get("growth_mib") is not None]  # type: ignore[arg-type]
    traced = [float(r["tracemalloc_mib"]) for r in runs if "tracemalloc_mib" in r]  # type: ignore[arg-type]
    return {
        "outcome": runs[0]["outcome"],
        "seconds": statistics.median(times) if times else None,
        "growth_mib": max(growths) if growths else None,
        "tracemalloc_mib": max(traced) if traced else None,
    }


def cell(value: object, digits: int) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-src", type=Path)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", action="append", default=[], help="an input's name; repeatable")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    variants = {"this": harness.REPO}
    if args.baseline_src:
        variants = {"baseline": args.baseline_src.resolve(), **variants}
    modules = {name: parser_module(src) for name, src in variants.items()}
    names = [n for n in INPUTS if not args.only or n in args.only]
    work = Path(tempfile.mkdtemp(prefix="mailpipe-hostile-"))
    results: dict[str, dict[str, object]] = {}
    try:
        files: dict[str, Path] = {}
        for name in names:
            data = INPUTS[name]()
            if data is None:
                print(f"skipped {name!r}: input not found", file=sys.stderr)
                continue
            files[name] = work / f"{len(files):02d}.eml"
            files[name].write_bytes(data)
        for name, path in files.items():
            runs: dict[str, list[dict[str, object]]] = {v: [] for v in variants}
            for repetition in range(args.repeat):
                for variant in harness.rotated(list(variants), repetition):
                    runs[variant].append(
                        measure(
                            variants[variant],
                            modules[variant],
                            path,
                            args.timeout,
                            args.tracemalloc,
                        )
                    )
            results[name] = {
                "bytes": path.stat().st_size,
                **{variant: summarise(r) for variant, r in runs.items()},
            }
            print_row(name, results[name], list(variants), args.tracemalloc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": harness.machine(),
                    "variants": {
                        v: {"src": str(s), "parser": modules[v]} for v, s in variants.items()
                    },
                    "repeat": args.repeat,
                    "results": results,
                },
                indent=2,
            )
        )
    return 0


def print_row(name: str, result: dict[str, object], variants: list[str], traced: bool) -> None:
    for variant in variants:
        r: dict[str, object] = result[variant]  # type: ignore[assignment]
        memory = f"{cell(r['growth_mib'], 1):>8} MiB"
        if traced:
            memory += f" {cell(r['tracemalloc_mib'], 1):>8} MiB traced"
        print(
            f"{name:<34} {result['bytes']:>11,} {variant:<8} {cell(r['seconds'], 3):>8} s "
            f"{memory}  {r['outcome']}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
