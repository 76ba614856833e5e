"""The embedded default, a SQLite file and a local blob folder, under a real prefork worker whose
two children write at once: every email ends as it would on PostgreSQL."""

from __future__ import annotations

import os
from email.message import EmailMessage
from pathlib import Path

import pytest
from sqlalchemy import func, select

from mailpipe.cli.demo import fleet
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import enqueue_emails
from mailpipe.operations import actions
from mailpipe.pipeline import runs
from mailpipe.resources import Resources
from mailpipe.settings import Settings
from mailpipe.storage import flags, models
from mailpipe.storage.migrate import upgrade
from mailpipe.storage.models import Document, EmailLabel, PipelineRun, RunAttempt
from tests.support.waits import wait_until_closed

pytestmark = [pytest.mark.slow, pytest.mark.services]  # Redis, PostgreSQL and the S3 server


def invoice(n: int, attachment: bool) -> bytes:
    message = EmailMessage()
    message["From"] = "billing@acme.example"
    message["To"] = "d@example.org"
    message["Subject"] = f"Invoice {n}"
    message["Message-ID"] = f"<sqlite-{n}@acme>"
    message.set_content(f"Amount due: {n} EUR")
    if attachment:
        message.add_attachment(
            f"item,price\nwidget,{n}\n", subtype="csv", filename=f"items-{n}.csv"
        )
    return message.as_bytes()


def test_eighty_emails_through_a_worker_on_sqlite(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    database = f"sqlite:///{tmp_path / 'var' / 'mailpipe.db'}"
    env = {
        **os.environ,
        "MAILPIPE_DATABASE_URL": database,
        "MAILPIPE_BLOB_URL": f"file://{tmp_path / 'var' / 'blobs'}",
        "MAILPIPE_REDIS_PREFIX": f"{os.environ['MAILPIPE_REDIS_PREFIX']}sqlite:",
    }
    settings = Settings(
        **{
            **res.settings.model_dump(),
            "database_url": database,
            "blob_url": env["MAILPIPE_BLOB_URL"],
            "redis_prefix": env["MAILPIPE_REDIS_PREFIX"],
        }
    )
    local = Resources(settings)
    upgrade(database)
    with local.db.transaction() as session:
        flags.set_model_calls(session, True)
    raws = [invoice(n, attachment=n % 2 == 0) for n in range(70)]
    copies = raws[:10]  # the same bytes again: each a copy of an email above
    ids = store_emails(local, raws + copies + [b"\x00\x01 not an email"])
    worker = fleet.worker(env, tmp_path, concurrency=2, name="sqlite").start()
    try:
        worker.wait_ready()
        assert len(enqueue_emails(ids, local).sent) == len(ids)
        statuses = wait_until_closed(local, ids, timeout=180)
    finally:
        worker.stop()
    assert [statuses[i] for i in ids[:70]] == ["succeeded"] * 70
    assert [statuses[i] for i in ids[70:80]] == ["duplicate"] * 10
    assert statuses[ids[80]] == "failed"
    with local.db.session() as session:
        assert session.scalar(select(func.count()).select_from(Document)) == 35
        # The 70 distinct emails and their 10 copies, which show their origins' labels.
        assert session.scalar(select(func.count(func.distinct(EmailLabel.email_id)))) == 80
        # One attempt of each job ended it, as its run (others before it may have met a locked
        # database and been retried); the rejected one names its error's class.
        ended = session.execute(
            select(RunAttempt.email_id, RunAttempt.outcome, RunAttempt.error_class)
            .where(RunAttempt.outcome.in_(["succeeded", "duplicate", "failed"]))
            .order_by(RunAttempt.email_id)
        ).all()
        failed = session.scalars(select(PipelineRun).where(PipelineRun.email_id == ids[80])).one()
    assert [(email_id, outcome) for email_id, outcome, _ in ended] == sorted(statuses.items())
    assert ended[-1].error_class == failed.error_class == "InputRejected"
    local.close()


def test_an_id_forgotten_on_sqlite_is_never_given_again(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Migrated from the release before with emails and their runs stored (the migration builds
    the email table again under them): the highest id forgotten, the next email stored gets
    another, so no fence of the forget holds it back."""
    database = f"sqlite:///{tmp_path / 'mailpipe.db'}"
    settings = Settings(
        **{
            **res.settings.model_dump(),
            "database_url": database,
            "blob_url": f"file://{tmp_path / 'blobs'}",
        }
    )
    local = Resources(settings)
    try:
        upgrade(database, "0016")
        kept, last = store_emails(local, [invoice(1, False), invoice(2, False)])
        with local.db.transaction() as session:
            runs.ensure_runs(session, [kept, last])  # rows that refer to the emails
        upgrade(database)
        done = actions.forget(
            local, [last], enqueue=lambda ids, task, lane, boxes: list(ids), user="t"
        )
        assert done.email_ids == [last]
        [stored] = store_emails(local, [invoice(3, False)])
        assert stored > last
        with local.db.session() as session:
            assert session.scalars(
                select(models.EmailMessage.id).order_by(models.EmailMessage.id)
            ).all() == [
                kept,
                stored,
            ]
    finally:
        local.close()
