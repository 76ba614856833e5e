"""The same job twice, one after the other or two at once, leaves identical rows."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from sqlalchemy import select

from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import enqueue_emails, send_job
from mailpipe.pipeline import job
from mailpipe.pipeline.policy import Kind
from mailpipe.storage.models import (
    Classification,
    Document,
    EmailLabel,
    EmailMessage,
    EmailOrigin,
    PipelineRun,
    RunAttempt,
)
from tests.support.database import clean
from tests.support.emails import raw_email
from tests.support.switches import set_model_calls
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

INVOICE = {
    "subject": "Invoice 9",
    "sender": "billing@acme.example",
    "to": "d@example.org",
    "message_id": "i9@acme",
    "body": "Amount due: 3 EUR. Unsubscribe here.",
    "attachments": [("a.csv", "text/csv", b"x,y\r\n1,2\r\n")],
}
EMAIL = raw_email(**INVOICE)
COPY = raw_email(**INVOICE, headers={"Received": "from mx2"})  # another delivery of it
MODELS = (EmailMessage, EmailOrigin, PipelineRun, RunAttempt, Document, EmailLabel, Classification)
# Columns that record when, or how long, rather than what.
WHEN = {
    "created_at",
    "updated_at",
    "closed_at",
    "classified_at",
    "latency_ms",
    "attempt_started_at",
    "received_at",
    "started_at",
    "ended_at",
}


def snapshot(res, skip: set[str] = frozenset()) -> dict[str, list[tuple]]:  # type: ignore[no-untyped-def]
    """Every row the pipeline writes, every column but those in `skip`."""
    out = {}
    with res.db.session() as session:
        for model in MODELS:
            rows = session.scalars(
                select(model).order_by(*model.__table__.primary_key.columns)
            ).all()
            out[model.__tablename__] = [
                tuple(
                    (c.name, getattr(r, c.key))
                    for c in model.__table__.columns
                    if c.name not in skip
                )
                for r in rows
            ]
    return out


def test_a_second_delivery_of_a_closed_run_changes_no_row(res, live_worker) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    ids = store_emails(res, [EMAIL, COPY])
    enqueue_emails(ids, res)
    # Both children race for the origin: whichever records it first owns it.
    assert sorted(wait_until_closed(res, ids).values()) == ["duplicate", "succeeded"]
    first = snapshot(res)
    assert len(first["document"]) == 1 and len(first["classification"]) == 1

    closed_before = live_worker.log_path.read_text().count("'already_closed'")
    for email_id in ids:
        send_job(email_id)  # a redelivery, as after a lost ack
    wait_for(
        lambda: live_worker.log_path.read_text().count("'already_closed'") == closed_before + 2,
        30,
        "both deliveries to end",
    )
    assert snapshot(res) == first  # to the last timestamp


def test_steps_run_again_after_model_calls_are_switched_on_leave_the_same_rows(
    res, live_worker
) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, False)
    [email_id] = store_emails(res, [EMAIL])
    enqueue_emails([email_id], res)
    # The run stays open with model calls off; its documents commit with that.
    wait_for(lambda: snapshot(res)["document"] != [], 60, "the documents of a run left open")
    waiting = snapshot(res, WHEN)
    assert waiting["classification"] == []

    # Switched on and sent again: the CPU stage hands the run to the model stage, which
    # classifies it from what was kept; the rows written before stay as they were.
    set_model_calls(res, True)
    enqueue_emails([email_id], res)
    assert wait_until_closed(res, [email_id]) == {email_id: "succeeded"}
    done = snapshot(res, WHEN)
    for table in ("email_message", "email_origin", "document"):
        assert done[table] == waiting[table]
    # The CPU stage sent again handed off without an attempt: the model stage's is the one more.
    outcomes = [(dict(row)["stage"], dict(row)["outcome"]) for row in done["run_attempt"]]
    assert outcomes == [("cpu", "waiting"), ("model", "succeeded")]
    assert len(done["classification"]) == 1
    assert [row[2][1] for row in done["email_label"]] == ["invoice", "newsletter"]


def _run_in_child(email_id: int, inside, starts) -> str:  # type: ignore[no-untyped-def]
    """One delivery without its lease (what a lapsed lease allows), in a process of its own,
    meeting the other delivery inside the steps: both are there at once."""
    from mailpipe.resources import get_resources

    real_steps = job._run_steps

    def meeting(*args: object) -> job.Verdict:
        starts.append(time.time())
        inside.wait(30)
        return real_steps(*args)  # type: ignore[arg-type]

    job._run_steps = meeting  # type: ignore[assignment]
    outcome = job.run_claimed(get_resources(), email_id)
    if outcome.kind is Kind.RETRY:
        # The other delivery's attempt, unleased, was taken for lost: this is the retry sent
        # after that attempt's backoff, while the other is still inside its steps.
        outcome = job.run_claimed(get_resources(), email_id)
    return outcome.kind.value


def test_two_deliveries_at_once_without_the_lease_leave_the_rows_of_one(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    [email_id] = store_emails(res, [EMAIL])
    assert job.process_email(res, email_id).kind.value == "succeeded"
    # The loser's inserts roll back but still draw from the id sequences, so generated ids
    # (and the origin link that holds one) are compared apart from the rows' contents.
    racy = WHEN | {"attempts", "claims", "error", "id", "origin_id"}
    single = snapshot(res, racy)
    assert [dict(row)["outcome"] for row in single.pop("run_attempt")] == ["succeeded"]

    clean(res)  # the same email again, from nothing, with the same ids
    set_model_calls(res, True)
    assert store_emails(res, [EMAIL]) == [email_id]
    context = multiprocessing.get_context("spawn")
    manager = context.Manager()
    inside, starts = manager.Barrier(2), manager.list()
    with context.Pool(2) as pool:
        outcomes = pool.starmap(
            _run_in_child, [(email_id, inside, starts), (email_id, inside, starts)]
        )
    # Both were inside the steps at once (the barrier let them through together); the second
    # to claim holds the run, and the first, fenced off, wrote nothing after its claim.
    assert len(starts) == 2
    assert sorted(outcomes) == ["already_closed", "succeeded"]
    raced = snapshot(res, racy)
    # The second claim took the first attempt, still running but unleased, for lost; the first,
    # fenced off, wrote no row of its own.
    attempts = [(dict(row)["attempt"], dict(row)["outcome"]) for row in raced.pop("run_attempt")]
    assert attempts == [(1, "lost"), (2, "succeeded")]
    assert raced == single
    with res.db.session() as session:
        run = session.scalars(select(PipelineRun)).one()
        origin = session.scalars(select(EmailOrigin)).one()
        assert session.get(EmailMessage, email_id).origin_id == origin.id
    assert (run.attempts, run.error) == (2, None)
