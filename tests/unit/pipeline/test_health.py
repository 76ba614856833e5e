"""Whose fault a dependency's error is, decided by the dependency's own check, called directly:
PostgreSQL, Redis and the S3 server, no worker."""

from __future__ import annotations

import time

import pytest

from mailpipe.app.probes import ProbeResult, probe
from mailpipe.broker.queues import Stage
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import pauses
from mailpipe.errors import BlobAccessDenied, BlobUnavailable, Dependency
from mailpipe.operations.status import fleet_status
from mailpipe.pipeline import health, job
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage.models import RunStatus
from tests.support.switches import set_model_calls
from tests.unit.pipeline.test_job import history, run_of

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def emails(n: int) -> list[bytes]:
    return [
        f"From: a@example.com\r\nSubject: s{i}\r\nMessage-ID: <h{i}@x>\r\n\r\nbody {i}\r\n".encode()
        for i in range(n)
    ]


class Refusing:
    """A blob store in front of the real one that refuses what the test says: the keys it
    names (one object refused), every call (an outage), or writes under a prefix."""

    def __init__(self, real) -> None:  # type: ignore[no-untyped-def]
        self.real = real
        self.url = real.url
        self.denied_keys: set[str] = set()
        self.denied_puts: str | None = None  # a key prefix
        self.down = False
        self.calls = 0

    def _refuse(self, key: str, operation: str) -> None:
        self.calls += 1
        if self.down:
            raise BlobUnavailable(f"S3 unavailable for {operation} of {key}: 503")
        if key in self.denied_keys:
            raise BlobAccessDenied(f"S3 refused {operation} of {key}: AccessDenied (403)")

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        self._refuse(key, "GetObject")
        return self.real.get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes) -> None:
        self._refuse(key, "PutObject")
        if self.denied_puts is not None and key.startswith(self.denied_puts):
            raise BlobAccessDenied(f"S3 refused PutObject of {key}: AccessDenied (403)")
        self.real.put(key, data)

    def delete(self, key: str) -> None:
        self._refuse(key, "DeleteObject")
        self.real.delete(key)


def refusing(res: Resources, **settings: object) -> tuple[Resources, Refusing]:
    blobs = Refusing(res.blobs)
    return Resources(res.settings.model_copy(update=settings)).with_standins(blobs=blobs), blobs


def blob_key(res: Resources, email_id: int) -> str:
    from mailpipe.storage.models import EmailMessage

    with res.db.session() as session:
        return session.get_one(EmailMessage, email_id).blob_key


def test_a_refused_object_fails_its_own_email_after_its_attempts(res) -> None:  # type: ignore[no-untyped-def]
    """The check passes: the refusal is the email's, retried with backoff, then failed with its
    own class. The stage never pauses, and the other emails never notice."""
    bad, good = store_emails(res, emails(2))
    set_model_calls(res, True)
    denied, blobs = refusing(res, health_cache_seconds=0)
    blobs.denied_keys.add(blob_key(res, bad))
    outcomes = [job.process_email(denied, bad) for _ in range(res.settings.max_attempts)]
    assert [o.kind for o in outcomes] == [Kind.RETRY] * (res.settings.max_attempts - 1) + [
        Kind.FAILED
    ]
    run = run_of(res, bad)
    assert (run.status, run.error_class) == (RunStatus.FAILED, "BlobAccessDenied")
    assert run.attempts == res.settings.max_attempts
    assert pauses.paused(res.redis) == {}
    assert job.process_email(denied, good).kind is Kind.SUCCEEDED


def test_an_outage_uses_no_attempt_waits_past_any_bound_and_pauses_the_stage(res) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, emails(3))
    set_model_calls(res, True)
    down, blobs = refusing(res, pause_after_emails=3, health_cache_seconds=0)
    blobs.down = True
    # Deferred past MAILPIPE_MAX_DEFERRAL already: an outage's wait has no bound.
    long_ago = time.time() - 2 * res.settings.max_deferral
    outcomes = [job.process_email(down, i, deferred_since=long_ago) for i in ids]
    # Two emails are not yet a pattern: they wait; the third pauses the stage.
    assert [o.kind for o in outcomes] == [Kind.DEFER, Kind.DEFER, Kind.PAUSED]
    assert {o.deferred_since for o in outcomes} == {long_ago}
    assert outcomes[0].outage is Dependency.BLOBS
    assert [run_of(res, i).attempts for i in ids] == [0, 0, 0]
    assert [run_of(res, i).status for i in ids] == [RunStatus.OPEN] * 3
    assert history(res, ids[0]) == [("cpu", 1, "deferred", "BlobUnavailable")]
    paused = fleet_status(res)["paused"]["cpu"]
    assert (paused["by"], paused["dependency"], paused["alarm"]) == ("auto", "blobs", False)

    # The probe is the check, never an email: refused while the outage lasts, then it ends it.
    assert probe(down, Stage.CPU) is ProbeResult.REFUSED
    assert set(pauses.paused(res.redis)) == {Stage.CPU}
    blobs.down = False
    assert probe(down, Stage.CPU) is ProbeResult.PASSED
    assert pauses.paused(res.redis) == {}
    down.pauses.forget()
    assert [job.process_email(down, i).kind for i in ids] == [Kind.SUCCEEDED] * 3
    assert [run_of(res, i).attempts for i in ids] == [1, 1, 1]


def test_a_denied_write_fails_the_check_so_the_pause_holds(res) -> None:  # type: ignore[no-untyped-def]
    """The probe writes as the stage does: a bucket that takes no document texts keeps the
    stage paused, where a read-only probe would end it and let the faults pause it again."""
    denied, blobs = refusing(res)
    blobs.denied_puts = "text/"
    assert not health.check(denied, Dependency.BLOBS).passed
    pauses.record_fault(
        res.redis, Stage.CPU, 1, "BlobAccessDenied", dependency="blobs", threshold=1, window=60
    )
    assert probe(denied, Stage.CPU) is ProbeResult.REFUSED
    blobs.denied_puts = None
    assert probe(denied, Stage.CPU) is ProbeResult.PASSED


def test_a_process_checks_a_dependency_once_per_cache_period(res) -> None:  # type: ignore[no-untyped-def]
    cached, blobs = refusing(res, health_cache_seconds=60)
    health.forget()
    assert health.passes(cached, Dependency.BLOBS)
    calls = blobs.calls
    assert calls == 6  # a write, a read and a delete under each of two prefixes
    blobs.down = True
    assert health.passes(cached, Dependency.BLOBS)  # the cached verdict
    assert blobs.calls == calls
    health.forget()
    assert not health.passes(cached, Dependency.BLOBS)


def test_the_model_check_calls_nothing_while_model_calls_are_off(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, False)
    assert health.check(res, Dependency.MODEL).error == (
        "CheckFailed: model calls are off: the model is not called"
    )
    set_model_calls(res, True)
    assert health.check(res, Dependency.MODEL).passed


def test_the_database_and_redis_checks_pass_on_healthy_services(res) -> None:  # type: ignore[no-untyped-def]
    assert health.check(res, Dependency.DATABASE).passed
    assert health.check(res, Dependency.REDIS).passed
