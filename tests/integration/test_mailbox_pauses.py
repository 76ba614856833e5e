"""A mailbox's pause on real workers (`mailpipe pause --mailbox`, mailpipe.pipeline.mailbox_pauses).

The workers are `celery worker` processes of the test's own key prefix (tests/support/fleet.py);
the test acts and reads as an operator does, with `mailpipe`, and reads the runs in the database.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from mailpipe.cli.ingest import store_emails
from mailpipe.pipeline import runs
from mailpipe.storage.models import PipelineRun
from tests.support.bedrock_server import invoices
from tests.support.waits import holds_for, wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

PAUSED = "acme@example.org"
EMAILS = 20
# Long enough for every job sent to be taken, and for a job that cycled to be seen cycling.
WATCHED_S = 4.0


def runs_of(res, email_ids: list[int]) -> dict[int, PipelineRun]:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        found = session.scalars(select(PipelineRun).where(PipelineRun.email_id.in_(email_ids)))
        return {run.email_id: run for run in found}


def test_a_paused_mailbox_waits_through_a_flush_while_others_run_and_its_resume_runs_it(
    res, fleet
) -> None:  # type: ignore[no-untyped-def]
    f = fleet()
    f.worker("cpu")
    f.cli("pause", "--mailbox", PAUSED, "--reason", "under investigation")
    held = store_emails(res, invoices(EMAILS), mailbox=PAUSED)
    other = store_emails(res, invoices(EMAILS), mailbox="other")
    # Half the paused mailbox's emails have an open run already (taken before the pause).
    with res.db.transaction() as session:
        runs.ensure_runs(session, held[: EMAILS // 2])
    # Sent without their mailboxes, as upstream's enqueue_email sends them: each goes by way
    # of its lane's own queue to its mailbox's shard.
    f.enqueue(held + other)

    assert set(wait_until_closed(res, other, timeout=120).values()) == {"succeeded"}

    def untouched() -> bool:
        found = runs_of(res, held)
        return (
            set(found) == set(held[: EMAILS // 2])
            and {(run.status.value, run.attempts, run.claims) for run in found.values()}
            == {("open", 0, 0)}
            and f.queue_depth() == 0
            and f.unacked() == 0
        )

    # Ended, not sent round the queues: nothing waits in the broker, nothing is claimed.
    wait_for(untouched, 30, "the paused mailbox's jobs to end")
    holds_for(untouched, WATCHED_S, "the paused mailbox's emails untouched")
    assert not f.sweep()["readded_ids"]

    # A Redis restarted without its data: the workers put the pause back from the database,
    # and the jobs sent again meanwhile are held as before.
    f.flush()
    f.enqueue(held)
    wait_for(untouched, 30, "the jobs sent again to end")
    holds_for(untouched, WATCHED_S, "the paused mailbox's emails untouched after the flush")
    assert res.redis.exists(f"{f.prefix}mailpipe:mailbox-pauses:restored")
    assert not f.sweep()["readded_ids"]
    [shown] = json.loads(f.cli("status", "--json"))["paused_mailboxes"]
    assert (shown["mailbox"], shown["reason"], shown["waiting"]) == (
        PAUSED,
        "under investigation",
        EMAILS,
    )

    assert f"{EMAILS} job(s) sent" in f.cli("resume", "--mailbox", PAUSED)
    assert set(wait_until_closed(res, held, timeout=120).values()) == {"succeeded"}
    assert {run.attempts for run in runs_of(res, held).values()} == {1}
    assert json.loads(f.cli("status", "--json"))["paused_mailboxes"] == []
