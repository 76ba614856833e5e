"""Connections the server closed: no ping per checkout, and no job or attempt lost to them."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import OperationalError

from mailpipe.cli.ingest import store_emails
from mailpipe.pipeline import job
from mailpipe.pipeline.job import Kind
from mailpipe.resources import Resources
from mailpipe.storage import db, flags
from mailpipe.storage.models import PipelineRun
from tests.conftest import DATABASE, PG_ADMIN_URL

PLAIN = b"From: a@example.org\r\nSubject: note {n}\r\nMessage-ID: <c{n}@example.org>\r\n\r\nhello {n}\r\n"


def close_connections_from_the_server(res: Resources) -> int:
    """What a database restart does to every pooled connection: the server ends them. The test's
    own pool (`res`) is emptied, so that only the process under test meets the closed ones."""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        ended = len(
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (DATABASE.name,),
            ).fetchall()
        )
    res.db.dispose()
    return ended


def test_a_job_meeting_a_closed_connection_runs_its_claim_again(res, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(db, "PING_AFTER_IDLE_S", 3600.0)  # no ping can save it: the retry must
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    worker = Resources(res.settings)
    first, second = store_emails(res, [PLAIN.replace(b"{n}", b"1"), PLAIN.replace(b"{n}", b"2")])
    assert job.process_email(worker, first).kind is Kind.SUCCEEDED
    assert close_connections_from_the_server(res) >= 1
    assert job.process_email(worker, second).kind is Kind.SUCCEEDED
    with res.db.session() as session:
        run = session.scalars(select(PipelineRun).where(PipelineRun.email_id == second)).one()
    assert (run.status.value, run.attempts, run.error) == ("succeeded", 1, None)


def test_a_connection_idle_past_the_window_is_pinged_and_replaced(res, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(db, "PING_AFTER_IDLE_S", 0.0)
    idle = Resources(res.settings)
    with idle.db.session() as session:
        session.execute(text("SELECT 1"))
    assert close_connections_from_the_server(res) >= 1
    with idle.db.session() as session:  # the ping finds it dead; the pool opens another
        assert session.scalar(text("SELECT 2")) == 2


def test_without_the_retry_a_closed_connection_is_an_error(res, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The premise of the two tests above: nothing else in the pool hides a closed connection."""
    monkeypatch.setattr(db, "PING_AFTER_IDLE_S", 3600.0)
    busy = Resources(res.settings)
    with busy.db.session() as session:
        session.execute(text("SELECT 1"))
    assert close_connections_from_the_server(res) >= 1
    with pytest.raises(OperationalError, match=r"terminat|closed"), busy.db.session() as session:
        session.execute(text("SELECT 1"))
