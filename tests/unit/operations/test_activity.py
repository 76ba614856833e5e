"""The fleet over time (mailpipe.operations.activity) from attempt rows written at known times, on
PostgreSQL and on SQLite (the demo's, where the percentiles are taken in Python), and the lanes'
samples as the metrics report writes and prunes them. The windows' buckets: test_activity_buckets.py."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, insert, select

from mailpipe.broker.queues import Lane, Stage
from mailpipe.enqueue import enqueue_emails
from mailpipe.operations import metrics
from mailpipe.operations.activity import DAY, HOUR, KINDS, fleet_activity
from mailpipe.resources import Resources
from mailpipe.settings import Settings
from mailpipe.storage.migrate import upgrade
from mailpipe.storage.models import QueueSample, RunStatus, utcnow
from tests.support.failed_runs import add_attempts, add_emails, add_run, attempt

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

# Twenty seconds into the minute 12:30: the hour's buckets are the minutes 11:31 to 12:30.
NOW = datetime(2026, 1, 1, 12, 30, 20)


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request: pytest.FixtureRequest, res: Resources, tmp_path: Path) -> Iterator[Resources]:
    if request.param == "postgresql":
        yield res
        return
    url = f"sqlite:///{tmp_path / 'activity.db'}"
    upgrade(url)
    local = Resources(Settings(**{**res.settings.model_dump(), "database_url": url}))
    yield local
    local.db.dispose()


def at(hour: int, minute: int, second: float = 0) -> datetime:
    return datetime(2026, 1, 1, hour, minute) + timedelta(seconds=second)


def add_run_attempts(db: Resources, rows: list[tuple[str, str, float | None, datetime]]) -> None:
    """An attempt per (stage, outcome, seconds it ran or None, when it ended), of one run."""
    [email_id] = add_emails(db, 1)
    add_run(db, email_id, RunStatus.OPEN)
    add_attempts(
        db,
        email_id,
        [attempt(stage, outcome, ended, ran=ran) for stage, outcome, ran, ended in rows],
    )


def test_attempts_per_minute_by_stage_and_kind(db: Resources) -> None:
    add_run_attempts(
        db,
        [
            ("model", "succeeded", 1.0, at(11, 30, 59.9)),  # before the window
            ("model", "succeeded", 1.0, at(11, 31)),  # its first instant
            ("model", "failed", 4.0, at(12, 0, 30)),
            ("model", "deferred", None, at(12, 0, 31)),
            ("cpu", "lost", 900.0, at(12, 10)),
            ("cpu", "duplicate", 0.1, at(12, 29, 59.9)),
            ("cpu", "retrying", 2.0, at(12, 30)),
            ("cpu", "cut_off", 300.0, at(12, 30, 1)),
            ("cpu", "succeeded", 0.2, at(12, 30, 5)),
            ("cpu", "handed_off", 0.4, at(12, 30, 10)),
            ("cpu", "waiting", 0.3, at(12, 30, 15)),
            ("cpu", "succeeded", 0.2, at(12, 31)),  # after it
        ],
    )
    with db.db.session() as session:
        seen = fleet_activity(session, HOUR, NOW)
    assert seen.start == at(11, 31) and seen.end == at(12, 31)
    assert len(seen.times) == 60 and seen.times[-1] == at(12, 30)

    def nonzero(stage: Stage) -> dict[str, dict[int, int]]:
        return {
            kind: {i: n for i, n in enumerate(seen.stages[stage].jobs[kind]) if n} for kind in KINDS
        }

    assert nonzero(Stage.CPU) == {
        "succeeded": {58: 1, 59: 3},
        "failed": {},
        "retried": {39: 1, 59: 2},
        "deferred": {},
    }
    assert nonzero(Stage.MODEL) == {
        "succeeded": {0: 1},
        "failed": {29: 1},
        "retried": {},
        "deferred": {29: 1},
    }
    figures = seen.as_json()
    assert figures["window"] == "hour" and figures["bucket_s"] == 60
    assert figures["times"][-1] == "2026-01-01T12:30:00Z"
    assert figures["stages"]["cpu"]["jobs"]["succeeded"][59] == 3
    assert figures["stages"]["cpu"]["per_minute"]["succeeded"][59] == 3.0


def test_a_minute_s_p50_and_p90_are_of_the_attempts_that_succeeded(db: Resources) -> None:
    minute = at(12, 20)
    add_run_attempts(
        db,
        [("cpu", "succeeded", float(s), minute + timedelta(seconds=s)) for s in range(1, 11)]
        + [
            ("cpu", "failed", 100.0, minute),  # not a success: not timed
            ("cpu", "cut_off", 100.0, minute),
            ("cpu", "succeeded", None, minute),  # no start: not timed, still counted
            ("model", "succeeded", 2.5, at(12, 21)),
        ],
    )
    with db.db.session() as session:
        seen = fleet_activity(session, HOUR, NOW)
    cpu, model = seen.stages[Stage.CPU], seen.stages[Stage.MODEL]
    i = seen.times.index(minute)
    assert cpu.jobs["succeeded"][i] == 11
    # percentile_cont: the value at q * (n - 1) of the ten durations, interpolated.
    assert cpu.p50_s[i] == pytest.approx(5.5)
    assert cpu.p90_s[i] == pytest.approx(9.1)
    assert model.p50_s[i + 1] == pytest.approx(2.5) and model.p90_s[i + 1] == pytest.approx(2.5)
    assert [j for j, p in enumerate(cpu.p50_s) if p is not None] == [i]
    assert [j for j, p in enumerate(model.p50_s) if p is not None] == [i + 1]


def test_the_day_has_quarter_hours_and_a_rate_a_minute(db: Resources) -> None:
    add_run_attempts(
        db,
        [
            ("cpu", "succeeded", 0.5, at(12, 14, 59)),
            ("cpu", "succeeded", 0.5, at(12, 15)),
            ("cpu", "succeeded", 1.5, at(12, 29, 59)),
            ("cpu", "retrying", 0.5, datetime(2025, 12, 31, 12, 45)),  # the day's first instant
            ("cpu", "retrying", 0.5, datetime(2025, 12, 31, 12, 44, 59)),  # before it
        ],
    )
    with db.db.session() as session:
        seen = fleet_activity(session, DAY, NOW)
    cpu = seen.stages[Stage.CPU]
    assert len(seen.times) == 96 and seen.times[-2:] == [at(12, 15), at(12, 30)]
    assert cpu.jobs["succeeded"][-4:] == [0, 1, 2, 0]
    assert cpu.jobs["retried"][0] == 1 and sum(cpu.jobs["retried"]) == 1
    assert cpu.p50_s[-2] == pytest.approx(1.0)
    assert seen.as_json()["stages"]["cpu"]["per_minute"]["succeeded"][-2] == round(2 / 15, 3)


def test_a_report_keeps_each_lane_s_sample_for_a_day(res: Resources) -> None:
    """The metrics report writes a row per lane with what it read, and deletes those older than
    a day in the same transaction; the charts draw the most of a bucket's readings, and a
    bucket no report read as none."""
    now = datetime.now(UTC).replace(tzinfo=None)
    with res.db.transaction() as session:
        session.execute(
            insert(QueueSample),
            [
                {
                    "measured_at": now - age,
                    "queue": "mailpipe",
                    "lane": "live",
                    "depth": 1,
                    "oldest_age_s": 1.0,
                }
                for age in (timedelta(days=1, minutes=1), timedelta(hours=23))
            ],
        )
    enqueue_emails(add_emails(res, 3), res)
    enqueue_emails(add_emails(res, 2), res, lane=Lane.BULK)
    readings = metrics.collect(res)
    readings = metrics.collect(res)  # two reports, the second a moment later
    with res.db.session() as session:
        kept = session.execute(
            select(QueueSample.queue, QueueSample.lane, QueueSample.depth)
            .where(QueueSample.measured_at > now - timedelta(minutes=1))
            .order_by(QueueSample.id)
        ).all()
        oldest = session.scalar(select(func.min(QueueSample.measured_at)))
    lanes = [("mailpipe", "live", 3), ("mailpipe", "bulk", 2)]
    lanes += [("mailpipe.model", "live", 0), ("mailpipe.model", "bulk", 0)]
    assert [tuple(row) for row in kept] == lanes * 2
    assert oldest == now - timedelta(hours=23)  # the one a day and a minute old is gone
    with res.db.session() as session:
        seen = fleet_activity(session, HOUR, utcnow())
    by_name = {lane.name: lane for lane in seen.lanes}
    assert list(by_name) == ["mailpipe", "mailpipe.bulk", "mailpipe.model", "mailpipe.model.bulk"]
    live = by_name["mailpipe"]
    assert live.depth[-1] == 3 or live.depth[-2:] == [3, 3]  # a report each side of a minute
    assert live.oldest_age_s[-1] == pytest.approx(max(r.oldest_job_age_s for r in readings[:1]))
    assert live.depth[:-2] == [None] * 58  # no report in the hour before
    assert by_name["mailpipe.bulk"].depth[-1] == 2


def test_a_sample_is_the_most_a_bucket_s_reports_read(db: Resources) -> None:
    with db.db.transaction() as session:
        session.execute(
            insert(QueueSample),
            [
                {
                    "measured_at": measured_at,
                    "queue": "mailpipe.model",
                    "lane": "live",
                    "depth": depth,
                    "oldest_age_s": oldest,
                }
                for measured_at, depth, oldest in [
                    (at(12, 29, 1), 7, 30.0),
                    (at(12, 29, 31), 9, 12.0),
                    (at(12, 30, 1), 0, 0.0),
                    (at(11, 30, 59), 50, 50.0),  # before the window
                ]
            ],
        )
    with db.db.session() as session:
        seen = fleet_activity(session, HOUR, NOW)
    [lane] = seen.lanes
    assert (lane.name, lane.depth[-3:], lane.oldest_age_s[-3:]) == (
        "mailpipe.model",
        [None, 9, 0],
        [None, 30.0, 0.0],
    )
