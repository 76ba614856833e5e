"""The sweeper: turns the database, the source of truth, back into work (DESIGN: Sweeper).

Rules, applied in keyset batches over small partial indexes, so a sweep costs in proportion to
its candidates and not to the emails stored:

- an email with no pipeline run is re-added (its run is created, swept once);
- an open run whose job was started or re-added and never finished is re-added, model calls on
  or off (a lost job stays lost otherwise);
- with model calls on, an open run is re-added at once when the email was never classified, and
  after `MAILPIPE_STALL_AFTER` seconds (default 1800) since its last change when it was;
- with model calls off, runs waiting for them are left alone;
- an email whose job is queued or running (its dedup marker is set) is never counted as stalled
  and never enqueued twice;
- each re-add increments the run's sweep_count; a run already swept `MAILPIPE_MAX_SWEEPS` times
  (default 3) that is still stalled is failed and its email marked for review.

Two sweeps at once (a manual one and a scheduled one) cannot double anything: a Redis lock lets
one run, and every enqueue goes through the dedup marker anyway. This module never imports Celery;
the task shell passes in how to enqueue and how to count live workers.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Select, and_, not_, or_, select, update

from mailpipe import flags, redis_keys
from mailpipe.enqueue import EnqueueResult, is_queued
from mailpipe.metrics import MetricsSink, collect
from mailpipe.models import EmailMessage, PipelineRun, RunStatus, SweepReport, utcnow
from mailpipe.pipeline import runs
from mailpipe.resources import Resources

log = logging.getLogger(__name__)

Enqueue = Callable[[Sequence[int]], EnqueueResult]

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('expire', KEYS[1], ARGV[2]) end
return 0
"""
# The sweep lock lapses this long after its last renewal (one per batch): a sweep whose process
# was killed blocks the next ones for a minute at most.
SWEEP_LOCK_TTL_S = 60


class SweepLock:
    """One sweep at a time across the fleet; renewed between batches by its holder."""

    def __init__(self, res: Resources) -> None:
        self.redis = res.redis
        self.key = redis_keys.sweep_lock()
        self.token = uuid.uuid4().hex

    def acquire(self) -> bool:
        return bool(self.redis.set(self.key, self.token, nx=True, ex=SWEEP_LOCK_TTL_S))

    def renew(self) -> None:
        self.redis.eval(_RENEW, 1, self.key, self.token, SWEEP_LOCK_TTL_S)

    def release(self) -> None:
        self.redis.eval(_RELEASE, 1, self.key, self.token)


@dataclass
class SweepResult:
    ran: bool = True
    model_calls: bool = False
    readded_no_run: int = 0
    readded_stalled: int = 0
    skipped_queued: int = 0
    marked_for_review: int = 0
    queue_depth: int = 0
    backlog_per_task: float = 0.0
    readded_ids: list[int] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, object]:
        data = asdict(self)
        data.pop("readded_ids")
        return data


def sweep(
    res: Resources,
    enqueue: Enqueue,
    count_workers: Callable[[], int],
    sink: MetricsSink,
) -> SweepResult:
    lock = SweepLock(res)
    if not lock.acquire():
        log.info("sweep skipped: another sweep is running")
        return SweepResult(ran=False)
    try:
        result = _sweep(res, enqueue, lock)
    finally:
        lock.release()

    metrics = collect(res, count_workers)
    result.queue_depth = metrics.queue_depth
    result.backlog_per_task = metrics.backlog_per_task
    sink.send(metrics)
    with res.db.transaction() as session:
        session.add(
            SweepReport(
                finished_at=utcnow(),
                readded_no_run=result.readded_no_run,
                readded_stalled=result.readded_stalled,
                skipped_queued=result.skipped_queued,
                marked_for_review=result.marked_for_review,
                queue_depth=result.queue_depth,
                backlog_per_task=result.backlog_per_task,
            )
        )
    log.info("sweep: %s", result.summary())
    return result


def _sweep(res: Resources, enqueue: Enqueue, lock: SweepLock) -> SweepResult:
    with res.db.session() as session:
        model_calls = flags.model_calls_enabled(session)
    result = SweepResult(model_calls=model_calls)
    # Open runs first: the runs this sweep creates for emails without one are not looked at twice.
    _sweep_open_runs(res, enqueue, result, model_calls, lock)
    _sweep_emails_without_run(res, enqueue, result, lock)
    return result


def emails_without_run(after_id: int, limit: int) -> Select[tuple[int]]:
    """A keyset batch of emails that have no run, from the partial index over them."""
    return (
        select(EmailMessage.id)
        .where(not_(EmailMessage.has_run), EmailMessage.id > after_id)
        .order_by(EmailMessage.id)
        .limit(limit)
    )


def open_runs(
    after_id: int, limit: int, model_calls: bool, stall_cutoff: datetime
) -> Select[tuple[int, int, int]]:
    """A keyset batch of open runs that may be stalled, from the partial index on open runs."""
    unfinished = or_(PipelineRun.attempts > 0, PipelineRun.sweep_count > 0)
    if model_calls:
        stalled = or_(
            unfinished, PipelineRun.classified_at.is_(None), PipelineRun.updated_at < stall_cutoff
        )
    else:
        stalled = unfinished
    return (
        select(PipelineRun.id, PipelineRun.email_id, PipelineRun.sweep_count)
        .where(and_(PipelineRun.status == RunStatus.OPEN, PipelineRun.id > after_id, stalled))
        .order_by(PipelineRun.id)
        .limit(limit)
    )


def _sweep_emails_without_run(
    res: Resources, enqueue: Enqueue, result: SweepResult, lock: SweepLock
) -> None:
    last_id = 0
    while True:
        lock.renew()
        with res.db.session() as session:
            ids = list(session.scalars(emails_without_run(last_id, res.settings.sweep_batch_size)))
        if not ids:
            return
        last_id = ids[-1]
        waiting = _not_queued(res, ids, result)
        sent = enqueue(waiting).sent if waiting else []
        if sent:
            with res.db.transaction() as session:
                runs.ensure_runs(session, sent)
                _count_sweep(session, sent)
        result.readded_no_run += len(sent)
        result.readded_ids.extend(sent)


def _sweep_open_runs(
    res: Resources, enqueue: Enqueue, result: SweepResult, model_calls: bool, lock: SweepLock
) -> None:
    settings = res.settings
    cutoff = utcnow() - timedelta(seconds=settings.stall_after)
    last_id = 0
    while True:
        lock.renew()
        with res.db.session() as session:
            rows = session.execute(
                open_runs(last_id, settings.sweep_batch_size, model_calls, cutoff)
            ).all()
        if not rows:
            return
        last_id = rows[-1].id
        waiting = set(_not_queued(res, [row.email_id for row in rows], result))
        exhausted = [r.email_id for r in rows if r.email_id in waiting and r.sweep_count >= settings.max_sweeps]
        retry = [r.email_id for r in rows if r.email_id in waiting and r.sweep_count < settings.max_sweeps]
        if exhausted:
            with res.db.transaction() as session:
                _mark_for_review(session, exhausted, settings.max_sweeps)
            result.marked_for_review += len(exhausted)
        sent = enqueue(retry).sent if retry else []
        if sent:
            with res.db.transaction() as session:
                _count_sweep(session, sent)
        result.readded_stalled += len(sent)
        result.readded_ids.extend(sent)


def _not_queued(res: Resources, email_ids: list[int], result: SweepResult) -> list[int]:
    queued = is_queued(res, email_ids)
    result.skipped_queued += sum(queued)
    return [email_id for email_id, busy in zip(email_ids, queued) if not busy]


def _count_sweep(session, email_ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    session.execute(
        update(PipelineRun)
        .where(PipelineRun.email_id.in_(email_ids))
        .values(sweep_count=PipelineRun.sweep_count + 1, last_swept_at=utcnow())
    )


def _mark_for_review(session, email_ids: list[int], max_sweeps: int) -> None:  # type: ignore[no-untyped-def]
    reason = f"stalled: re-added {max_sweeps} times by the sweeper without finishing"
    now = utcnow()
    session.execute(
        update(PipelineRun)
        .where(PipelineRun.email_id.in_(email_ids), PipelineRun.status == RunStatus.OPEN)
        .values(status=RunStatus.FAILED, error=reason, closed_at=now, attempt_started_at=None)
    )
    session.execute(
        update(EmailMessage)
        .where(EmailMessage.id.in_(email_ids))
        .values(needs_review=True, review_reason=reason)
    )
