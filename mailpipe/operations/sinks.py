"""Where the fleet's metrics report goes (mailpipe.operations.metrics builds it): CloudWatch,
one batched PutMetricData a report, when `MAILPIPE_METRICS_NAMESPACE` is set; the log otherwise.
One small interface, `MetricsSink`, with the two behind it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from mailpipe.broker.queues import Lane, Stage
from mailpipe.errors import describe
from mailpipe.operations.metrics import JOB_COUNT_NAMES, BacklogMetrics
from mailpipe.settings import Settings

# The report's own logger: its lines keep the name operators filter them by.
log = logging.getLogger("mailpipe.operations.metrics")


class MetricsSink(Protocol):
    def send(self, readings: Sequence[BacklogMetrics]) -> None: ...


class LogMetricsSink:
    def send(self, readings: Sequence[BacklogMetrics]) -> None:
        for metrics in readings:
            self._log(metrics)

    def _log(self, metrics: BacklogMetrics) -> None:
        for stage, jobs in (metrics.stage_jobs or {}).items():
            figures = " ".join(f"{name}={jobs.counts[name]}" for name in JOB_COUNT_NAMES)
            log.info(
                "metrics stage=%s %s JobDurationP50=%s JobDurationP90=%s",
                stage,
                figures,
                jobs.percentile(0.5),
                jobs.percentile(0.9),
            )
        counts = "".join(
            f" {name}={value}"
            for name, value in (
                ("OldestMailboxWaitSeconds", metrics.oldest_mailbox_wait_s),
                ("FailedRuns", metrics.failed_runs),
                ("Deferrals", metrics.deferrals),
                ("StagePaused", _names(metrics.paused_stages)),
            )
            if value is not None
        )
        log.info(
            "metrics queue=%s lane=%s QueueDepth=%d OldestJobAgeSeconds=%.1f DeferredJobs=%d "
            "BacklogPerTask=%.2f RunningTasks=%d%s",
            metrics.queue_dimension,
            metrics.lane,
            metrics.queue_depth,
            metrics.oldest_job_age_s,
            metrics.deferred_jobs,
            metrics.backlog_per_task,
            metrics.running_tasks,
            counts,
        )


class CloudWatchSink:
    """One batched PutMetricData per report (every lane's figures, the stages' pauses and
    jobs: at most 36 entries, well within the API's 1,000).

    Short timeouts and at most 3 attempts bound how long a report can take (about 20 s against a
    CloudWatch that accepts connections and never answers). A report that fails is logged and
    dropped, never retried later: the next report is a fresh reading, and the alarms treat a
    missing FailedRuns datapoint as no failures, a missing OldestJobAgeSeconds or BacklogPerTask
    as breaching.
    """

    def __init__(self, namespace: str, endpoint_url: str | None) -> None:
        self.namespace = namespace
        self._endpoint_url = endpoint_url
        self._client: Any = None

    def send(self, readings: Sequence[BacklogMetrics]) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        data = [entry for metrics in readings for entry in metric_data(metrics)]
        try:
            self._cloudwatch().put_metric_data(Namespace=self.namespace, MetricData=data)
        except (BotoCoreError, ClientError) as exc:
            log.warning(
                "CloudWatch PutMetricData failed, these figures are dropped: %s", describe(exc)
            )

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
    """The PutMetricData entries of one reading: its lane's figures (dimensions `Queue` and
    `Lane`; OldestMailboxWaitSeconds's `Stage` and `Lane`), its stage's RunningTasks (dimension `Queue`) on the live lane's reading, and each
    stage's pause and jobs (dimension `Stage`) when the reading carries them."""
    queue = [{"Name": "Queue", "Value": metrics.queue_dimension}]
    lane = [*queue, {"Name": "Lane", "Value": metrics.lane.value}]
    figures: list[tuple[str, float, str, list[dict[str, str]]]] = [
        ("QueueDepth", metrics.queue_depth, "Count", lane),
        ("OldestJobAgeSeconds", metrics.oldest_job_age_s, "Seconds", lane),
        ("DeferredJobs", metrics.deferred_jobs, "Count", lane),
        ("BacklogPerTask", metrics.backlog_per_task, "Count", lane),
    ]
    if metrics.oldest_mailbox_wait_s is not None:
        # By stage and lane only: a mailbox's name may be an address, and each name would be a
        # metric of its own.
        by_lane = [
            {"Name": "Stage", "Value": metrics.stage.value},
            {"Name": "Lane", "Value": metrics.lane.value},
        ]
        figures.append(
            ("OldestMailboxWaitSeconds", metrics.oldest_mailbox_wait_s, "Seconds", by_lane)
        )
    if metrics.lane is Lane.LIVE:
        # The same workers consume both lanes: one count per stage.
        figures.append(("RunningTasks", metrics.running_tasks, "Count", queue))
    if metrics.failed_runs is not None:
        figures.append(("FailedRuns", metrics.failed_runs, "Count", queue))
    if metrics.deferrals is not None:
        figures.append(("Deferrals", metrics.deferrals, "Count", queue))
    if metrics.paused_stages is not None:
        figures.extend(
            (
                "StagePaused",
                stage in metrics.paused_stages,
                "None",
                [{"Name": "Stage", "Value": stage}],
            )
            for stage in Stage
        )
    for stage, jobs in (metrics.stage_jobs or {}).items():
        figures.extend(
            (name, jobs.counts[name], "Count", [{"Name": "Stage", "Value": stage}])
            for name in JOB_COUNT_NAMES
        )
    # A rolling deploy half done shows as two releases' counts.
    figures.extend(
        ("RunningTasks", count, "Count", [{"Name": "Version", "Value": version}])
        for version, count in (metrics.versions or {}).items()
    )
    timestamp = datetime.fromtimestamp(metrics.measured_at, UTC)
    entries = [
        {
            "MetricName": name,
            "Dimensions": dimensions,
            "Timestamp": timestamp,
            "Value": float(value),
            "Unit": unit,
        }
        for name, value, unit, dimensions in figures
    ]
    for stage, jobs in (metrics.stage_jobs or {}).items():
        if jobs.durations:  # an empty Values array is refused
            durations = sorted(jobs.durations.items())
            entries.append(
                {
                    "MetricName": "JobDuration",
                    "Dimensions": [{"Name": "Stage", "Value": stage}],
                    "Timestamp": timestamp,
                    "Values": [seconds for seconds, _ in durations],
                    "Counts": [float(count) for _, count in durations],
                    "Unit": "Seconds",
                }
            )
    return entries


def make_sink(settings: Settings) -> MetricsSink:
    if settings.metrics_namespace:
        return CloudWatchSink(settings.metrics_namespace, settings.cloudwatch_endpoint_url)
    return LogMetricsSink()


def _names(stages: frozenset[Stage] | None) -> str | None:
    return None if stages is None else ",".join(sorted(stages)) or "none"
