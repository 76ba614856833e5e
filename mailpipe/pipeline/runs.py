"""The pipeline run of an email: its status, attempts and error, moved only through here."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from mailpipe.db import insert_ignore
from mailpipe.models import EmailMessage, PipelineRun, RunStatus, utcnow

# Errors are for operators: long tracebacks belong in the log, not in the row.
MAX_ERROR_CHARS = 2000


class Claim(enum.Enum):
    GO = "go"  # this delivery runs the job
    CLOSED = "closed"  # the run is already closed: stop without touching anything
    EXHAUSTED = "exhausted"  # every attempt is used: the run was failed just now


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    attempt: int


def claim_attempt(session: Session, email_id: int, max_attempts: int) -> ClaimResult:
    """Count one attempt, or say why the job must not run.

    An attempt is counted before any work, in its own commit, so that a try whose process dies
    still counts: a job that crashes its child every time stops after `max_attempts`.
    """
    ensure_runs(session, [email_id])
    run = _locked_run(session, email_id)
    if run.status is not RunStatus.OPEN:
        return ClaimResult(Claim.CLOSED, run.attempts)
    if run.attempt_started_at is not None:
        run.error = _clip(
            f"attempt {run.attempts} ended without a result: its worker process died or was killed"
        )
    if run.attempts >= max_attempts:
        _close(run, RunStatus.FAILED, f"gave up after {run.attempts} attempts: {run.error or 'no error recorded'}")
        return ClaimResult(Claim.EXHAUSTED, run.attempts)
    run.attempts += 1
    run.attempt_started_at = utcnow()
    return ClaimResult(Claim.GO, run.attempts)


def ensure_runs(session: Session, email_ids: list[int]) -> None:
    """Create the open runs of emails that have none yet (and flag those emails as having one)."""
    created = insert_ignore(
        session, PipelineRun, [{"email_id": i} for i in email_ids], ["email_id"], PipelineRun.email_id
    )
    if created:
        session.execute(update(EmailMessage).where(EmailMessage.id.in_(created)).values(has_run=True))


def give_back_attempt(session: Session, email_id: int) -> None:
    """Undo the count of an attempt that did not run (deferred by the rate limiter)."""
    run = _locked_run(session, email_id)
    if run.status is RunStatus.OPEN and run.attempt_started_at is not None:
        run.attempts = max(0, run.attempts - 1)
        run.attempt_started_at = None


def leave_open(session: Session, email_id: int) -> None:
    """The job did all it may with model calls off; the run waits for them, attempts reset."""
    run = _locked_run(session, email_id)
    run.attempts = 0
    run.sweep_count = 0
    run.attempt_started_at = None
    run.error = None


def close(
    session: Session, email_id: int, status: RunStatus, error: str | None = None
) -> PipelineRun:
    """Close an open run; a run closed meanwhile (a second delivery) is left as it is."""
    run = _locked_run(session, email_id)
    if run.status is RunStatus.OPEN:
        _close(run, status, error)
        if status is RunStatus.SUCCEEDED:
            run.classified_at = run.closed_at
    return run


def record_failed_attempt(session: Session, email_id: int, error: str, max_attempts: int) -> bool:
    """Record a transient error; True when attempts remain, False when the run failed for good."""
    run = _locked_run(session, email_id)
    if run.status is not RunStatus.OPEN:
        return False
    run.attempt_started_at = None
    if run.attempts >= max_attempts:
        _close(run, RunStatus.FAILED, f"gave up after {run.attempts} attempts: {error}")
        return False
    run.error = _clip(error)
    return True


def reopen(session: Session, email_id: int) -> bool:
    """Put a failed run back to open with a fresh attempt budget (`mailpipe failed --retry`)."""
    run = _locked_run(session, email_id)
    if run.status is not RunStatus.FAILED:
        return False
    run.status = RunStatus.OPEN
    run.attempts = 0
    run.sweep_count = 0
    run.attempt_started_at = None
    run.closed_at = None
    return True


def _locked_run(session: Session, email_id: int) -> PipelineRun:
    # FOR UPDATE on PostgreSQL serialises two deliveries that lost their lease; SQLite ignores
    # it and serialises every write transaction anyway (BEGIN IMMEDIATE).
    statement = select(PipelineRun).where(PipelineRun.email_id == email_id).with_for_update()
    return session.scalars(statement).one()


def _close(run: PipelineRun, status: RunStatus, error: str | None) -> None:
    run.status = status
    run.error = _clip(error) if error else run.error if status is RunStatus.FAILED else None
    run.attempt_started_at = None
    run.closed_at = utcnow()


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"
