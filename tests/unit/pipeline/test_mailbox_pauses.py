"""A mailbox's pause (mailpipe.pipeline.mailbox_pauses, `actions.pause_mailbox`): its jobs end
without claiming anything, the sweeper leaves its emails alone, the pause outlives a flushed
Redis, and its resume sends the jobs again. On the real Redis and PostgreSQL, with no worker:
tests/integration/test_mailbox_pauses.py runs it on real workers."""

from __future__ import annotations

import hashlib
import logging
import os

import pytest
from sqlalchemy import select, update

from mailpipe.broker import layout
from mailpipe.broker.queues import job_queues
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import pauses, redis_keys
from mailpipe.enqueue import enqueue_emails, sender
from mailpipe.operations import actions, status, sweeper
from mailpipe.pipeline import job, mailbox_pauses, runs
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage.models import PipelineRun, RunStatus, utcnow
from tests.support.emails import raw_email
from tests.support.services import delete_prefix
from tests.support.switches import set_model_calls

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

PAUSED = "acme@example.org"


def emails(n: int, tag: str) -> list[bytes]:
    return [raw_email(f"s{i}", message_id=f"{tag}{i}@x", body=f"body {i}") for i in range(n)]


def lose_redis(res: Resources) -> None:
    """What a flushed or restarted Redis leaves: none of this run's keys, and no cached read."""
    delete_prefix(os.environ["MAILPIPE_BROKER_URL"], os.environ["MAILPIPE_REDIS_PREFIX"])
    res.mailbox_pauses.forget()
    assert pauses.paused_mailboxes_if_known(res.redis) is None


def in_broker(res: Resources) -> set[int]:
    return layout.emails_in_broker(res.redis, job_queues(res.settings))


def run_sweep(res: Resources) -> sweeper.SweepResult:
    return sweeper.sweep(res, enqueue=sender(res), in_flight_grace=0)


def test_a_paused_mailboxs_delivery_claims_nothing_and_releases_its_marker(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    actions.pause_mailbox(res, PAUSED, "under investigation", user="ops")
    [held] = store_emails(res, emails(1, "a"), mailbox=PAUSED)
    [other] = store_emails(res, emails(1, "b"), mailbox="other")
    enqueue_emails([held], res, mailboxes={held: PAUSED})
    assert res.redis.exists(redis_keys.job_marker(held))

    assert job.process_email(res, held, mailbox=PAUSED).kind is Kind.HELD
    # A message that names no mailbox is held by its row's.
    assert job.process_email(res, held).kind is Kind.HELD
    assert job.classify_email(res, held, mailbox=PAUSED).kind is Kind.HELD
    with res.db.session() as session:
        assert session.scalars(select(PipelineRun)).all() == []
    assert not res.redis.exists(redis_keys.job_marker(held))
    # Another mailbox goes on.
    assert job.process_email(res, other, mailbox="other").kind is Kind.SUCCEEDED


def test_an_open_run_of_a_paused_mailbox_keeps_its_attempts(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, emails(1, "c"), mailbox=PAUSED)
    with res.db.transaction() as session:
        runs.ensure_runs(session, [email_id])
    actions.pause_mailbox(res, PAUSED, "runaway import", user="ops")

    assert job.process_email(res, email_id, mailbox=PAUSED).kind is Kind.HELD
    with res.db.session() as session:
        run = session.scalars(select(PipelineRun)).one()
        assert (run.status, run.attempts, run.claims) == (RunStatus.OPEN, 0, 0)


def test_the_default_mailbox_is_paused_by_its_shown_name(res) -> None:  # type: ignore[no-untyped-def]
    actions.pause_mailbox(res, "default", "incident", user="ops")
    [email_id] = store_emails(res, emails(1, "d"))
    assert job.process_email(res, email_id).kind is Kind.HELD
    assert job.process_email(res, email_id, mailbox="default").kind is Kind.HELD
    with pytest.raises(ValueError):
        actions.pause_mailbox(res, " ", "incident", user="ops")


def test_a_mailbox_pause_is_put_back_after_a_flush(res) -> None:  # type: ignore[no-untyped-def]
    held = actions.pause_mailbox(res, PAUSED, "under investigation", user="ops")
    [email_id] = store_emails(res, emails(1, "e"), mailbox=PAUSED)
    lose_redis(res)

    assert job.process_email(res, email_id, mailbox=PAUSED).kind is Kind.HELD
    assert pauses.paused_mailboxes_if_known(res.redis) == {PAUSED: held}  # back, for everyone
    # Paused again, it keeps the first pause's start and reason.
    assert actions.pause_mailbox(res, PAUSED, "another reason", user="ops") == held


def test_a_resumed_mailbox_stays_resumed_through_a_flush(res) -> None:  # type: ignore[no-untyped-def]
    actions.pause_mailbox(res, PAUSED, "under investigation", user="ops")
    assert actions.resume_mailbox(res, PAUSED, enqueue=sender(res), user="ops").was_paused
    lose_redis(res)
    assert mailbox_pauses.in_force(res) == {}
    assert not actions.resume_mailbox(res, PAUSED, enqueue=sender(res), user="ops").was_paused


def test_the_sweeper_leaves_a_paused_mailboxs_emails_alone(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    held = store_emails(res, emails(4, "f"), mailbox=PAUSED)
    other = store_emails(res, emails(2, "g"), mailbox="other")
    with res.db.transaction() as session:
        runs.ensure_runs(session, held[:2])
        # Swept to its last: lost once more, an unpaused run would be failed as stalled.
        session.execute(
            update(PipelineRun)
            .where(PipelineRun.email_id == held[0])
            .values(sweep_count=res.settings.max_sweeps, last_swept_at=utcnow())
        )
    actions.pause_mailbox(res, PAUSED, "under investigation", user="ops")

    result = run_sweep(res)
    assert sorted(result.readded_ids) == other
    assert (result.readded_no_run, result.readded_stalled, result.marked_for_review) == (2, 0, 0)
    assert in_broker(res) == set(other)
    with res.db.session() as session:
        found = {r.email_id: r for r in session.scalars(select(PipelineRun))}
    assert {found[i].status for i in held[:2]} == {RunStatus.OPEN}
    assert found[held[0]].sweep_count == res.settings.max_sweeps
    assert found[held[1]].sweep_count == 0
    assert not set(held[2:]) & set(found)


def test_a_resume_sends_every_waiting_job_in_its_stage(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    held = store_emails(res, emails(5, "h"), mailbox=PAUSED)
    other = store_emails(res, emails(1, "i"), mailbox="other")
    with res.db.transaction() as session:
        runs.ensure_runs(session, held[:3])
        # Past its CPU stage: its model stage is what is sent.
        session.execute(
            update(PipelineRun).where(PipelineRun.email_id == held[0]).values(converted_at=utcnow())
        )
    actions.pause_mailbox(res, PAUSED, "under investigation", user="ops")
    assert in_broker(res) == set()

    resumed = actions.resume_mailbox(res, PAUSED, enqueue=sender(res), user="ops", batch=2)
    assert resumed == actions.Resumed(True, 5)
    assert in_broker(res) == set(held)
    model = layout.emails_in_broker(res.redis, [f"{res.settings.queue}.model"])
    assert model == {held[0]}
    assert other[0] not in in_broker(res)
    # Sent once: a second resume finds them queued.
    assert actions.resume_mailbox(res, PAUSED, enqueue=sender(res), user="ops").enqueued == 0


def test_status_and_the_job_api_show_a_paused_mailbox(res) -> None:  # type: ignore[no-untyped-def]
    held = store_emails(res, emails(3, "j"), mailbox=PAUSED)
    [other] = store_emails(res, emails(1, "k"), mailbox="other")
    with res.db.transaction() as session:
        runs.ensure_runs(session, held[:1])
    actions.pause_mailbox(res, PAUSED, "under investigation", user="ops")

    [shown] = status.fleet_status(res)["paused_mailboxes"]
    assert (shown["mailbox"], shown["reason"], shown["waiting"]) == (
        PAUSED,
        "under investigation",
        3,
    )
    with res.db.session() as session:
        for email_id in held:
            found = status.job_state(res, session, email_id)
            assert found is not None
            assert (found["state"], found["waiting_for"]) == ("waiting", "paused_mailbox")
        found = status.job_state(res, session, other)
        assert found is not None
        assert found["state"] == "not_enqueued"


def test_the_audit_lines_never_name_the_mailbox(res, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="mailpipe")
    actions.pause_mailbox(res, PAUSED, "under investigation", user="ops")
    actions.resume_mailbox(res, PAUSED, enqueue=sender(res), user="ops")
    digest = hashlib.sha256(PAUSED.encode()).hexdigest()
    audited = [r.getMessage() for r in caplog.records if r.name.endswith("actions")]
    assert audited == [
        f"pause_mailbox by ops mailbox_sha256={digest}",
        f"resume_mailbox by ops mailbox_sha256={digest}",
    ]
    assert not any(PAUSED in record.getMessage() for record in caplog.records)
