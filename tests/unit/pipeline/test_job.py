"""The job's control flow, called directly: PostgreSQL and the S3 server, no broker, no worker."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from mailpipe import flags
from mailpipe.ingest import store_emails
from mailpipe.models import Classification, Document, EmailLabel, PipelineRun, utcnow
from mailpipe.pipeline import job
from mailpipe.resources import Resources

INVOICE = (
    b'From: billing@acme.example\r\nSubject: Invoice 12\r\nMessage-ID: <j12@acme>\r\n'
    b'Content-Type: multipart/mixed; boundary="b"\r\n\r\n'
    b"--b\r\nContent-Type: text/plain\r\n\r\nAmount due: 12 EUR\r\n"
    b'--b\r\nContent-Type: text/plain; name="notes.txt"\r\nContent-Disposition: attachment; filename="../../notes.txt"\r\n\r\n'
    b"pay soon\r\n--b--\r\n"
)


def run_of(res: Resources, email_id: int) -> PipelineRun:
    with res.db.session() as session:
        return session.scalars(select(PipelineRun).where(PipelineRun.email_id == email_id)).one()


def test_model_calls_off_leaves_the_run_open_after_the_documents(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    assert job.process_email(res, email_id) is job.Outcome.WAITING
    run = run_of(res, email_id)
    assert (run.status.value, run.attempts, run.attempt_started_at) == ("open", 0, None)
    with res.db.session() as session:
        [document] = session.scalars(select(Document)).all()
        assert session.scalars(select(Classification)).all() == []
    assert document.status.value == "converted" and document.filename == "notes.txt"
    assert "pay soon" in (document.text or "")

    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    assert job.process_email(res, email_id) is job.Outcome.SUCCEEDED
    with res.db.session() as session:
        labels = set(session.scalars(select(EmailLabel.label)))
    assert labels == {"invoice"}
    assert job.process_email(res, email_id) is job.Outcome.ALREADY_CLOSED


def test_transient_errors_retry_then_fail_after_max_attempts(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    unreachable = Resources(res.settings.model_copy(update={"s3_endpoint_url": "http://127.0.0.1:9"}))
    for attempt in (1, 2, 3, 4):
        if attempt < 4:
            with pytest.raises(job.RetryLater) as retry:
                job.process_email(unreachable, email_id)
            assert retry.value.attempt == attempt
            assert "S3 unavailable" in str(retry.value)
        else:
            assert job.process_email(unreachable, email_id) is job.Outcome.FAILED
    run = run_of(res, email_id)
    assert run.status.value == "failed" and run.attempts == 4
    assert run.error.startswith("gave up after 4 attempts: TransientError: S3 unavailable")


def test_an_attempt_that_died_is_named_and_counted(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    # What a child killed mid-job leaves behind: an attempt counted and never finished.
    assert job.process_email(res, email_id) is job.Outcome.SUCCEEDED
    with res.db.transaction() as session:
        session.execute(
            update(PipelineRun).values(status="open", attempts=4, attempt_started_at=utcnow(), closed_at=None)
        )
    assert job.process_email(res, email_id) is job.Outcome.FAILED
    run = run_of(res, email_id)
    assert "gave up after 4 attempts" in run.error and "worker process died" in run.error


def test_permanent_errors_fail_at_once(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [b"Subject: x\r\n\r\n" + b"a" * 2048])
    small = Resources(res.settings.model_copy(update={"max_email_bytes": 1024}))
    assert job.process_email(small, email_id) is job.Outcome.FAILED
    run = run_of(res, email_id)
    assert run.attempts == 1 and "over the limit of 1024" in run.error
