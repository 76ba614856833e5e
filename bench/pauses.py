"""S3 refusing the fleet under a backlog, with stage pauses and without, side by side in one run:
runs failed, attempts used, the time from access restored until every email succeeded, and what
the denied fleet costs the broker and S3 meanwhile.

    .venv/bin/python -m bench.pauses [--emails 2000] [--window 30] [--json out.json]

Each variant gets services of its own: a `redis-server` on a free port (its `INFO` counters are
its fleet's alone) and a PostgreSQL database; one S3 server (moto) serves both, each variant's
worker reaching it through a proxy of its own (tests/support/flaky_proxy.py) that answers 403
AccessDenied. The emails are stored and enqueued by `mailpipe ingest` straight to S3, with one
worker (`-P prefork -c 2`, the default settings) already up. Once the fleet has settled (paused:
the stage is paused and every job waits in the queue; not paused: every email's job has hit the
fault at least once), the broker's `total_commands_processed`, the proxy's requests and the
worker's CPU time are read twice, `--window` seconds apart. Then access is restored and the
database polled until every run has succeeded.

- **pause**: the defaults: three emails hitting the fault within 60 s pause the CPU stage, and a
  probe every `MAILPIPE_PAUSE_PROBE_INTERVAL` (30 s) ends the pause once it passes.
- **no pause**: `MAILPIPE_PAUSE_AFTER_EMAILS` past any backlog, so the stage never pauses and
  each job waits on its own, sent again after `MAILPIPE_DEFER_BASE` (5 s) growing with its wait
  up to `MAILPIPE_DEFER_MAX` (60 s), without an attempt.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from redis import Redis

from bench import harness, workload
from bench.report import table
from mailpipe.cli.demo import fleet
from mailpipe.cli.demo.servers import PrivateRedis
from tests.support.flaky_proxy import FlakyProxy
from tests.support.services import S3Server

BUCKET = "mailpipe-bench-pauses"
VARIANTS = {
    "pause": {},
    "no pause": {"MAILPIPE_PAUSE_AFTER_EMAILS": str(10**9)},
}
SETTLE_TIMEOUT_S = 240
DRAIN_TIMEOUT_S = 600


def wait_until(predicate, timeout: float, what: str, every: float = 0.5) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout:.0f} s")
        time.sleep(every)


def scalar(db, sql: str) -> int:  # type: ignore[no-untyped-def]
    return int(db.execute(sql).fetchone()[0])


def counters(  # type: ignore[type-arg]
    broker: Redis, proxy: FlakyProxy, meter: harness.CpuMeter, worker: fleet.CeleryProcess
) -> dict:
    meter.poll([worker.pid, *worker.child_pids()])
    return {
        "redis_commands": int(broker.info("stats")["total_commands_processed"]),
        "s3_requests": proxy.failed_requests,
        "at": time.monotonic(),
    }


def run_variant(
    name: str,
    settings: dict[str, str],
    folder: Path,
    emails: int,
    s3: S3Server,
    window: float,
    workdir: Path,
) -> dict[str, object]:
    logs = workdir / name.replace(" ", "-")
    redis_server = PrivateRedis(logs / "redis.log").start()
    database = harness.database(f"mailpipe_bench_pauses_{uuid.uuid4().hex[:8]}").create()
    proxy = FlakyProxy(s3.url).start()
    env = harness.base_env(
        database_url=database.url,
        prefix="",
        blob_url=f"s3://{BUCKET}/blobs",
        MAILPIPE_BROKER_URL=redis_server.url,
        MAILPIPE_S3_ENDPOINT_URL=s3.url,
        **settings,
    )
    env = {**harness.env_without_settings(), **env}
    broker = Redis.from_url(redis_server.url)
    worker = fleet.worker(
        {**env, "MAILPIPE_S3_ENDPOINT_URL": proxy.url}, logs, concurrency=2, name="worker"
    )
    try:
        harness.run_mailpipe(harness.REPO, env, "db", "upgrade")
        harness.run_mailpipe(harness.REPO, env, "model-calls", "on")
        proxy.deny(code="AccessDenied")
        worker.start().wait_ready(120)
        with psycopg.connect(database.url, autocommit=True) as db:
            harness.ingest(harness.REPO, env, folder, emails)
            settle(name, env, broker, db, emails)
            meter = harness.CpuMeter()
            before = counters(broker, proxy, meter, worker)
            time.sleep(window)
            after = counters(broker, proxy, meter, worker)
            seconds = after["at"] - before["at"]

            proxy.deny(False)
            restored = time.monotonic()
            wait_until(
                lambda: (
                    scalar(db, "SELECT count(*) FROM pipeline_run WHERE status = 'succeeded'")
                    == emails
                ),
                DRAIN_TIMEOUT_S,
                f"{name}: every run succeeded",
                every=0.2,
            )
            done_s = time.monotonic() - restored
            return {
                "variant": name,
                "emails": emails,
                "failed": scalar(db, "SELECT count(*) FROM pipeline_run WHERE status = 'failed'"),
                "attempts_used": scalar(db, "SELECT coalesce(sum(attempts), 0) FROM pipeline_run"),
                "restored_to_done_s": round(done_s, 1),
                "redis_cmds_per_s": round(
                    (after["redis_commands"] - before["redis_commands"]) / seconds, 1
                ),
                "s3_requests_per_s": round(
                    (after["s3_requests"] - before["s3_requests"]) / seconds, 2
                ),
                "worker_cpu_pct": round(100 * meter.seconds() / seconds, 1),
            }
    finally:
        worker.stop()
        proxy.stop()
        broker.close()
        redis_server.stop()
        database.drop()


def settle(name: str, env: dict[str, str], broker: Redis, db, emails: int) -> None:  # type: ignore[no-untyped-def]
    """Wait until the denied fleet is in its steady state: paused with every job back in the
    queue, or, never pausing, with every email's job deferring."""
    if name == "pause":

        def settled() -> bool:
            status = json.loads(harness.run_mailpipe(harness.REPO, env, "status", "--json"))
            return (
                "cpu" in status["paused"]
                and broker.llen("mailpipe") == emails
                and broker.hlen("unacked") == 0
            )

        wait_until(settled, SETTLE_TIMEOUT_S, f"{name}: paused, every job queued", every=2)
    else:
        wait_until(
            lambda: scalar(db, "SELECT count(*) FROM pipeline_run") == emails,
            SETTLE_TIMEOUT_S,
            f"{name}: every job deferring",
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emails", type=int, default=2000)
    parser.add_argument(
        "--window", type=float, default=30.0, help="seconds the denied fleet is measured"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="mailpipe-pauses-"))
    emails, _ = workload.plain_workload(args.emails)
    folder = harness.write_emails(workdir / "emails", emails)
    s3 = S3Server(workdir / "moto.log").start(BUCKET)
    try:
        results = [
            run_variant(name, settings, folder, len(emails), s3, args.window, workdir)
            for name, settings in VARIANTS.items()
        ]
    finally:
        s3.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(results, list(results[0])))
    if args.json:
        harness.write_report(args.json, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
