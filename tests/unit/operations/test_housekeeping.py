"""Housekeeping's pass, called directly: what it deletes and what it keeps (PostgreSQL)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, insert, select, update

from mailpipe.cli.ingest import store_emails
from mailpipe.operations.housekeeping import Pruned, prune
from mailpipe.operations.status import email_detail
from mailpipe.pipeline import runs
from mailpipe.resources import Resources
from mailpipe.storage.models import (
    ModelInput,
    PipelineRun,
    RunAttempt,
    RunStatus,
    SweepReport,
    utcnow,
)
from tests.support.emails import raw_email
from tests.support.failed_runs import add_attempts, attempt

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

NOW = utcnow()
OLD = NOW - timedelta(days=31)  # past the default 30 days
RECENT = NOW - timedelta(days=29)


def emails(res: Resources, n: int) -> list[int]:
    raws = [raw_email(str(i), sender="a@b.example", body=f"body {i}") for i in range(n)]
    ids = store_emails(res, raws)
    with res.db.transaction() as session:
        runs.ensure_runs(session, ids)
    return ids


def set_run(res: Resources, email_id: int, status: RunStatus, closed_at, **values) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        session.execute(
            update(PipelineRun)
            .where(PipelineRun.email_id == email_id)
            .values(status=status, closed_at=closed_at, **values)
        )


def add_retries(res: Resources, email_id: int, ended_at, n: int = 3) -> None:  # type: ignore[no-untyped-def]
    retries = [
        attempt("cpu", "retrying", ended_at + timedelta(seconds=i), number=i)
        for i in range(1, n + 1)
    ]
    add_attempts(res, email_id, retries)


def attempts_of(res: Resources) -> dict[int, int]:
    with res.db.session() as session:
        rows = session.execute(
            select(RunAttempt.email_id, func.count()).group_by(RunAttempt.email_id)
        ).all()
    return {email_id: count for email_id, count in rows}


def test_a_pass_prunes_what_only_grows_and_keeps_what_a_run_needs(res: Resources) -> None:
    done_old, done_recent, listed, dismissed, still_open, copy = emails(res, 6)
    set_run(res, done_old, RunStatus.SUCCEEDED, OLD)
    set_run(res, done_recent, RunStatus.SUCCEEDED, RECENT)
    set_run(res, listed, RunStatus.FAILED, OLD, error="it broke", error_class="Stalled")
    set_run(res, dismissed, RunStatus.FAILED, OLD, error="it broke", dismissed_at=OLD)
    set_run(res, copy, RunStatus.DUPLICATE, OLD)
    # Open again (a retry, a reprocess), with the time it last closed.
    set_run(res, still_open, RunStatus.OPEN, OLD)
    for email_id in (done_old, done_recent, listed, dismissed, still_open, copy):
        add_retries(res, email_id, OLD)  # every attempt ended long ago
    with res.db.transaction() as session:
        session.execute(
            insert(SweepReport),
            [{"started_at": OLD, "finished_at": OLD}, {"started_at": RECENT}],
        )
        answered = {"classified_at": OLD}
        session.execute(
            update(PipelineRun).where(PipelineRun.email_id == done_old).values(**answered)
        )
        session.execute(
            update(PipelineRun).where(PipelineRun.email_id == listed).values(**answered)
        )
        session.execute(
            insert(ModelInput),
            [{"email_id": i, "input": {}} for i in (done_old, done_recent, listed, still_open)],
        )
    small_batches = Resources(res.settings.model_copy(update={"housekeeping_batch": 2}))

    assert prune(small_batches, NOW) == Pruned(attempts=9, sweep_reports=1, model_inputs=1)

    # The runs closed within the retention, on the failed list, or open keep their history.
    assert attempts_of(res) == {done_recent: 3, listed: 3, still_open: 3}
    with res.db.session() as session:
        assert session.scalars(select(SweepReport.started_at)).all() == [RECENT]
        kept_inputs = set(session.scalars(select(ModelInput.email_id)))
        # Only the succeeded run with its answer stored loses its input: a retry of the listed
        # run's model stage, and the runs without an answer, still read theirs.
        assert kept_inputs == {done_recent, listed, still_open}
        # The email page still has the run: its status, its times, its error.
        shown = email_detail(session, done_old)
    assert shown is not None
    assert (shown["run"]["status"], shown["history"]) == ("succeeded", [])
    assert prune(small_batches, NOW) == Pruned(0, 0, 0)  # nothing left to do


def test_the_retention_is_a_setting(res: Resources) -> None:
    [email_id] = emails(res, 1)
    set_run(res, email_id, RunStatus.SUCCEEDED, RECENT)
    add_retries(res, email_id, RECENT)
    assert prune(res, NOW).attempts == 0  # 29 days: within the default 30
    shorter = Resources(res.settings.model_copy(update={"keep_attempts_days": 7}))
    assert prune(shorter, NOW).attempts == 3
    assert attempts_of(res) == {}
