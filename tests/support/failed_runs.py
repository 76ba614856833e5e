"""Emails, runs and attempts written straight into the database, as the console finds them:
failed at a stage with an error class, some marked for review or dismissed. No blob, no job."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import insert, select

from mailpipe.resources import Resources
from mailpipe.storage.models import EmailMessage, PipelineRun, RunAttempt, RunStatus

T0 = datetime(2026, 1, 1, 12, 0, 0)


def add_emails(res: Resources, n: int, **values: Any) -> list[int]:
    """`n` email rows, with a run each if `values` has `has_run=True`."""
    row = {"blob_key": "blobs/none", "size": 1, "sha256": "0" * 64, **values}
    with res.db.transaction() as session:
        return list(
            session.scalars(
                insert(EmailMessage).returning(EmailMessage.id, sort_by_parameter_order=True),
                [dict(row) for _ in range(n)],
            )
        )


def add_run(res: Resources, email_id: int, status: RunStatus, **values: Any) -> None:
    with res.db.transaction() as session:
        session.execute(insert(PipelineRun).values(email_id=email_id, status=status, **values))
        session.get_one(EmailMessage, email_id).has_run = True


def attempt(
    stage: str, outcome: str, ended_at: datetime, *, ran: float | None = None, number: int = 1
) -> dict[str, Any]:
    """An attempt row's values: the stage's attempt `number`, which ran `ran` seconds (None: no
    start recorded) and ended at `ended_at`."""
    return {
        "stage": stage,
        "outcome": outcome,
        "attempt": number,
        "started_at": None if ran is None else ended_at - timedelta(seconds=ran),
        "ended_at": ended_at,
    }


def add_attempts(res: Resources, email_id: int, attempts: list[dict[str, Any]]) -> None:
    """`attempts` (each from `attempt`) as rows of the email's run, as the job writes them."""
    with res.db.transaction() as session:
        run_id = session.scalar(select(PipelineRun.id).where(PipelineRun.email_id == email_id))
        session.execute(
            insert(RunAttempt),
            [{"run_id": run_id, "email_id": email_id, **values} for values in attempts],
        )


def add_failed(
    res: Resources,
    minutes: int,
    error_class: str = "BlobMissing",
    *,
    model_stage: bool = False,
    review: bool = False,
    dismissed: bool = False,
    mailbox: str | None = None,
) -> int:
    """One email of `mailbox` (None: the default one) whose run failed `minutes` after T0."""
    [email_id] = add_emails(
        res, 1, needs_review=review, review_reason="stalled" if review else None, mailbox=mailbox
    )
    closed_at = T0 + timedelta(minutes=minutes)
    add_run(
        res,
        email_id,
        RunStatus.FAILED,
        attempts=4,
        error_class=error_class,
        error=f"{error_class}: failed",
        converted_at=closed_at - timedelta(seconds=1) if model_stage else None,
        closed_at=closed_at,
        dismissed_at=closed_at if dismissed else None,
    )
    return email_id
