"""Deferrals count up on one row of the history, and the history is read a page at a time:
PostgreSQL, Redis and the S3 server, no worker."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import insert, select

from mailpipe.broker.queues import Stage, stage_queue
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.operations import metrics
from mailpipe.operations.activity import HOUR, fleet_activity
from mailpipe.operations.status import HISTORY_PAGE, email_detail, history
from mailpipe.pipeline import job, policy, runs
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage.models import QueueSample, RunAttempt, utcnow
from tests.support.switches import set_model_calls
from tests.unit.pipeline.test_job import PLAIN, remote_model, run_of
from tests.unit.pipeline.test_job import history as outcomes

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def claimed(res: Resources, email_id: int) -> runs.Claim:
    """A delivery's claim of the run."""
    with res.db.transaction() as session:
        claim = runs.claim(session, email_id, policy.Limits.of(res.settings))
    assert isinstance(claim, runs.Claim), claim
    return claim


def deferrals(res: Resources, email_id: int) -> list[int | None]:
    with res.db.session() as session:
        statement = select(RunAttempt.deferrals).where(RunAttempt.email_id == email_id)
        return list(session.scalars(statement.order_by(RunAttempt.id)))


def test_a_run_deferred_a_thousand_times_keeps_one_row_with_the_count(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [PLAIN])
    model = remote_model(res)
    set_model_calls(res, True)
    assert job.process_email(model, email_id).kind is Kind.HANDED_OFF
    set_model_calls(res, False)
    for _ in range(1000):
        assert job.classify_email(model, email_id).kind is Kind.WAITING  # its attempt given back
    assert outcomes(res, email_id) == [
        ("cpu", 1, "handed_off", None),
        ("model", 1, "deferred", None),
    ]
    assert deferrals(res, email_id) == [None, 1000]
    assert run_of(res, email_id).attempts == 0  # every one given back

    with res.db.session() as session:
        shown = email_detail(session, email_id)
    assert shown is not None
    last = shown["history"][-1]
    assert (last["outcome"], last["deferrals"]) == ("deferred", 1000)

    set_model_calls(res, True)
    assert job.classify_email(model, email_id).kind is Kind.SUCCEEDED
    assert [o for _, _, o, _ in outcomes(res, email_id)] == ["handed_off", "deferred", "succeeded"]


def test_a_deferral_after_another_end_starts_a_row_of_its_own(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [PLAIN])
    with res.db.transaction() as session:
        runs.ensure_runs(session, [email_id])

    def deferred(times: int) -> None:
        for _ in range(times):
            claim = claimed(res, email_id)
            with res.db.transaction() as session:
                runs.give_back(session, claim, error="slow down", error_class="Throttled")

    deferred(2)
    claim = claimed(res, email_id)
    with res.db.transaction() as session:
        failed = runs.record_failed_attempt(
            session, claim, "it broke", policy.Limits(4, 10), error_class="TransientError"
        )
    assert failed is None  # attempts remain
    deferred(3)
    assert outcomes(res, email_id) == [
        ("cpu", 1, "deferred", "Throttled"),
        ("cpu", 1, "retrying", "TransientError"),
        ("cpu", 2, "deferred", "Throttled"),
    ]
    assert deferrals(res, email_id) == [2, None, 3]


def test_a_deferral_row_of_the_release_before_counts_one_and_is_not_counted_on(res) -> None:  # type: ignore[no-untyped-def]
    """0.2.0 writes a row per deferral, without a count: this release's deferral after it
    starts a row of its own, and both read as one deferral."""
    [email_id] = store_emails(res, [PLAIN])
    with res.db.transaction() as session:
        runs.ensure_runs(session, [email_id])
    claim = claimed(res, email_id)
    run = run_of(res, email_id)
    with res.db.transaction() as session:
        session.execute(
            insert(RunAttempt).values(
                run_id=run.id,
                email_id=email_id,
                stage="cpu",
                attempt=1,
                ended_at=utcnow(),
                outcome="deferred",
                error_class="Throttled",
            )
        )
        runs.give_back(session, claim, error="slow down", error_class="Throttled")
    assert deferrals(res, email_id) == [None, 1]
    with res.db.session() as session:
        shown = history(session, email_id)["history"]
    assert [row["deferrals"] for row in shown] == [1, 1]


def test_the_history_is_read_fifty_attempts_at_a_time_the_last_first(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [PLAIN])
    with res.db.transaction() as session:
        runs.ensure_runs(session, [email_id])
    run = run_of(res, email_id)
    start = utcnow()
    with res.db.transaction() as session:
        session.execute(
            insert(RunAttempt),
            [
                {
                    "run_id": run.id,
                    "email_id": email_id,
                    "stage": "cpu",
                    "attempt": n,
                    "ended_at": start + timedelta(seconds=n),
                    "outcome": "retrying",
                }
                for n in range(1, 121)
            ],
        )
    pages: list[list[int]] = []
    before = None
    with res.db.session() as session:
        while True:
            page = history(session, email_id, before)
            pages.append([row["attempt"] for row in page["history"]])
            before = page["older_history"]
            if before is None:
                break
    assert HISTORY_PAGE == 50
    assert pages == [list(range(71, 121)), list(range(21, 71)), list(range(1, 21))]


def test_a_report_counts_each_lane_s_deferrals_for_its_stage_and_its_charts(res) -> None:  # type: ignore[no-untyped-def]
    """A deferral writes no row a report could count: its job counts it on its lane in Redis,
    the report takes the count into its stage's JobsDeferred and the lane's sample, and the
    charts draw it from there."""
    [email_id] = store_emails(res, [PLAIN])
    with res.db.transaction() as session:
        runs.ensure_runs(session, [email_id])
    res.redis.set(redis_keys.lease(email_id), "elsewhere:1:holder", px=60_000)
    for _ in range(3):
        assert job.process_email(res, email_id).kind is Kind.DEFER  # its lease is held
    res.redis.delete(redis_keys.lease(email_id))
    [reading, *others] = metrics.collect(res)
    assert reading.stage_jobs is not None
    assert reading.stage_jobs[Stage.CPU].counts["JobsDeferred"] == 3
    assert reading.stage_jobs[Stage.MODEL].counts["JobsDeferred"] == 0
    live = stage_queue(Stage.CPU, res.settings)
    assert {r.queue: r.lane_deferrals for r in [reading, *others]}[live] == 3
    with res.db.session() as session:
        sampled = session.scalars(
            select(QueueSample.deferred).where(
                QueueSample.queue == live, QueueSample.lane == "live"
            )
        ).all()
        charted = fleet_activity(session, HOUR, utcnow())
    assert list(sampled) == [3]
    assert sum(charted.stages[Stage.CPU].jobs["deferred"]) == 3
    # Taken: the next report counts from nothing.
    [reading, *_] = metrics.collect(res)
    assert reading.lane_deferrals == 0
