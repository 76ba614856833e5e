"""What the fleet's metrics cost the shared services, with 1, 4 and 8 worker processes: PutMetricData
calls, database transactions and broker messages per report interval, for this checkout and a
baseline checkout, side by side in one run.

    .venv/bin/python -m bench.fleet_metrics --baseline-src DIR [--workers 1 4 8] [--interval 5]
                                            [--intervals 6] [--json out.json]

Each variant gets services of its own, so that every count is its fleet's alone: a `redis-server`
on a free port (its `INFO commandstats`), a PostgreSQL database (its `pg_stat_database`
transaction counters) and a local CloudWatch-compatible server (moto; the reports it received).
The fleet is N `celery -A mailpipe worker -P prefork -c 1` processes and one `celery beat`, all
with the checkout's own code, idle (no email), reporting every `--interval` seconds. Once every
worker is ready and two intervals have passed (the start-up sweep is over), the counters are read,
then read again `--intervals` intervals later. Figures are per interval: at the default
`MAILPIPE_METRICS_INTERVAL` of 60 s, per minute.

Broker messages are PUBLISH (broadcasts: pings, Celery's own worker events) and LPUSH (task
messages, replies) commands. Celery's worker events, the same in both checkouts, are part of
both counts; the Redis commands of mailpipe's own heartbeat are in neither.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import psycopg
from redis import Redis

from bench import harness
from mailpipe.cli.demo.servers import PrivateRedis
from tests.support.services import S3Server

WORK = Path(tempfile.mkdtemp(prefix="mailpipe-fleet-metrics-"))


class Fleet:
    """N workers and one beat of the checkout at `src`, on services of their own."""

    def __init__(self, src: Path, workers: int, interval: float, moto: S3Server) -> None:
        self.src, self.workers, self.interval = src, workers, interval
        self.name = f"fm_{uuid.uuid4().hex[:8]}"
        self.logs = WORK / self.name
        self.logs.mkdir()
        self.redis_server = PrivateRedis(self.logs / "redis.log").start()
        self.database = harness.database(f"mailpipe_bench_{self.name}").create()
        self.namespace = f"Bench{self.name}"
        self.env = {
            **os.environ,
            **harness.base_env(
                database_url=self.database.url,
                prefix="",
                blob_url=f"file://{self.logs / 'blobs'}",
                PYTHONPATH=str(src),
            ),
            "MAILPIPE_BROKER_URL": self.redis_server.url,
            "MAILPIPE_METRICS_NAMESPACE": self.namespace,
            "MAILPIPE_METRICS_INTERVAL": str(interval),
            "MAILPIPE_CLOUDWATCH_ENDPOINT_URL": moto.url,
        }
        harness.run_mailpipe(src, self.env, "db", "upgrade")
        self.redis = Redis.from_url(self.redis_server.url)
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        celery = [sys.executable, "-m", "celery", "-A", "mailpipe"]
        for number in range(self.workers):
            self._spawn(
                f"worker{number}",
                [
                    *celery,
                    "worker",
                    "--pool=prefork",
                    "--concurrency=1",
                    f"--hostname=w{number}@localhost",
                    "--without-mingle",
                    "--without-gossip",
                    "--loglevel=INFO",
                ],
            )
        self._spawn(
            "beat",
            [*celery, "beat", "--loglevel=INFO", f"--schedule={self.logs / 'beat-schedule'}"],
        )
        deadline = time.monotonic() + 60 + 15 * self.workers
        while not all(
            "ready." in (self.logs / f"worker{n}.log").read_text(errors="replace")
            for n in range(self.workers)
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers did not start: see {self.logs}")
            time.sleep(0.5)

    def _spawn(self, name: str, command: list[str]) -> None:
        with (self.logs / f"{name}.log").open("ab") as log:
            self.processes.append(
                subprocess.Popen(
                    command,
                    env=self.env,
                    cwd=self.src,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def counters(self) -> dict[str, float]:
        stats = self.redis.info("commandstats")
        with psycopg.connect(harness.PG_ADMIN_URL, autocommit=True) as conn:
            row = conn.execute(
                "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = %s",
                (self.database.name,),
            ).fetchone()
        assert row is not None, self.database.name
        commits, rollbacks = row
        return {
            "put_metric_data": reports(self.namespace),
            "db_transactions": commits + rollbacks,
            "publish": stats.get("cmdstat_publish", {}).get("calls", 0),
            "lpush": stats.get("cmdstat_lpush", {}).get("calls", 0),
        }

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        self.redis_server.stop()
        self.database.drop()


def reports(namespace: str) -> int:
    """PutMetricData calls the server received for `namespace`: each carries one QueueDepth for
    the email queue's live lane."""
    cloudwatch = boto3.client(
        "cloudwatch",
        endpoint_url=os.environ["MAILPIPE_CLOUDWATCH_ENDPOINT_URL"],
        region_name="us-east-1",
    )
    now = datetime.now(UTC)
    points = cloudwatch.get_metric_statistics(
        Namespace=namespace,
        MetricName="QueueDepth",
        Dimensions=[{"Name": "Queue", "Value": "mailpipe"}, {"Name": "Lane", "Value": "live"}],
        StartTime=now - timedelta(hours=1),
        EndTime=now + timedelta(minutes=5),
        Period=3600,
        Statistics=["SampleCount"],
    )["Datapoints"]
    return int(sum(p["SampleCount"] for p in points))


def measure(src: Path, workers: int, interval: float, intervals: int, moto: S3Server) -> dict:
    fleet = Fleet(src, workers, interval, moto)
    try:
        fleet.start()
        time.sleep(2 * interval)
        before = fleet.counters()
        time.sleep(intervals * interval)
        after = fleet.counters()
    finally:
        fleet.stop()
    per_interval = {name: (after[name] - before[name]) / intervals for name in before}
    per_interval["broker_messages"] = per_interval["publish"] + per_interval["lpush"]
    return per_interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-src", type=Path, required=True)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--intervals", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    moto = S3Server(WORK / "moto.log").start("unused")
    os.environ["MAILPIPE_CLOUDWATCH_ENDPOINT_URL"] = moto.url
    rows = []
    try:
        for workers in args.workers:
            for variant, src in (("baseline", args.baseline_src.resolve()), ("this", harness.REPO)):
                figures = measure(src, workers, args.interval, args.intervals, moto)
                rows.append({"variant": variant, "workers": workers, **figures})
                print(
                    f"{variant:8} workers={workers}  per interval: "
                    f"PutMetricData {figures['put_metric_data']:.1f}  "
                    f"DB transactions {figures['db_transactions']:.1f}  "
                    f"broker messages {figures['broker_messages']:.1f} "
                    f"(PUBLISH {figures['publish']:.1f}, LPUSH {figures['lpush']:.1f})",
                    flush=True,
                )
    finally:
        moto.stop()
    if args.json:
        args.json.write_text(
            json.dumps(
                {"machine": harness.machine(), "args": vars(args), "rows": rows},
                indent=2,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
