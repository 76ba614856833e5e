"""Outages and bad objects on real workers: the dependency's health decides what fails.

S3 is moto's server behind a fault proxy on loopback (tests/support/flaky_proxy.py), the model
the Bedrock stand-in, the database a PostgreSQL server of the test's own that the test stops.
Each outage lasts longer than the whole retry horizon (the four attempts' backoffs), so a job
that counted it against its email would fail; none may. A refused object fails its own email
alone, after its attempts, with an error class of its own, and the stage never pauses.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from mailpipe.cli.ingest import store_emails
from mailpipe.resources import Resources
from mailpipe.storage.models import (
    Classification,
    EmailLabel,
    EmailMessage,
    PipelineRun,
    utcnow,
)
from tests.support.bedrock_server import (
    TimedBedrockServer,
    error,
    keyword_labels,
    labels,
    unlimited_bedrock_env,
)
from tests.support.database import on_server
from tests.support.document_samples import DOCX, docx_bytes
from tests.support.emails import raw_email
from tests.support.flaky_proxy import FlakyProxy
from tests.support.fleet import Fleet
from tests.support.services import PrivatePostgres
from tests.support.waits import holds_for, wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

EMAILS = 120
REPROCESSED = 30
PROBE_INTERVAL_S = 1.0
# The retry horizon with the suite's backoff (MAILPIPE_RETRY_BACKOFF_BASE 0.5, _MAX 4): the
# three retries wait at most 0.5 + 1 + 2 s. Each outage outlasts it several times over.
RETRY_HORIZON_S = 3.5
OUTAGE_S = 3 * RETRY_HORIZON_S
FAST = {"MAILPIPE_PAUSE_PROBE_INTERVAL": str(PROBE_INTERVAL_S)}


def emails(n: int, tag: str) -> list[bytes]:
    return [
        raw_email(
            f"Invoice {i}",
            sender=f"billing{i}@acme.example",
            message_id=f"{tag}-{i}@acme.example",
            body=f"Invoice {i}: amount due {i} EUR",
        )
        for i in range(n)
    ]


def with_document(n: int, tag: str) -> list[bytes]:
    doc = docx_bytes([f"Payment terms: thirty days. {tag}"])
    return [
        raw_email(
            f"Invoice {i}",
            sender=f"billing{i}@acme.example",
            message_id=f"{tag}-{i}@acme.example",
            body=f"Invoice {i}",
            attachments=[("terms.docx", DOCX, doc)],
        )
        for i in range(n)
    ]


def runs(res: Resources, ids: list[int]) -> list[PipelineRun]:
    with res.db.session() as session:
        return list(session.scalars(select(PipelineRun).where(PipelineRun.email_id.in_(ids))))


def pause_of(f: Fleet, stage: str) -> dict[str, str]:
    """The stage's pause in the fleet's key space, read from Redis (the status CLI needs the
    database, which one test stops)."""
    fields = f.res.redis.hgetall(f"{f.prefix}mailpipe:pause:{stage}")
    return {k.decode(): v.decode() for k, v in fields.items()}


def ever_paused(f: Fleet, stage: str) -> bool:
    """Whether the stage paused at all: a pause leaves its outage's start behind it."""
    return bool(f.res.redis.exists(f"{f.prefix}mailpipe:outage:{stage}"))


@pytest.fixture
def proxy(res) -> Iterator[FlakyProxy]:  # type: ignore[no-untyped-def]
    proxy = FlakyProxy(res.settings.s3_endpoint_url).start()
    yield proxy
    proxy.stop()


def test_denied_objects_fail_their_own_emails_and_the_stage_never_pauses(res, fleet, proxy) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, emails(EMAILS, "denied"))
    with res.db.session() as session:
        keys = dict(
            session.execute(
                select(EmailMessage.id, EmailMessage.blob_key).where(EmailMessage.id.in_(ids))
            ).all()
        )
    denied = ids[:3]
    proxy.deny_keys({keys[i] for i in denied})
    f = fleet(MAILPIPE_S3_ENDPOINT_URL=proxy.url, **FAST)
    f.worker("cpu")
    f.enqueue(ids)

    statuses = wait_until_closed(res, ids, timeout=120)
    assert {statuses[i] for i in denied} == {"failed"}
    assert {statuses[i] for i in ids[3:]} == {"succeeded"}
    by_id = {run.email_id: run for run in runs(res, ids)}
    assert {(by_id[i].error_class, by_id[i].attempts) for i in denied} == {
        ("BlobAccessDenied", res.settings.max_attempts)
    }
    assert {by_id[i].attempts for i in ids[3:]} == {1}
    assert not ever_paused(f, "cpu")
    # Each refusal asked the store's check, which passed: the refusals were the objects'.
    assert proxy.requests_to("/health-check/") > 0


def test_an_s3_outage_fails_no_run_and_uses_no_attempt(res, fleet, proxy) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, emails(EMAILS, "s3-outage"))
    f = fleet(MAILPIPE_S3_ENDPOINT_URL=proxy.url, **FAST)
    proxy.fail_for(OUTAGE_S)
    f.worker("cpu")
    f.enqueue(ids)
    wait_for(lambda: pause_of(f, "cpu"), 60, "the cpu stage to pause")
    assert pause_of(f, "cpu")["dependency"] == "blobs"

    statuses = wait_until_closed(res, ids, timeout=120)
    assert set(statuses.values()) == {"succeeded"}
    assert {run.attempts for run in runs(res, ids)} == {1}
    assert proxy.failed_requests > 0
    assert pause_of(f, "cpu") == {}


def test_a_model_outage_fails_no_run_and_uses_no_attempt(res, fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = TimedBedrockServer(
        default=error("ServiceUnavailableException", 503, "The service is unavailable.")
    )
    server.start()
    try:
        f = fleet(**unlimited_bedrock_env(server, tmp_path), **FAST)
        f.both_stages()
        ids = store_emails(res, emails(EMAILS, "model-outage"))
        f.enqueue(ids)
        wait_for(lambda: pause_of(f, "model"), 60, "the model stage to pause")
        assert pause_of(f, "model")["dependency"] == "model"
        # Paused past the retry horizon: a job that counted the outage would have failed.
        holds_for(lambda: bool(pause_of(f, "model")), OUTAGE_S, "the model stage paused")
        assert {run.status.value for run in runs(res, ids)} == {"open"}

        server.default = keyword_labels
        statuses = wait_until_closed(res, ids, timeout=120)
    finally:
        server.stop()
    assert set(statuses.values()) == {"succeeded"}
    assert {run.attempts for run in runs(res, ids)} == {1}
    assert server.statuses().count(503) >= 3
    assert pause_of(f, "model") == {}


def test_a_reprocess_during_a_model_outage_fails_nothing(res, fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Succeeded emails reprocessed from classify while the model is down: the model stage
    pauses and their jobs wait, no run fails or spends an attempt on the outage, and once the
    model is back each succeeds with the answer it gives now."""
    server = TimedBedrockServer(default=keyword_labels)
    server.start()
    try:
        f = fleet(**unlimited_bedrock_env(server, tmp_path), **FAST)
        queue = f.env.get("MAILPIPE_QUEUE", res.settings.queue)
        f.worker("cpu", "-Q", f"{queue},{queue}.control")
        # Both lanes, as the model role consumes them: a reprocess is sent in the bulk one.
        f.worker("model", "-P", "threads", "-c", "8", "-Q", f"{queue}.model,{queue}.model.bulk")
        ids = store_emails(res, emails(REPROCESSED, "reprocess-outage"))
        # What the reprocess's filter leaves out: one that took every email would be refused.
        [lunch] = store_emails(res, [raw_email("lunch", sender="carol@corp.example", body="Noon?")])
        f.enqueue([*ids, lunch])
        assert set(wait_until_closed(res, [*ids, lunch]).values()) == {"succeeded"}
        assert labels_of(res, ids) == {frozenset({"invoice"})}

        server.default = error("ServiceUnavailableException", 503, "The service is unavailable.")
        asked_at = utcnow()
        reprocessed = f.cli("reprocess", "--label", "invoice", "--from", "classify", "--yes")
        assert f"reopened {REPROCESSED}, enqueued {REPROCESSED}" in reprocessed
        wait_for(lambda: pause_of(f, "model"), 60, "the model stage to pause")
        assert pause_of(f, "model")["dependency"] == "model"

        def paused_and_waiting() -> bool:
            return bool(pause_of(f, "model")) and {r.status.value for r in runs(res, ids)} == {
                "open"
            }

        # Past the retry horizon: a job that counted the outage would have failed its run.
        holds_for(paused_and_waiting, OUTAGE_S, "the model stage paused, every run open")

        server.default = labels({"invoice": 0.9, "support": 0.8})
        statuses = wait_until_closed(res, ids, timeout=120)
    finally:
        server.stop()
    assert set(statuses.values()) == {"succeeded"}
    assert {run.attempts for run in runs(res, ids)} == {1}
    assert labels_of(res, ids) == {frozenset({"invoice", "support"})}
    with res.db.session() as session:
        answered = session.scalars(
            select(Classification.created_at).where(Classification.email_id.in_(ids))
        ).all()
    assert len(answered) == REPROCESSED and min(answered) > asked_at
    assert server.statuses().count(503) >= 3
    assert pause_of(f, "model") == {}


def labels_of(res: Resources, ids: list[int]) -> set[frozenset[str]]:
    """The label sets the emails have, each set once."""
    found: dict[int, set[str]] = {email_id: set() for email_id in ids}
    with res.db.session() as session:
        for email_id, label in session.execute(
            select(EmailLabel.email_id, EmailLabel.label).where(EmailLabel.email_id.in_(ids))
        ):
            found[email_id].add(label)
    return {frozenset(names) for names in found.values()}


def test_a_database_outage_fails_no_run_and_uses_no_attempt(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pg = PrivatePostgres()
    f = None
    try:
        pg.start()
        private = on_server(res, pg.url)
        ids = store_emails(private, emails(EMAILS, "db-outage"))
        f = Fleet(private, tmp_path, MAILPIPE_DATABASE_URL=pg.url, **FAST)
        f.worker("cpu")
        f.enqueue(ids)
        wait_for(
            lambda: len([r for r in runs(private, ids) if r.status.value == "succeeded"]) >= 5,
            60,
            "a few emails done",
        )
        private.close()
        pg.stop()  # under load: every connection is cut
        wait_for(lambda: pause_of(f, "cpu"), 60, "the cpu stage to pause")
        assert pause_of(f, "cpu")["dependency"] == "database"
        holds_for(lambda: bool(pause_of(f, "cpu")), OUTAGE_S, "the cpu stage paused")
        pg.start()
        private = Resources(private.settings)
        statuses = wait_until_closed(private, ids, timeout=120)
        assert set(statuses.values()) == {"succeeded"}
        assert {run.attempts for run in runs(private, ids)} == {1}
        private.close()
    finally:
        if f is not None:
            f.stop()
        pg.destroy()


def test_a_denied_write_keeps_the_stage_paused_until_it_is_allowed(res, fleet, proxy) -> None:  # type: ignore[no-untyped-def]
    """PutObject refused for document texts alone: the probe's check writes there too, so the
    pause holds without flapping, where a probe that only read would end it every interval."""
    ids = store_emails(res, with_document(10, "denied-write"))
    proxy.deny_writes("text/")
    f = fleet(MAILPIPE_S3_ENDPOINT_URL=proxy.url, MAILPIPE_DOC_INLINE_TEXT_BYTES="0", **FAST)
    f.worker("cpu")
    f.enqueue(ids)
    wait_for(lambda: pause_of(f, "cpu"), 60, "the cpu stage to pause")
    token = pause_of(f, "cpu")["token"]
    # Several probe intervals: every probe's check is refused, and the pause is the same one.
    holds_for(
        lambda: pause_of(f, "cpu").get("token") == token,
        5 * PROBE_INTERVAL_S,
        "one pause, never ended",
    )
    assert proxy.requests_to("/health-check/") >= 3
    assert {run.status.value for run in runs(res, ids)} == {"open"}

    proxy.deny_writes(None)
    statuses = wait_until_closed(res, ids, timeout=120)
    assert set(statuses.values()) == {"succeeded"}
    assert {run.attempts for run in runs(res, ids)} == {1}


def test_a_job_that_kills_its_child_waits_its_backoff_each_time(res, fleet) -> None:  # type: ignore[no-untyped-def]
    base = 2.0
    f = fleet(MAILPIPE_RETRY_BACKOFF_BASE=str(base), MAILPIPE_RETRY_BACKOFF_MAX="8")
    f.worker("cpu")
    [email_id] = store_emails(res, emails(1, "crash-backoff"))
    f.set_fault(email_id, "sigkill", times=2)
    f.enqueue([email_id])
    assert wait_until_closed(res, [email_id], timeout=60) == {email_id: "succeeded"}
    starts = f.starts(email_id)
    assert len(starts) == 3
    # Each death is a failed attempt: the next waits at least half its backoff's ceiling
    # (base, then twice the base), counted from when the dead attempt started.
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert gaps[0] >= base / 2, gaps
    assert gaps[1] >= base, gaps
    countdowns = f.countdowns(email_id)
    assert len(countdowns) == 2
    assert base / 2 <= countdowns[0] <= base
    assert base <= countdowns[1] <= 2 * base
    [run] = runs(res, [email_id])
    assert run.attempts == 3
