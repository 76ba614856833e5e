"""The job's control flow, called directly: PostgreSQL, Redis and the S3 server, no worker."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import delete, select, text, update

from mailpipe.broker.queues import Stage
from mailpipe.classifiers import ClassificationResult, EmailForClassifier
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import forgotten, redis_keys
from mailpipe.enqueue import enqueue_emails
from mailpipe.errors import TransientError
from mailpipe.operations import sweeper
from mailpipe.pipeline import interventions, job, policy, runs
from mailpipe.pipeline.policy import Kind, Verdict
from mailpipe.resources import Resources
from mailpipe.storage.models import (
    Classification,
    Document,
    EmailLabel,
    EmailMessage,
    ModelInput,
    PipelineRun,
    RunAttempt,
    RunStatus,
)
from tests.support.switches import set_model_calls
from tests.support.waits import wait_for

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

INVOICE = (
    b"From: billing@acme.example\r\nSubject: Invoice 12\r\nMessage-ID: <j12@acme>\r\n"
    b'Content-Type: multipart/mixed; boundary="b"\r\n\r\n'
    b"--b\r\nContent-Type: text/plain\r\n\r\nAmount due: 12 EUR\r\n"
    b'--b\r\nContent-Type: text/plain; name="notes.txt"\r\nContent-Disposition: attachment; filename="../../notes.txt"\r\n\r\n'
    b"pay soon\r\n--b--\r\n"
)


PLAIN = (
    b"From: billing@acme.example\r\nSubject: Invoice 13\r\nMessage-ID: <j13@acme>\r\n\r\n"
    b"Amount due: 13 EUR\r\n"
)


def run_of(res: Resources, email_id: int) -> PipelineRun:
    with res.db.session() as session:
        return session.scalars(select(PipelineRun).where(PipelineRun.email_id == email_id)).one()


def history(res: Resources, email_id: int) -> list[tuple[str, int, str, str | None]]:
    """The email's attempts, in order: stage, attempt, outcome, error class."""
    with res.db.session() as session:
        statement = (
            select(RunAttempt.stage, RunAttempt.attempt, RunAttempt.outcome, RunAttempt.error_class)
            .where(RunAttempt.email_id == email_id)
            .order_by(RunAttempt.id)
        )
        return [tuple(row) for row in session.execute(statement)]  # type: ignore[misc]


def start_attempt(res: Resources, email_id: int) -> int:
    """What a delivery does before its steps: the claim. A delivery whose child is then killed
    leaves exactly this behind. When the attempt before died too, the claim records that and
    asks for the backoff first: the retry sent after it claims."""
    with res.db.transaction() as session:
        claim = runs.claim(session, email_id, policy.Limits.of(res.settings))
    if isinstance(claim, runs.Refused):
        assert claim.reason is runs.Refusal.UNFINISHED, claim
        with res.db.transaction() as session:
            claim = runs.claim(session, email_id, policy.Limits.of(res.settings))
    assert isinstance(claim, runs.Claim), claim
    return claim.attempt


def after_backoff(res: Resources, email_id: int) -> job.Verdict:
    """A delivery that finds the last attempt unfinished, and the retry sent after its backoff."""
    outcome = job.process_email(res, email_id)
    if outcome.kind is Kind.RETRY and "ended without a result" in (outcome.error or ""):
        return job.process_email(res, email_id)
    return outcome


def refused_reads(res: Resources, n: int) -> Resources:
    """Resources whose next `n` blob reads fail as a service might for one email, while the
    store's check passes: failed attempts of the email's own."""
    errors = [TransientError("S3 unavailable") for _ in range(n)]
    return Resources(res.settings).with_standins(blobs=RaisingBlobs(res.blobs, errors))


def rows(res: Resources) -> dict[str, list[tuple]]:
    with res.db.session() as session:
        return {
            model.__tablename__: sorted(
                tuple(getattr(r, c.key) for c in model.__table__.columns)
                for r in session.scalars(select(model))
            )
            for model in (PipelineRun, Document, EmailLabel, Classification)
        }


def test_model_calls_off_leaves_the_run_open_after_the_documents(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    assert job.process_email(res, email_id).kind is Kind.WAITING
    run = run_of(res, email_id)
    assert (run.status.value, run.attempts, run.attempt_started_at) == ("open", 0, None)
    with res.db.session() as session:
        [document] = session.scalars(select(Document)).all()
        assert session.scalars(select(Classification)).all() == []
    assert document.status.value == "converted" and document.filename == "notes.txt"
    assert "pay soon" in (document.text or "")
    # The job is over: its marker went with the lease, so the email can be enqueued again.
    assert not res.redis.exists(redis_keys.job_marker(email_id), redis_keys.lease(email_id))

    # Sent again with model calls still off, it waits again, writing nothing.
    before = rows(res)
    assert job.process_email(res, email_id).kind is Kind.WAITING
    # Once they are on, sending it again hands it to its model stage, which works from what
    # the CPU stage kept: no second parse, no new row.
    set_model_calls(res, True)
    assert job.process_email(res, email_id).kind is Kind.HANDED_OFF
    assert rows(res) == before
    assert job.classify_email(res, email_id).kind is Kind.SUCCEEDED
    with res.db.session() as session:
        labels = set(session.scalars(select(EmailLabel.label)))
    assert labels == {"invoice"}
    before = rows(res)
    assert job.classify_email(res, email_id).kind is Kind.CLOSED
    assert job.process_email(res, email_id).kind is Kind.CLOSED
    assert rows(res) == before  # a delivery of a closed run changes no row


def test_a_run_left_waiting_keeps_its_sweeps_for_the_next_stage(res) -> None:  # type: ignore[no-untyped-def]
    """A run the sweeper re-added (its job had been lost), whose CPU stage then ran with model
    calls off, waits with a fresh attempt budget but its sweep count kept: at most
    MAILPIPE_MAX_SWEEPS re-adds over both stages."""
    [email_id] = store_emails(res, [INVOICE])
    result = sweeper.sweep(
        res,
        enqueue=lambda ids, task, lane, boxes: enqueue_emails(ids, res, task, lane, boxes).sent,
        in_flight_grace=0.0,
    )
    assert result.readded_ids == [email_id]
    assert run_of(res, email_id).sweep_count == 1
    assert job.process_email(res, email_id).kind is Kind.WAITING
    run = run_of(res, email_id)
    assert (run.status.value, run.attempts, run.sweep_count) == ("open", 0, 1)


def test_transient_errors_retry_with_backoff_then_fail_after_max_attempts(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    unreachable = refused_reads(res, 4)
    for attempt in (1, 2, 3):
        outcome = job.process_email(unreachable, email_id)
        assert outcome.kind is Kind.RETRY
        assert "S3 unavailable" in (outcome.error or "")
        ceiling = min(
            res.settings.retry_backoff_max, res.settings.retry_backoff_base * 2 ** (attempt - 1)
        )
        assert ceiling / 2 <= outcome.delay <= ceiling
        assert run_of(res, email_id).attempts == attempt
        # A retry keeps the marker (stamped anew): the follow-up message is the job's.
        assert res.redis.exists(redis_keys.job_marker(email_id))
    outcome = job.process_email(unreachable, email_id)
    assert outcome.kind is Kind.FAILED
    run = run_of(res, email_id)
    assert run.status.value == "failed" and run.attempts == 4
    assert run.error.startswith("gave up after 4 attempts: TransientError: S3 unavailable")


def test_a_run_at_a_lowered_attempt_limit_fails_without_another_attempt(res) -> None:  # type: ignore[no-untyped-def]
    """Retries were left under the old limit and none are under the one deployed since: the next
    delivery fails the run at once, without a third attempt."""
    [email_id] = store_emails(res, [INVOICE])
    unreachable = refused_reads(res, 2)
    for _ in (1, 2):
        assert job.process_email(unreachable, email_id).kind is Kind.RETRY
    lowered = Resources(res.settings.model_copy(update={"max_retries": 1}))  # 2 attempts in all
    outcome = job.process_email(lowered, email_id)
    assert outcome.kind is Kind.FAILED
    run = run_of(res, email_id)
    assert (run.status.value, run.attempts) == ("failed", 2)
    assert run.error.startswith("gave up after 2 attempts: TransientError: S3 unavailable")


def test_an_attempt_that_died_is_named_and_counted(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    set_model_calls(res, True)
    for _ in range(4):
        start_attempt(res, email_id)
    # The fifth delivery finds the fourth attempt unfinished: every attempt is used.
    outcome = job.process_email(res, email_id)
    assert outcome.kind is Kind.FAILED
    run = run_of(res, email_id)
    assert run.attempts == 4
    assert "gave up after 4 attempts" in run.error and "worker process died" in run.error


def test_the_next_attempt_runs_with_the_death_of_the_last_on_record(res, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """While the next attempt runs, the run says why there is one: the last one died."""
    [email_id] = store_emails(res, [INVOICE])
    set_model_calls(res, True)
    start_attempt(res, email_id)  # attempt 1 claimed, then its child died
    seen = []
    real_steps = job._run_steps

    def steps(*args):  # type: ignore[no-untyped-def]
        seen.append((run_of(res, email_id).attempts, run_of(res, email_id).error))
        return real_steps(*args)

    monkeypatch.setattr(job, "_run_steps", steps)
    assert job.process_email(res, email_id).kind is Kind.RETRY  # the death waits its backoff
    assert seen == []
    assert job.process_email(res, email_id).kind is Kind.SUCCEEDED
    assert seen == [
        (
            2,
            "attempt 1 ended without a result: its worker process died or was killed, or stopped "
            "renewing its lease",
        )
    ]
    assert run_of(res, email_id).error is None


def test_an_attempt_cut_off_by_the_hard_time_limit_waits_its_backoff_then_the_last_fails(
    res,
) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    set_model_calls(res, True)
    for attempt in (1, 2, 3):
        assert start_attempt(res, email_id) == attempt
        outcome = job.process_email(res, email_id, cut_off=25)
        assert outcome.kind is Kind.RETRY  # recorded, not run: back after the backoff
        assert outcome.error == f"attempt {attempt} was cut off by the hard time limit (25 s)"
        run = run_of(res, email_id)
        assert (run.attempts, run.attempt_started_at, run.status.value) == (attempt, None, "open")
    start_attempt(res, email_id)
    outcome = job.process_email(res, email_id, cut_off=25)
    assert outcome.kind is Kind.FAILED
    run = run_of(res, email_id)
    assert run.status.value == "failed" and run.attempts == 4
    assert (
        run.error == "gave up after 4 attempts: attempt 4 was cut off by the hard time limit (25 s)"
    )


class RaisingBlobs:
    """A blob store whose reads raise what `errors` hands out, one per read, then read for real."""

    def __init__(self, real, errors: list[BaseException]) -> None:  # type: ignore[no-untyped-def]
        self.real = real
        self.errors = errors

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        if self.errors:
            raise self.errors.pop(0)
        return self.real.get(key, max_bytes=max_bytes)


@pytest.mark.parametrize(
    ("error", "recorded"),
    [
        ("soft", "soft time limit (20 s) exceeded"),
        ("bug", "unexpected KeyError"),
    ],
)
def test_the_soft_time_limit_and_a_bug_are_failed_attempts_that_are_retried(  # type: ignore[no-untyped-def]
    res, error: str, recorded: str
) -> None:
    from billiard.exceptions import SoftTimeLimitExceeded

    def raised() -> BaseException:
        return SoftTimeLimitExceeded() if error == "soft" else KeyError("a bug")

    [email_id] = store_emails(res, [INVOICE])
    flaky = Resources(res.settings).with_standins(
        blobs=RaisingBlobs(res.blobs, [raised(), raised()])
    )
    for attempt in (1, 2):
        outcome = job.process_email(flaky, email_id)
        assert outcome.kind is Kind.RETRY
        run = run_of(res, email_id)
        assert (run.status.value, run.attempts, run.error) == ("open", attempt, recorded)
    assert job.process_email(flaky, email_id).kind is Kind.WAITING
    assert (run_of(res, email_id).status.value, run_of(res, email_id).claims) == ("open", 3)

    [doomed] = store_emails(res, [PLAIN])
    always = Resources(res.settings).with_standins(
        blobs=RaisingBlobs(res.blobs, [raised() for _ in range(4)])
    )
    kinds = [job.process_email(always, doomed).kind for _ in range(4)]
    assert kinds == [Kind.RETRY, Kind.RETRY, Kind.RETRY, Kind.FAILED]
    run = run_of(res, doomed)
    assert (run.status.value, run.attempts) == ("failed", 4)
    assert run.error == f"gave up after 4 attempts: {recorded}"


def test_a_stale_delivery_cannot_pass_for_a_later_claim(res) -> None:  # type: ignore[no-untyped-def]
    """A claims and stalls; B claims, converts and the stage's attempts go back to 0; the model
    stage's C claims. A's late write must be fenced off, and C's accepted: the fence is the
    claim, which only grows, not the attempts, which a new stage resets."""
    [email_id] = store_emails(res, [INVOICE])
    with res.db.transaction() as session:
        a = runs.claim(session, email_id, policy.Limits(4, 10))
    with res.db.transaction() as session:
        died = runs.claim(
            session, email_id, policy.Limits(4, 10)
        )  # finds A unfinished: A's process died
    assert isinstance(died, runs.Refused) and died.reason is runs.Refusal.UNFINISHED
    with res.db.transaction() as session:
        b = runs.claim(session, email_id, policy.Limits(4, 10))  # the retry, after its backoff
    with res.db.transaction() as session:
        runs.mark_converted(session, b, model_calls=True)
    with res.db.transaction() as session:
        c = runs.claim(session, email_id, policy.Limits(4, 10), stage=Stage.MODEL)
    assert (a.attempt, b.attempt, c.attempt) == (1, 2, 1)
    assert (a.token, b.token, c.token) == (1, 2, 3)
    with pytest.raises(runs.Superseded), res.db.transaction() as session:
        runs.mark_converted(session, a, model_calls=True)
    with res.db.transaction() as session:
        runs.close(session, c, RunStatus.SUCCEEDED)
    assert run_of(res, email_id).status is RunStatus.SUCCEEDED


def test_a_shutdown_cut_off_gives_its_attempt_back_until_the_bound(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    marked_before = time.time() - 1
    start_attempt(res, email_id)
    # A mark from before the attempt started (a job that had ended inside an earlier window)
    # counts for nothing: this attempt died, and it counts.
    with res.db.transaction() as session:
        died = runs.claim(
            session, email_id, policy.Limits(4, 10), shutdown_cut_off_at=lambda: marked_before
        )
    assert isinstance(died, runs.Refused) and died.reason is runs.Refusal.UNFINISHED
    run = run_of(res, email_id)
    assert (run.attempts, run.cutoffs) == (1, 0)
    assert run.error.startswith("attempt 1 ended without a result")
    start_attempt(res, email_id)
    assert run_of(res, email_id).attempts == 2
    for cut in (1, 2):
        with res.db.transaction() as session:
            claim = runs.claim(
                session, email_id, policy.Limits(4, 3), shutdown_cut_off_at=lambda: time.time()
            )
        run = run_of(res, email_id)
        assert (type(claim), run.attempts, run.cutoffs) == (runs.Claim, 2, cut)
        assert run.error.startswith(f"cut off by shutdown ({cut} of at most 3)")
    with res.db.transaction() as session:
        claim = runs.claim(
            session, email_id, policy.Limits(4, 3), shutdown_cut_off_at=lambda: time.time()
        )
    run = run_of(res, email_id)
    assert (type(claim), run.status, run.cutoffs) == (runs.Failed, RunStatus.FAILED, 3)
    assert run.error.startswith("cut off by shutdown 3 times")


def test_permanent_errors_fail_at_once(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [b"Subject: x\r\n\r\n" + b"a" * 2048])
    small = Resources(res.settings.model_copy(update={"max_email_bytes": 1024}))
    outcome = job.process_email(small, email_id)
    assert outcome.kind is Kind.FAILED
    run = run_of(res, email_id)
    assert run.attempts == 1 and "over the limit of 1024" in run.error
    assert not res.redis.exists(redis_keys.job_marker(email_id))


def test_an_unknown_email_fails_with_its_id(res) -> None:  # type: ignore[no-untyped-def]
    outcome = job.process_email(res, 999_999)
    assert (outcome.kind, outcome.error) == (Kind.FAILED, "no email_message row with id 999999")


def test_a_held_lease_defers_without_an_attempt_and_deferrals_are_bounded(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    res.redis.set(redis_keys.lease(email_id), "elsewhere:1:holder", px=60_000)
    outcome = job.process_email(res, email_id)
    assert outcome.kind is Kind.DEFER and "being processed by elsewhere:1:holder" in outcome.error
    # Never a countdown past the longest backoff (so never past the visibility timeout).
    assert 0.5 <= outcome.delay <= res.settings.retry_backoff_max
    assert outcome.deferred_since is not None
    assert res.redis.zscore(redis_keys.deferred(res.settings.queue), email_id) is not None
    with res.db.session() as session:
        assert session.scalar(select(PipelineRun.attempts)) is None  # no run, no attempt

    # A job deferred for longer than MAILPIPE_MAX_DEFERRAL in all fails with the reason.
    [other] = store_emails(res, [INVOICE.replace(b"j12@", b"j13@")])
    start_attempt(res, other)  # its run exists and is open
    res.redis.set(redis_keys.lease(other), "elsewhere:1:holder", px=60_000)
    since = time.time() - res.settings.max_deferral
    outcome = job.process_email(res, other, deferred_since=since)
    assert outcome.kind is Kind.FAILED and "past MAILPIPE_MAX_DEFERRAL" in outcome.error
    run = run_of(res, other)
    assert run.status.value == "failed" and "past MAILPIPE_MAX_DEFERRAL" in run.error


class BlockingBlobs:
    """The real blob store, except that the first `get` waits until the test lets it go."""

    def __init__(self, real) -> None:  # type: ignore[no-untyped-def]
        self.real = real
        self.reached = threading.Event()
        self.go = threading.Event()

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        self.reached.set()
        assert self.go.wait(30)
        return self.real.get(key, max_bytes)

    def put(self, key: str, data: bytes) -> None:
        self.real.put(key, data)


def stalling(res: Resources) -> tuple[Resources, BlockingBlobs]:
    """Resources whose first blob read waits until the test lets it go, and their blob store."""
    blobs = BlockingBlobs(res.blobs)
    return Resources(res.settings).with_standins(blobs=blobs), blobs


def test_a_delivery_that_lost_its_lease_writes_nothing_and_leaves_the_holder_s_marker(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    set_model_calls(res, True)
    stalled, blobs = stalling(res)
    first: list[job.Verdict] = []
    thread = threading.Thread(target=lambda: first.append(job.process_email(stalled, email_id)))
    thread.start()
    assert blobs.reached.wait(30)
    # The first delivery stalls past its lease (its renewals stopped); a second takes over and
    # finishes the job.
    res.redis.delete(redis_keys.lease(email_id))
    second = after_backoff(res, email_id)
    assert second.kind is Kind.SUCCEEDED
    assert run_of(res, email_id).attempts == 2
    done = rows(res)
    res.redis.set(redis_keys.job_marker(email_id), "123.000")  # a later enqueue's marker
    blobs.go.set()
    thread.join(30)
    assert first[0].kind is Kind.CLOSED  # fenced: attempt 2 holds the run
    assert rows(res) == done
    assert res.redis.get(redis_keys.job_marker(email_id)) == b"123.000"


class RemoteRules:
    """The rules classifier posing as a paid remote one, counting its calls."""

    remote = True

    def __init__(self, real) -> None:  # type: ignore[no-untyped-def]
        self.real = real
        self.model_id = real.model_id
        self.calls = 0

    def classify(self, email: EmailForClassifier) -> ClassificationResult:
        self.calls += 1
        return self.real.classify(email)


def remote_model(res: Resources) -> Resources:
    """Resources whose classifier poses as a remote model (`RemoteRules`, counting its calls):
    their CPU stage hands each email to a model stage."""
    return Resources(res.settings).with_standins(classifier=RemoteRules(res.classifier))


def test_a_remote_model_is_called_from_its_own_stage_with_what_the_cpu_stage_kept(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    set_model_calls(res, True)
    remote = remote_model(res)
    classifier = remote.classifier
    handed = job.process_email(remote, email_id)
    assert handed.kind is Kind.HANDED_OFF and handed.follows_up
    assert classifier.calls == 0  # the CPU stage never waits on a remote model
    # The hand-off's message will be sent: the email's marker stays for it.
    assert res.redis.exists(redis_keys.job_marker(email_id))
    with res.db.session() as session:
        kept = session.get_one(ModelInput, email_id).input
        run = session.scalars(select(PipelineRun)).one()
    assert "Amount due: 12 EUR" in kept["body_text"] and kept["documents"][0][2] == "pay soon"
    assert (run.status.value, run.attempts) == ("open", 0) and run.converted_at is not None
    # A model stage sent before its CPU stage ran does nothing.
    [other] = store_emails(res, [INVOICE.replace(b"j12@", b"j14@")])
    early = job.classify_email(remote, other)
    assert (early.kind, early.error) == (
        Kind.CLOSED,
        "not converted yet: the CPU stage comes first",
    )

    assert job.classify_email(remote, email_id).kind is Kind.SUCCEEDED
    assert classifier.calls == 1
    with res.db.session() as session:
        assert set(session.scalars(select(EmailLabel.label))) == {"invoice"}


def test_the_model_s_answer_is_kept_before_the_labels_and_never_asked_for_twice(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    set_model_calls(res, True)
    remote = remote_model(res)
    classifier = remote.classifier
    assert job.process_email(remote, email_id).kind is Kind.HANDED_OFF

    # The labels' transaction fails after the answer was stored (the child dies there).
    real_sync = job.sync_model_labels

    def crash(*args: object) -> None:
        raise SystemExit("killed")

    job.sync_model_labels = crash  # type: ignore[assignment]
    try:
        try:
            job.classify_email(remote, email_id)
        except SystemExit:
            pass
    finally:
        job.sync_model_labels = real_sync  # type: ignore[assignment]
    run = run_of(res, email_id)
    assert run.status.value == "open" and run.classified_at is not None
    with res.db.session() as session:
        [stored] = session.scalars(select(Classification)).all()
    assert stored.labels == [["invoice", 0.8]] and classifier.calls == 1

    assert job.classify_email(remote, email_id).kind is Kind.RETRY  # the death's backoff
    outcome = job.classify_email(remote, email_id)
    assert outcome.kind is Kind.SUCCEEDED
    assert classifier.calls == 1  # the labels came from the stored answer
    with res.db.session() as session:
        labels = session.execute(select(EmailLabel.label, EmailLabel.confidence)).all()
    assert [tuple(label) for label in labels] == [("invoice", 0.8)]


@pytest.mark.parametrize(
    ("raw", "written"),
    [(INVOICE, Document), (PLAIN, Classification)],
    ids=["with-attachments", "without"],
)
def test_a_superseded_delivery_writes_nothing_while_the_new_holder_still_runs(  # type: ignore[no-untyped-def]
    res, raw, written
) -> None:
    """The fence is the claim, not only the run's status: the first delivery wakes while the
    second, which made claim 2, is still inside its steps and the run still open. With
    attachments the origin's transaction finds the run at another attempt; without, the one
    transaction of the steps does."""
    [email_id] = store_emails(res, [raw])
    set_model_calls(res, True)
    (first_res, first_blobs), (second_res, second_blobs) = stalling(res), stalling(res)
    outcomes: dict[str, job.Verdict] = {}
    first = threading.Thread(
        target=lambda: outcomes.update(first=job.process_email(first_res, email_id))
    )
    first.start()
    assert first_blobs.reached.wait(30)
    res.redis.delete(redis_keys.lease(email_id))  # the first delivery's lease lapsed
    second = threading.Thread(
        target=lambda: outcomes.update(second=after_backoff(second_res, email_id))
    )
    second.start()
    assert second_blobs.reached.wait(30)
    assert run_of(res, email_id).attempts == 2
    first_blobs.go.set()
    first.join(30)
    assert outcomes["first"].kind is Kind.CLOSED
    assert outcomes["first"].error == f"email {email_id}: claim 2 holds the run, not 1"
    with res.db.session() as session:
        assert session.scalars(select(written)).all() == []  # nothing of the first's
        assert session.scalars(select(EmailLabel)).all() == []
    # Its attempt's only row is the one the second claim wrote on finding it unfinished.
    assert history(res, email_id) == [("cpu", 1, "lost", "Lost")]
    second_blobs.go.set()
    second.join(30)
    assert outcomes["second"].kind is Kind.SUCCEEDED
    assert history(res, email_id) == [("cpu", 1, "lost", "Lost"), ("cpu", 2, "succeeded", None)]


def test_a_death_after_a_transient_error_is_recorded_as_the_death(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [INVOICE])
    unreachable = refused_reads(res, 2)
    assert job.process_email(unreachable, email_id).kind is Kind.RETRY  # attempt 1: S3 down
    start_attempt(res, email_id)  # attempt 2 claimed, then its child died
    # Attempt 3 finds attempt 2 unfinished, and waits its backoff first.
    assert job.process_email(unreachable, email_id).kind is Kind.RETRY
    assert job.process_email(unreachable, email_id).kind is Kind.RETRY
    run = run_of(res, email_id)
    assert run.attempts == 3
    # Its error is its own again (S3), but the death came first and was recorded as such.
    assert "S3 unavailable" in run.error
    start_attempt(res, email_id)  # attempt 4 claimed, and died too
    outcome = job.process_email(res, email_id)
    assert outcome.kind is Kind.FAILED
    assert run_of(res, email_id).error == (
        "gave up after 4 attempts: attempt 4 ended without a result: its worker process died or "
        "was killed, or stopped renewing its lease"
    )


def test_a_delivery_whose_run_was_failed_meanwhile_writes_nothing(res) -> None:  # type: ignore[no-untyped-def]
    """The fence is also the run's status: here a deferred copy of the same job, past its bound,
    fails the run while the first delivery is inside its steps at the same attempt."""
    [email_id] = store_emails(res, [INVOICE])
    set_model_calls(res, True)
    stalled, blobs = stalling(res)
    outcomes: list[job.Verdict] = []
    thread = threading.Thread(target=lambda: outcomes.append(job.process_email(stalled, email_id)))
    thread.start()
    assert blobs.reached.wait(30)
    # A second delivery finds the lease held, and has been deferred past the bound.
    since = time.time() - res.settings.max_deferral
    assert job.process_email(res, email_id, deferred_since=since).kind is Kind.FAILED
    before = rows(res)
    blobs.go.set()
    thread.join(30)
    assert outcomes[0].kind is Kind.CLOSED
    assert outcomes[0].error == f"email {email_id}: the run is failed already"
    assert rows(res) == before


def test_a_malformed_header_line_is_skipped_and_recorded_on_the_run(res) -> None:  # type: ignore[no-untyped-def]
    raw = (
        b"Received: from x by y\r\nThis line has no colon\r\nFrom: Ann <ann@example.org>\r\n"
        b"Subject: kept\r\nMessage-ID: <garbled@example.org>\r\n\r\nbody\r\n"
    )
    [email_id] = store_emails(res, [raw])
    set_model_calls(res, True)
    assert job.process_email(res, email_id).kind is Kind.SUCCEEDED
    run = run_of(res, email_id)
    assert run.parse_defects is not None
    assert run.parse_defects["skipped_header_lines"] == ["This line has no colon"]
    assert run.parse_defects["count"] >= 1
    with res.db.session() as session:
        assert session.get_one(EmailMessage, email_id).subject == "kept"


def test_a_reopened_run_asks_the_model_again(res) -> None:  # type: ignore[no-untyped-def]
    """An operator's retry of a failed run that holds an answer: the answer no longer counts."""
    [email_id] = store_emails(res, [INVOICE])
    set_model_calls(res, True)
    remote = remote_model(res)
    classifier = remote.classifier
    assert job.process_email(remote, email_id).kind is Kind.HANDED_OFF
    assert job.classify_email(remote, email_id).kind is Kind.SUCCEEDED
    assert classifier.calls == 1
    with res.db.transaction() as session:  # failed after its answer, as an operator finds it
        session.execute(
            update(PipelineRun)
            .where(PipelineRun.email_id == email_id)
            .values(status=RunStatus.FAILED, error="labels refused")
        )
    with res.db.transaction() as session:
        assert interventions.reopen(session, email_id)
    run = run_of(res, email_id)
    assert (run.status.value, run.classified_at, run.converted_at) == ("open", None, None)
    assert job.process_email(remote, email_id).kind is Kind.HANDED_OFF
    assert job.classify_email(remote, email_id).kind is Kind.SUCCEEDED
    assert classifier.calls == 2


def test_a_claim_that_meets_the_forgets_deletion_ends_as_forgotten(res) -> None:  # type: ignore[no-untyped-def]
    """The forget's deletion holds the run's row while a delivery claims: the claim waits, finds
    the run gone and the email with it when the deletion commits, and its insert of a new run
    fails on the foreign key. The fence is up by then, so the delivery ends as forgotten, not as
    a task error."""
    [email_id] = store_emails(res, [INVOICE])
    with res.db.transaction() as session:
        runs.ensure_runs(session, [email_id])
    forgotten.fence(res.redis, [email_id], 60)
    outcomes: list[Verdict | Exception] = []
    claiming = threading.Thread(
        target=lambda: outcomes.append(_outcome_of(res, email_id)), daemon=True
    )
    with res.db.engine.connect() as deleting:
        deleting.begin()
        try:
            deleting.execute(delete(PipelineRun).where(PipelineRun.email_id == email_id))
            deleting.execute(delete(EmailMessage).where(EmailMessage.id == email_id))
            deleter = deleting.execute(text("SELECT pg_backend_pid()")).scalar_one()
            claiming.start()
            wait_for(
                lambda: _blocked_by(res, deleter), 10, "the claim to wait on the deletion's lock"
            )
            assert claiming.is_alive()
            deleting.commit()
        finally:
            deleting.rollback()  # when the test failed before the commit
    claiming.join(30)
    assert not claiming.is_alive()
    [outcome] = outcomes
    assert isinstance(outcome, Verdict), outcome
    assert outcome.kind is Kind.CLOSED and outcome.error == "the email is being forgotten"


def _outcome_of(res: Resources, email_id: int) -> Verdict | Exception:
    try:
        return job.process_email(res, email_id)
    except Exception as exc:
        return exc


def _blocked_by(res: Resources, pid: int) -> bool:
    """Whether a backend waits on a lock that backend `pid` holds."""
    with res.db.session() as session:
        return bool(
            session.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"
                ),
                {"pid": pid},
            ).scalar()
        )
