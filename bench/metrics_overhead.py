"""Worker throughput with and without the metrics handler, side by side in one run.

    .venv/bin/python bench/metrics_overhead.py [--emails 500] [--repeat 3] [--interval 1]
                                               [--json out.json]

Each run starts a real `celery worker -P prefork -c 2` on a fresh PostgreSQL database (created from
MAILPIPE_BENCH_PG_ADMIN_URL, default postgresql://postgres@127.0.0.1:5432/postgres, dropped at
the end), a local blob folder and the local Redis under a key prefix of its own, with model calls
on and the `rules` classifier. Once the worker answers a ping, the same `--emails` small emails
(stored afresh on emptied tables) are enqueued in one batch; the run's time is from the enqueue to
the last run closed. "with" reports every `--interval` seconds (1 s, to make the cost visible;
production reports once a minute) to a local CloudWatch-compatible server (moto, started here);
"without" has the reporter off (MAILPIPE_WORKER_METRICS=false). The variants alternate, each
repetition swapping which goes first, and the medians and their ratio are printed. Also shown:
the worker main process's CPU seconds during a run (where the handler's thread runs), the CPU
seconds of the local CloudWatch server (a cost real CloudWatch does not put on the worker's
machine, but which shares this machine's CPUs with the worker here) and the reports it received.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import psutil

PG_ADMIN_URL = os.environ.get(
    "MAILPIPE_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("MAILPIPE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/9")
RUN = f"{os.getpid()}"
DATABASE = f"mailpipe_bench_{RUN}"
NAMESPACE = "MailpipeBench"
WORK = Path(tempfile.mkdtemp(prefix="mailpipe-metrics-bench-"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CLOUDWATCH_PORT = _free_port()
ENV = {
    "MAILPIPE_DATABASE_URL": PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + DATABASE,
    "MAILPIPE_BROKER_URL": REDIS_URL,
    "MAILPIPE_BLOB_URL": f"file://{WORK / 'blobs'}",
    "MAILPIPE_REDIS_PREFIX": f"bench{RUN}:",
    "MAILPIPE_MODEL_BACKEND": "rules",
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# This process stores and enqueues the emails with the same settings as the workers.
os.environ.update(ENV)

from sqlalchemy import create_engine, func, select, text  # noqa: E402

from mailpipe import flags, localfleet  # noqa: E402
from mailpipe.db import normalise_url  # noqa: E402
from mailpipe.enqueue import enqueue_emails  # noqa: E402
from mailpipe.ingest import store_emails  # noqa: E402
from mailpipe.migrate import upgrade  # noqa: E402
from mailpipe.models import Base, PipelineRun, RunStatus  # noqa: E402
from mailpipe.resources import get_resources  # noqa: E402

SUBJECTS = ["Invoice {i} due", "Weekly newsletter {i}", "Security alert {i}", "Lunch on {i}?",
            "Ticket #{i}: cannot log in", "Meeting invitation {i}"]


def small_emails(n: int) -> list[bytes]:
    return [
        (f"From: sender{i % 17}@example.org\r\nTo: ops@example.com\r\n"
         f"Subject: {SUBJECTS[i % len(SUBJECTS)].format(i=i)}\r\n"
         f"Message-ID: <bench-{i}@example.org>\r\n"
         f"Date: Mon, 3 Mar 2025 10:00:00 +0000\r\n\r\nHello,\r\n\r\nthis is message {i}. "
         f"{'Please pay the amount due by Friday. ' * (1 + i % 4)}\r\n\r\nRegards\r\n").encode()
        for i in range(n)
    ]


def worker_env(with_metrics: bool, interval: float) -> dict[str, str]:
    env = dict(os.environ)
    if with_metrics:
        env["MAILPIPE_METRICS_NAMESPACE"] = NAMESPACE
        env["MAILPIPE_METRICS_INTERVAL"] = str(interval)
        env["MAILPIPE_CLOUDWATCH_ENDPOINT_URL"] = f"http://127.0.0.1:{CLOUDWATCH_PORT}"
    else:
        env["MAILPIPE_WORKER_METRICS"] = "false"
    return env


def reset(res) -> None:  # type: ignore[no-untyped-def]
    tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
    with res.db.transaction() as session:
        session.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    for key in res.redis.scan_iter(match=ENV["MAILPIPE_REDIS_PREFIX"] + "*", count=1000):
        res.redis.delete(key)


def closed_runs(res) -> int:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return session.scalar(
            select(func.count())
            .select_from(PipelineRun)
            .where(PipelineRun.status != RunStatus.OPEN)
        ) or 0


def reports_received(start: float, end: float) -> int:
    import boto3

    client = boto3.client("cloudwatch", endpoint_url=f"http://127.0.0.1:{CLOUDWATCH_PORT}")
    reply = client.get_metric_statistics(
        Namespace=NAMESPACE,
        MetricName="QueueDepth",
        Dimensions=[{"Name": "Queue", "Value": "mailpipe"}],
        StartTime=datetime.fromtimestamp(start, timezone.utc),
        EndTime=datetime.fromtimestamp(end, timezone.utc),
        Period=60,
        Statistics=["SampleCount"],
    )
    return int(sum(p["SampleCount"] for p in reply["Datapoints"]))


def one_run(  # type: ignore[no-untyped-def]
    res, raws: list[bytes], with_metrics: bool, interval: float, cloudwatch: psutil.Process
) -> dict[str, object]:
    reset(res)
    ids = store_emails(res, raws)
    name = f"{'with' if with_metrics else 'without'}-{uuid.uuid4().hex[:6]}"
    env = worker_env(with_metrics, interval)
    worker = localfleet.worker(env, WORK / "logs", concurrency=2, name=name)
    worker.start()
    try:
        worker.wait_ready()
        # Switched on after start-up, so no start-up sweep races the batch below.
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
        main = psutil.Process(worker.pid)
        cpu_before, cloudwatch_before = main.cpu_times(), cloudwatch.cpu_times()
        started = time.time()
        enqueue_emails(ids, res)
        while closed_runs(res) < len(ids):
            if not worker.alive():
                raise RuntimeError(worker.log_tail())
            time.sleep(0.05)
        elapsed = time.time() - started
        cpu_after, cloudwatch_after = main.cpu_times(), cloudwatch.cpu_times()
    finally:
        worker.stop()
    with res.db.session() as session:
        by_status = select(PipelineRun.status, func.count()).group_by(PipelineRun.status)
        statuses = dict(session.execute(by_status).all())
    return {
        "variant": "with" if with_metrics else "without",
        "seconds": round(elapsed, 3),
        "jobs_per_s": round(len(ids) / elapsed, 2),
        "main_cpu_s": round(_cpu(cpu_after) - _cpu(cpu_before), 3),
        "cloudwatch_cpu_s": round(_cpu(cloudwatch_after) - _cpu(cloudwatch_before), 3),
        "reports": reports_received(started, started + elapsed) if with_metrics else 0,
        "statuses": {status.value: n for status, n in statuses.items()},
    }


def _cpu(times) -> float:  # type: ignore[no-untyped-def]
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--emails", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    admin = create_engine(normalise_url(PG_ADMIN_URL), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{DATABASE}"')
    moto_log = (WORK / "moto.log").open("wb")
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(CLOUDWATCH_PORT)],
        stdout=moto_log, stderr=subprocess.STDOUT,
    )
    res = get_resources()
    try:
        upgrade(ENV["MAILPIPE_DATABASE_URL"])
        raws = small_emails(args.emails)
        results = []
        for rep in range(args.repeat):
            order = (True, False) if rep % 2 == 0 else (False, True)
            for with_metrics in order:
                result = one_run(res, raws, with_metrics, args.interval, psutil.Process(moto.pid))
                result["repetition"] = rep + 1
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        for key in res.redis.scan_iter(match=ENV["MAILPIPE_REDIS_PREFIX"] + "*", count=1000):
            res.redis.delete(key)
        res.close()
        moto.terminate()
        moto.wait(10)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        admin.dispose()
        shutil.rmtree(WORK, ignore_errors=True)

    summary = {}
    for variant in ("with", "without"):
        runs = [r for r in results if r["variant"] == variant]
        summary[variant] = {
            "median_jobs_per_s": statistics.median(r["jobs_per_s"] for r in runs),
            "median_main_cpu_s": statistics.median(r["main_cpu_s"] for r in runs),
            "median_cloudwatch_cpu_s": statistics.median(r["cloudwatch_cpu_s"] for r in runs),
            "median_reports": statistics.median(r["reports"] for r in runs),
        }
    ratio = summary["with"]["median_jobs_per_s"] / summary["without"]["median_jobs_per_s"]
    print()
    print(f"{args.emails} emails, worker -P prefork -c 2, PostgreSQL, local blobs, rules, "
          f"reports every {args.interval:g} s; {args.repeat} repetitions, interleaved")
    print(f"{'variant':<10}{'jobs/s':>10}{'main CPU s':>13}{'CloudWatch server CPU s':>26}"
          f"{'reports':>10}   (medians)")
    for variant, row in summary.items():
        print(f"{variant:<10}{row['median_jobs_per_s']:>10.1f}{row['median_main_cpu_s']:>13.2f}"
              f"{row['median_cloudwatch_cpu_s']:>26.2f}{row['median_reports']:>10.0f}")
    print(f"throughput ratio with/without: {ratio:.3f}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")
    if args.json:
        report = {"runs": results, "summary": summary, "ratio": ratio}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
