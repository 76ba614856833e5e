"""Connections the server closed: no ping per checkout, and no job or attempt lost to them.
Database errors that quote nothing of the email they were about. The web role's reads, given up
past its own statement timeout."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import insert, select, text
from sqlalchemy.exc import DBAPIError, OperationalError

from mailpipe.cli.ingest import store_emails
from mailpipe.errors import describe, is_statement_timeout
from mailpipe.pipeline import job
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.settings import Settings
from mailpipe.storage import db, flags
from mailpipe.storage.models import EmailMessage, EmailOrigin, PipelineRun
from tests.conftest import DATABASE, PG_ADMIN_URL
from tests.support.emails import raw_email

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def note(n: int) -> bytes:
    return raw_email(f"note {n}", message_id=f"c{n}@example.org", body=f"hello {n}")


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
    first, second = store_emails(res, [note(1), note(2)])
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


# What an email puts in a row, and must never reach an error's message: logs and runs keep those.
SUBJECT = "Salary review for Jane Roe"
MESSAGE_ID = "<jane-roe-salary@example.org>"


def test_a_statement_s_parameters_are_in_no_database_error(res) -> None:  # type: ignore[no-untyped-def]
    overlong_key = "raw/" + "k" * 300  # blob_key is a varchar(255)
    row = {"blob_key": overlong_key, "size": 1, "sha256": "0" * 64, "subject": SUBJECT}
    with pytest.raises(DBAPIError) as refused, res.db.transaction() as session:
        session.execute(insert(EmailMessage), [row])
    for said in (str(refused.value), describe(refused.value)):
        assert SUBJECT not in said and overlong_key not in said
    assert describe(refused.value) == "DataError: StringDataRightTruncation (SQLSTATE 22001)"


def test_describe_names_a_unique_violation_by_its_sqlstate_alone(res) -> None:  # type: ignore[no-untyped-def]
    (email_id,) = store_emails(res, [note(1)])
    origin = {"fingerprint": "f" * 64, "message_id": MESSAGE_ID, "first_email_id": email_id}
    with res.db.transaction() as session:
        session.execute(insert(EmailOrigin), [origin])
    with pytest.raises(DBAPIError) as refused, res.db.transaction() as session:
        session.execute(insert(EmailOrigin), [origin])
    assert MESSAGE_ID not in str(refused.value)
    assert describe(refused.value) == "IntegrityError: UniqueViolation (SQLSTATE 23505)"


def test_a_sqlite_error_has_no_sqlstate_and_no_parameters(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = db.make_engine(f"sqlite:///{tmp_path / 'one.db'}")
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE origin (message_id TEXT UNIQUE)"))
        connection.execute(text("INSERT INTO origin VALUES (:m)"), {"m": MESSAGE_ID})
    with pytest.raises(DBAPIError) as refused, engine.begin() as connection:
        connection.execute(text("INSERT INTO origin VALUES (:m)"), {"m": MESSAGE_ID})
    engine.dispose()
    assert MESSAGE_ID not in str(refused.value)
    assert describe(refused.value) == "IntegrityError: IntegrityError"


def test_the_web_role_s_reads_give_up_past_its_timeout_and_its_actions_do_not(res) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(**{**res.settings.model_dump(), "web_statement_timeout_ms": 200})
    web = Resources.for_web(settings)
    connections = f"{settings.db_statement_timeout}s"
    try:
        for database in (web.db, web.searches):
            with database.reading() as session:
                assert session.scalar(text("SHOW statement_timeout")) == "200ms"
                with pytest.raises(OperationalError) as gave_up:
                    session.execute(text("SELECT pg_sleep(5)"))
            assert is_statement_timeout(gave_up.value)
            with database.reading() as session:  # the pooled connection, in a new transaction
                assert session.scalar(text("SHOW statement_timeout")) == "200ms"
        # An action's session keeps the connection's timeout, as every other role's reads do.
        with web.db.session() as session:
            assert session.scalar(text("SHOW statement_timeout")) == connections
            session.execute(text("SELECT pg_sleep(0.3)"))  # past the reads' 200 ms
        with res.db.reading() as session:
            assert session.scalar(text("SHOW statement_timeout")) == connections
    finally:
        web.close()
