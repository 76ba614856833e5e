"""The probe of a paused stage against a real database and S3 server."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from sqlalchemy.engine import make_url

from mailpipe.app.probes import ProbeResult, probe
from mailpipe.broker.queues import Stage
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import pauses
from mailpipe.resources import Resources
from tests.support.emails import raw_email

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

EMAIL = raw_email("probe", sender="a@example.com", message_id="probe@x", body="body")


def test_a_database_that_refuses_the_role_keeps_the_pause(res) -> None:  # type: ignore[no-untyped-def]
    """A role that may read every table but write none: the database's check writes as a job
    does, so the probe keeps the stage paused until the grants are back."""
    [email_id] = store_emails(res, [EMAIL])
    pauses.record_fault(
        res.redis,
        Stage.CPU,
        email_id,
        "ProgrammingError: (SQLSTATE 42501)",
        dependency="database",
        threshold=1,
        window=60,
    )
    role = f"probe_{uuid.uuid4().hex[:8]}"
    url = make_url(res.settings.database_url)
    admin = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    try:
        readonly = Resources(
            res.settings.model_copy(
                update={"database_url": url.set(username=role).render_as_string(False)}
            )
        )
        try:
            assert probe(readonly, Stage.CPU) is ProbeResult.REFUSED
        finally:
            readonly.close()
        assert set(pauses.paused(res.redis)) == {Stage.CPU}
        assert probe(res, Stage.CPU) is ProbeResult.PASSED
        assert pauses.paused(res.redis) == {}
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}")
            conn.execute(f"DROP ROLE {role}")
