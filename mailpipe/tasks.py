"""Celery tasks: thin shells around the pipeline.

The pipeline (`mailpipe.pipeline`) never imports Celery; what it means to run as a task — the
lease, retries with backoff, deferral, the dedup marker — lives in `EmailJobTask` below.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from celery import Task
from kombu import Connection

from mailpipe import sweeper
from mailpipe.celery import app
from mailpipe.enqueue import enqueue_emails
from mailpipe.errors import RunFailed, UnknownEmail
from mailpipe.leases import Lease, LeaseHeld
from mailpipe.metrics import make_sink
from mailpipe.pipeline import job
from mailpipe.queues import TaskName
from mailpipe.resources import Resources, get_resources

log = logging.getLogger(__name__)


class EmailJobTask(Task):
    """Base of tasks that run one email's job. It adds:

    - the email's lease, held and renewed while the job runs; a delivery that finds it held by a
      live job re-sends itself for when the lease may be free (not an attempt);
    - retries of transient errors with exponential backoff and full jitter, at most
      `max_retries`; the attempt count in the database also counts tries whose child died;
    - the dedup marker: refreshed while the job runs, deleted when it ends other than by a retry.
    """

    max_retries = 3
    acks_late = True
    reject_on_worker_lost = True

    def run_job(self, email_id: int, step: Callable[[Resources, int], job.Outcome]) -> str:
        res = get_resources()
        settings = res.settings
        lease = Lease(res.redis, email_id, settings.lease_ttl, settings.dedup_ttl)
        try:
            lease.acquire()
        except LeaseHeld as held:
            return self._defer(email_id, held.wait, str(held))
        # The lease goes back before a retry or a deferred copy is sent, so that the copy never
        # finds it held; the marker stays for that copy.
        try:
            outcome = step(res, email_id)
        except job.Deferred as deferred:
            lease.release(job_over=False)
            return self._defer(email_id, deferred.delay, str(deferred))
        except job.RetryLater as retry:
            lease.release(job_over=False)
            raise self._retry(retry, retry.attempt, retry.retry_after) from retry
        except BaseException:
            lease.release(job_over=True)
            raise
        lease.release(job_over=True)
        if outcome is job.Outcome.FAILED:
            raise RunFailed(f"email {email_id}: {job.run_error(res, email_id)}")
        return outcome.value

    def _retry(self, exc: Exception, attempt: int | None, retry_after: float | None) -> Exception:
        settings = get_resources().settings
        retries = (attempt - 1) if attempt else self.request.retries
        countdown = retry_after or backoff(
            retries, settings.retry_backoff_base, settings.retry_backoff_max
        )
        log.info("email job retrying in %.1fs: %s", countdown, exc)
        return self.retry(exc=exc, countdown=countdown, max_retries=settings.max_retries)

    def _defer(self, email_id: int, delay: float, reason: str) -> str:
        # A fresh message for later; this one is acked. The spread keeps many deferred copies
        # from landing at the same instant.
        countdown = max(0.5, delay) * random.uniform(1.0, 1.25)
        self.apply_async((email_id,), countdown=countdown)
        log.info("email %s deferred %.1fs: %s", email_id, countdown, reason)
        return "deferred"


def backoff(retries: int, base: float, maximum: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(maximum, base * 2**retries)].

    Celery's own helper draws whole seconds only, which cannot express the sub-second bases that
    tests use; the jitter spreads retries of jobs that failed together.
    """
    return random.uniform(0, min(maximum, base * 2**retries))


# `throws`: an expected failure, logged in a line rather than with a traceback.
@app.task(
    bind=True, base=EmailJobTask, name=TaskName.PROCESS_EMAIL.value, throws=(RunFailed, UnknownEmail)
)
def process_email(self: EmailJobTask, email_id: int) -> str:
    """Process one stored email: steps 1 to 7 of DESIGN.

    Idempotent: every step upserts, so a second run, or two at once after a lost lease, leaves
    the same rows. Retries: transient errors up to 3 times with backoff and jitter; permanent
    errors fail the run at once. A failed run makes the task raise RunFailed, so that Flower lists
    it as FAILURE.
    """
    return self.run_job(email_id, job.process_email)


@app.task(name=TaskName.SWEEP.value, acks_late=False, ignore_result=True)
def sweep() -> dict[str, object]:
    """Re-add lost and stalled jobs (mailpipe.sweeper).

    Idempotent: a Redis lock lets one sweep run at a time and every re-add is deduplicated.
    No retries: the next scheduled sweep is the retry. Acked early: a sweep lost with its worker
    is simply the next one.
    """
    return run_sweep(get_resources()).summary()


def run_sweep(res: Resources) -> sweeper.SweepResult:
    """One sweep with the real enqueue, live-worker count and metrics sink."""
    return sweeper.sweep(
        res,
        enqueue=lambda ids: enqueue_emails(ids, res),
        count_workers=count_live_workers,
        sink=make_sink(res.settings),
    )


def count_live_workers(connection: Connection | None = None) -> int:
    """Worker processes (ECS tasks) that answer a ping within a second; `connection`: a broker
    connection of the caller's own instead of one from the app's pool."""
    return len(app.control.ping(timeout=1.0, connection=connection) or [])
