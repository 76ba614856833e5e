"""The fleet over time, as the console's overview draws it and `/api/activity` gives it: for the
last hour (a bucket a minute) or the last day (a bucket a quarter of an hour),

- each stage's attempts by what they came to, as the metrics report counts them
  (`metrics.JOB_COUNTS`: succeeded, failed, retried), from `run_attempt`, and its deferrals,
  which count up on one row of the history, from the lanes' samples (each report's count);
- the p50 and p90 duration (ended_at - started_at) of the attempts that succeeded;
- each lane's depth and oldest job, the most of the metrics report's readings in the bucket
  (`queue_sample`, which the report writes: mailpipe.operations.metrics.keep_samples).

Buckets are aligned on whole minutes and quarter hours (UTC); the last one is the one under way.
The attempts are one range read of `ix_run_attempt_ended_at`, grouped in one pass: the cost grows
with the attempts in the window, not with the table (docs/benchmarks.md, "Activity charts").
PostgreSQL 14 or later (`date_bin`); SQLite, the demo's, reads the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ARRAY,
    ColumnElement,
    DateTime,
    Float,
    Integer,
    Select,
    case,
    cast,
    func,
    select,
)
from sqlalchemy.dialects.postgresql import array
from sqlalchemy.orm import Session

from mailpipe.broker.queues import Lane, Stage, stage_of
from mailpipe.operations.metrics import JOB_COUNT_NAMES, JOB_COUNTS, UNTIMED_OUTCOMES
from mailpipe.storage.models import QueueSample, RunAttempt, utcnow

# The metrics report's names, as the charts call them: JobsSucceeded is "succeeded".
KINDS = tuple(name.removeprefix("Jobs").lower() for name in JOB_COUNT_NAMES)
OUTCOMES = {
    kind: sorted(o.value for o, counted in JOB_COUNTS.items() if counted == name)
    for kind, name in zip(KINDS, JOB_COUNT_NAMES, strict=True)
}
# The attempts whose duration is a job's: those that succeeded (a lost or cut-off one's end is
# when a later claim noticed it, and is never a success).
TIMED = sorted(set(OUTCOMES["succeeded"]) - {o.value for o in UNTIMED_OUTCOMES})
QUANTILES = (0.5, 0.9)


@dataclass(frozen=True)
class Window:
    """The span drawn and the width of its buckets."""

    name: str
    span: timedelta
    bucket: timedelta

    @property
    def buckets(self) -> int:
        return self.span // self.bucket

    @property
    def bucket_minutes(self) -> float:
        return self.bucket / timedelta(minutes=1)

    def start(self, now: datetime) -> datetime:
        """The first bucket's start for a window whose last bucket holds `now` (naive UTC)."""
        width = self.bucket.total_seconds()
        last = math.floor(now.replace(tzinfo=UTC).timestamp() / width) * width
        return _naive_utc(last) - (self.buckets - 1) * self.bucket


HOUR = Window("hour", timedelta(hours=1), timedelta(minutes=1))
DAY = Window("day", timedelta(days=1), timedelta(minutes=15))
WINDOWS = {window.name: window for window in (HOUR, DAY)}


@dataclass(frozen=True)
class StageSeries:
    """One stage's attempts per bucket, by kind, and the durations of those that succeeded."""

    jobs: Mapping[str, list[int]]  # KINDS -> attempts that ended in each bucket
    p50_s: list[float | None]  # None: no attempt succeeded in the bucket
    p90_s: list[float | None]


@dataclass(frozen=True)
class LaneSeries:
    """One lane's readings per bucket: the most waiting and the oldest job's age, each the
    largest the reports of the bucket read; None where no report was made (beat down)."""

    queue: str  # the stage's queue, the `Queue` dimension
    lane: str
    depth: list[int | None]
    oldest_age_s: list[float | None]
    deferred: list[int]  # the lane's deferrals the bucket's reports counted

    @property
    def name(self) -> str:
        return self.queue if self.lane == Lane.LIVE else f"{self.queue}.{self.lane}"


@dataclass(frozen=True)
class Activity:
    window: Window
    start: datetime  # naive UTC, the first bucket's
    stages: Mapping[Stage, StageSeries]
    lanes: Sequence[LaneSeries]

    @property
    def times(self) -> list[datetime]:
        """Each bucket's start."""
        return [self.start + i * self.window.bucket for i in range(self.window.buckets)]

    @property
    def end(self) -> datetime:
        return self.start + self.window.span

    def per_minute(self, attempts: int) -> float:
        """A bucket's attempts as a rate a minute (the last bucket's, still filling, reads low)."""
        return attempts / self.window.bucket_minutes

    def as_json(self) -> dict[str, Any]:
        return {
            "window": self.window.name,
            "bucket_s": int(self.window.bucket.total_seconds()),
            "start": _iso(self.start),
            "end": _iso(self.end),
            "times": [_iso(t) for t in self.times],
            "stages": {
                stage.value: {
                    "jobs": dict(series.jobs),
                    "per_minute": {
                        kind: [round(self.per_minute(n), 3) for n in counts]
                        for kind, counts in series.jobs.items()
                    },
                    "p50_s": [_rounded(s) for s in series.p50_s],
                    "p90_s": [_rounded(s) for s in series.p90_s],
                }
                for stage, series in self.stages.items()
            },
            "lanes": [
                {
                    "queue": lane.queue,
                    "lane": lane.lane,
                    "depth": lane.depth,
                    "oldest_age_s": [_rounded(s) for s in lane.oldest_age_s],
                }
                for lane in self.lanes
            ],
        }


def fleet_activity(session: Session, window: Window, now: datetime | None = None) -> Activity:
    """The fleet over `window`, its last bucket the one `now` (naive UTC) is in."""
    start = window.start(now or utcnow())
    stages = _stages(session, window, start)
    lanes = _lanes(session, window, start)
    for lane in lanes:
        deferred = stages[stage_of(lane.queue)].jobs["deferred"]
        for i, count in enumerate(lane.deferred):
            deferred[i] += count
    return Activity(window=window, start=start, stages=stages, lanes=lanes)


def _stages(session: Session, window: Window, start: datetime) -> dict[Stage, StageSeries]:
    """One pass over the window's attempts, grouped by stage and bucket: the count of each kind,
    and on PostgreSQL the percentiles (`percentile_cont`, which skips the NULL durations of the
    attempts that did not succeed). SQLite, the demo's, has no percentile_cont: the succeeded
    attempts' times are read and their percentiles taken here, the same way."""
    postgresql = session.get_bind().dialect.name == "postgresql"
    timed = RunAttempt.outcome.in_(TIMED) & RunAttempt.started_at.is_not(None)
    in_window = (
        RunAttempt.ended_at >= start,
        RunAttempt.ended_at < start + window.span,
        # A deferral's row counts up in place: deferrals come from the lanes' samples.
        RunAttempt.deferrals.is_(None),
    )
    bucket = _bucket(postgresql, RunAttempt.ended_at, start, window).label("bucket")
    seconds = func.date_part("epoch", RunAttempt.ended_at - RunAttempt.started_at, type_=Float)
    attempts = (
        select(
            RunAttempt.stage,
            RunAttempt.outcome,
            bucket,
            *([case((timed, seconds)).label("seconds")] if postgresql else []),
        )
        .where(*in_window)
        .subquery()
    )
    counts = [func.count().filter(attempts.c.outcome.in_(OUTCOMES[kind])) for kind in KINDS]
    # Both percentiles from one sort of each group's durations.
    quantiles = (
        [
            func.percentile_cont(array(QUANTILES), type_=ARRAY(Float)).within_group(
                attempts.c.seconds
            )
        ]
        if postgresql
        else []
    )
    grouped: Select[Any] = select(
        attempts.c.stage, attempts.c.bucket, *counts, *quantiles
    ).group_by(attempts.c.stage, attempts.c.bucket)
    n = window.buckets
    series = {
        stage: StageSeries(
            jobs={kind: [0] * n for kind in KINDS}, p50_s=[None] * n, p90_s=[None] * n
        )
        for stage in Stage
    }
    for stage, bucket_of, *figures in session.execute(grouped):
        found, i = series[Stage(stage)], _index(bucket_of, start, window)
        for kind, count in zip(KINDS, figures, strict=False):
            found.jobs[kind][i] = count
        if postgresql:
            found.p50_s[i], found.p90_s[i] = figures[-1] or (None, None)
    if not postgresql:
        durations: dict[tuple[str, int], list[float]] = {}
        for stage, bucket_of, started, ended in session.execute(
            select(RunAttempt.stage, bucket, RunAttempt.started_at, RunAttempt.ended_at).where(
                *in_window, timed
            )
        ):
            assert started is not None  # timed
            durations.setdefault((stage, _index(bucket_of, start, window)), []).append(
                (ended - started).total_seconds()
            )
        for (stage, i), values in durations.items():
            found = series[Stage(stage)]
            found.p50_s[i], found.p90_s[i] = (percentile(values, q) for q in QUANTILES)
    return series


def _lanes(session: Session, window: Window, start: datetime) -> list[LaneSeries]:
    postgresql = session.get_bind().dialect.name == "postgresql"
    samples = (
        select(
            QueueSample.queue,
            QueueSample.lane,
            _bucket(postgresql, QueueSample.measured_at, start, window).label("bucket"),
            QueueSample.depth,
            QueueSample.oldest_age_s,
            QueueSample.deferred,
        )
        .where(QueueSample.measured_at >= start, QueueSample.measured_at < start + window.span)
        .subquery()
    )
    grouped = select(
        samples.c.queue,
        samples.c.lane,
        samples.c.bucket,
        func.max(samples.c.depth),
        func.max(samples.c.oldest_age_s),
        func.coalesce(func.sum(samples.c.deferred), 0),
    ).group_by(samples.c.queue, samples.c.lane, samples.c.bucket)
    n = window.buckets
    lanes: dict[tuple[str, str], LaneSeries] = {}
    for queue, lane, bucket_of, depth, oldest, deferred in session.execute(grouped):
        found = lanes.setdefault(
            (queue, lane), LaneSeries(queue, lane, [None] * n, [None] * n, [0] * n)
        )
        i = _index(bucket_of, start, window)
        found.depth[i], found.oldest_age_s[i], found.deferred[i] = depth, oldest, deferred
    # Each stage's queue in turn, its live lane first.
    return [lanes[key] for key in sorted(lanes, key=lambda k: (k[0], k[1] != Lane.LIVE))]


def percentile(values: Sequence[float], q: float) -> float:
    """PostgreSQL's `percentile_cont`: the value at position q * (n - 1) of the sorted values,
    interpolated linearly between its neighbours."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def _bucket(postgresql: bool, at: Any, start: datetime, window: Window) -> ColumnElement[Any]:
    """The bucket `at` falls in: on PostgreSQL its start (`date_bin`, PostgreSQL 14: one call
    per row, on timestamps, where `floor(extract(epoch ...))` does numeric arithmetic); on
    SQLite its number from the window's start, from the whole seconds strftime reads of the
    stored text (the buckets start on whole minutes, so no fraction of a second moves a row)."""
    if postgresql:
        return func.date_bin(window.bucket, at, start, type_=DateTime)
    since = cast(func.strftime("%s", at), Integer) - int(start.replace(tzinfo=UTC).timestamp())
    return since // int(window.bucket.total_seconds())


def _index(bucket: datetime | int, start: datetime, window: Window) -> int:
    return (bucket - start) // window.bucket if isinstance(bucket, datetime) else bucket


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(float(seconds), 4)


def _iso(at: datetime) -> str:
    return at.isoformat() + "Z"


def _naive_utc(timestamp: float) -> datetime:
    # Times in the database are naive UTC (mailpipe.storage.models.utcnow).
    return datetime.fromtimestamp(timestamp, UTC).replace(tzinfo=None)
