"""The shared corpus through a real prefork worker, PostgreSQL, Redis and the S3 server."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from mailpipe.cli.ingest import ingest
from mailpipe.storage import flags
from mailpipe.storage.models import EmailMessage, PipelineRun
from tests.support.paths import CORPUS
from tests.support.waits import wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def test_every_corpus_email_ends_in_a_terminal_state(res, live_worker) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    report = ingest(res, [CORPUS / "emails"])
    # Licences, READMEs, images and sound files in the corpus folder are not emails.
    rejected = {r.source.rsplit("/", 1)[-1]: r.reason for r in report.rejected}
    assert "small.png" in rejected and "LICENSE" in rejected
    assert all(reason for reason in rejected.values())
    assert report.stored >= 140
    assert report.enqueued == report.stored

    statuses = wait_until_closed(res, report.email_ids, timeout=240)
    assert set(statuses.values()) <= {"succeeded", "duplicate", "failed"}
    with res.db.session() as session:
        failed = session.execute(
            select(PipelineRun.email_id, PipelineRun.error).where(PipelineRun.status == "failed")
        ).all()
    # The corpus has no empty or garbage files left after ingest's checks: nothing fails.
    assert failed == []

    # The same emails again are copies: each links to the first and stops there.
    again = ingest(res, [CORPUS / "emails" / "mail-parser"])
    statuses = wait_until_closed(res, again.email_ids, timeout=120)
    assert set(statuses.values()) == {"duplicate"}
    with res.db.session() as session:
        originals = {
            row.sha256: row.id
            for row in session.scalars(
                select(EmailMessage).where(EmailMessage.id.in_(report.email_ids))
            )
        }
        for copy in session.scalars(
            select(EmailMessage).where(EmailMessage.id.in_(again.email_ids))
        ):
            assert copy.duplicate_of == originals[copy.sha256]
