"""What one job costs the broker and the database, end to end, for this checkout and another,
side by side: Redis commands and PostgreSQL commits per email, from its enqueue to its run's
close.

    .venv/bin/python -m bench.job_costs --baseline-src DIR [--emails 1000] [--mailbox NAME]
                                        [--json out.json]

Each checkout gets a `redis-server` on a free port (its `INFO stats` counts that fleet alone) and a
PostgreSQL database of its own (`pg_stat_database.xact_commit`), its own `mailpipe db upgrade`
and `mailpipe model-calls on`, and one `celery -A mailpipe worker -c 2` with its own code and the
`rules` classifier (a run closes in its CPU stage). Once the worker is idle, `--emails` plain
emails (`bench.workload.plain_workload`) are stored and enqueued by the checkout's own `mailpipe
ingest` (this checkout's with `--mailbox NAME`, when given: one mailbox's emails, in its shard
queues); the counters are read before the ingest and once every run has closed, and the idle
worker's own commands over as long (its heartbeat, Celery's events) are taken off.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from redis import Redis

from bench import harness
from bench.workload import plain_workload
from mailpipe.cli.demo.servers import PrivateRedis

REPO = Path(__file__).resolve().parents[1]


def one_checkout(
    src: Path, emails: list[bytes], work: Path, options: tuple[str, ...] = ()
) -> dict[str, Any]:
    redis_server = PrivateRedis(work / "redis.log").start()
    database = harness.database(f"mailpipe_bench_costs_{uuid.uuid4().hex[:8]}")
    database.create()
    worker = None
    try:
        env = harness.base_env(
            database_url=database.url, prefix="", blob_url=f"file://{work / 'blobs'}"
        )
        env["MAILPIPE_BROKER_URL"] = redis_server.url
        harness.run_mailpipe(src, env, "db", "upgrade")
        harness.run_mailpipe(src, env, "model-calls", "on")
        folder = harness.write_emails(work / "emails", emails)
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "mailpipe", "worker", "-c", "2",
             "--loglevel", "INFO", "--without-mingle", "--without-gossip",
             "-n", f"costs-{uuid.uuid4().hex[:6]}@%h"],
            env={**env, "PYTHONPATH": str(src)},
            cwd=src,
            stdout=(work / "worker.log").open("ab"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        redis = Redis.from_url(redis_server.url)
        wait(lambda: "ready." in (work / "worker.log").read_text(), 60, "the worker")
        time.sleep(3)  # its start-up sweep done
        idle_from, idle_commands = time.monotonic(), commands(redis)
        time.sleep(5)
        idle_rate = (commands(redis) - idle_commands) / (time.monotonic() - idle_from)
        started, before_commands, before_commits = (
            time.monotonic(),
            commands(redis),
            commits(database.url),
        )
        before_by_name = by_name(redis)
        harness.ingest(src, env, folder, len(emails), *options)
        wait(lambda: closed(database.url) == len(emails), 600, "every run to close")
        elapsed = time.monotonic() - started
        time.sleep(2)  # PostgreSQL's statistics are flushed within a second
        sent = commands(redis) - before_commands - idle_rate * elapsed
        after_by_name = by_name(redis)
        per_name = {
            name: round((calls - before_by_name.get(name, 0)) / len(emails), 2)
            for name, calls in sorted(after_by_name.items())
            if calls - before_by_name.get(name, 0) >= len(emails) / 20
        }
        return {
            "src": str(src),
            "ingest_options": list(options),
            "emails": len(emails),
            "redis_commands_per_email": round(sent / len(emails), 2),
            "commits_per_email": round((commits(database.url) - before_commits) / len(emails), 2),
            "idle_commands_per_s": round(idle_rate, 1),
            "commands_per_email_by_name": per_name,
        }
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(30)
        redis_server.stop()
        database.drop()


def commands(redis: Redis) -> int:
    return int(redis.info("stats")["total_commands_processed"])


def by_name(redis: Redis) -> dict[str, int]:
    """Calls of each command so far (`INFO commandstats`)."""
    return {
        name.removeprefix("cmdstat_"): int(stats["calls"])
        for name, stats in redis.info("commandstats").items()
    }


def commits(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


def closed(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pipeline_run WHERE status <> 'open'").fetchone()
    return int(row[0]) if row else 0


def wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-src", type=Path, required=True)
    parser.add_argument("--emails", type=int, default=1000)
    parser.add_argument("--mailbox", help="this checkout's emails all in this mailbox")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    emails, _ = plain_workload(args.emails)
    results = []
    mine = ("--mailbox", args.mailbox) if args.mailbox else ()
    for src, options in ((REPO, mine), (args.baseline_src.resolve(), ())):
        with tempfile.TemporaryDirectory(prefix="mailpipe-costs-") as work:
            results.append(one_checkout(src, emails, Path(work), options))
    return harness.publish(args, {"checkouts": results})


if __name__ == "__main__":
    raise SystemExit(main())
