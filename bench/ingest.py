"""`mailpipe ingest` of a 10,000-message mbox against the least any ingest must do.

    .venv/bin/python -m bench.ingest [--messages 10000] [--repeat 3] [--seed 2] [--json FILE]

The mbox (written once per run into a temporary folder, reproducible from --seed) holds short
plain-text emails and, one in three, emails with a small text or CSV attachment. Four variants,
interleaved (each repetition starts with a different one), each into an emptied PostgreSQL
database, a new empty blob folder and a fresh Redis key prefix on the shared Redis:

- cli: the real command, `mailpipe ingest MBOX`, as a subprocess (wall time, interpreter start and
  imports included; the entry point pyproject.toml declares, as the installed script runs it):
  blobs written, rows inserted in batches of 500, one job enqueued per email through the
  deduplicated path (a SET NX marker each, then the publish);
- ingest(): the same work through `mailpipe.cli.ingest.ingest(res, [mbox])` in a subprocess, timed
  around that call only (so the difference to cli is start-up);
- ingest() no task-sent event: an experiment, the same call with Celery's task_send_sent_event
  (set in celeryconfig for Flower) switched off in that process only, which halves the publishes;
- baseline: the stdlib `mailbox` module reads the same mbox, each message is written to the blob
  folder (content-addressed file name, one plain write) and all rows are inserted with one
  psycopg `executemany` and one commit. No enqueue, no checks. Timed like ingest().

Every variant is checked afterwards: 10,000 rows, and for the mailpipe variants 10,000 messages
in the queue.
"""

from __future__ import annotations

import argparse
import json
import mailbox
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC
from pathlib import Path

from bench import harness
from tests.support.services import delete_prefix

RUN = uuid.uuid4().hex[:8]
DATABASE = harness.database(f"mailpipe_bench_ingest_{RUN}")
VARIANTS = ["cli", "ingest()", "ingest() no task-sent event", "baseline"]
CHILDREN = {
    "ingest()": "ingest",
    "ingest() no task-sent event": "ingest-nosent",
    "baseline": "baseline",
}


def write_mbox(path: Path, messages: int, seed: int) -> int:
    from bench.workload import small_email

    rng = random.Random(seed)
    box = mailbox.mbox(path, create=True)
    box.lock()
    try:
        for number in range(messages):
            box.add(small_email(rng, number, attachment=rng.random() < 1 / 3, tag=f"ingest{seed}"))
        box.flush()
    finally:
        box.unlock()
        box.close()
    return path.stat().st_size


def child_ingest(mbox: Path, sent_event: bool = True) -> None:
    from mailpipe.celery import app
    from mailpipe.cli.ingest import ingest
    from mailpipe.resources import get_resources

    if not sent_event:
        app.conf.task_send_sent_event = False

    res = get_resources()
    started = time.perf_counter()
    report = ingest(res, [mbox])
    seconds = time.perf_counter() - started
    print(
        json.dumps(
            {
                "seconds": seconds,
                "stored": report.stored,
                "enqueued": report.enqueued,
                "rejected": len(report.rejected),
            }
        )
    )


def child_baseline(mbox: Path) -> None:
    """What any ingest must at least do: read, write each blob, insert the rows."""
    import hashlib
    from datetime import datetime

    import psycopg

    root = Path(os.environ["MAILPIPE_BLOB_URL"].removeprefix("file://"))
    url = os.environ["MAILPIPE_DATABASE_URL"]
    started = time.perf_counter()
    rows = []
    made: set[str] = set()
    box = mailbox.mbox(mbox, create=False)
    for key in box.iterkeys():
        data = box.get_bytes(key)
        digest = hashlib.sha256(data).hexdigest()
        fan = digest[:2]
        if fan not in made:
            (root / "raw" / fan).mkdir(parents=True, exist_ok=True)
            made.add(fan)
        (root / "raw" / fan / f"{digest}.eml").write_bytes(data)
        now = datetime.now(UTC).replace(tzinfo=None)
        rows.append((f"raw/{fan}/{digest}.eml", len(data), digest, now, now))
    box.close()
    with psycopg.connect(url) as conn:
        conn.cursor().executemany(
            "INSERT INTO email_message (blob_key, size, sha256, received_at, created_at) "
            "VALUES (%s, %s, %s, %s, %s)",
            rows,
        )
        conn.commit()
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "stored": len(rows), "enqueued": 0, "rejected": 0}))


def run_variant(variant: str, mbox: Path, rep: int, work: Path) -> dict[str, object]:
    import psycopg
    import redis

    prefix = f"benchingest{RUN}r{rep}{VARIANTS.index(variant)}:"
    blobs = work / "blobs"
    harness.clean_dir(blobs)
    harness.truncate(DATABASE.url)
    env = {
        **os.environ,
        **harness.base_env(database_url=DATABASE.url, prefix=prefix, blob_url=f"file://{blobs}"),
    }
    if variant == "cli":
        command = [*harness.mailpipe_command(harness.REPO), "ingest", str(mbox)]
    else:
        command = [sys.executable, "-m", "bench.ingest", "--child", CHILDREN[variant], str(mbox)]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stdout}\n{done.stderr}")
    inner = json.loads(done.stdout.strip().splitlines()[-1]) if variant != "cli" else {}
    with psycopg.connect(DATABASE.url) as conn:
        (rows,) = conn.execute("SELECT count(*) FROM email_message").fetchone()
    client = redis.Redis.from_url(harness.REDIS_URL)
    queued = client.llen(f"{prefix}mailpipe")
    client.close()
    delete_prefix(harness.REDIS_URL, prefix)
    return {
        "variant": variant,
        "rep": rep,
        "wall_s": wall,
        "inner_s": inner.get("seconds"),
        "rows": rows,
        "queued": queued,
        "cli_output": done.stdout.strip()[:200] if variant == "cli" else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=sorted(CHILDREN.values()))
    parser.add_argument("mbox", nargs="?", type=Path)
    args = parser.parse_args()
    if args.child and args.child.startswith("ingest"):
        child_ingest(args.mbox, sent_event=args.child != "ingest-nosent")
        return 0
    if args.child == "baseline":
        child_baseline(args.mbox)
        return 0

    from mailpipe.storage.migrate import upgrade

    print(f"machine: {harness.machine()}")
    work = Path(tempfile.mkdtemp(prefix="mailpipe-ingest-"))
    mbox = work / "bench.mbox"
    size = write_mbox(mbox, args.messages, args.seed)
    print(f"mbox: {args.messages} messages, {size / 1e6:.1f} MB ({mbox})")
    upgrade(DATABASE.create().url)
    results = []
    try:
        for rep in range(args.repeat):
            for variant in harness.rotated(VARIANTS, rep):
                r = run_variant(variant, mbox, rep, work)
                expected_queue = args.messages if variant != "baseline" else 0
                if r["rows"] != args.messages or r["queued"] != expected_queue:
                    raise RuntimeError(f"{variant}: {r['rows']} rows, {r['queued']} queued")
                results.append(r)
                inner = f", inner {r['inner_s']:.2f} s" if r["inner_s"] else ""
                print(
                    f"rep {rep} {variant:9s}: wall {r['wall_s']:.2f} s "
                    f"({args.messages / r['wall_s']:.0f}/s){inner}",
                    flush=True,
                )
    finally:
        DATABASE.drop()
        shutil.rmtree(work, ignore_errors=True)
    n = args.messages
    med = {
        v: {
            "wall_s": harness.median(r["wall_s"] for r in results if r["variant"] == v),
            "inner_s": (
                harness.median(r["inner_s"] for r in results if r["variant"] == v)
                if v != "cli"
                else None
            ),
        }
        for v in VARIANTS
    }
    print(
        "\n| variant | runs: wall s | median wall s | emails/s (wall) | median timed-call s "
        "| emails/s (call) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for v in VARIANTS:
        walls = ", ".join(f"{r['wall_s']:.2f}" for r in results if r["variant"] == v)
        inner = med[v]["inner_s"]
        call = f"{inner:.2f} | {n / inner:.0f}" if inner else "- | -"
        print(f"| {v} | {walls} | {med[v]['wall_s']:.2f} | {n / med[v]['wall_s']:.0f} | {call} |")
    ratio_wall = med["baseline"]["wall_s"] / med["cli"]["wall_s"]
    ratio_call = med["baseline"]["inner_s"] / med["ingest()"]["inner_s"]
    nosent = med["ingest() no task-sent event"]["inner_s"]
    print(
        f"task-sent event off: ingest() {med['ingest()']['inner_s']:.2f} s -> {nosent:.2f} s "
        f"({(med['ingest()']['inner_s'] - nosent) / n * 1e6:.0f} µs per email)"
    )
    print(
        f"\nmailpipe/baseline emails/s: cli vs baseline (wall) {ratio_wall:.3f}; "
        f"ingest() vs baseline (timed call) {ratio_call:.3f}; "
        "mailpipe's extra per email: "
        f"{(med['ingest()']['inner_s'] - med['baseline']['inner_s']) / n * 1e6:.0f} µs"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": harness.machine(),
                    "messages": n,
                    "mbox_bytes": size,
                    "runs": results,
                    "medians": med,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
