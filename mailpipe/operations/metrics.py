"""Backlog metrics for autoscaling and alarms (docs/metrics.md).

Per queue (dimension `Queue` = `MAILPIPE_QUEUE`):

- `QueueDepth`: jobs waiting in the email queue, every priority list of it;
- `OldestJobAgeSeconds`: how long the oldest of them has waited (0 when none waits);
- `DeferredJobs`: jobs deferred (a held lease, the rate limit, throttling) and waiting for their
  delivery, which workers hold for its countdown outside the queue;
- `RunningTasks`: worker processes (ECS tasks) with a fresh heartbeat, not a guess from ECS;
- `BacklogPerTask`: (QueueDepth + DeferredJobs) / RunningTasks, what Auto Scaling tracks;
- `FailedRuns`: runs that failed since the previous report, counted once across the fleet;
- `Deferrals`: deferrals since the previous report, counted once across the fleet.

Two reporters send them: every worker's main process (`MetricsReporter`, a daemon thread started
at worker_ready) and the sweeper. The first four are fleet-wide readings that every reporter
sends alike, so Average and Maximum are right for them and Sum is not. `FailedRuns` and
`Deferrals` are counts per report window that one reporter claims (see `claim_failed_runs`), so
their Sum over a period is the number in it.

One small interface with two sinks: CloudWatch when `MAILPIPE_METRICS_NAMESPACE` is set, the log
otherwise. This module never imports Celery; the callers pass in how to count live workers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import func, select

from mailpipe.coordination import redis_keys
from mailpipe.coordination.brokerstate import queue_stats
from mailpipe.resources import Resources
from mailpipe.settings import Settings
from mailpipe.storage.models import PipelineRun, RunStatus

log = logging.getLogger("mailpipe.operations.metrics")

# A run's closed_at is stamped before its transaction commits: a window that ends this long
# before now sees every run that failed in it, at the cost of reporting failures this much later.
FAILED_RUNS_SETTLE_S = 5.0

# Moves the shared FailedRuns cursor only if no other reporter moved it since it was read.
_ADVANCE_CURSOR = """
if (redis.call('get', KEYS[1]) or '') ~= ARGV[1] then return 0 end
redis.call('set', KEYS[1], ARGV[2])
return 1
"""


@dataclass(frozen=True)
class BacklogMetrics:
    queue: str
    queue_depth: int
    oldest_job_age_s: float
    running_tasks: int  # worker processes (ECS tasks) alive now
    deferred_jobs: int = 0
    # Runs failed since the last report; None when another reporter counted this window.
    failed_runs: int | None = None
    deferrals: int | None = None
    measured_at: float = field(default_factory=time.time)

    @property
    def backlog_per_task(self) -> float:
        # With no live task, the whole backlog is what one new task would face.
        return (self.queue_depth + self.deferred_jobs) / max(1, self.running_tasks)


class MetricsSink(Protocol):
    def send(self, metrics: BacklogMetrics) -> None: ...


class LogMetricsSink:
    def send(self, metrics: BacklogMetrics) -> None:
        counts = "".join(
            f" {name}={value}"
            for name, value in (
                ("FailedRuns", metrics.failed_runs),
                ("Deferrals", metrics.deferrals),
            )
            if value is not None
        )
        log.info(
            "metrics queue=%s QueueDepth=%d OldestJobAgeSeconds=%.1f DeferredJobs=%d "
            "BacklogPerTask=%.2f RunningTasks=%d%s",
            metrics.queue,
            metrics.queue_depth,
            metrics.oldest_job_age_s,
            metrics.deferred_jobs,
            metrics.backlog_per_task,
            metrics.running_tasks,
            counts,
        )


class CloudWatchSink:
    """One batched PutMetricData per report.

    Short timeouts and at most 3 attempts bound how long a report can take (about 20 s against a
    CloudWatch that accepts connections and never answers). A report that fails is logged and
    dropped, never retried later: the next report is a fresh reading, and the alarms treat a
    missing FailedRuns datapoint as no failures, a missing OldestJobAgeSeconds as breaching.
    """

    def __init__(self, namespace: str, endpoint_url: str | None) -> None:
        self.namespace = namespace
        self._endpoint_url = endpoint_url
        self._client: Any = None

    def send(self, metrics: BacklogMetrics) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._cloudwatch().put_metric_data(
                Namespace=self.namespace, MetricData=metric_data(metrics)
            )
        except (BotoCoreError, ClientError) as exc:
            log.warning("CloudWatch PutMetricData failed, these figures are dropped: %s", exc)

    def _cloudwatch(self) -> Any:
        # Built on first use in the process that sends (never at import, never before a fork),
        # from its own session: boto3's default session is not thread-safe.
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.session.Session().client(
                "cloudwatch",
                endpoint_url=self._endpoint_url,
                config=Config(
                    connect_timeout=2,
                    read_timeout=5,
                    retries={"mode": "standard", "max_attempts": 3},
                ),
            )
        return self._client


def metric_data(metrics: BacklogMetrics) -> list[dict[str, Any]]:
    """The PutMetricData entries of one report, all with the dimension `Queue`."""
    figures: list[tuple[str, float, str]] = [
        ("QueueDepth", metrics.queue_depth, "Count"),
        ("OldestJobAgeSeconds", metrics.oldest_job_age_s, "Seconds"),
        ("DeferredJobs", metrics.deferred_jobs, "Count"),
        ("BacklogPerTask", metrics.backlog_per_task, "Count"),
        ("RunningTasks", metrics.running_tasks, "Count"),
    ]
    if metrics.failed_runs is not None:
        figures.append(("FailedRuns", metrics.failed_runs, "Count"))
    if metrics.deferrals is not None:
        figures.append(("Deferrals", metrics.deferrals, "Count"))
    timestamp = datetime.fromtimestamp(metrics.measured_at, UTC)
    dimensions = [{"Name": "Queue", "Value": metrics.queue}]
    return [
        {
            "MetricName": name,
            "Dimensions": dimensions,
            "Timestamp": timestamp,
            "Value": float(value),
            "Unit": unit,
        }
        for name, value, unit in figures
    ]


def make_sink(settings: Settings) -> MetricsSink:
    if settings.metrics_namespace:
        return CloudWatchSink(settings.metrics_namespace, settings.cloudwatch_endpoint_url)
    return LogMetricsSink()


def collect(res: Resources, count_workers: Callable[[], int]) -> BacklogMetrics:
    """One reading of every metric. A database error costs FailedRuns only: the backlog figures,
    which scaling depends on, are still worth sending."""
    measured_at = time.time()
    stats = queue_stats(res.redis, res.settings.queue)
    deferred, deferrals = _deferred_work(res, measured_at)
    running = count_workers()
    try:
        failed = claim_failed_runs(res, lookback=res.settings.metrics_interval)
    except Exception:
        log.warning("could not count failed runs for FailedRuns", exc_info=True)
        failed = None
    return BacklogMetrics(
        queue=res.settings.queue,
        queue_depth=stats.depth,
        oldest_job_age_s=stats.oldest_age_s or 0.0,
        running_tasks=running,
        deferred_jobs=deferred,
        failed_runs=failed,
        deferrals=deferrals,
        measured_at=measured_at,
    )


def _deferred_work(res: Resources, now: float) -> tuple[int, int | None]:
    """Deferred jobs waiting now, and deferrals since the last report of any reporter (None when
    none was counted). An entry whose delivery never came (lost with a worker past the
    visibility timeout, a purged queue) leaves the count once it is a visibility timeout late."""
    pipe = res.redis.pipeline(transaction=True)
    pipe.zremrangebyscore(redis_keys.deferred(), "-inf", now - res.settings.visibility_timeout)
    pipe.zcard(redis_keys.deferred())
    pipe.getdel(redis_keys.deferrals_counter())
    _, waiting, counted = pipe.execute()
    return int(waiting), int(counted) if counted is not None else None


def claim_failed_runs(res: Resources, lookback: float) -> int | None:
    """Runs that failed since the last report of any reporter, or None if another reporter has
    counted up to now already.

    Every worker reports, so "since my last report" would count each failure once per worker. A
    cursor in Redis holds the end of the last counted window instead: a reporter counts the runs
    failed in (cursor, now - settle] and moves the cursor with a compare-and-set; if another
    reporter moved it first, its count is dropped and that reporter's is the one sent. Each failure
    is thus counted once (at most once: a report lost on its way to CloudWatch loses its count).
    With no cursor yet (a new fleet, a flushed Redis) the first window is `lookback` long.

    The count is a range scan of the partial index on failed runs' `closed_at`.
    """
    key = redis_keys.failed_runs_cursor()
    end = time.time() - FAILED_RUNS_SETTLE_S
    cursor = res.redis.get(key)
    start = float(cursor) if cursor is not None else end - lookback
    if end <= start:
        return None
    with res.db.session() as session:
        count = session.scalar(
            select(func.count())
            .select_from(PipelineRun)
            .where(
                PipelineRun.status == RunStatus.FAILED,
                PipelineRun.closed_at > _naive_utc(start),
                PipelineRun.closed_at <= _naive_utc(end),
            )
        )
    if not res.redis.eval(_ADVANCE_CURSOR, 1, key, cursor or b"", repr(end)):
        return None
    return count or 0


def _naive_utc(timestamp: float) -> datetime:
    # Times in the database are naive UTC (mailpipe.storage.models.utcnow).
    return datetime.fromtimestamp(timestamp, UTC).replace(tzinfo=None)


class MetricsReporter:
    """Reports every `interval` seconds from a daemon thread of the worker's main process.

    The thread, not Celery's event loop, waits on Redis, the database and
    CloudWatch: a slow or unreachable CloudWatch delays the next report, never job intake. Reports
    keep to a fixed grid; one that overruns is followed at once by the next, never by a burst.
    Every error is logged and the report dropped.

    Its connections are its own (not the process's shared `Resources`), so the pool's children,
    forked from this process, never use them.
    """

    def __init__(
        self,
        res: Resources,
        count_workers: Callable[[], int],
        sink: MetricsSink,
        interval: float,
    ) -> None:
        self._res = res
        self._count_workers = count_workers
        self._sink = sink
        self._interval = interval
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mailpipe-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop reporting; waits at most `timeout` for a report in flight (the thread is a
        daemon, so one stuck on CloudWatch does not hold up the worker's exit)."""
        self._stopping.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._res.close()

    def report_once(self) -> None:
        try:
            self._sink.send(collect(self._res, self._count_workers))
        except Exception:
            log.warning("metrics report dropped", exc_info=True)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stopping.is_set():
            self.report_once()
            next_at = max(next_at + self._interval, time.monotonic())
            self._stopping.wait(next_at - time.monotonic())
