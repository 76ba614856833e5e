"""The attempt history and the run's error class, as the run's acts write them (runs), driven by
the job: PostgreSQL, Redis and the S3 server, no worker."""

from __future__ import annotations

import socket
import time

import pytest
from sqlalchemy import select, update

from mailpipe.broker.queues import Stage
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.errors import TransientError
from mailpipe.pipeline import interventions, job, policy, runs
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage.models import EmailMessage, RunAttempt, RunStatus
from tests.support.switches import set_model_calls
from tests.unit.pipeline.test_job import (
    INVOICE,
    PLAIN,
    RaisingBlobs,
    history,
    remote_model,
    run_of,
    start_attempt,
)

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def attempts(res: Resources, email_id: int) -> list[RunAttempt]:
    with res.db.session() as session:
        statement = select(RunAttempt).where(RunAttempt.email_id == email_id)
        return list(session.scalars(statement.order_by(RunAttempt.id)))


def with_blobs(res: Resources, blobs: object, **settings: object) -> Resources:
    return Resources(res.settings.model_copy(update=settings)).with_standins(blobs=blobs)


def test_a_job_classified_in_its_cpu_stage_has_one_attempt(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    set_model_calls(res, True)
    assert job.process_email(res, email_id).kind is Kind.SUCCEEDED
    [row] = attempts(res, email_id)
    run = run_of(res, email_id)
    assert (row.run_id, row.stage, row.attempt, row.outcome) == (run.id, "cpu", 1, "succeeded")
    assert (row.error_class, row.error, row.host) == (None, None, socket.gethostname())
    assert row.started_at is not None and row.started_at <= row.ended_at == run.closed_at


def test_each_stage_s_attempts_are_written_as_they_end(res) -> None:  # type: ignore[no-untyped-def]
    handed, waiting = store_emails(res, [INVOICE, PLAIN])
    remote = remote_model(res)
    set_model_calls(res, True)
    assert job.process_email(remote, handed).kind is Kind.HANDED_OFF
    assert job.classify_email(remote, handed).kind is Kind.SUCCEEDED
    assert history(res, handed) == [("cpu", 1, "handed_off", None), ("model", 1, "succeeded", None)]

    set_model_calls(res, False)
    assert job.process_email(remote, waiting).kind is Kind.WAITING
    assert job.classify_email(remote, waiting).kind is Kind.WAITING  # its attempt given back
    set_model_calls(res, True)
    # The CPU stage sent again only hands off, counting no attempt: no row.
    assert job.process_email(remote, waiting).kind is Kind.HANDED_OFF
    assert job.classify_email(remote, waiting).kind is Kind.SUCCEEDED
    assert history(res, waiting) == [
        ("cpu", 1, "waiting", None),
        ("model", 1, "deferred", None),
        ("model", 1, "succeeded", None),
    ]


def test_a_failed_attempt_then_a_success(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    set_model_calls(res, True)
    flaky = with_blobs(res, RaisingBlobs(res.blobs, [TransientError("S3 unavailable")]))
    assert job.process_email(flaky, email_id).kind is Kind.RETRY
    run = run_of(res, email_id)
    assert (run.error_class, run.error) == ("TransientError", "TransientError: S3 unavailable")
    assert job.process_email(flaky, email_id).kind is Kind.SUCCEEDED
    retried, succeeded = attempts(res, email_id)
    assert (retried.attempt, retried.outcome, retried.error_class) == (
        1,
        "retrying",
        "TransientError",
    )
    assert retried.error == "TransientError: S3 unavailable"
    assert (succeeded.attempt, succeeded.outcome, succeeded.error) == (2, "succeeded", None)
    assert retried.ended_at <= succeeded.started_at
    assert (run_of(res, email_id).error_class, run_of(res, email_id).error) == (None, None)


def test_an_attempt_that_uses_up_the_last_fails_with_its_own_error(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    down = with_blobs(res, RaisingBlobs(res.blobs, [TransientError("S3 down") for _ in range(4)]))
    kinds = [job.process_email(down, email_id).kind for _ in range(4)]
    assert kinds == [Kind.RETRY, Kind.RETRY, Kind.RETRY, Kind.FAILED]
    assert history(res, email_id) == [
        *(("cpu", n, "retrying", "TransientError") for n in (1, 2, 3)),
        ("cpu", 4, "failed", "TransientError"),
    ]
    # The failed list names what failed it, not that its attempts ran out.
    run = run_of(res, email_id)
    assert (run.status, run.error_class) == (RunStatus.FAILED, "TransientError")


def test_a_missing_blob_fails_the_attempt_and_the_run_as_blob_missing(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    with res.db.transaction() as session:
        session.execute(
            update(EmailMessage).where(EmailMessage.id == email_id).values(blob_key="gone/1")
        )
    assert job.process_email(res, email_id).kind is Kind.FAILED
    [row] = attempts(res, email_id)
    assert (row.outcome, row.error_class) == ("failed", "BlobMissing")
    run = run_of(res, email_id)
    assert (run.error_class, run.error) == ("BlobMissing", row.error)
    assert row.error is not None and row.error.startswith("BlobMissing: blob gone/1 not found")


def test_an_unfinished_attempt_is_written_by_the_claim_that_finds_it(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    set_model_calls(res, True)
    start_attempt(res, email_id)  # attempt 1, then the hard time limit killed it
    assert job.process_email(res, email_id, cut_off=25).kind is Kind.RETRY
    assert run_of(res, email_id).error_class == "HardTimeLimit"
    start_attempt(res, email_id)  # attempt 2, then its worker's shutdown cut it off
    with res.db.transaction() as session:
        runs.claim(session, email_id, policy.Limits(4, 10), shutdown_cut_off_at=lambda: time.time())
    assert run_of(res, email_id).error_class == "ShutdownCutoffs"
    started = run_of(res, email_id).attempt_started_at  # attempt 2 again, its process died
    assert job.process_email(res, email_id).kind is Kind.RETRY  # the death waits its backoff
    assert job.process_email(res, email_id).kind is Kind.SUCCEEDED
    assert history(res, email_id) == [
        ("cpu", 1, "cut_off", "HardTimeLimit"),
        ("cpu", 2, "cut_off", "ShutdownCutoffs"),
        ("cpu", 2, "lost", "Lost"),
        ("cpu", 3, "succeeded", None),
    ]
    *_, lost, _ = attempts(res, email_id)
    assert lost.started_at == started
    assert lost.error == (
        "attempt 2 ended without a result: its worker process died or was killed, or stopped "
        "renewing its lease"
    )


def test_an_unfinished_attempt_that_fails_the_run_is_written_as_failed(res) -> None:  # type: ignore[no-untyped-def]
    dying, cut = store_emails(res, [INVOICE, PLAIN])
    for _ in range(4):
        start_attempt(res, dying)
    assert job.process_email(res, dying).kind is Kind.FAILED
    assert history(res, dying) == [
        *(("cpu", n, "lost", "Lost") for n in (1, 2, 3)),
        ("cpu", 4, "failed", "Lost"),
    ]
    assert run_of(res, dying).error_class == "Lost"

    start_attempt(res, cut)
    with res.db.transaction() as session:
        claim = runs.claim(
            session, cut, policy.Limits(4, 1), shutdown_cut_off_at=lambda: time.time()
        )
    assert isinstance(claim, runs.Failed)
    assert history(res, cut) == [("cpu", 1, "failed", "ShutdownCutoffs")]
    assert run_of(res, cut).error_class == "ShutdownCutoffs"


def test_runs_failed_from_outside_a_claim_name_their_bound_and_write_no_attempt(res) -> None:  # type: ignore[no-untyped-def]
    deferred, stalled = store_emails(res, [INVOICE, PLAIN])
    with res.db.transaction() as session:
        runs.ensure_runs(session, [deferred, stalled])
    res.redis.set(redis_keys.lease(deferred), "elsewhere:1:holder", px=60_000)
    since = time.time() - res.settings.max_deferral
    assert job.process_email(res, deferred, deferred_since=since).kind is Kind.FAILED
    with res.db.transaction() as session:
        assert interventions.fail_stalled(session, [stalled], "stalled: lost 4 times") == [stalled]

    classes = {i: run_of(res, i).error_class for i in (deferred, stalled)}
    assert classes == {deferred: "DeferredTooLong", stalled: "Stalled"}
    assert history(res, deferred) == history(res, stalled) == []

    with res.db.transaction() as session:
        assert interventions.reopen(session, deferred)
    run = run_of(res, deferred)
    assert (run.status, run.error, run.error_class) == (RunStatus.OPEN, None, None)


def test_a_claim_that_counts_no_attempt_says_why_and_writes_nothing_of_the_job_s(res) -> None:  # type: ignore[no-untyped-def]
    emails = [INVOICE, PLAIN, b"Subject: a\n\nb\n", b"Subject: c\n\nd\n"]
    closed, converted, fresh, died = store_emails(res, emails)
    set_model_calls(res, False)
    assert job.process_email(res, closed).kind is Kind.WAITING
    set_model_calls(res, True)
    assert job.classify_email(res, closed).kind is Kind.SUCCEEDED
    set_model_calls(res, False)
    assert job.process_email(res, converted).kind is Kind.WAITING
    start_attempt(res, died)

    def claim(email_id: int, stage: Stage = Stage.CPU) -> object:
        with res.db.transaction() as session:
            return runs.claim(session, email_id, policy.Limits(4, 10), stage=stage)

    assert claim(10**9) == runs.Refused(runs.Refusal.NO_EMAIL)
    assert claim(closed) == runs.Refused(runs.Refusal.CLOSED)
    assert claim(converted) == runs.Refused(runs.Refusal.CONVERTED)
    assert claim(fresh, Stage.MODEL) == runs.Refused(runs.Refusal.NOT_CONVERTED)
    lost = "attempt 1 ended without a result: its worker process died or was killed, or stopped "
    assert claim(died) == runs.Refused(runs.Refusal.UNFINISHED, 1, lost + "renewing its lease")
    assert [run_of(res, i).attempts for i in (converted, died)] == [0, 1]
    assert isinstance(claim(died), runs.Claim)  # the lost attempt ended, the next one counts
