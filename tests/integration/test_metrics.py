"""Backlog metrics read back from a CloudWatch-compatible server (moto, the session's S3 server,
which serves every AWS API on one port), sent by real workers and by the sweeper."""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from sqlalchemy import update

from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.coordination.brokerstate import ENQUEUED_AT_HEADER
from mailpipe.enqueue import enqueue_emails
from mailpipe.harness import fleet as localfleet
from mailpipe.operations import metrics, sweeper
from mailpipe.pipeline import runs
from mailpipe.resources import Resources
from mailpipe.settings import get_settings
from mailpipe.storage import flags
from mailpipe.storage.models import PipelineRun, RunStatus, utcnow
from tests.support.fleet import enqueue_in
from tests.support.waits import wait_for, wait_until_closed

NAMES = {
    "QueueDepth",
    "OldestJobAgeSeconds",
    "DeferredJobs",
    "BacklogPerTask",
    "RunningTasks",
    "FailedRuns",
}
QUEUE_DIMENSION = [{"Name": "Queue", "Value": "mailpipe"}]
INTERVAL = 1.0


def good_email(i: int) -> bytes:
    message_id = f"<m{i}-{uuid.uuid4().hex}@x>"
    return (
        f"From: a@example.org\r\nSubject: Invoice {i}\r\nMessage-ID: {message_id}\r\n\r\n"
        f"Amount due {i}\r\n"
    ).encode()


def fleet_env(endpoint: str | None = None) -> dict[str, str]:
    """Its own key prefix (under the run's, so the session cleans it up): these workers see only
    their own jobs and pings, and the shared worker never sees them. Its own namespace: the
    server keeps every test's datapoints."""
    env = dict(os.environ)
    env["MAILPIPE_REDIS_PREFIX"] = f"{os.environ['MAILPIPE_REDIS_PREFIX']}m{uuid.uuid4().hex[:8]}:"
    env["MAILPIPE_METRICS_NAMESPACE"] = f"MailpipeTest{uuid.uuid4().hex[:8]}"
    env["MAILPIPE_METRICS_INTERVAL"] = str(INTERVAL)
    env["MAILPIPE_CLOUDWATCH_ENDPOINT_URL"] = endpoint or os.environ["MAILPIPE_S3_ENDPOINT_URL"]
    return env


def cloudwatch() -> Any:
    return boto3.client("cloudwatch", endpoint_url=os.environ["MAILPIPE_S3_ENDPOINT_URL"])


def stats(namespace: str, name: str, start: float, end: float) -> dict[str, float]:
    """Minimum, Maximum, Sum and SampleCount of the datapoints timestamped in the whole seconds
    inside [start, end): the server drops the fraction of a query's bounds, as CloudWatch does."""
    reply = cloudwatch().get_metric_statistics(
        Namespace=namespace,
        MetricName=name,
        Dimensions=QUEUE_DIMENSION,
        StartTime=datetime.fromtimestamp(math.ceil(start), UTC),
        EndTime=datetime.fromtimestamp(math.floor(end), UTC),
        Period=60,
        Statistics=["Minimum", "Maximum", "Sum", "SampleCount"],
    )
    points = reply["Datapoints"]
    if not points:
        return {"SampleCount": 0.0}
    return {
        "Minimum": min(p["Minimum"] for p in points),
        "Maximum": max(p["Maximum"] for p in points),
        "Sum": sum(p["Sum"] for p in points),
        "SampleCount": sum(p["SampleCount"] for p in points),
    }


def test_a_worker_reports_exact_figures_with_the_queue_dimension(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = fleet_env()
    namespace, prefix = env["MAILPIPE_METRICS_NAMESPACE"], env["MAILPIPE_REDIS_PREFIX"]
    # Four emails that succeed and two that fail (an empty and a garbage one), stored with no job:
    # the sweep the worker sends at start (model calls on) enqueues them from inside the worker.
    ids = store_emails(res, [good_email(i) for i in range(4)] + [b"", b"\x00\x01 not an email"])
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    started = time.time()
    # Consuming the control queue only, the worker runs the sweep but leaves the jobs waiting:
    # the depth holds still at a known value until it is told to take them.
    worker = localfleet.worker(
        env, tmp_path, concurrency=2, extra_args=("--queues", "mailpipe.control")
    )
    worker.start()
    try:
        worker.wait_ready()
        wait_for(lambda: res.redis.llen(prefix + "mailpipe") == 6, 30, "the start-up sweep's jobs")
        waiting_from = time.time()
        time.sleep(4.5 * INTERVAL)
        waiting_until = time.time()

        control = localfleet.control_app(env)
        assert control.control.add_consumer("mailpipe", destination=[worker.nodename], reply=True)
        statuses = wait_until_closed(res, ids, timeout=60)
        assert sorted(statuses.values()) == ["failed"] * 2 + ["succeeded"] * 4
        drained_from = time.time() + 2 * INTERVAL  # a report already underway may predate it

        # The failures reach FailedRuns once their window has settled, and only once.
        def failed_runs_sum() -> float:
            return stats(namespace, "FailedRuns", started, time.time() + 1).get("Sum", 0.0)

        wait_for(lambda: failed_runs_sum() >= 2, 10 + metrics.FAILED_RUNS_SETTLE_S, "FailedRuns")
        time.sleep(max(0.0, drained_from + 3 * INTERVAL - time.time()))
        ended = time.time()
        assert failed_runs_sum() == 2
    finally:
        assert worker.stop() == 0, worker.log_tail()

    listed = cloudwatch().list_metrics(Namespace=namespace)["Metrics"]
    assert {m["MetricName"] for m in listed} == NAMES
    assert all(m["Dimensions"] == QUEUE_DIMENSION for m in listed)

    # While six jobs waited and one worker process was alive, every report said so.
    waiting = {name: stats(namespace, name, waiting_from, waiting_until) for name in NAMES}
    assert waiting["QueueDepth"]["Minimum"] == waiting["QueueDepth"]["Maximum"] == 6
    assert waiting["RunningTasks"]["Minimum"] == waiting["RunningTasks"]["Maximum"] == 1
    assert waiting["BacklogPerTask"]["Minimum"] == waiting["BacklogPerTask"]["Maximum"] == 6
    assert waiting["DeferredJobs"]["Maximum"] == 0  # nothing was deferred
    # The oldest job's age grows with the wall clock and never exceeds the time since the worker
    # started (it enqueued the jobs).
    age = waiting["OldestJobAgeSeconds"]
    assert 0 < age["Minimum"] < age["Maximum"] <= waiting_until - started
    # Throttled to the interval: a few reports in the window, not one per loop turn.
    reports = waiting["QueueDepth"]["SampleCount"]
    assert 2 <= reports <= (waiting_until - waiting_from) / INTERVAL + 3

    drained = {name: stats(namespace, name, drained_from, ended) for name in NAMES}
    assert drained["QueueDepth"]["SampleCount"] >= 1
    assert drained["QueueDepth"]["Maximum"] == drained["OldestJobAgeSeconds"]["Maximum"] == 0
    assert drained["BacklogPerTask"]["Maximum"] == 0
    assert drained["RunningTasks"]["Minimum"] == drained["RunningTasks"]["Maximum"] == 1


def test_failed_runs_are_counted_once_across_reporters(res) -> None:  # type: ignore[no-untyped-def]
    """Eight reporters claim at the same moment: the failures are counted once in all."""
    ids = store_emails(res, [good_email(i) for i in range(6)])
    now = utcnow()
    with res.db.transaction() as session:
        runs.ensure_runs(session, ids)
        closed = {
            ids[0]: now - timedelta(seconds=10),
            ids[1]: now - timedelta(seconds=20),
            ids[2]: now - timedelta(seconds=30),
            ids[3]: now - timedelta(seconds=1),  # not settled yet: the next window's
            ids[4]: now - timedelta(hours=1),
        }  # before the first window
        for email_id, closed_at in closed.items():
            session.execute(
                update(PipelineRun)
                .where(PipelineRun.email_id == email_id)
                .values(status=RunStatus.FAILED, closed_at=closed_at)
            )
        session.execute(
            update(PipelineRun)
            .where(PipelineRun.email_id == ids[5])
            .values(status=RunStatus.SUCCEEDED, closed_at=now)
        )
    reporters = [Resources(get_settings()) for _ in range(8)]
    barrier = threading.Barrier(len(reporters))
    counts: list[int | None] = [None] * len(reporters)

    def claim(i: int) -> None:
        barrier.wait()
        counts[i] = metrics.claim_failed_runs(reporters[i], lookback=60)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(reporters))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for reporter in reporters:
        reporter.close()
    assert sum(c for c in counts if c is not None) == 3, counts
    assert res.redis.exists(redis_keys.key("metrics:failed-runs-cursor"))


def test_the_sweeper_reports_through_cloudwatch(res) -> None:  # type: ignore[no-untyped-def]
    namespace = f"MailpipeTest{uuid.uuid4().hex[:8]}"
    settings = res.settings.model_copy(
        update={
            "metrics_namespace": namespace,
            "cloudwatch_endpoint_url": os.environ["MAILPIPE_S3_ENDPOINT_URL"],
        }
    )
    sink = metrics.make_sink(settings)
    assert isinstance(sink, metrics.CloudWatchSink)
    before = time.time()
    sweeper.sweep(
        res, enqueue=lambda ids: enqueue_emails(ids, res), count_workers=lambda: 3, sink=sink
    )
    after = time.time() + 1
    figures = {name: stats(namespace, name, before - 1, after) for name in NAMES - {"FailedRuns"}}
    assert figures["RunningTasks"]["Minimum"] == figures["RunningTasks"]["Maximum"] == 3
    assert figures["QueueDepth"]["Maximum"] == figures["BacklogPerTask"]["Maximum"] == 0
    assert metrics.make_sink(res.settings).__class__ is metrics.LogMetricsSink  # no namespace


@pytest.fixture
def black_hole() -> Iterator[tuple[str, list[socket.socket]]]:
    """A server that accepts connections and never answers: the worst CloudWatch there is."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    server.close()
    for conn in accepted:
        conn.close()


def test_an_unreachable_cloudwatch_does_not_slow_jobs(res, tmp_path: Path, black_hole) -> None:  # type: ignore[no-untyped-def]
    endpoint, accepted = black_hole
    env = fleet_env(endpoint)
    ids = store_emails(res, [good_email(i) for i in range(20)])
    worker = localfleet.worker(env, tmp_path, concurrency=2).start()
    try:
        worker.wait_ready()
        # The reporter is now stuck on CloudWatch (each report can take ~20 s to give up) ...
        wait_for(lambda: len(accepted) >= 1, 30, "the reporter to call the black hole")
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
        enqueue_in(env, ids)
        # ... while the main process answers pings at once and keeps handing out jobs. Were the
        # report sent from the event loop, each one would stall intake for ~20 s: 20 jobs taken
        # a few at a time by 2 children could not finish inside the deadline below.
        control = localfleet.control_app(env)
        for _ in range(3):
            assert control.control.ping(destination=[worker.nodename], timeout=2.0)
        statuses = wait_until_closed(res, ids, timeout=30)
        assert set(statuses.values()) == {"succeeded"}
        assert worker.alive()
    finally:
        # Exits by itself (0), not by the SIGKILL that follows 30 s of waiting, although the
        # metrics thread is still waiting on the black hole.
        assert worker.stop() == 0, worker.log_tail()


def test_a_job_enqueued_by_upstream_code_carries_its_enqueue_time(res) -> None:  # type: ignore[no-untyped-def]
    env = fleet_env()
    [email_id] = store_emails(res, [good_email(0)])
    enqueue_in(env, [email_id])
    message = json.loads(res.redis.lindex(env["MAILPIPE_REDIS_PREFIX"] + "mailpipe", -1))
    assert ENQUEUED_AT_HEADER in message["headers"]
