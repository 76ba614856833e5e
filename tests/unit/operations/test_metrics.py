"""What one report sends, built from readings without any service."""

from __future__ import annotations

import logging

import pytest

from mailpipe.broker.queues import Stage
from mailpipe.operations.metrics import BacklogMetrics, LogMetricsSink, metric_data


def reading(**fleet: object) -> BacklogMetrics:
    return BacklogMetrics(
        queue="mailpipe", queue_depth=4, oldest_job_age_s=2.0, running_tasks=2, **fleet
    )


def test_each_stage_has_its_pause_figure_with_the_stage_as_dimension() -> None:
    data = metric_data(reading(paused_stages=frozenset({Stage.MODEL})))
    paused = {
        entry["Dimensions"][0]["Value"]: entry["Value"]
        for entry in data
        if entry["MetricName"] == "StagePaused"
    }
    assert paused == {"cpu": 0.0, "model": 1.0}
    queue = [entry for entry in data if entry["MetricName"] != "StagePaused"]
    assert {entry["Dimensions"][0]["Name"] for entry in queue} == {"Queue"}
    assert len(queue) == 5


def test_a_reading_without_the_fleet_s_figures_has_no_pause_figure() -> None:
    names = [entry["MetricName"] for entry in metric_data(reading())]
    assert names == [
        "QueueDepth",
        "OldestJobAgeSeconds",
        "DeferredJobs",
        "BacklogPerTask",
        "RunningTasks",
    ]


def test_the_log_names_the_paused_stages(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mailpipe.operations.metrics"):
        LogMetricsSink().send(
            [reading(paused_stages=frozenset(Stage)), reading(paused_stages=frozenset())]
        )
    assert [r.getMessage().rsplit(" ", 1)[1] for r in caplog.records] == [
        "StagePaused=cpu,model",
        "StagePaused=none",
    ]
