"""Backlog metrics for autoscaling and alarms (docs/metrics.md).

Per lane of each stage's queue (dimensions `Queue`: the email queue `MAILPIPE_QUEUE` or its
model queue `<queue>.model`, which the worker and model roles scale on; and `Lane`: `live`, that
queue itself, or `bulk`, its `.bulk` twin):

- `QueueDepth`: jobs waiting in the lane's queue, every priority list of it;
- `OldestJobAgeSeconds`: how long the oldest of them has waited (0 when none waits);
- `DeferredJobs`: jobs deferred (a held lease, the rate limit, throttling) and waiting for their
  delivery, which workers hold for its countdown outside the queue;
- `BacklogPerTask`: (QueueDepth + DeferredJobs) / RunningTasks of the stage: summed over the two
  lanes, the stage's backlog per task, what Auto Scaling tracks; 0 while the stage is paused, as
  a task added then would sit idle.

Per stage and lane (dimensions `Stage` and `Lane`, never a mailbox's name):

- `OldestMailboxWaitSeconds`: the longest wait of a mailbox's oldest waiting email, over every
  mailbox but the one with the most waiting work there (mailpipe.operations.waiting): one flood
  alone reads 0, a mailbox starved behind it its wait; 0 while the stage is paused.

Per stage's queue (dimension `Queue` alone):

- `RunningTasks`: worker processes (ECS tasks) consuming either lane, with a fresh heartbeat;
  also per release (dimension `Version`), so a fleet half rolled to the next release shows two.

With the email queue's dimension only:

- `FailedRuns`: runs that failed since the previous report;
- `Deferrals`: deferrals since the previous report, of either stage.

Per stage (dimension `Stage`: `cpu`, `model`):

- `StagePaused`: 1 while the stage is paused (mailpipe.coordination.pauses), else 0;
- `JobsSucceeded`, `JobsFailed`, `JobsRetried`: the stage's attempts that ended since the
  previous report (`run_attempt` rows), by what they came to (`JOB_COUNTS`); `JobsDeferred`: its
  jobs' deferrals, counted per lane in Redis as they happen, since a deferral counts up on one
  row of the history instead of writing a row each;
- `JobDuration`: how long each of those attempts ran, as a distribution (`Values` and `Counts`)
  from which CloudWatch computes percentiles.

One reporter sends them for the whole fleet: the beat that holds the beat lock
(mailpipe.app.scheduler), every `MAILPIPE_METRICS_INTERVAL` seconds, from beat's own process, which
runs no jobs: the report goes out when every worker child is busy, which is when it matters most.
A report is one reading of Redis, one transaction of two indexed range reads in the database
(the failed runs, the attempts that ended), one grouped read of the waiting work by mailbox,
one that keeps each lane's depth and oldest job for
the console's charts (`queue_sample`, a day of them) and one batched PutMetricData, whatever the
fleet's size. The sweeper reads the same backlog for its own report,
and sends nothing.

Where a report goes is mailpipe.operations.sinks: CloudWatch when `MAILPIPE_METRICS_NAMESPACE` is
set, the log otherwise. This module never imports Celery.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from redis import RedisError
from sqlalchemy import delete, func, insert, select

from mailpipe.broker.layout import queue_stats
from mailpipe.broker.queues import Lane, Stage, lane_of, stage_of, stage_queue
from mailpipe.coordination import deferrals, redis_keys
from mailpipe.coordination.heartbeat import live_versions, live_workers
from mailpipe.operations.waiting import oldest_mailbox_waits
from mailpipe.pipeline import stage_pauses
from mailpipe.resources import Resources

if TYPE_CHECKING:
    from mailpipe.operations import sinks
from mailpipe.storage.models import (
    AttemptOutcome,
    PipelineRun,
    QueueSample,
    RunAttempt,
    RunStatus,
    table,
)

log = logging.getLogger("mailpipe.operations.metrics")

# A run's closed_at and an attempt's ended_at are stamped before their transaction commits: a
# window that ends this long before now sees every run failed and attempt ended in it, at the
# cost of reporting them this much later.
REPORT_SETTLE_S = 5.0

# What each outcome of an attempt counts as, in its stage's figures.
JOB_COUNTS = {
    AttemptOutcome.SUCCEEDED: "JobsSucceeded",
    AttemptOutcome.DUPLICATE: "JobsSucceeded",
    # The CPU stage's work is done: the model stage is next, or waits for model calls.
    AttemptOutcome.HANDED_OFF: "JobsSucceeded",
    AttemptOutcome.WAITING: "JobsSucceeded",
    AttemptOutcome.FAILED: "JobsFailed",
    AttemptOutcome.RETRYING: "JobsRetried",
    AttemptOutcome.LOST: "JobsRetried",
    AttemptOutcome.CUT_OFF: "JobsRetried",
    AttemptOutcome.DEFERRED: "JobsDeferred",
}
JOB_COUNT_NAMES = ("JobsSucceeded", "JobsFailed", "JobsRetried", "JobsDeferred")
# Outcomes written by a later claim: their ended_at is when the loss was noticed, so their
# duration says nothing of the job's.
UNTIMED_OUTCOMES = frozenset({AttemptOutcome.LOST, AttemptOutcome.CUT_OFF})

# How long the lanes' samples are kept: the console draws at most a day of them.
SAMPLES_KEPT = timedelta(days=1)

# JobDuration's values are rounded to steps of a twentieth of a decade from 1 ms (each value
# within 6 % of the duration): 150 steps, the most distinct values CloudWatch takes for one
# metric in one request, reach 8.7 hours, far above any job's hard time limit.
DURATION_FLOOR_S = 0.001
DURATION_STEPS_PER_DECADE = 20
DURATION_STEPS = 150

# Moves the shared report cursor only if no other reporter moved it since it was read.
_ADVANCE_CURSOR = """
if (redis.call('get', KEYS[1]) or '') ~= ARGV[1] then return 0 end
redis.call('set', KEYS[1], ARGV[2])
return 1
"""


@dataclass(frozen=True)
class StageJobs:
    """One stage's attempts that ended in a report's window."""

    counts: Mapping[str, int]  # JOB_COUNT_NAMES -> attempts
    durations: Mapping[float, int]  # seconds, rounded by duration_step -> attempts

    def percentile(self, q: float) -> float | None:
        """The duration `q` (0 to 1) of the attempts are at or under, or None with none."""
        total = sum(self.durations.values())
        seen = 0
        for seconds, count in sorted(self.durations.items()):
            seen += count
            if seen >= q * total:
                return seconds
        return None


@dataclass(frozen=True)
class SinceLastReport:
    """What ended since the previous report: the runs that failed, each stage's attempts."""

    failed_runs: int
    stage_jobs: Mapping[Stage, StageJobs]

    def with_deferrals(self, readings: Iterable[BacklogMetrics]) -> SinceLastReport:
        """The window with each lane's deferrals (which write no row each) added to its
        stage's JobsDeferred."""
        added: Counter[Stage] = Counter()
        for reading in readings:
            added[stage_of(reading.queue)] += reading.lane_deferrals
        jobs = {
            stage: replace(
                found,
                counts={
                    **found.counts,
                    "JobsDeferred": found.counts["JobsDeferred"] + added[stage],
                },
            )
            for stage, found in self.stage_jobs.items()
        }
        return replace(self, stage_jobs=jobs)


@dataclass(frozen=True)
class BacklogMetrics:
    queue: str  # the queue read: a stage's queue (its live lane) or its `.bulk` twin
    queue_depth: int
    oldest_job_age_s: float
    running_tasks: int  # worker processes (ECS tasks) alive now, consuming the stage
    deferred_jobs: int = 0
    # Runs failed since the last report; None when another reporter counted this window.
    failed_runs: int | None = None
    deferrals: int | None = None
    # This lane's deferrals since the report before.
    lane_deferrals: int = 0
    # The stages paused now; None on the readings that do not carry the fleet's figures.
    paused_stages: frozenset[Stage] | None = None
    # Live worker processes per release, on the reading that carries the fleet's figures.
    versions: Mapping[str, int] | None = None
    # Each stage's attempts since the last report; None as for failed_runs.
    stage_jobs: Mapping[Stage, StageJobs] | None = None
    # The queue's stage is paused: no task may take its jobs, however many run.
    held: bool = False
    # The lane's worst-off mailbox's oldest wait, the mailbox with the most waiting work left
    # out; None when the database could not be read.
    oldest_mailbox_wait_s: float | None = None
    measured_at: float = field(default_factory=time.time)

    @property
    def lane(self) -> Lane:
        return lane_of(self.queue)

    @property
    def queue_dimension(self) -> str:
        """The `Queue` dimension: the stage's queue, the name of its live lane (a bulk lane is
        that name with `.bulk` after it, mailpipe.broker.queues.stage_queue)."""
        return self.queue.removesuffix(f".{Lane.BULK}")

    @property
    def stage(self) -> Stage:
        return stage_of(self.queue)

    @property
    def backlog_per_task(self) -> float:
        if self.held:
            # A task added now would sit idle: scaling out on a paused backlog adds nothing.
            return 0.0
        # With no live task, the whole backlog is what one new task would face.
        return (self.queue_depth + self.deferred_jobs) / max(1, self.running_tasks)


def collect(res: Resources) -> list[BacklogMetrics]:
    """One reading of every metric, a reading per lane of each stage (the email queue's live
    lane first, carrying the fleet's counts). A database error costs FailedRuns and the stages'
    jobs only: the backlog figures, which scaling depends on, are still worth sending."""
    measured_at = time.time()
    settings = res.settings
    paused = stage_pauses.in_force(res)
    for stage, pause in paused.items():
        if pause.alarming(settings.outage_alarm_after, measured_at):
            log.error(
                "ALARM: the %s stage has been paused for %.0f s, past MAILPIPE_OUTAGE_ALARM_AFTER "
                "(%g s), by an outage of %s: %s",
                stage,
                measured_at - pause.since,
                settings.outage_alarm_after,
                pause.dependency or "a dependency",
                pause.error,
            )
    lane_deferrals = take_lane_deferrals(res)
    readings: list[BacklogMetrics] = []
    for stage in Stage:
        lanes = [stage_queue(stage, settings, lane) for lane in Lane]
        readings.extend(
            replace(
                read_backlog(res, queue, measured_at, lanes),
                held=stage in paused,
                lane_deferrals=lane_deferrals.get(queue, 0),
            )
            for queue in lanes
        )
    readings = with_mailbox_waits(res, readings, measured_at)
    try:
        keep_samples(res, readings)
    except Exception:
        log.warning("could not keep the lanes' samples for the console", exc_info=True)
    email, *others = readings
    counted = deferrals.take_total(res.redis)
    try:
        window = claim_window(res, lookback=settings.metrics_interval)
    except Exception:
        log.warning("could not count failed runs and ended jobs", exc_info=True)
        window = None
    if window is not None:
        window = window.with_deferrals(readings)
    return [
        replace(
            email,
            failed_runs=window.failed_runs if window else None,
            stage_jobs=window.stage_jobs if window else None,
            deferrals=counted,
            paused_stages=frozenset(paused),
            versions=live_versions(res.redis, settings.worker_dead_after),
        ),
        *others,
    ]


def report(res: Resources, sink: sinks.MetricsSink) -> None:
    """One report of the fleet's metrics (beat's lock holder runs it every interval,
    mailpipe.app.scheduler); a report that fails drops its figures, the next is a fresh
    reading."""
    sink.send(collect(res))


def read_backlog(
    res: Resources, queue: str, now: float | None = None, consumed: Sequence[str] = ()
) -> BacklogMetrics:
    """The backlog of one queue now, from Redis alone; counts nothing, so any caller may read it.
    Its running tasks are the workers consuming any of `consumed` (the queue alone by default):
    both lanes of its stage, for a lane's share of the stage's backlog per task.
    A deferred entry whose delivery never came (lost with a worker past the visibility timeout,
    a purged queue) leaves the count once it is a visibility timeout late."""
    now = time.time() if now is None else now
    stats = queue_stats(res.redis, queue)
    pipe = res.redis.pipeline(transaction=True)
    pipe.zremrangebyscore(redis_keys.deferred(queue), "-inf", now - res.settings.visibility_timeout)
    pipe.zcard(redis_keys.deferred(queue))
    _, deferred = pipe.execute()
    return BacklogMetrics(
        queue=queue,
        queue_depth=stats.depth,
        oldest_job_age_s=stats.oldest_age_s or 0.0,
        running_tasks=live_workers(
            res.redis, res.settings.worker_dead_after, *(consumed or [queue])
        ),
        deferred_jobs=int(deferred),
        measured_at=now,
    )


def with_mailbox_waits(
    res: Resources, readings: Sequence[BacklogMetrics], measured_at: float
) -> list[BacklogMetrics]:
    """The readings with their lane's OldestMailboxWaitSeconds: 0 on a paused stage's, whose
    every mailbox waits for the pause, which has its own alarm. A database error costs that
    figure only."""
    try:
        with res.db.reading() as session:
            waits = oldest_mailbox_waits(session, _naive_utc(measured_at))
    except Exception:
        log.warning("could not read the mailboxes' waiting work", exc_info=True)
        return list(readings)
    return [
        replace(
            reading,
            oldest_mailbox_wait_s=0.0 if reading.held else waits[(reading.stage, reading.lane)],
        )
        for reading in readings
    ]


def take_lane_deferrals(res: Resources) -> dict[str, int]:
    """Each lane's deferrals since the last report, taken: the next report counts from 0. The
    queue's name -> deferrals; empty if Redis can't be read (those figures are lost)."""
    try:
        return deferrals.take_by_lane(res.redis)
    except RedisError:
        log.warning("could not read the lanes' deferrals; they are dropped", exc_info=True)
        return {}


def keep_samples(res: Resources, readings: Sequence[BacklogMetrics]) -> None:
    """Each lane's depth and oldest job of one report as a `queue_sample` row, for the console's
    charts (mailpipe.operations.activity), and the samples older than SAMPLES_KEPT deleted, in
    one transaction: the table holds a day of reports (a row per lane each)."""
    with res.db.transaction() as session:
        session.execute(
            insert(table(QueueSample)),
            [
                {
                    "measured_at": _naive_utc(reading.measured_at),
                    "queue": reading.queue_dimension,
                    "lane": reading.lane.value,
                    "depth": reading.queue_depth,
                    "oldest_age_s": reading.oldest_job_age_s,
                    "deferred": reading.lane_deferrals,
                }
                for reading in readings
            ],
        )
        oldest_kept = _naive_utc(min(r.measured_at for r in readings)) - SAMPLES_KEPT
        session.execute(delete(QueueSample).where(QueueSample.measured_at < oldest_kept))


def claim_window(res: Resources, lookback: float) -> SinceLastReport | None:
    """The runs failed and the attempts ended since the last report, or None if another report
    has counted up to now already.

    Reports come from whichever beat holds the lock, and the holder changes (a deploy, a beat
    that died), so "since my last report" is no one's to keep. A cursor in Redis holds the end of
    the last counted window instead: a report reads the runs failed and the attempts ended in
    (cursor, now - settle] and moves the cursor with a compare-and-set; if another report moved
    it first (the old holder's last report still in flight), its figures are dropped. Each is
    thus counted once (at most once: a report lost on its way to CloudWatch loses its figures).
    With no cursor yet (a new fleet, a flushed Redis) the first window is `lookback` long.

    Two range scans of indexes: the partial index on failed runs' `closed_at`, and the attempts'
    `ended_at`, whose rows are read (one per attempt: the report's cost grows with the fleet's
    throughput, not its size).
    """
    key = redis_keys.report_cursor()
    end = time.time() - REPORT_SETTLE_S
    cursor = res.redis.get(key)
    start = float(cursor) if cursor is not None else end - lookback
    if end <= start:
        return None
    since, until = _naive_utc(start), _naive_utc(end)
    with res.db.session() as session:
        failed = session.scalar(
            select(func.count())
            .select_from(PipelineRun)
            .where(
                PipelineRun.status == RunStatus.FAILED,
                PipelineRun.closed_at > since,
                PipelineRun.closed_at <= until,
            )
        )
        attempts = session.execute(
            select(
                RunAttempt.stage, RunAttempt.outcome, RunAttempt.started_at, RunAttempt.ended_at
            ).where(
                RunAttempt.ended_at > since,
                RunAttempt.ended_at <= until,
                # A deferral's row counts up in place: deferrals are counted in Redis
                # (`with_deferrals`); a row without a count is one deferral of 0.2.0's.
                RunAttempt.deferrals.is_(None),
            )
        ).all()
    if not res.redis.eval(_ADVANCE_CURSOR, 1, key, cursor or b"", repr(end)):
        return None
    return SinceLastReport(failed_runs=failed or 0, stage_jobs=stage_jobs(attempts))


def stage_jobs(
    attempts: Iterable[tuple[str, str, datetime | None, datetime]],
) -> dict[Stage, StageJobs]:
    """Each stage's figures from its attempts' (stage, outcome, started_at, ended_at)."""
    counts: dict[Stage, Counter[str]] = {stage: Counter() for stage in Stage}
    durations: dict[Stage, Counter[float]] = {stage: Counter() for stage in Stage}
    for stage_name, outcome, started_at, ended_at in attempts:
        stage = Stage(stage_name)
        counts[stage][JOB_COUNTS[AttemptOutcome(outcome)]] += 1
        if started_at is not None and outcome not in UNTIMED_OUTCOMES:
            durations[stage][duration_step((ended_at - started_at).total_seconds())] += 1
    return {
        stage: StageJobs(
            counts={name: counts[stage][name] for name in JOB_COUNT_NAMES},
            durations=dict(durations[stage]),
        )
        for stage in Stage
    }


def duration_step(seconds: float) -> float:
    """The value a duration is reported as: the middle of its step (DURATION_STEPS_PER_DECADE),
    the durations below 1 ms in the first step and those beyond the last in the last."""
    decades = math.log10(max(seconds, DURATION_FLOOR_S) / DURATION_FLOOR_S)
    step = min(int(decades * DURATION_STEPS_PER_DECADE), DURATION_STEPS - 1)
    middle = DURATION_FLOOR_S * 10 ** ((step + 0.5) / DURATION_STEPS_PER_DECADE)
    return float(f"{middle:.4g}")


def _naive_utc(timestamp: float) -> datetime:
    # Times in the database are naive UTC (mailpipe.storage.models.utcnow).
    return datetime.fromtimestamp(timestamp, UTC).replace(tzinfo=None)
