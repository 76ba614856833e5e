"""The fleet's own checks of its dependencies: whose fault an error is (docs/operations.md,
"What each failure does").

A job that meets a dependency's error asks that dependency's check, never the email's call
alone. When the check fails too, the dependency is down or refuses the whole fleet: no run
fails and no attempt is used. When it passes, the error is the email's own. Each check makes
the calls the stage makes, on things the fleet owns:

- blobs: write, read back and delete a small object under each prefix the pipeline reads or
  writes (raw emails, document texts), with the bucket's own encryption settings;
- model: the classifier's cheapest call, inside the fleet's rate limit, and only while model
  calls are on (with them off nothing is called, and nothing is proved);
- database: one transaction that writes the check's row and runs an INSERT, an UPDATE and a
  DELETE of each table the pipeline writes, matching no row: PostgreSQL checks the privileges
  all the same, so a grant missing on one table fails the check;
- redis: a PING.

A process keeps each verdict for MAILPIPE_HEALTH_CACHE_SECONDS, so that an outage costs one
check per process per interval, not one per job. A healthy fleet runs no check at all: only an
error asks.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass

from redis import RedisError
from sqlalchemy import delete, false, insert, select, update

from mailpipe.broker.queues import Lane
from mailpipe.coordination import redis_keys
from mailpipe.coordination.ratelimit import FleetRateLimiter
from mailpipe.errors import Dependency, MailpipeError, describe
from mailpipe.resources import Resources
from mailpipe.storage.db import upsert
from mailpipe.storage.keys import RAW_PREFIX, TEXT_PREFIX
from mailpipe.storage.models import (
    Classification,
    Document,
    EmailLabel,
    EmailMessage,
    EmailOrigin,
    HealthCheck,
    ModelInput,
    PipelineRun,
    RunAttempt,
    table,
    utcnow,
)

log = logging.getLogger(__name__)

_PROBE_BYTES = b"mailpipe health check\n"
# The tables a job writes, each checked for INSERT and UPDATE; labels are deleted too.
_WRITTEN = (
    EmailMessage,
    EmailOrigin,
    PipelineRun,
    RunAttempt,
    Document,
    ModelInput,
    Classification,
    EmailLabel,
)
_DELETED = (EmailLabel,)


class CheckFailed(MailpipeError):
    """A check that found its dependency wrong without an error of the dependency's own."""


@dataclass(frozen=True)
class Verdict:
    dependency: Dependency
    error: str | None  # None: the check passed

    @property
    def passed(self) -> bool:
        return self.error is None


def check(res: Resources, dependency: Dependency) -> Verdict:
    """Run the dependency's check now, and count it."""
    try:
        _CHECKS[dependency](res)
        verdict = Verdict(dependency, None)
    except Exception as exc:
        log.warning("%s check failed: %s", dependency, describe(exc))
        verdict = Verdict(dependency, describe(exc))
    try:
        res.redis.incr(redis_keys.health_checks_counter(dependency))
    except RedisError as exc:
        log.warning("the %s check was not counted: %s", dependency, describe(exc))
    return verdict


def passes(res: Resources, dependency: Dependency) -> bool:
    """Whether the dependency's check passes, as this process last saw it within the cache's
    age."""
    cache = _cache()
    now = time.monotonic()
    cached = cache.get(dependency)
    if cached is not None and now - cached[0] < res.settings.health_cache_seconds:
        return cached[1].passed
    verdict = check(res, dependency)
    cache[dependency] = (now, verdict)
    return verdict.passed


def forget() -> None:
    """Drop this process's cached verdicts: the next `passes` checks anew."""
    _cache().clear()


def _check_blobs(res: Resources) -> None:
    for prefix in (RAW_PREFIX, TEXT_PREFIX):
        key = f"{prefix}/health-check/{uuid.uuid4().hex}"
        res.blobs.put(key, _PROBE_BYTES)
        try:
            if res.blobs.get(key) != _PROBE_BYTES:
                raise CheckFailed(f"blob store check: {key} read back other bytes")
        finally:
            res.blobs.delete(key)


def _check_model(res: Resources) -> None:
    with res.db.session() as session:
        if not res.model_calls(session):
            raise CheckFailed("model calls are off: the model is not called")
    if not res.classifier.remote:
        res.classifier.check()
        return
    settings = res.settings
    limiter = FleetRateLimiter.for_model_calls(res.redis, settings)
    with limiter.slot(wait=settings.model_slot_wait, lane=Lane.LIVE):
        res.classifier.check()


def _check_database(res: Resources) -> None:
    with res.db.transaction() as session:
        upsert(session, HealthCheck, [{"name": "database", "checked_at": utcnow()}], ["name"])
        for model in _WRITTEN:
            t = table(model)
            key = next(iter(t.primary_key.columns))
            columns = list(t.columns)
            session.execute(
                insert(t).from_select([c.name for c in columns], select(*columns).where(false()))
            )
            session.execute(update(t).where(false()).values({key: key}))
        for model in _DELETED:
            session.execute(delete(table(model)).where(false()))


def _check_redis(res: Resources) -> None:
    res.redis.ping()


_CHECKS = {
    Dependency.BLOBS: _check_blobs,
    Dependency.MODEL: _check_model,
    Dependency.DATABASE: _check_database,
    Dependency.REDIS: _check_redis,
}

_verdicts: dict[Dependency, tuple[float, Verdict]] = {}
_verdicts_pid = os.getpid()


def _cache() -> dict[Dependency, tuple[float, Verdict]]:
    """This process's verdicts: a forked child starts with none of its parent's."""
    global _verdicts, _verdicts_pid
    if _verdicts_pid != os.getpid():
        _verdicts, _verdicts_pid = {}, os.getpid()
    return _verdicts
