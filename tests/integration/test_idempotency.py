"""The same job twice, one after the other or two at once, leaves identical rows."""

from __future__ import annotations

import multiprocessing

from sqlalchemy import select, update

from mailpipe import flags
from mailpipe.ingest import store_emails
from mailpipe.models import (
    Classification,
    Document,
    EmailLabel,
    EmailMessage,
    EmailOrigin,
    PipelineRun,
    RunStatus,
)
from mailpipe.pipeline import job
from mailpipe.tasks import process_email
from tests.integration.conftest import wait_for, wait_until_closed

EMAIL = (
    b'From: billing@acme.example\r\nTo: d@example.org\r\nSubject: Invoice 9\r\nMessage-ID: <i9@acme>\r\n'
    b'Content-Type: multipart/mixed; boundary="b"\r\n\r\n'
    b"--b\r\nContent-Type: text/plain\r\n\r\nAmount due: 3 EUR. Unsubscribe here.\r\n"
    b'--b\r\nContent-Type: text/csv; name="a.csv"\r\nContent-Disposition: attachment; filename="a.csv"\r\n\r\n'
    b"x,y\r\n1,2\r\n--b--\r\n"
)
COPY = EMAIL.replace(b"To: d@", b"Received: from mx2\r\nTo: d@")

VOLATILE = {"created_at", "updated_at", "closed_at", "classified_at", "latency_ms", "attempt_started_at", "attempts"}


def snapshot(res) -> dict[str, list[tuple]]:  # type: ignore[no-untyped-def]
    """Every row the pipeline writes, without the columns that record when."""
    out = {}
    with res.db.session() as session:
        for model in (EmailMessage, EmailOrigin, PipelineRun, Document, EmailLabel, Classification):
            rows = session.scalars(select(model).order_by(model.__table__.primary_key.columns.values()[0])).all()
            out[model.__tablename__] = [
                tuple((c.name, getattr(r, c.key)) for c in model.__table__.columns if c.name not in VOLATILE and c.name != "id")
                for r in rows
            ]
    return out


def reopen_all(res) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        session.execute(update(PipelineRun).values(status=RunStatus.OPEN, closed_at=None, attempts=0))


def test_running_a_job_again_leaves_identical_rows(res, live_worker) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    ids = store_emails(res, [EMAIL, COPY])
    for email_id in ids:
        process_email.apply_async((email_id,))
    wait_until_closed(res, ids)
    first = snapshot(res)
    assert len(first["document"]) == 1 and len(first["classification"]) == 1

    # A second delivery of a closed run stops without touching anything.
    process_email.apply_async((ids[0],))
    reopen_all(res)  # and a full re-run of every step leaves the same rows
    for email_id in ids:
        process_email.apply_async((email_id,))
    wait_until_closed(res, ids)
    wait_for(lambda: snapshot(res) == first, 30, "the same rows after the re-run")


def _run_in_child(email_id: int, barrier) -> str:  # type: ignore[no-untyped-def]
    from mailpipe.resources import get_resources

    barrier.wait()
    return job.process_email(get_resources(), email_id).value


def test_two_deliveries_at_once_without_the_lease_leave_identical_rows(res) -> None:  # type: ignore[no-untyped-def]
    """What a lost lease allows: two processes running every step of one job at the same time."""
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    [email_id] = store_emails(res, [EMAIL])
    assert job.process_email(res, email_id) is job.Outcome.SUCCEEDED
    single = snapshot(res)

    reopen_all(res)
    context = multiprocessing.get_context("spawn")
    barrier = context.Manager().Barrier(2)
    with context.Pool(2) as pool:
        outcomes = pool.starmap(_run_in_child, [(email_id, barrier), (email_id, barrier)])
    assert "succeeded" in outcomes
    assert snapshot(res) == single
