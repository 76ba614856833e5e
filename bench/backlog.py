"""A backlog older than every TTL, drained with sweeps firing: how deep the queue gets, how many
runs are failed or marked for review, and how many deliveries beyond one per email.

    .venv/bin/python -m bench.backlog --emails 20000 --baseline-src /tmp/mailpipe-base

Each variant gets its own PostgreSQL database, Redis key prefix and blob folder. N small emails
are stored and enqueued with no worker running; the fleet then stays down for longer than every
TTL (markers 20 s, the shortest the settings accept with sweeps every 10 s, and leases 5 s), and
then beat (a sweep every 10 s) and one worker (`-P prefork -c 2`) start and drain the queue with
model calls on. The queue depth is sampled every 0.2 s; deliveries are counted from the worker's
log ("received"); failed runs, runs marked for review and sweep counts are read from the database
at the end.

`--baseline-src` names a checkout of another mailpipe (for example the previous release, made with
`git worktree add /tmp/mailpipe-base <commit>`): the same measurement runs with its code, in the
same run, and both are printed side by side. Each variant's code is only ever run, never imported
here (a checkout may have another layout): its `mailpipe` command migrates its database, switches
model calls on, stores the emails and enqueues them, and its `celery` starts the worker and beat,
each in the checkout's folder with the checkout first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg
import redis

from bench import harness, workload
from mailpipe.cli.demo import fleet
from tests.support.services import delete_prefix

TTL_ENV = {
    "MAILPIPE_DEDUP_TTL": "20",
    "MAILPIPE_LEASE_TTL": "5",
    "MAILPIPE_SWEEP_INTERVAL": "10",
}
WAIT_PAST_TTLS_S = 30


def counts(db) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Runs by status, emails marked for review, and what the sweeps did."""

    def scalar(sql: str) -> int:
        return db.execute(sql).fetchone()[0]

    return {
        "statuses": dict(db.execute("SELECT status::text, count(*) FROM pipeline_run GROUP BY 1")),
        "needs_review": scalar("SELECT count(*) FROM email_message WHERE needs_review"),
        "swept_runs": scalar("SELECT count(*) FROM pipeline_run WHERE sweep_count > 0"),
        "readded": scalar(
            "SELECT coalesce(sum(readded_no_run + readded_stalled), 0) FROM sweep_report"
        ),
        "sweeps": scalar("SELECT count(*) FROM sweep_report"),
    }


def run_variant(
    name: str, src: Path, folder: Path, emails: int, workdir: Path
) -> dict[str, object]:
    database = harness.database(f"mailpipe_bench_backlog_{name}_{uuid.uuid4().hex[:8]}").create()
    prefix = f"benchbacklog{uuid.uuid4().hex[:8]}:"
    env = harness.base_env(
        database_url=database.url,
        prefix=prefix,
        blob_url=f"file://{workdir / name / 'blobs'}",
        PYTHONPATH=str(src),
        **TTL_ENV,
    )
    env = {**os.environ, **env}
    try:
        harness.run_mailpipe(src, env, "db", "upgrade")
        harness.run_mailpipe(src, env, "model-calls", "on")
        harness.ingest(src, env, folder, emails)
        time.sleep(WAIT_PAST_TTLS_S)
        with psycopg.connect(database.url, autocommit=True) as db:
            return {"variant": name, "emails": emails} | drain(name, src, env, db, emails, workdir)
    finally:
        delete_prefix(harness.REDIS_URL, prefix)
        database.drop()


def drain(  # type: ignore[no-untyped-def]
    name: str, src: Path, env: dict[str, str], db, emails: int, workdir: Path
) -> dict[str, object]:
    """Start beat and a worker of the checkout at `src`; sample the queue until it is drained."""
    client = redis.Redis.from_url(harness.REDIS_URL)
    queue = f"{env['MAILPIPE_REDIS_PREFIX']}mailpipe"
    peak = [client.llen(queue)]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], client.llen(queue))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    logs = workdir / name / "logs"
    beat = fleet.beat(env, logs)
    worker = fleet.worker(env, logs, concurrency=2, name=f"{name}-worker")
    # `python -m celery` puts the working folder first on the path: start in the variant's own.
    beat.cwd = worker.cwd = src
    started = time.monotonic()
    beat.start()
    worker.start()
    try:
        worker.wait_ready(120)
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            closed = sum(v for k, v in counts(db)["statuses"].items() if k != "open")
            if closed == emails and client.llen(queue) == 0:
                break
            time.sleep(2)
        drained_s = time.monotonic() - started
    finally:
        stop.set()
        sampler.join()
        beat.stop()
        worker.stop()
        client.close()
    log = worker.log_path.read_text(errors="replace")
    deliveries = len(re.findall(r"Task mailpipe\.process_email\[[^\]]+\] received", log))
    found = counts(db)
    return {
        "peak_queue_depth": peak[0],
        "deliveries": deliveries,
        "extra_deliveries": deliveries - emails,
        "failed": found["statuses"].get("failed", 0),
        "needs_review": found["needs_review"],
        "runs_swept": found["swept_runs"],
        "readded_by_sweeps": found["readded"],
        "sweeps": found["sweeps"],
        "succeeded": found["statuses"].get("succeeded", 0),
        "drain_s": round(drained_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emails", type=int, default=20_000)
    parser.add_argument(
        "--baseline-src", type=Path, help="a checkout of the mailpipe to compare with"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="mailpipe-backlog-"))
    rng = random.Random(14)
    emails = [
        workload.small_email(rng, number, attachment=False, tag="backlog")
        for number in range(args.emails)
    ]
    folder = harness.write_emails(workdir / "emails", emails)
    variants = [("mailpipe", harness.REPO)]
    if args.baseline_src:
        variants.insert(0, ("baseline", args.baseline_src.resolve()))
    try:
        results = [run_variant(name, src, folder, len(emails), workdir) for name, src in variants]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    keys = [k for k in results[0] if k != "variant"]
    print(f"{'':>20}" + "".join(f"{r['variant']:>12}" for r in results))
    for key in keys:
        print(f"{key:>20}" + "".join(f"{r[key]:>12}" for r in results))
    if args.json:
        args.json.write_text(
            json.dumps({"machine": harness.machine(), "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
