"""`mailpipe forget` beside real workers: a prefork worker of the CPU stage and the model role on
threads, classifying with the `bedrock` backend against the local server (the fleet of
tests/integration/test_model_calls.py). An email done, an origin with two copies, one whose job
is held at its model call, and one failed: after forget, no table holds a row naming it, the
blob store has nothing of it and Redis only its fence; the job in flight wrote nothing, and a
sweep adds nothing back."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from mailpipe.app.tasks import run_sweep
from mailpipe.broker import layout
from mailpipe.broker.queues import job_queues
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.enqueue import enqueue_emails, sender
from mailpipe.operations import actions
from mailpipe.resources import Resources
from mailpipe.storage.keys import document_texts
from mailpipe.storage.models import EmailMessage, EmailOrigin
from tests.integration.test_model_calls import model_fleet  # noqa: F401 (fixture)
from tests.support.bedrock_server import ConverseRequest, Reply, error, keyword_labels
from tests.support.erasure import redis_naming, rows_naming, stored_keys, with_document
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

USER = "test:operator"


def blob_key(res: Resources, email_id: int) -> str:
    with res.db.session() as session:
        return session.get_one(EmailMessage, email_id).blob_key


def assert_forgotten(res: Resources, email_id: int, raw_key: str | None) -> None:
    """Nothing of the email in any table, in the blob store (its raw email, unless `raw_key`
    is None because copies share it, and its document texts), or in Redis beyond its fence."""
    assert rows_naming(res, email_id) == {}
    kept = stored_keys(res)
    assert raw_key not in kept
    assert not [key for key in kept if key.startswith(document_texts(email_id))]
    assert redis_naming(res, email_id) == {f"forgotten:{email_id}"}


def assert_no_sweep_adds_back(res: Resources, email_ids: list[int]) -> None:
    result = run_sweep(res)
    assert result.ran and not set(email_ids) & set(result.readded_ids)
    queued = layout.emails_in_broker(res.redis, job_queues(res.settings))
    assert not set(email_ids) & queued
    assert all(rows_naming(res, email_id) == {} for email_id in email_ids)


def test_a_done_email_is_forgotten_from_the_command_line(res, model_fleet) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    model_fleet(workers=1, concurrency=2, delay=0.01)
    [email_id] = store_emails(res, [with_document()])
    enqueue_emails([email_id], res)
    assert wait_until_closed(res, [email_id], timeout=60) == {email_id: "succeeded"}
    raw_key = blob_key(res, email_id)
    assert {"classification.email_id", "email_label.email_id", "model_input.email_id"} <= set(
        rows_naming(res, email_id)
    )

    forgot = subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", "forget", str(email_id), "--yes"],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert forgot.returncode == 0, forgot.stderr
    assert "forget by cli:" in forgot.stderr and f"email_id={email_id} " in forgot.stderr
    assert_forgotten(res, email_id, raw_key)
    assert_no_sweep_adds_back(res, [email_id])


def test_an_origin_with_two_copies_passes_to_the_first_copy(res, model_fleet) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    model_fleet(workers=1, concurrency=2, delay=0.01)
    raw = with_document()
    first, copy1, copy2 = store_emails(res, [raw, raw, raw])
    enqueue_emails([first], res)
    wait_until_closed(res, [first], timeout=60)
    enqueue_emails([copy1, copy2], res)
    assert wait_until_closed(res, [first, copy1, copy2], timeout=60) == {
        first: "succeeded",
        copy1: "duplicate",
        copy2: "duplicate",
    }

    actions.forget(res, [first], enqueue=sender(res), user=USER)

    assert_forgotten(res, first, raw_key=None)
    with res.db.session() as session:
        [origin] = session.query(EmailOrigin).all()
        copies = {e.id: (e.origin_id, e.duplicate_of) for e in session.query(EmailMessage).all()}
    assert origin.first_email_id == copy1
    assert copies == {copy1: (origin.id, None), copy2: (origin.id, copy1)}
    assert blob_key(res, copy1) in stored_keys(res)  # the copies are stored as the same bytes
    assert_no_sweep_adds_back(res, [first])


def test_a_job_held_at_its_model_call_writes_nothing_once_forgotten(  # type: ignore[no-untyped-def]
    res,
    model_fleet,  # noqa: F811
    tmp_path,
) -> None:
    server = model_fleet(workers=1, concurrency=2, delay=0.01)
    answer = threading.Event()

    def held(request: ConverseRequest) -> Reply:
        assert answer.wait(60), "the test never let the model answer"
        return keyword_labels(request)

    server.enqueue(held)
    [email_id] = store_emails(res, [with_document()])
    raw_key = blob_key(res, email_id)
    enqueue_emails([email_id], res)
    wait_for(lambda: len(server.requests) == 1, 60, "the model call")

    actions.forget(res, [email_id], enqueue=sender(res), user=USER)
    answer.set()
    # The job goes on once the model answers, finds its run gone and gives its lease back.
    wait_for(lambda: not res.redis.exists(redis_keys.lease(email_id)), 30, "the job to end")

    assert_forgotten(res, email_id, raw_key)
    assert len(server.requests) == 1
    log = (tmp_path / "models-0.log").read_text()
    assert f"email {email_id}: the run is gone; this delivery stops without writing" in log
    assert "'already_closed'" in log
    assert_no_sweep_adds_back(res, [email_id])


def test_a_failed_email_is_forgotten(res, model_fleet) -> None:  # noqa: F811  # type: ignore[no-untyped-def]
    server = model_fleet(workers=1, concurrency=2, delay=0.01)
    server.enqueue(error("ValidationException", 400, "Input is too long for requested model."))
    [email_id] = store_emails(res, [with_document()])
    raw_key = blob_key(res, email_id)
    enqueue_emails([email_id], res)
    assert wait_until_closed(res, [email_id], timeout=60) == {email_id: "failed"}
    assert "run_attempt.email_id" in rows_naming(res, email_id)

    done = actions.forget(res, [email_id], enqueue=sender(res), user=USER)

    assert done.email_ids == [email_id]
    assert_forgotten(res, email_id, raw_key)
    assert_no_sweep_adds_back(res, [email_id])
