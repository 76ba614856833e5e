"""Backlog metrics read back from a CloudWatch-compatible server (moto, the session's S3 server,
which serves every AWS API on one port), sent by the reporter of a real beat while real workers
run jobs, or by one report run by hand."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from sqlalchemy import func, select

import mailpipe
from mailpipe.broker.layout import ENQUEUED_AT_HEADER
from mailpipe.broker.queues import Lane, Stage, family, stage_queue
from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.coordination.heartbeat import redis_time
from mailpipe.enqueue import enqueue_emails, send_job
from mailpipe.operations import metrics, sinks, sweeper
from mailpipe.pipeline import runs
from mailpipe.resources import Resources
from mailpipe.settings import get_settings
from mailpipe.storage import flags
from mailpipe.storage.models import ErrorClass, PipelineRun, RunAttempt, RunStatus
from tests.support.emails import raw_email
from tests.support.failed_runs import add_attempts, attempt
from tests.support.fleet import enqueue_in, waiting_in
from tests.support.waits import run_statuses, wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

# Per lane of each stage's queue (dimensions Queue and Lane).
LANE_NAMES = {"QueueDepth", "OldestJobAgeSeconds", "DeferredJobs", "BacklogPerTask"}
# Per stage's queue (dimension Queue): RunningTasks of both, FailedRuns of the email queue's.
NAMES = LANE_NAMES | {"RunningTasks", "FailedRuns"}
JOB_COUNTS = {"JobsSucceeded", "JobsFailed", "JobsRetried", "JobsDeferred"}
# Per stage in every report; JobDuration only when some attempt of the stage was timed.
STAGE_NAMES = {"StagePaused", *JOB_COUNTS}


def dimension(queue: str) -> list[dict[str, str]]:
    return [{"Name": "Queue", "Value": queue}]


def dimensions_of(name: str, queue: str, lane: Lane = Lane.LIVE) -> list[dict[str, str]]:
    """The dimensions `name` is sent with, for `queue` (a stage's) and, if per lane, `lane`."""
    if name not in LANE_NAMES:
        return dimension(queue)
    return [*dimension(queue), {"Name": "Lane", "Value": lane.value}]


def stage_dimension(stage: Stage) -> list[dict[str, str]]:
    return [{"Name": "Stage", "Value": stage.value}]


def good_email(i: int) -> bytes:
    return raw_email(
        f"Invoice {i}", message_id=f"m{i}-{uuid.uuid4().hex}@x", body=f"Amount due {i}"
    )


def metrics_settings(endpoint: str | None = None, interval: float = 60.0) -> dict[str, str]:
    """Its own namespace (the server keeps every test's datapoints), the interval, and
    heartbeats every second: a queue a worker is told to consume counts it within a second."""
    return {
        "MAILPIPE_METRICS_NAMESPACE": f"MailpipeTest{uuid.uuid4().hex[:8]}",
        "MAILPIPE_METRICS_INTERVAL": str(interval),
        "MAILPIPE_WORKER_HEARTBEAT_INTERVAL": "1",
        "MAILPIPE_WORKER_DEAD_AFTER": "5",
        "MAILPIPE_CLOUDWATCH_ENDPOINT_URL": endpoint or os.environ["MAILPIPE_S3_ENDPOINT_URL"],
    }


def fleet_env(endpoint: str | None = None, interval: float = 60.0) -> dict[str, str]:
    """Its own key prefix (under the run's, so the session cleans it up): these workers see only
    their own jobs and pings, and the shared worker never sees them."""
    env = dict(os.environ)
    env["MAILPIPE_REDIS_PREFIX"] = f"{os.environ['MAILPIPE_REDIS_PREFIX']}m{uuid.uuid4().hex[:8]}:"
    return env | metrics_settings(endpoint, interval)


def cloudwatch() -> Any:
    return boto3.client("cloudwatch", endpoint_url=os.environ["MAILPIPE_S3_ENDPOINT_URL"])


def datapoints(
    namespace: str,
    name: str,
    start: float,
    end: float,
    dimensions: list[dict[str, str]],
    period: int = 60,
) -> list[dict[str, Any]]:
    """The statistics of the datapoints timestamped in the whole seconds inside [start, end),
    per `period` seconds from the first of them: the server drops the fraction of a query's
    bounds, as CloudWatch does."""
    if math.ceil(start) >= math.floor(end):
        return []  # no whole second inside
    reply = cloudwatch().get_metric_statistics(
        Namespace=namespace,
        MetricName=name,
        Dimensions=dimensions,
        StartTime=datetime.fromtimestamp(math.ceil(start), UTC),
        EndTime=datetime.fromtimestamp(math.floor(end), UTC),
        Period=period,
        Statistics=["Minimum", "Maximum", "Sum", "SampleCount"],
    )
    return sorted(reply["Datapoints"], key=lambda p: p["Timestamp"])


def stats(
    namespace: str,
    name: str,
    start: float,
    end: float,
    queue: str = "mailpipe",
    dimensions: list[dict[str, str]] | None = None,
) -> dict[str, float]:
    """Minimum, Maximum, Sum and SampleCount of the datapoints inside [start, end); of the
    queue's live lane for the figures per lane."""
    points = datapoints(namespace, name, start, end, dimensions or dimensions_of(name, queue))
    if not points:
        return {"SampleCount": 0.0}
    return {
        "Minimum": min(p["Minimum"] for p in points),
        "Maximum": max(p["Maximum"] for p in points),
        "Sum": sum(p["Sum"] for p in points),
        "SampleCount": sum(p["SampleCount"] for p in points),
    }


def in_fleet(env: dict[str, str], code: str) -> None:
    """Run `code` in a process of the fleet's settings (its key prefix, namespace, endpoint)."""
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def report(env: dict[str, str]) -> None:
    """One report, what beat's reporter sends every interval, run once by hand."""
    in_fleet(
        env,
        "from mailpipe.operations import metrics, sinks; "
        "from mailpipe.resources import get_resources; "
        "res = get_resources(); sinks.make_sink(res.settings).send(metrics.collect(res))",
    )


def pause(env: dict[str, str], stage: Stage) -> None:
    in_fleet(
        env,
        "from mailpipe.coordination import pauses; from mailpipe.broker.queues import Stage; "
        "from mailpipe.resources import get_resources; "
        f"pauses.pause(get_resources().redis, Stage({stage.value!r}), 'test')",
    )


def reports_sent(namespace: str, since: float | None = None) -> float:
    """Reports sent to `namespace` (each sends one QueueDepth for the email queue's live lane), in the last
    hour or from `since` on."""
    start = time.time() - 3600 if since is None else since
    return stats(namespace, "QueueDepth", start, time.time() + 60)["SampleCount"]


def stage_paused(
    namespace: str, stage: Stage, start: float, end: float | None = None
) -> dict[str, float]:
    end = time.time() + 1 if end is None else end
    return stats(namespace, "StagePaused", start, end, dimensions=stage_dimension(stage))


def wait_for_window_to_settle(res: Resources) -> None:
    """Until a report's window (which ends REPORT_SETTLE_S before it is read) covers every run
    failed and every attempt ended so far; their times are the workers' clocks, this host's."""
    with res.db.session() as session:
        ends = [
            session.scalar(
                select(func.max(PipelineRun.closed_at)).where(
                    PipelineRun.status == RunStatus.FAILED
                )
            ),
            session.scalar(select(func.max(RunAttempt.ended_at))),
        ]
    last = max(end for end in ends if end is not None)
    settled_at = last.replace(tzinfo=UTC).timestamp() + metrics.REPORT_SETTLE_S
    wait_for(lambda: time.time() > settled_at, 30, "the window to settle")


def test_a_report_gives_exact_figures_per_queue(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = fleet_env()
    namespace, prefix = env["MAILPIPE_METRICS_NAMESPACE"], env["MAILPIPE_REDIS_PREFIX"]
    # Four emails that succeed and two that fail as they are (an empty and a garbage one),
    # stored with no job: the sweep the worker sends at start (model calls on) enqueues them.
    ids = store_emails(res, [good_email(i) for i in range(4)] + [b"", b"\x00\x01 not an email"])
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    started = time.time()
    # Consuming the control queue only, the worker runs the sweep and the reports but leaves the
    # jobs waiting: the depth holds still until it is told to take them.
    worker = localfleet.worker(
        env, tmp_path, concurrency=2, extra_args=("--queues", "mailpipe.control")
    )
    worker.start()
    try:
        worker.wait_ready()
        wait_for(
            lambda: waiting_in(res.redis, prefix, "mailpipe", res.settings) == 6,
            30,
            "the start-up sweep's jobs",
        )
        # A window's bounds are whole seconds: a second early, not to miss the report.
        waiting_from = time.time() - 1
        report(env)
        wait_for(lambda: reports_sent(namespace) == 1, 30, "the first report")
        waiting_until = time.time() + 1

        control = localfleet.control_app(env)
        for queue in family("mailpipe", res.settings):  # the email queue and its shards
            assert control.control.add_consumer(queue, destination=[worker.nodename], reply=True)
        statuses = wait_until_closed(res, ids, timeout=60)
        assert sorted(statuses.values()) == ["failed"] * 2 + ["succeeded"] * 4
        # The failures are counted once their window has settled; the worker's next heartbeat
        # names the queue it was told to consume.
        wait_for_window_to_settle(res)
        wait_for(
            lambda: res.redis.zcard(prefix + "mailpipe:queue:mailpipe:workers") == 1,
            10,
            "the heartbeat to name the email queue",
        )
        drained_from = time.time() - 1  # seconds after the first report
        report(env)
        wait_for(lambda: reports_sent(namespace) == 2, 30, "the second report")
        report(env)  # nothing failed since: FailedRuns 0, not the same 2 again
        wait_for(lambda: reports_sent(namespace) == 3, 30, "the third report")
        ended = time.time() + 1
    finally:
        assert worker.stop() == 0, worker.log_tail()

    # The server lists a metric of two dimensions once per report: each metric once here.
    listed = list(
        {
            (m["MetricName"], repr(m["Dimensions"])): m
            for m in cloudwatch().list_metrics(Namespace=namespace)["Metrics"]
        }.values()
    )
    by_queue = {
        queue: {m["MetricName"] for m in listed if m["Dimensions"] == dimension(queue)}
        for queue in ("mailpipe", "mailpipe.model")
    }
    assert by_queue == {
        "mailpipe": {"RunningTasks", "FailedRuns"},
        "mailpipe.model": {"RunningTasks"},
    }
    by_lane = {
        (queue, lane): {
            m["MetricName"]
            for m in listed
            if m["Dimensions"] == dimensions_of("QueueDepth", queue, lane)
        }
        for queue in ("mailpipe", "mailpipe.model")
        for lane in Lane
    }
    assert by_lane == dict.fromkeys(by_lane, LANE_NAMES)
    by_stage = {
        stage: {m["MetricName"] for m in listed if m["Dimensions"] == stage_dimension(stage)}
        for stage in Stage
    }
    # Only the CPU stage ran jobs (the rules backend classifies at once).
    assert by_stage == {Stage.CPU: STAGE_NAMES | {"JobDuration"}, Stage.MODEL: STAGE_NAMES}
    # The worker's release: RunningTasks per Version, one release running.
    by_version = [m for m in listed if m["Dimensions"][0]["Name"] == "Version"]
    assert [(m["MetricName"], m["Dimensions"]) for m in by_version] == [
        ("RunningTasks", [{"Name": "Version", "Value": mailpipe.__version__}])
    ]
    # The worst-off mailbox's wait, by stage and lane only.
    by_stage_and_lane = sorted(
        tuple(d["Value"] for d in m["Dimensions"])
        for m in listed
        if m["MetricName"] == "OldestMailboxWaitSeconds"
    )
    assert by_stage_and_lane == sorted((stage, lane) for stage in Stage for lane in Lane)
    assert len(listed) == 4 * len(LANE_NAMES) + 3 + 2 * len(STAGE_NAMES) + 1 + 1 + 4
    # One report's datapoints: four per lane, RunningTasks per stage and per release,
    # FailedRuns, per stage its pause and four job counts, per stage and lane the worst-off
    # mailbox's wait (and no Deferrals: nothing was deferred; no JobDuration: no job had run).
    first_report = [
        stats(namespace, m["MetricName"], waiting_from, waiting_until, dimensions=m["Dimensions"])
        for m in listed
    ]
    assert sum(figures["SampleCount"] for figures in first_report) == 34

    # While six jobs waited and no worker consumed their queue, the report said so.
    waiting = {name: stats(namespace, name, waiting_from, waiting_until) for name in NAMES}
    assert {name: figures["SampleCount"] for name, figures in waiting.items()} == dict.fromkeys(
        NAMES, 1
    )
    assert waiting["QueueDepth"]["Maximum"] == 6
    assert waiting["RunningTasks"]["Maximum"] == 0
    assert waiting["BacklogPerTask"]["Maximum"] == 6  # what one new task would face
    assert waiting["DeferredJobs"]["Maximum"] == 0  # nothing was deferred
    assert 0 < waiting["OldestJobAgeSeconds"]["Maximum"] <= waiting_until - started
    assert waiting["FailedRuns"]["Sum"] == 0
    for stage in Stage:  # nothing paused
        paused = stage_paused(namespace, stage, waiting_from, waiting_until)
        assert (paused["SampleCount"], paused["Maximum"]) == (1, 0), stage
    model = {
        name: stats(namespace, name, waiting_from, waiting_until, "mailpipe.model")
        for name in NAMES - {"FailedRuns"}
    }
    assert model["QueueDepth"]["Maximum"] == model["RunningTasks"]["Maximum"] == 0
    # Nothing waited in either bulk lane.
    for queue in ("mailpipe", "mailpipe.model"):
        bulk = stats(
            namespace,
            "QueueDepth",
            waiting_from,
            waiting_until,
            dimensions=dimensions_of("QueueDepth", queue, Lane.BULK),
        )
        assert (bulk["SampleCount"], bulk["Maximum"]) == (1, 0), queue

    drained = {name: stats(namespace, name, drained_from, ended) for name in NAMES}
    assert drained["QueueDepth"]["SampleCount"] == 2
    assert drained["QueueDepth"]["Maximum"] == drained["OldestJobAgeSeconds"]["Maximum"] == 0
    assert drained["BacklogPerTask"]["Maximum"] == 0
    assert drained["RunningTasks"]["Minimum"] == drained["RunningTasks"]["Maximum"] == 1
    # The two poison emails, counted once over the two reports.
    assert drained["FailedRuns"]["Sum"] == 2
    assert drained["FailedRuns"]["Maximum"] == 2 and drained["FailedRuns"]["Minimum"] == 0
    # The attempts the workers wrote, each counted once in its stage: the four emails that
    # succeeded and the two rejected at once, each timed.
    jobs = {
        stage: {
            name: stats(namespace, name, drained_from, ended, dimensions=stage_dimension(stage))
            for name in [*JOB_COUNTS, "JobDuration"]
        }
        for stage in Stage
    }
    assert {
        name: figures["Sum"] for name, figures in jobs[Stage.CPU].items() if name in JOB_COUNTS
    } == {
        "JobsSucceeded": 4,
        "JobsFailed": 2,
        "JobsRetried": 0,
        "JobsDeferred": 0,
    }
    assert jobs[Stage.CPU]["JobDuration"]["SampleCount"] == 6
    assert jobs[Stage.CPU]["JobDuration"]["Maximum"] <= ended - started
    assert {jobs[Stage.MODEL][name]["Sum"] for name in JOB_COUNTS} == {0}
    assert jobs[Stage.MODEL]["JobDuration"]["SampleCount"] == 0


def test_beat_reports_every_interval_while_every_worker_child_is_busy(res, fleet) -> None:  # type: ignore[no-untyped-def]
    """Both children of the only worker are held by jobs of minutes and a third job waits: the
    reports still go out, interval after interval, from beat's own process, which runs no jobs."""
    interval = 2.0
    f = fleet(
        **metrics_settings(interval=interval),
        # Jobs of minutes: limits above them, and one message reserved per child, so that the
        # third job waits in the queue.
        MAILPIPE_TASK_SOFT_TIME_LIMIT="300",
        MAILPIPE_TASK_TIME_LIMIT="310",
        MAILPIPE_VISIBILITY_TIMEOUT="400",
        MAILPIPE_WORKER_PREFETCH_MULTIPLIER="1",
    )
    namespace = f.env["MAILPIPE_METRICS_NAMESPACE"]
    ids = store_emails(res, [good_email(i) for i in range(3)])
    for email_id in ids:
        f.set_fault(email_id, "slow:300", times=1)
    f.enqueue(ids)
    worker = f.worker("busy", "--concurrency", "2")
    wait_for(lambda: sum(map(f.runs, ids)) == 2, 60, "both children to hold a job")
    assert f.queue_depth() == 1

    busy_from = time.time()
    f.beat()
    wait_for(lambda: reports_sent(namespace, busy_from) >= 4, 60, "four reports")
    busy_until = time.time() + 1
    # The children were busy all along: no job ended, none was taken by another delivery.
    assert sum(map(f.runs, ids)) == 2 and f.queue_depth() == 1
    assert set(run_statuses(res, ids).values()) == {"open"}
    backlog = stats(namespace, "BacklogPerTask", busy_from, busy_until)
    assert backlog["Minimum"] == backlog["Maximum"] == 1  # the waiting job, over one live worker

    pause(f.env, Stage.CPU)
    paused_from = time.time() - 1
    wait_for(
        lambda: stage_paused(namespace, Stage.CPU, paused_from).get("Maximum") == 1,
        30,
        "a report of the paused stage",
    )
    model = stage_paused(namespace, Stage.MODEL, paused_from)
    assert model["SampleCount"] >= 1 and model["Maximum"] == 0
    assert worker.alive()
    worker.kill()  # its jobs would hold a warm shutdown for minutes


def test_only_the_beat_holding_the_lock_reports(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two beats on one lock, each reporting to a namespace of its own: the one that never held
    the lock sent nothing; killed, the holder's reports are taken over by the other beat once
    the lock is its."""
    env = fleet_env(interval=2.0) | {"MAILPIPE_BEAT_LOCK_TIMEOUT": "6"}
    namespaces = {name: f"MailpipeTest{uuid.uuid4().hex[:8]}" for name in ("beat-a", "beat-b")}
    started = time.time() - 1
    beats = {
        name: localfleet.beat(env | {"MAILPIPE_METRICS_NAMESPACE": namespace}, tmp_path, name)
        for name, namespace in namespaces.items()
    }
    for beat in beats.values():
        beat.start()
    try:
        wait_for(lambda: any(reports_sent(n) >= 4 for n in namespaces.values()), 60, "four reports")
        [active] = [n for n, b in beats.items() if "holding the scheduler lock" in b.log_tail(400)]
        [standby] = [n for n in beats if n != active]
        assert reports_sent(namespaces[standby]) == 0
        beats[active].kill()
        wait_for(lambda: reports_sent(namespaces[standby]) >= 1, 60, "the standby to report")
        assert "holding the scheduler lock" in beats[standby].log_tail(400)
    finally:
        for beat in beats.values():
            beat.stop()
    assert (
        stats(namespaces[active], "RunningTasks", started, time.time() + 1, "mailpipe.control")[
            "SampleCount"
        ]
        == 0
    )  # the control queue is not a job queue: no figures of its own


def with_attempts(res: Resources, rows: list[tuple[str, str, float | None, float]]) -> list[int]:
    """One email and run per (stage, outcome, seconds it ran or None, when it ended as unix time),
    with its attempt row, as the job writes them."""
    ids = store_emails(res, [good_email(i) for i in range(len(rows))])
    with res.db.transaction() as session:
        runs.ensure_runs(session, ids)
    for email_id, (stage, outcome, seconds, ended) in zip(ids, rows, strict=True):
        ended_at = datetime.fromtimestamp(ended, UTC).replace(tzinfo=None)
        add_attempts(res, email_id, [attempt(stage, outcome, ended_at, ran=seconds)])
    return ids


def test_failed_runs_and_ended_attempts_are_counted_once_across_concurrent_reports(res) -> None:  # type: ignore[no-untyped-def]
    """Eight reports claim at the same moment (two beats for a moment, a late delivery): the
    failures and the attempts are counted once in all."""
    ids = store_emails(res, [good_email(i) for i in range(4)])
    with res.db.transaction() as session:
        runs.ensure_runs(session, ids)
        for email_id in ids[:3]:
            assert runs.fail(
                session, email_id, "given up", error_class=ErrorClass.DEFERRED_TOO_LONG
            )
    with_attempts(res, [("cpu", "succeeded", 0.2, time.time())] * 5)
    wait_for_window_to_settle(res)
    reporters = [Resources(get_settings()) for _ in range(8)]
    barrier = threading.Barrier(len(reporters))
    windows: list[metrics.SinceLastReport | None] = [None] * len(reporters)

    def claim(i: int) -> None:
        barrier.wait()
        windows[i] = metrics.claim_window(reporters[i], lookback=60)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(reporters))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for reporter in reporters:
        reporter.close()
    claimed = [w for w in windows if w is not None]
    assert sum(w.failed_runs for w in claimed) == 3, windows
    assert sum(w.stage_jobs[Stage.CPU].counts["JobsSucceeded"] for w in claimed) == 5, windows
    cursor = float(res.redis.get(redis_keys.report_cursor()))
    # A later report, once its window has moved past the cursor, counts only what ended after:
    # nothing.
    wait_for(lambda: time.time() - metrics.REPORT_SETTLE_S > cursor, 30, "the window to move on")
    later = metrics.claim_window(res, lookback=60)
    assert later is not None and later.failed_runs == 0
    assert not any(sum(jobs.counts.values()) for jobs in later.stage_jobs.values())


def test_a_report_gives_each_stage_s_jobs_and_durations(res) -> None:  # type: ignore[no-untyped-def]
    """Attempts written as the job writes them, in the window of one report and before it: the
    report counts each stage's attempts in its window by what they came to, and sends their
    durations as one distribution per stage; the next report, with nothing ended since, zeros."""
    env = fleet_env()
    namespace = env["MAILPIPE_METRICS_NAMESPACE"]
    cursor_key = env["MAILPIPE_REDIS_PREFIX"] + "mailpipe:metrics:report-cursor"
    now = time.time()
    res.redis.set(cursor_key, repr(now - 30))  # where the last report stopped
    with_attempts(
        res,
        [
            # before the window: counted by the last report
            ("cpu", "succeeded", 9.0, now - 40),
            ("model", "failed", 9.0, now - 31),
            # in it
            ("cpu", "handed_off", 0.2, now - 20),
            ("cpu", "handed_off", 0.2, now - 20),
            ("cpu", "succeeded", 0.4, now - 20),
            ("cpu", "duplicate", 0.1, now - 20),
            ("cpu", "failed", 0.05, now - 20),
            ("cpu", "retrying", 240.0, now - 20),
            ("cpu", "cut_off", 300.0, now - 20),  # untimed: ended when a later claim saw it
            ("model", "succeeded", 2.0, now - 10),
            ("model", "succeeded", 3.0, now - 10),
            ("model", "deferred", None, now - 10),
            ("model", "lost", 900.0, now - 10),
        ],
    )
    wait_for(lambda: time.time() - metrics.REPORT_SETTLE_S > now, 30, "the window to settle")
    window_from = time.time() - 1
    report(env)
    wait_for(lambda: reports_sent(namespace) == 1, 30, "the report")
    window_until = time.time() + 1
    # The next report's datapoints are stamped after the first's whole seconds: from the first
    # whole second after window_until on, where the next window's query starts.
    wait_for(
        lambda: time.time() > math.ceil(window_until), 10, "the first report's last second to pass"
    )
    report(env)
    wait_for(lambda: reports_sent(namespace) == 2, 30, "the next report")
    ended = time.time() + 1

    def figures(name: str, stage: Stage, start: float, end: float) -> dict[str, float]:
        return stats(namespace, name, start, end, dimensions=stage_dimension(stage))

    expected = {
        Stage.CPU: {"JobsSucceeded": 4, "JobsFailed": 1, "JobsRetried": 2, "JobsDeferred": 0},
        Stage.MODEL: {"JobsSucceeded": 2, "JobsFailed": 0, "JobsRetried": 1, "JobsDeferred": 1},
    }
    for stage, counts in expected.items():
        got = {name: figures(name, stage, window_from, window_until) for name in counts}
        assert {name: f["Sum"] for name, f in got.items()} == counts, stage
        assert {f["SampleCount"] for f in got.values()} == {1}, stage
        later = {name: figures(name, stage, window_until, ended) for name in counts}
        assert {name: f["Sum"] for name, f in later.items()} == dict.fromkeys(counts, 0), stage
    cpu = figures("JobDuration", Stage.CPU, window_from, window_until)
    assert cpu["SampleCount"] == 6  # the cut-off attempt is not timed
    assert (cpu["Minimum"], cpu["Maximum"]) == (
        metrics.duration_step(0.05),
        metrics.duration_step(240.0),
    )
    model = figures("JobDuration", Stage.MODEL, window_from, window_until)
    assert model["SampleCount"] == 2  # neither the deferral without a start nor the lost one
    assert (model["Minimum"], model["Maximum"]) == (
        metrics.duration_step(2.0),
        metrics.duration_step(3.0),
    )
    # Nothing ended since the first report: no duration in the second.
    for stage in Stage:
        assert figures("JobDuration", stage, window_until, ended)["SampleCount"] == 0


def test_the_sweeper_reads_the_backlog_and_sends_nothing(res) -> None:  # type: ignore[no-untyped-def]
    namespace = f"MailpipeTest{uuid.uuid4().hex[:8]}"
    settings = res.settings.model_copy(
        update={
            "metrics_namespace": namespace,
            "cloudwatch_endpoint_url": os.environ["MAILPIPE_S3_ENDPOINT_URL"],
        }
    )
    assert isinstance(sinks.make_sink(settings), sinks.CloudWatchSink)
    assert sinks.make_sink(res.settings).__class__ is sinks.LogMetricsSink  # no namespace
    store_emails(res, [good_email(i) for i in range(3)])
    # The sweep runs with the settings that give it a CloudWatch namespace: were it to send
    # figures, they would be there.
    reporting = Resources(settings)
    try:
        result = sweeper.sweep(
            reporting,
            enqueue=lambda ids, task, lane, boxes: (
                enqueue_emails(ids, reporting, task, lane, boxes).sent
            ),
        )
    finally:
        reporting.close()
    assert (result.queue_depth, result.backlog_per_task) == (3, 3.0)
    assert cloudwatch().list_metrics(Namespace=namespace)["Metrics"] == []


class BlackHole:
    """A server that accepts connections and never answers: the worst CloudWatch there is.

    While `held` is set it sends each connection a byte every 0.2 s, never a whole status line:
    each byte starts the client's read timeout again, so a call stays in flight for as long as
    the test holds it, and times out once it stops."""

    def __init__(self) -> None:
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self.held = threading.Event()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._dribble, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self._server.accept()[0])
            except OSError:
                return

    def _dribble(self) -> None:
        while not self._closed.wait(0.2):
            if self.held.is_set():
                for conn in list(self.accepted):
                    try:
                        conn.sendall(b"H")
                    except OSError:
                        pass  # the client gave up on it

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def black_hole() -> Iterator[BlackHole]:
    server = BlackHole()
    yield server
    server.close()


def test_an_unreachable_cloudwatch_never_delays_beat(res, tmp_path: Path, black_hole) -> None:  # type: ignore[no-untyped-def]
    """A report stuck on a CloudWatch that never answers holds its own thread only: beat goes on
    firing the sweep every interval, and no second report starts while it is stuck."""
    env = fleet_env(black_hole.url, interval=1.0) | {"MAILPIPE_SWEEP_INTERVAL": "1"}
    control = env["MAILPIPE_REDIS_PREFIX"] + "mailpipe.control"
    black_hole.held.set()  # the first report's call is in flight until the test lets it go
    beat = localfleet.beat(env, tmp_path).start()
    try:
        wait_for(lambda: len(black_hole.accepted) >= 1, 30, "the report to call the black hole")
        sweeps_before = res.redis.llen(control)
        # While the first report is stuck, the sweeps go on ...
        wait_for(lambda: res.redis.llen(control) - sweeps_before >= 4, 60, "four more sweeps")
        # ... and the reports due meanwhile are skipped, not started beside it.
        wait_for(
            lambda: "this one is skipped" in beat.log_tail(400),
            30,
            "a report skipped while the first is stuck",
        )
        assert len(black_hole.accepted) == 1
        assert "PutMetricData failed" not in beat.log_tail(400)  # still the first call, stuck
        black_hole.held.clear()
        # Its tries time out one after another, and the report gives up.
        wait_for(
            lambda: "PutMetricData failed, these figures are dropped" in beat.log_tail(400),
            90,
            "the report to give up",
        )
        assert beat.alive()
    finally:
        assert beat.stop() == 0, beat.log_tail()


def test_a_job_enqueued_by_upstream_code_carries_its_enqueue_time(res) -> None:  # type: ignore[no-untyped-def]
    env = fleet_env()
    [email_id] = store_emails(res, [good_email(0)])
    enqueue_in(env, [email_id])
    message = json.loads(res.redis.lindex(env["MAILPIPE_REDIS_PREFIX"] + "mailpipe", -1))
    assert ENQUEUED_AT_HEADER in message["headers"]


def send_bulk(res: Resources, email_ids: list[int]) -> None:
    """Jobs of the CPU stage on its bulk lane's queue."""
    for email_id in email_ids:
        send_job(email_id, lane=Lane.BULK)


def test_a_paused_stage_reports_no_backlog_per_task_to_scale_on(res) -> None:  # type: ignore[no-untyped-def]
    """A task added while its stage is paused would sit idle: the paused stage's lanes'
    BacklogPerTask is 0 while their depth is still reported; the other stage's figures are
    untouched."""
    from mailpipe.coordination import pauses

    ids = store_emails(res, [good_email(i) for i in range(5)])
    enqueue_emails(ids[:3], res)
    send_bulk(res, ids[3:])
    email_queues = [stage_queue(Stage.CPU, res.settings, lane) for lane in Lane]

    def email_queue_readings() -> list[metrics.BacklogMetrics]:
        readings = {r.queue: r for r in metrics.collect(res)}
        return [readings[queue] for queue in email_queues]

    assert [r.backlog_per_task for r in email_queue_readings()] == [3, 2]
    pauses.pause(res.redis, Stage.CPU, "maintenance")
    live, bulk = email_queue_readings()
    assert [(r.queue_depth, r.backlog_per_task) for r in (live, bulk)] == [(3, 0.0), (2, 0.0)]
    assert live.paused_stages == frozenset({Stage.CPU})
    pauses.resume(res.redis, Stage.CPU)
    assert [r.backlog_per_task for r in email_queue_readings()] == [3, 2]


def test_a_bulk_lane_reports_its_own_figures(res) -> None:  # type: ignore[no-untyped-def]
    """Jobs waiting in the bulk lane are its figures (Lane=bulk), not the live lane's; both
    lanes' BacklogPerTask divide by the workers consuming either lane, counted once."""
    namespace = f"MailpipeTest{uuid.uuid4().hex[:8]}"
    endpoint = os.environ["MAILPIPE_S3_ENDPOINT_URL"]
    ids = store_emails(res, [good_email(i) for i in range(5)])
    enqueue_emails(ids[:2], res)
    send_bulk(res, ids[2:])
    live_queue, bulk_queue = (stage_queue(Stage.CPU, res.settings, lane) for lane in Lane)
    now = redis_time(res.redis)
    res.redis.zadd(redis_keys.workers_on(live_queue), {"celery@a:1:x": now})
    res.redis.zadd(redis_keys.workers_on(bulk_queue), {"celery@a:1:x": now, "celery@b:1:y": now})
    sent_from = time.time() - 1
    sinks.CloudWatchSink(namespace, endpoint).send(metrics.collect(res))
    sent_until = time.time() + 1

    def sent(name: str, lane: Lane, queue: str = live_queue) -> float:
        figures = stats(
            namespace, name, sent_from, sent_until, dimensions=dimensions_of(name, queue, lane)
        )
        assert figures["SampleCount"] == 1, (name, lane, queue)
        return figures["Maximum"]

    assert [sent("QueueDepth", lane) for lane in Lane] == [2, 3]
    assert [sent("BacklogPerTask", lane) for lane in Lane] == [1.0, 1.5]
    assert sent("RunningTasks", Lane.LIVE) == 2  # either lane: a, b
    assert sent("OldestJobAgeSeconds", Lane.BULK) > 0
    model = stage_queue(Stage.MODEL, res.settings)
    assert [sent("QueueDepth", lane, model) for lane in Lane] == [0, 0]
