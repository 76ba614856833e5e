"""What one report sends, built from readings without any service."""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime, timedelta

import pytest

from mailpipe.broker.queues import Stage
from mailpipe.operations.metrics import (
    JOB_COUNT_NAMES,
    JOB_COUNTS,
    BacklogMetrics,
    duration_step,
    stage_jobs,
)
from mailpipe.operations.sinks import LogMetricsSink, metric_data
from mailpipe.storage.models import AttemptOutcome


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


def test_each_lane_s_figures_name_the_stage_s_queue_and_the_lane() -> None:
    """The bulk lane's reading has its own depth, age, deferrals and backlog per task, under
    the stage's queue and `Lane=bulk`; RunningTasks, the same workers for both lanes, is sent
    once per stage, with the live lane's."""
    live = reading(deferred_jobs=2)
    bulk = BacklogMetrics(
        queue="mailpipe.model.bulk", queue_depth=7, oldest_job_age_s=9.0, running_tasks=2
    )
    sent = {
        (entry["MetricName"], tuple(d["Value"] for d in entry["Dimensions"])): entry["Value"]
        for entry in metric_data(live) + metric_data(bulk)
    }
    assert sent == {
        ("QueueDepth", ("mailpipe", "live")): 4.0,
        ("OldestJobAgeSeconds", ("mailpipe", "live")): 2.0,
        ("DeferredJobs", ("mailpipe", "live")): 2.0,
        ("BacklogPerTask", ("mailpipe", "live")): 3.0,
        ("RunningTasks", ("mailpipe",)): 2.0,
        ("QueueDepth", ("mailpipe.model", "bulk")): 7.0,
        ("OldestJobAgeSeconds", ("mailpipe.model", "bulk")): 9.0,
        ("DeferredJobs", ("mailpipe.model", "bulk")): 0.0,
        ("BacklogPerTask", ("mailpipe.model", "bulk")): 3.5,
    }
    assert [d["Name"] for d in metric_data(bulk)[0]["Dimensions"]] == ["Queue", "Lane"]


def test_the_lanes_backlog_per_task_sum_to_the_stage_s() -> None:
    """Both lanes divide by the stage's running tasks: the sum the template scales on is the
    stage's whole backlog over its tasks; a paused stage's lanes are both 0."""
    lanes = [
        BacklogMetrics(queue=q, queue_depth=d, oldest_job_age_s=0.0, running_tasks=4)
        for q, d in (("mailpipe", 6), ("mailpipe.bulk", 10))
    ]
    assert sum(r.backlog_per_task for r in lanes) == (6 + 10) / 4
    assert {replace(r, held=True).backlog_per_task for r in lanes} == {0.0}


def test_the_log_names_the_paused_stages(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mailpipe.operations.metrics"):
        LogMetricsSink().send(
            [reading(paused_stages=frozenset(Stage)), reading(paused_stages=frozenset())]
        )
    assert [r.getMessage().rsplit(" ", 1)[1] for r in caplog.records] == [
        "StagePaused=cpu,model",
        "StagePaused=none",
    ]


def at(seconds: float) -> datetime:
    return datetime(2025, 1, 1) + timedelta(seconds=seconds)


def attempt(
    stage: str, outcome: str, seconds: float | None
) -> tuple[str, str, datetime | None, datetime]:
    """(stage, outcome, started_at, ended_at) of an attempt that ran `seconds` (None: no start)."""
    return (stage, outcome, None if seconds is None else at(0), at(seconds or 0))


def test_each_outcome_counts_in_its_stage_s_figures() -> None:
    jobs = stage_jobs(
        [
            attempt("cpu", "succeeded", 1.0),
            attempt("cpu", "duplicate", 1.0),
            attempt("cpu", "handed_off", 1.0),  # the CPU stage's work done
            attempt("cpu", "waiting", 1.0),
            attempt("cpu", "failed", 1.0),
            attempt("cpu", "retrying", 1.0),
            attempt("cpu", "lost", 1.0),
            attempt("cpu", "cut_off", 1.0),
            attempt("model", "deferred", None),
            attempt("model", "deferred", 1.0),
            attempt("model", "succeeded", 2.0),
        ]
    )
    assert {stage: dict(figures.counts) for stage, figures in jobs.items()} == {
        Stage.CPU: {"JobsSucceeded": 4, "JobsFailed": 1, "JobsRetried": 3, "JobsDeferred": 0},
        Stage.MODEL: {"JobsSucceeded": 1, "JobsFailed": 0, "JobsRetried": 0, "JobsDeferred": 2},
    }
    # A lost or cut-off attempt's end is when a later claim noticed it, and an attempt with no
    # start has no duration: neither is timed.
    assert sum(jobs[Stage.CPU].durations.values()) == 6
    assert sum(jobs[Stage.MODEL].durations.values()) == 2


def test_every_outcome_of_an_attempt_counts_as_one_of_the_four() -> None:
    assert set(JOB_COUNTS) == set(AttemptOutcome)
    assert set(JOB_COUNTS.values()) == set(JOB_COUNT_NAMES)


def test_a_stage_with_no_attempt_reports_zeros_and_no_duration() -> None:
    jobs = stage_jobs([attempt("model", "succeeded", 0.5)])
    assert dict(jobs[Stage.CPU].counts) == dict.fromkeys(
        ("JobsSucceeded", "JobsFailed", "JobsRetried", "JobsDeferred"), 0
    )
    data = metric_data(reading(paused_stages=frozenset(), stage_jobs=jobs))
    by_stage = {
        stage: sorted(e["MetricName"] for e in data if e["Dimensions"] == stage_dimension(stage))
        for stage in ("cpu", "model")
    }
    counts = ["JobsDeferred", "JobsFailed", "JobsRetried", "JobsSucceeded"]
    assert by_stage == {
        "cpu": [*counts, "StagePaused"],
        "model": ["JobDuration", *counts, "StagePaused"],
    }


def stage_dimension(stage: str) -> list[dict[str, str]]:
    return [{"Name": "Stage", "Value": stage}]


def test_durations_go_as_values_and_counts_that_cloudwatch_takes() -> None:
    """Every duration from 0 to a day, at once: each stage's JobDuration fits in the 150 distinct
    values CloudWatch takes per metric and request, each value within 6 % of the durations it
    stands for, and the whole report within 1,000 entries."""
    durations = [0.0, 0.0004] + [10 ** (k / 1000) for k in range(-3000, 5000)]
    attempts = [attempt(stage, "succeeded", s) for stage in ("cpu", "model") for s in durations]
    data = metric_data(reading(paused_stages=frozenset(), stage_jobs=stage_jobs(attempts)))
    assert len(data) <= 1000
    timed = [e for e in data if e["MetricName"] == "JobDuration"]
    assert [e["Dimensions"] for e in timed] == [stage_dimension("cpu"), stage_dimension("model")]
    for entry in timed:
        assert "Value" not in entry and entry["Unit"] == "Seconds"
        assert len(entry["Values"]) == len(set(entry["Values"])) == len(entry["Counts"]) <= 150
        assert sum(entry["Counts"]) == len(durations)
    for seconds in durations:
        if 0.001 <= seconds <= 30000:
            assert abs(duration_step(seconds) / seconds - 1) <= 0.06, seconds
    assert duration_step(0.0) == duration_step(0.0004) == duration_step(0.001)


def test_the_percentiles_read_from_the_steps() -> None:
    jobs = stage_jobs([attempt("cpu", "succeeded", s) for s in [0.1] * 5 + [1.0] * 4 + [30.0]])
    figures = jobs[Stage.CPU]
    assert figures.percentile(0.5) == duration_step(0.1)
    assert figures.percentile(0.9) == duration_step(1.0)
    assert figures.percentile(1.0) == duration_step(30.0)
    assert jobs[Stage.MODEL].percentile(0.5) is None


def test_the_log_gives_each_stage_s_jobs(caplog: pytest.LogCaptureFixture) -> None:
    jobs = stage_jobs([attempt("model", "succeeded", 2.0), attempt("model", "retrying", 2.0)])
    with caplog.at_level(logging.INFO, logger="mailpipe.operations.metrics"):
        LogMetricsSink().send([reading(paused_stages=frozenset(), stage_jobs=jobs)])
    lines = [r.getMessage() for r in caplog.records if "stage=" in r.getMessage()]
    step = duration_step(2.0)
    assert lines == [
        "metrics stage=cpu JobsSucceeded=0 JobsFailed=0 JobsRetried=0 JobsDeferred=0 "
        "JobDurationP50=None JobDurationP90=None",
        "metrics stage=model JobsSucceeded=1 JobsFailed=0 JobsRetried=1 JobsDeferred=0 "
        f"JobDurationP50={step} JobDurationP90={step}",
    ]


def test_running_tasks_are_sent_per_release_as_well() -> None:
    data = metric_data(reading(versions={"0.1.0": 3, "0.2.0": 1}))
    per_release = {
        entry["Dimensions"][0]["Value"]: entry["Value"]
        for entry in data
        if entry["MetricName"] == "RunningTasks" and entry["Dimensions"][0]["Name"] == "Version"
    }
    assert per_release == {"0.1.0": 3.0, "0.2.0": 1.0}


def test_the_oldest_mailbox_wait_goes_by_stage_and_lane_only() -> None:
    """No queue and no mailbox among its dimensions; not sent when the database was not read."""
    bulk = BacklogMetrics(
        queue="mailpipe.model.bulk",
        queue_depth=0,
        oldest_job_age_s=0.0,
        running_tasks=1,
        oldest_mailbox_wait_s=42.0,
    )
    [entry] = [e for e in metric_data(bulk) if e["MetricName"] == "OldestMailboxWaitSeconds"]
    assert entry["Dimensions"] == [
        {"Name": "Stage", "Value": "model"},
        {"Name": "Lane", "Value": "bulk"},
    ]
    assert (entry["Value"], entry["Unit"]) == (42.0, "Seconds")
    names = {e["MetricName"] for e in metric_data(replace(bulk, oldest_mailbox_wait_s=None))}
    assert "OldestMailboxWaitSeconds" not in names
