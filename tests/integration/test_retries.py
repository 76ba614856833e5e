"""Retries, time limits and refused messages on real prefork workers.

Failures come from `tests.support.faults` (a service down, or busy with a Retry-After; a bug; a
step slower than the soft time limit), inside the job's steps after the attempt was counted,
where a real outage would hit. Every one of them but rejected input is retried.
"""

from __future__ import annotations

import itertools

import pytest
from kombu import Connection, Exchange, Producer
from sqlalchemy import func, select

from mailpipe.cli.ingest import store_emails
from mailpipe.resources import Resources
from mailpipe.storage.models import PipelineRun, RunStatus, SweepReport
from tests.support.emails import raw_email
from tests.support.faults import release_claim, set_claim_fault
from tests.support.waits import wait_for, wait_until_closed

pytestmark = [pytest.mark.slow, pytest.mark.services]  # Redis, PostgreSQL and the S3 server

# Short windows the settings accept: the backoff doubles from 0.5 s, capped at 2 s.
BACKOFF = {"MAILPIPE_RETRY_BACKOFF_BASE": "0.5", "MAILPIPE_RETRY_BACKOFF_MAX": "2"}


def email(tag: str) -> bytes:
    return raw_email(f"Invoice {tag}", message_id=f"{tag}@x", body="Amount due")


def run_of(res, email_id: int) -> PipelineRun:  # type: ignore[no-untyped-def]
    from sqlalchemy import select

    with res.db.session() as session:
        return session.scalars(select(PipelineRun).where(PipelineRun.email_id == email_id)).one()


def test_transient_errors_back_off_and_the_run_fails_when_attempts_are_used_up(res, fleet) -> None:  # type: ignore[no-untyped-def]
    f = fleet(**BACKOFF)
    worker = f.worker("retrying")
    [down, fine] = store_emails(res, [email("down"), email("fine")])
    f.set_fault(down, "transient")
    f.enqueue([down, fine])
    statuses = wait_until_closed(res, [down, fine], timeout=90)
    assert statuses == {down: "failed", fine: "succeeded"}
    run = run_of(res, down)
    assert run.attempts == 4
    assert run.error == "gave up after 4 attempts: TransientError: the test's service is down"
    assert f.runs(down) == 4  # the first try and three retries, never a fifth
    # Each retry was sent with its backoff as its countdown: full jitter below 0.5, 1 and 2 s.
    countdowns = f.countdowns(down)
    assert len(countdowns) == 3, countdowns
    for countdown, ceiling in zip(countdowns, [0.5, 1.0, 2.0], strict=True):
        assert 0 <= countdown <= ceiling, countdowns
    assert worker.alive()


def test_a_services_retry_after_is_waited_out_rather_than_the_backoff(res, fleet) -> None:  # type: ignore[no-untyped-def]
    f = fleet(**BACKOFF)
    f.worker("busy-service")
    [busy] = store_emails(res, [email("busy")])
    # Twice "come back in 1.5 s", then the service answers: longer than any first backoff (0.5 s
    # at most), and shorter than the cap, so only the service's word explains the wait.
    f.set_fault(busy, "transient:1.5", times=2)
    f.enqueue([busy])
    assert wait_until_closed(res, [busy], timeout=60) == {busy: "succeeded"}
    assert f.countdowns(busy) == [1.5, 1.5]
    starts = f.starts(busy)
    assert len(starts) == 3
    # Never before its countdown: the worker holds a retry until its eta, so this lower bound
    # holds however loaded the machine is.
    assert all(later - earlier >= 1.5 for earlier, later in itertools.pairwise(starts)), starts
    run = run_of(res, busy)
    assert (run.attempts, run.error) == (3, None)


# The soft time limit a slow job hits; the hard one and the visibility timeout as the settings
# require above it.
SOFT_LIMIT = {
    "MAILPIPE_TASK_SOFT_TIME_LIMIT": "5",
    "MAILPIPE_TASK_TIME_LIMIT": "8",
    "MAILPIPE_VISIBILITY_TIMEOUT": "15",
}


def wait_for_failed_attempt(res, email_id: int, attempt: int, error: str) -> None:  # type: ignore[no-untyped-def]
    """Until the run shows `attempt` attempts, the last of them failed with `error`; a run that
    failed instead stops the wait at once."""

    def recorded() -> bool:
        with res.db.session() as session:
            run = session.scalars(
                select(PipelineRun).where(PipelineRun.email_id == email_id)
            ).first()
        if run is not None and run.status is RunStatus.FAILED:
            raise AssertionError(f"the run failed after {run.attempts} attempts: {run.error}")
        return run is not None and run.attempts == attempt and (run.error or "").startswith(error)

    wait_for(recorded, 60, f"attempt {attempt} to fail with its error recorded")


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("raise", "unexpected RuntimeError"),
        ("slow:60", "soft time limit (5 s) exceeded"),
    ],
    ids=["unexpected-error", "soft-time-limit"],
)
def test_a_job_that_fails_twice_succeeds_on_its_third_attempt(res, fleet, fault, error) -> None:  # type: ignore[no-untyped-def]
    f = fleet(**SOFT_LIMIT, **BACKOFF)
    worker = f.worker("third-time")
    [flaky] = store_emails(res, [email("third-time")])
    f.set_fault(flaky, fault, times=2)
    # Each claim is held before it commits, so that what the attempt before it left on the run
    # (its count and its error) stays there to be read until the test lets it go.
    set_claim_fault(res.redis, flaky, times=3, prefix=f.prefix)
    f.enqueue([flaky])
    release_claim(res.redis, flaky, f.prefix)
    for attempt in (1, 2):
        wait_for_failed_attempt(res, flaky, attempt, error)
        release_claim(res.redis, flaky, f.prefix)
    assert wait_until_closed(res, [flaky], timeout=60) == {flaky: "succeeded"}
    run = run_of(res, flaky)
    assert (run.attempts, run.error) == (3, None)
    assert f.runs(flaky) == 3
    assert worker.alive()


def sweep_reports(res: Resources) -> int:
    with res.db.session() as session:
        return int(session.scalar(select(func.count()).select_from(SweepReport)) or 0)


def test_a_pickle_message_is_refused_and_runs_nothing(res, fleet) -> None:  # type: ignore[no-untyped-def]
    f = fleet()
    worker = f.worker("json-only")
    # The worker's start-up sweep over first: it would re-add an email stored before it ran.
    wait_for(lambda: sweep_reports(res) == 1, 30, "the start-up sweep")
    [target] = store_emails(res, [email("pickled")])
    queue = res.settings.queue
    with Connection(
        res.settings.broker_url, transport_options={"global_keyprefix": f.prefix}
    ) as connection:
        producer = Producer(connection.default_channel, exchange=Exchange(queue, type="direct"))
        # What anyone who can write to Redis could send: a task message serialised with pickle.
        producer.publish(
            {"args": [target], "kwargs": {}},
            routing_key=queue,
            serializer="pickle",
            headers={"task": "mailpipe.process_email", "id": "pickled-1", "lang": "py"},
        )
    wait_for(lambda: "pickle" in worker.log_path.read_text(), 30, "the worker to refuse it")
    # Gone from the broker, not left to come back: nothing is left that could run the email.
    wait_for(lambda: f.queue_depth() == f.unacked() == 0, 30, "the message to be dropped")
    log = worker.log_path.read_text()
    assert "Refusing to deserialize untrusted content of type pickle" in log
    with res.db.session() as session:
        assert session.scalar(select(func.count()).select_from(PipelineRun)) == 0
    assert sweep_reports(res) == 1  # no other sweep came to run the email either
    assert worker.alive()
