"""Worker throughput with and without the metrics handler, side by side in one run.

    .venv/bin/python -m bench.metrics_overhead [--emails 500] [--repeat 3] [--interval 1]
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
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import psutil
from sqlalchemy import func, select

from bench import harness
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import enqueue_emails
from mailpipe.harness import fleet
from mailpipe.harness.services import S3Server, delete_prefix
from mailpipe.resources import get_resources
from mailpipe.storage import flags
from mailpipe.storage.migrate import upgrade
from mailpipe.storage.models import PipelineRun, RunStatus

RUN = uuid.uuid4().hex[:8]
DATABASE = harness.database(f"mailpipe_bench_metrics_{RUN}")
PREFIX = f"benchmetrics{RUN}:"
NAMESPACE = "MailpipeBench"
WORK = Path(tempfile.mkdtemp(prefix="mailpipe-metrics-bench-"))
# This process stores and enqueues the emails with the same settings as the workers.
os.environ.update(
    harness.base_env(database_url=DATABASE.url, prefix=PREFIX, blob_url=f"file://{WORK / 'blobs'}")
)

SUBJECTS = [
    "Invoice {i} due",
    "Weekly newsletter {i}",
    "Security alert {i}",
    "Lunch on {i}?",
    "Ticket #{i}: cannot log in",
    "Meeting invitation {i}",
]


def small_emails(n: int) -> list[bytes]:
    return [
        (
            f"From: sender{i % 17}@example.org\r\nTo: ops@example.com\r\n"
            f"Subject: {SUBJECTS[i % len(SUBJECTS)].format(i=i)}\r\n"
            f"Message-ID: <bench-{i}@example.org>\r\n"
            f"Date: Mon, 3 Mar 2025 10:00:00 +0000\r\n\r\nHello,\r\n\r\nthis is message {i}. "
            f"{'Please pay the amount due by Friday. ' * (1 + i % 4)}\r\n\r\nRegards\r\n"
        ).encode()
        for i in range(n)
    ]


def worker_env(with_metrics: bool, interval: float, cloudwatch_url: str) -> dict[str, str]:
    env = dict(os.environ)
    if with_metrics:
        env["MAILPIPE_METRICS_NAMESPACE"] = NAMESPACE
        env["MAILPIPE_METRICS_INTERVAL"] = str(interval)
        env["MAILPIPE_CLOUDWATCH_ENDPOINT_URL"] = cloudwatch_url
    else:
        env["MAILPIPE_WORKER_METRICS"] = "false"
    return env


def reset(res) -> None:  # type: ignore[no-untyped-def]
    """Empty tables, model calls off (on after the worker starts) and none of the run's keys."""
    harness.truncate(DATABASE.url)
    with res.db.transaction() as session:
        flags.set_model_calls(session, False)
    delete_prefix(harness.REDIS_URL, PREFIX)


def closed_runs(res) -> int:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return (
            session.scalar(
                select(func.count())
                .select_from(PipelineRun)
                .where(PipelineRun.status != RunStatus.OPEN)
            )
            or 0
        )


def reports_received(cloudwatch_url: str, start: float, end: float) -> int:
    import boto3

    client = boto3.client("cloudwatch", endpoint_url=cloudwatch_url)
    reply = client.get_metric_statistics(
        Namespace=NAMESPACE,
        MetricName="QueueDepth",
        Dimensions=[{"Name": "Queue", "Value": "mailpipe"}],
        StartTime=datetime.fromtimestamp(start, UTC),
        EndTime=datetime.fromtimestamp(end, UTC),
        Period=60,
        Statistics=["SampleCount"],
    )
    return int(sum(p["SampleCount"] for p in reply["Datapoints"]))


def one_run(  # type: ignore[no-untyped-def]
    res, raws: list[bytes], with_metrics: bool, interval: float, moto: S3Server
) -> dict[str, object]:
    reset(res)
    ids = store_emails(res, raws)
    name = f"{'with' if with_metrics else 'without'}-{uuid.uuid4().hex[:6]}"
    env = worker_env(with_metrics, interval, moto.url)
    worker = fleet.worker(env, WORK / "logs", concurrency=2, name=name)
    assert moto.process is not None
    cloudwatch = psutil.Process(moto.process.pid)
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
        "reports": reports_received(moto.url, started, started + elapsed) if with_metrics else 0,
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

    upgrade(DATABASE.create().url)
    # moto's server answers every AWS API on its port: the S3 one stands in for CloudWatch.
    moto = S3Server(WORK / "moto.log")
    res = get_resources()
    try:
        moto.start(bucket="mailpipe-bench")
        raws = small_emails(args.emails)
        results = []
        for rep in range(args.repeat):
            order = (True, False) if rep % 2 == 0 else (False, True)
            for with_metrics in order:
                result = one_run(res, raws, with_metrics, args.interval, moto)
                result["repetition"] = rep + 1
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        res.close()
        moto.stop()
        delete_prefix(harness.REDIS_URL, PREFIX)
        DATABASE.drop()
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
    print(
        f"{args.emails} emails, worker -P prefork -c 2, PostgreSQL, local blobs, rules, "
        f"reports every {args.interval:g} s; {args.repeat} repetitions, interleaved"
    )
    print(
        f"{'variant':<10}{'jobs/s':>10}{'main CPU s':>13}{'CloudWatch server CPU s':>26}"
        f"{'reports':>10}   (medians)"
    )
    for variant, row in summary.items():
        print(
            f"{variant:<10}{row['median_jobs_per_s']:>10.1f}{row['median_main_cpu_s']:>13.2f}"
            f"{row['median_cloudwatch_cpu_s']:>26.2f}{row['median_reports']:>10.0f}"
        )
    print(f"throughput ratio with/without: {ratio:.3f}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}"
    )
    if args.json:
        report = {"runs": results, "summary": summary, "ratio": ratio}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
