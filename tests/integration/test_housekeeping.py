"""Housekeeping on a real fleet: beat's lock holder prunes as the fleet works, and the attempt
table stays its size."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sqlalchemy import func, select

from mailpipe.cli.demo import fleet as localfleet
from mailpipe.operations.status import email_detail
from mailpipe.storage import flags
from mailpipe.storage.models import EmailMessage, RunAttempt
from tests.integration.test_web import failed_run
from tests.support.emails import raw_email
from tests.support.waits import wait_for, wait_until_closed
from tests.unit.operations.test_housekeeping import OLD, add_retries

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

WAVES = 4
PER_WAVE = 250
KEEP_S = 3.0


def attempt_rows(res) -> int:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return session.scalar(select(func.count()).select_from(RunAttempt)) or 0


def test_the_attempt_table_stays_flat_while_the_fleet_works(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = dict(os.environ)
    env["MAILPIPE_REDIS_PREFIX"] = f"fleet{uuid.uuid4().hex[:8]}:"
    env["MAILPIPE_HOUSEKEEPING_INTERVAL"] = "1"
    env["MAILPIPE_KEEP_ATTEMPTS_DAYS"] = str(KEEP_S / 86400)
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    # A run on the failed list, with its attempts: the operator still needs them.
    listed = failed_run(res)
    add_retries(res, listed, OLD)
    with res.db.session() as session:
        needed = session.scalar(
            select(func.count()).select_from(RunAttempt).where(RunAttempt.email_id == listed)
        )
    assert needed, "the failed run has attempts to keep"

    worker = localfleet.worker(env, tmp_path, name="housekeeping-worker").start()
    beat = localfleet.beat(env, tmp_path).start()
    seen: list[tuple[int, int]] = []  # per wave: the most rows seen, the rows once pruned
    try:
        worker.wait_ready()
        for wave in range(WAVES):
            folder = tmp_path / f"wave{wave}"
            folder.mkdir()
            for i in range(PER_WAVE):
                (folder / f"{i:03}.eml").write_bytes(
                    raw_email(
                        f"Invoice {wave}-{i}", message_id=f"h{wave}-{i}@x", body=f"Amount due {i}"
                    )
                )
            subprocess.run(
                [sys.executable, "-m", "mailpipe.cli.main", "ingest", str(folder)],
                env=env,
                capture_output=True,
                check=True,
            )
            with res.db.session() as session:
                ids = list(
                    session.scalars(select(EmailMessage.id).where(EmailMessage.id != listed))
                )
            statuses = wait_until_closed(res, ids, timeout=180)
            assert set(statuses.values()) == {"succeeded"}
            most = attempt_rows(res)
            wait_for(
                lambda: attempt_rows(res) == needed,
                60,
                "housekeeping to prune the wave's attempts once the retention passed",
            )
            seen.append((most, attempt_rows(res)))
    finally:
        beat.stop()
        worker.stop()
    # Every wave wrote attempts, and each time housekeeping took the table back to the rows a
    # run still needs: flat over the waves, whatever the fleet has done.
    assert all(most > needed for most, _ in seen[:1]), seen
    assert [after for _, after in seen] == [needed] * WAVES
    with res.db.session() as session:
        kept = session.scalar(
            select(func.count()).select_from(RunAttempt).where(RunAttempt.email_id == listed)
        )
        shown = email_detail(session, ids[-1])
    assert kept == needed
    assert shown is not None and shown["run"]["status"] == "succeeded"
    assert "housekeeping: deleted" in beat.log_tail(400)
