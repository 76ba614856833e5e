"""Celery tasks: thin shells around the pipeline.

The pipeline (`mailpipe.pipeline`) never imports Celery: it takes the lease, claims the attempt,
runs the steps and returns what happened. What it means to run as a task, mapping that verdict to
Celery's actions, lives in `EmailJobTask` below.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.exceptions import TaskPredicate
from celery.worker.request import Request

from mailpipe.broker import mailboxes
from mailpipe.broker.layout import job_headers
from mailpipe.broker.queues import Lane, TaskName
from mailpipe.broker.sending import Route
from mailpipe.celery import app
from mailpipe.coordination import shutdowns
from mailpipe.enqueue import route, send_job, sender
from mailpipe.errors import MailpipeError, RunFailed, TransientError, Unexpected, describe
from mailpipe.operations import sweeper
from mailpipe.pipeline import emails, job
from mailpipe.pipeline.policy import Kind, Verdict
from mailpipe.resources import Resources, get_resources

log = logging.getLogger(__name__)

PAUSED_RESEND_S = 1.0


class EmailRequest(Request):
    """Celery's request, except that:

    - a delivery killed by the hard time limit is sent again at once, marked as cut off. Celery
      acknowledges the killed delivery, and its child was killed before it could record
      anything; the new delivery records the attempt as cut off and waits its backoff, or fails
      the run when that was the last attempt. Without it the job would be lost until the sweeper
      found it;
    - a running delivery cancelled at the end of the soft-shutdown window marks its email as cut
      off by shutdown before the broker takes the message back, so that its next claim gives the
      attempt back instead of counting a crash.
    """

    def cancel(self, pool: Any, signal: Any = None, emit_retry: bool = True) -> None:
        if self.time_start:
            try:
                shutdowns.mark_cut_off(get_resources().redis, [self.args[0]])
            except Exception:
                log.exception("could not mark email %s as cut off by shutdown", self.args[0])
        super().cancel(pool, signal=signal, emit_retry=emit_retry)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft:
            email_id = self.args[0]
            try:
                task = TaskName(self.task.name)
                lane = _lane(self.kwargs)
                mailbox = (self.kwargs or {}).get("mailbox")
                again = _route(get_resources(), email_id, task, lane, mailbox)
                send_job(email_id, task, lane, again, kwargs={"cut_off": timeout})
            except Exception:
                log.exception("could not send email %s again after its hard time limit", email_id)
        super().on_timeout(soft, timeout)


def _lane(kwargs: dict[str, Any] | None) -> Lane:
    """The lane a job message carries; a message sent before lanes existed is live."""
    return Lane((kwargs or {}).get("lane", Lane.LIVE.value))


def _named(sent: Route) -> dict[str, str]:
    return {} if sent.mailbox is None else {"mailbox": sent.mailbox}


def _slot(verdict: Verdict) -> dict[str, float]:
    """The mailbox slot a follow-up carries (`mailbox_slot`), when the job holds one: a keyword
    the previous release refuses, so a ceiling on a job of the lane's own queue (the default
    mailbox's, or any with no shard queues) is for a fleet that no longer runs it."""
    return {} if verdict.mailbox_slot is None else {"mailbox_slot": verdict.mailbox_slot}


def _route(res: Resources, email_id: int, task: TaskName, lane: Lane, mailbox: str | None) -> Route:
    """Where a delivery's follow-up goes: the shorter of its mailbox's shard queues, or its
    lane's own queue when the message named no mailbox (or a name this release refuses)."""
    try:
        given = None if mailbox is None else {email_id: mailboxes.stored(mailbox)}
    except ValueError:
        given = None
    return route(res, [email_id], task, lane, given)[email_id]


class MailpipeTask(Task):
    """Base of mailpipe's tasks. An exception that leaves one, whatever its message quotes of an
    email, reaches Celery (its log line, the task-failed event, Flower) in `describe`'s words:
    mailpipe's own errors as they are, without what they were raised from; any other as
    `Unexpected`, with its traceback. Celery's own (a retry) pass through."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Celery's trace has pushed the request: `run`, as Task.__call__ would push another.
        try:
            return self.run(*args, **kwargs)
        except TaskPredicate:
            raise
        except MailpipeError as exc:
            raise exc from None
        except Exception as exc:
            raise Unexpected(describe(exc)).with_traceback(exc.__traceback__) from None


class EmailJobTask(MailpipeTask):
    """Base of tasks that run one email's job. It adds:

    - one mapping from the job's `Verdict` to Celery: a retry (`self.retry`, so Flower shows
      it), a deferral (a fresh message with `deferred_since`), a failure (`RunFailed`, so Flower
      lists the job as failed), or the verdict's name as the task's result;
    - `EmailRequest`: a delivery cut off by the hard time limit comes back, counted.

    Acked late and rejected (requeued) when its child dies: the attempt count in the database,
    not Celery's retry count, bounds how often a job runs.
    """

    acks_late = True
    reject_on_worker_lost = True
    Request = EmailRequest

    def follow(self, email_id: int, verdict: Verdict, lane: Lane, mailbox: str | None) -> str:
        """Map the verdict to Celery; every follow-up goes in the delivery's `lane` and
        `mailbox` (as the message names it; None: not named)."""
        res = get_resources()
        task = TaskName(self.name)
        if verdict.kind is Kind.RETRY:
            again = _route(res, email_id, task, lane, mailbox)
            raise self.retry(
                args=(email_id,),
                kwargs={"lane": lane.value, **_named(again)},
                queue=again.queue,
                countdown=verdict.delay,
                exc=TransientError(verdict.error or "retry"),
                max_retries=None,
                headers=job_headers(email_id),
            )
        if verdict.kind is Kind.DEFER:
            send_job(
                email_id,
                task,
                lane,
                _route(res, email_id, task, lane, mailbox),
                kwargs={"deferred_since": verdict.deferred_since, **_slot(verdict)},
                countdown=verdict.delay,
            )
        elif verdict.kind is Kind.PAUSED:
            # Back to the queue its workers stop consuming within a second of the pause, where
            # it waits the pause out; the second's countdown keeps a worker that has not stopped
            # yet from taking it straight back.
            # It keeps when it first waited, so that its wait counts from the outage's start.
            send_job(
                email_id,
                task,
                lane,
                _route(res, email_id, task, lane, mailbox),
                kwargs={"deferred_since": verdict.deferred_since, **_slot(verdict)},
                countdown=PAUSED_RESEND_S,
            )
        elif verdict.kind is Kind.HANDED_OFF:
            model = TaskName.CLASSIFY_EMAIL
            if mailbox is None and res.settings.mailbox_queues:
                # Sent without its mailbox (upstream's `enqueue_email(id)`): the model stage,
                # where the fleet's cost is, takes it in its mailbox's turns all the same.
                found = emails.mailbox_of(res, email_id)
                mailbox = None if found is None else mailboxes.shown(found.mailbox)
            send_job(email_id, model, lane, _route(res, email_id, model, lane, mailbox))
        elif verdict.kind is Kind.FAILED:
            raise RunFailed(f"email {email_id}: {verdict.error}")
        return verdict.kind.value


# `throws`: an expected failure, logged in a line rather than with a traceback.
@app.task(
    bind=True,
    base=EmailJobTask,
    name=TaskName.PROCESS_EMAIL.value,
    throws=(RunFailed,),
    max_retries=None,
)
def process_email(
    self: EmailJobTask,
    email_id: int,
    deferred_since: float | None = None,
    cut_off: float | None = None,
    lane: str = Lane.LIVE.value,
    mailbox: str | None = None,
    **unknown: Any,
) -> str:
    """Process one stored email (docs/architecture.md, "The life of one email").

    Idempotent: every step upserts, and every write is fenced by the claim, so a second run, or
    two at once after a lost lease, leaves the same rows. Retries: every failed attempt (a
    service down, a time limit, a killed child, a bug) up to MAILPIPE_MAX_RETRIES times with
    backoff and jitter, counted in the database; rejected input fails the run at once; an
    outage (a dependency whose own check fails), a deferral or a shutdown's cut-off uses no
    attempt. A delivery of a paused mailbox ends claiming nothing; the resume sends it again.
    """
    ignore_unknown(self, unknown)
    res = get_resources()
    verdict = job.process_email(
        res,
        email_id,
        lane=Lane(lane),
        cut_off=cut_off,
        deferred_since=deferred_since,
        mailbox=mailbox,
    )
    return self.follow(email_id, verdict, Lane(lane), mailbox)


@app.task(
    bind=True,
    base=EmailJobTask,
    name=TaskName.CLASSIFY_EMAIL.value,
    throws=(RunFailed,),
    max_retries=None,
)
def classify_email(
    self: EmailJobTask,
    email_id: int,
    deferred_since: float | None = None,
    lane: str = Lane.LIVE.value,
    mailbox: str | None = None,
    mailbox_slot: float | None = None,
    **unknown: Any,
) -> str:
    """The model stage of an email's job: the model call, the stored answer and the labels; sent
    by the CPU stage once the documents are stored, and by the sweeper. Consumed by the model
    role, on threads: it only waits on the model and writes a few rows.

    Idempotent: it never calls the model again once the answer is stored, and every write is
    fenced by the claim. Retries as `process_email`; a model-call slot is waited for in the
    thread, then the job is deferred (not an attempt); a call its mailbox's ceiling refuses is
    deferred at once until the slot it was handed (`mailbox_slot`, which its next delivery
    carries).
    """
    ignore_unknown(self, unknown)
    res = get_resources()
    verdict = job.classify_email(
        res,
        email_id,
        lane=Lane(lane),
        deferred_since=deferred_since,
        mailbox=mailbox,
        mailbox_slot=mailbox_slot,
    )
    return self.follow(email_id, verdict, Lane(lane), mailbox)


@app.task(
    bind=True, base=MailpipeTask, name=TaskName.SWEEP.value, acks_late=False, ignore_result=True
)
def sweep(self: Task, **unknown: Any) -> dict[str, object]:
    """Re-add lost and stalled jobs (mailpipe.operations.sweeper).

    Idempotent: a Redis lock lets one sweep run at a time and every re-add is deduplicated.
    No retries: the next scheduled sweep is the retry. Acked early: a sweep lost with its worker
    is simply the next one.
    """
    ignore_unknown(self, unknown)
    return run_sweep(get_resources()).summary()


def ignore_unknown(task: Task, unknown: dict[str, Any]) -> None:
    """A newer release may send arguments this one does not know (docs/decisions/
    message-compatibility.md): they are ignored, so that the job runs as this release runs it."""
    if unknown:
        log.debug(
            "%s: ignoring arguments this release does not know: %s", task.name, sorted(unknown)
        )


def run_sweep(res: Resources) -> sweeper.SweepResult:
    """One sweep with the real enqueue."""
    return sweeper.sweep(res, enqueue=sender(res))
