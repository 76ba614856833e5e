"""The sweeper: turns the database, the source of truth, back into work (docs/sweeper.md).

Whether a job is lost is decided by what the broker holds, read once per sweep
(`mailpipe.broker.layout.emails_in_broker`): an email whose job is queued, delivered to a worker,
or held for its countdown is never re-added, never counted as stalled and never failed, however
long it has waited and whatever became of its dedup marker. Rules, applied in keyset batches over
small partial indexes:

- an email with no pipeline run whose job is not in the broker is re-added (its run is created,
  swept once);
- an open run whose CPU stage is not done is re-added, model calls on or off (a lost job stays
  lost otherwise, a reopened one included);
- with model calls on, a run that waits for them (`waiting_since`) has its model stage started:
  no job was lost, so nothing is counted against it, however often the switch went off and on;
- with model calls on, an open run is re-added at once when the email was never classified, and
  `MAILPIPE_STALL_AFTER` seconds (default 1800) after its classification was stored when it was;
- with model calls off, runs waiting for them are left alone;
- a run whose model stage waits for a model batch (mailpipe.pipeline.batches) is left alone:
  beat's leader forms, follows and applies its batch;
- the emails of a paused mailbox are left alone, run or none: not re-added, not counted, not
  failed (their resume sends their jobs);
- each re-add of a lost job increments the run's sweep_count, over both stages; a run already swept
  `MAILPIPE_MAX_SWEEPS` times (default 3) whose job is lost again is failed and its email marked
  for review. Every write of a run goes through mailpipe.pipeline.interventions.

A job sent after the broker was read is missing from that read; its marker, stamped when it was
sent, tells the sweep to leave it (`markers.IN_FLIGHT_GRACE_S`). A running job is also known by its
lease. Two sweeps at once (a manual one and a scheduled one) cannot double anything: a Redis lock
lets one run, and every enqueue goes through the dedup marker anyway. This module never imports
Celery; the task shell passes in how to enqueue and how to count live workers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from redis.exceptions import LockError
from redis.lock import Lock
from sqlalchemy import Select, and_, exists, not_, select
from sqlalchemy.orm import Session

from mailpipe.broker import layout, mailboxes
from mailpipe.broker.queues import TaskName, job_queues
from mailpipe.broker.sending import Enqueue, Place, in_lanes
from mailpipe.coordination import markers, redis_keys
from mailpipe.operations.metrics import read_backlog
from mailpipe.pipeline import interventions, mailbox_pauses, runs
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.models import (
    EmailMessage,
    ModelBatchRecord,
    PipelineRun,
    RunStatus,
    SweepReport,
    utcnow,
)

log = logging.getLogger(__name__)

# The sweep lock lapses this long after its last renewal (one per batch): a sweep whose process
# was killed blocks the next ones for a minute at most.
SWEEP_LOCK_TTL_S = 60


@dataclass
class SweepResult:
    ran: bool = True
    model_calls: bool = False
    readded_no_run: int = 0
    readded_stalled: int = 0
    started_waiting: int = 0
    skipped_queued: int = 0
    marked_for_review: int = 0
    queue_depth: int = 0
    backlog_per_task: float = 0.0
    broker_jobs: int | None = None  # emails with a job in the broker, when it was read
    readded_ids: list[int] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, object]:
        data = asdict(self)
        data.pop("readded_ids")
        return data


class BrokerView:
    """Which emails have a job in the broker, read at most once per sweep, when first needed."""

    def __init__(self, res: Resources, in_flight_grace: float) -> None:
        self._res = res
        self._grace = in_flight_grace
        self.read_at: float | None = None
        self._present: set[int] = set()

    @property
    def taken(self) -> bool:
        return self.read_at is not None

    def take(self) -> None:
        self.read_at = time.time()
        self._present = layout.emails_in_broker(self._res.redis, job_queues(self._res.settings))

    def __len__(self) -> int:
        return len(self._present)

    def lost(self, email_ids: list[int], result: SweepResult) -> list[int]:
        """The emails among `email_ids` whose job is neither in the broker nor just sent, nor
        running; markers of those found waiting are kept fresh, those of lost jobs dropped."""
        assert self.read_at is not None
        present = [i for i in email_ids if i in self._present]
        markers.refresh(self._res.redis, present, self._res.settings.dedup_ttl)
        absent = [i for i in email_ids if i not in self._present]
        if not absent:
            result.skipped_queued += len(present)
            return []
        stamps = markers.read(self._res.redis, absent)
        pipe = self._res.redis.pipeline(transaction=False)
        for email_id in absent:
            pipe.exists(redis_keys.lease(email_id))
        leased = pipe.execute()
        lost: list[int] = []
        stale: dict[int, bytes] = {}
        recent = self.read_at - self._grace
        for email_id, stamp, running in zip(absent, stamps, leased, strict=True):
            if running or (stamp is not None and markers.set_at(stamp) > recent):
                present.append(email_id)
                continue
            lost.append(email_id)
            if stamp is not None:
                stale[email_id] = stamp
        if stale:
            markers.drop_stale(self._res.redis, stale)
        result.skipped_queued += len(present)
        return lost


def sweep(
    res: Resources,
    enqueue: Enqueue,
    in_flight_grace: float = markers.IN_FLIGHT_GRACE_S,
) -> SweepResult:
    """One sweep; `in_flight_grace`: how young a marker keeps a job the broker read missed."""
    lock = res.redis.lock(redis_keys.sweep_lock(), timeout=SWEEP_LOCK_TTL_S, blocking=False)
    if not lock.acquire():
        log.info("sweep skipped: another sweep is running")
        return SweepResult(ran=False)
    try:
        result = _sweep(res, enqueue, lock, BrokerView(res, in_flight_grace))
    finally:
        try:
            lock.release()
        except LockError:
            log.warning("the sweep outlived its lock; another sweep may have run beside it")

    backlog = read_backlog(res, res.settings.queue)
    result.queue_depth = backlog.queue_depth
    result.backlog_per_task = backlog.backlog_per_task
    with res.db.transaction() as session:
        session.add(
            SweepReport(
                finished_at=utcnow(),
                readded_no_run=result.readded_no_run,
                readded_stalled=result.readded_stalled,
                started_waiting=result.started_waiting,
                skipped_queued=result.skipped_queued,
                marked_for_review=result.marked_for_review,
                queue_depth=result.queue_depth,
                backlog_per_task=result.backlog_per_task,
            )
        )
    log.info("sweep: %s", result.summary())
    return result


def _sweep(res: Resources, enqueue: Enqueue, lock: Lock, view: BrokerView) -> SweepResult:
    with res.db.session() as session:
        model_calls = flags.model_calls_enabled(session)
    result = SweepResult(model_calls=model_calls)
    # As the column holds them: None is the default mailbox.
    held = {mailboxes.stored(name) for name in mailbox_pauses.in_force(res)}
    # Open runs first: the runs this sweep creates for emails without one are not looked at twice.
    _sweep_open_runs(res, enqueue, result, model_calls, lock, view, held)
    _sweep_emails_without_run(res, enqueue, result, lock, view, held)
    if view.taken:
        result.broker_jobs = len(view)
    return result


def emails_without_run(after_id: int, limit: int) -> Select:
    """A keyset batch of emails that have no run, from the partial index over them, with their
    lane and mailbox."""
    return (
        select(EmailMessage.id, EmailMessage.lane, EmailMessage.mailbox)
        .where(not_(EmailMessage.has_run), EmailMessage.id > after_id)
        .order_by(EmailMessage.id)
        .limit(limit)
    )


def open_runs(after_id: int, limit: int, model_calls: bool, stall_cutoff: datetime) -> Select:
    """A keyset batch of open runs that may be stalled, from the partial index on open runs."""
    answered_lately = and_(
        PipelineRun.classified_at.is_not(None), PipelineRun.classified_at >= stall_cutoff
    )
    # A run whose model stage waits for a batch has no job: beat's leader holds its work.
    waits_for_batch = exists().where(
        ModelBatchRecord.email_id == PipelineRun.email_id, ModelBatchRecord.realtime.is_(False)
    )
    if model_calls:
        stalled = not_(answered_lately)
    else:
        # Runs past their CPU stage wait for model calls; the others need a job either way.
        stalled = PipelineRun.converted_at.is_(None)
    return (
        select(
            PipelineRun.id,
            PipelineRun.email_id,
            PipelineRun.sweep_count,
            PipelineRun.converted_at.is_not(None).label("converted"),
            PipelineRun.waiting_since.is_not(None).label("waiting"),
            EmailMessage.lane,
            EmailMessage.mailbox,
        )
        .join(EmailMessage, EmailMessage.id == PipelineRun.email_id)
        .where(
            and_(PipelineRun.status == RunStatus.OPEN, PipelineRun.id > after_id, stalled),
            not_(waits_for_batch),
        )
        .order_by(PipelineRun.id)
        .limit(limit)
    )


def _batches(res: Resources, view: BrokerView, lock: Lock, read):
    """Keyset batches from `read(session, after_id)`; the broker is read before the first batch
    is used, and that batch read again after it, so that no job that ended while the broker was
    read is taken for lost."""
    last_id = 0
    while True:
        lock.extend(SWEEP_LOCK_TTL_S, replace_ttl=True)
        with res.db.session() as session:
            rows = read(session, last_id)
        if rows and not view.taken:
            view.take()
            with res.db.session() as session:
                rows = read(session, last_id)
        if not rows:
            return
        last_id = rows[-1][0]
        yield rows


def _sweep_emails_without_run(
    res: Resources,
    enqueue: Enqueue,
    result: SweepResult,
    lock: Lock,
    view: BrokerView,
    held: set[str | None],
) -> None:
    batch_size = res.settings.sweep_batch_size

    def read(session: Session, after_id: int) -> list[tuple[int, Place]]:
        found = session.execute(emails_without_run(after_id, batch_size))
        return [(int(row.id), Place(row.lane, row.mailbox)) for row in found]

    for rows in _batches(res, view, lock, read):
        places = {email_id: place for email_id, place in rows if place.mailbox not in held}
        lost = view.lost(list(places), result)
        sent = in_lanes(enqueue, lost, places, TaskName.PROCESS_EMAIL)
        if sent:
            with res.db.transaction() as session:
                runs.ensure_runs(session, sent)
                interventions.count_sweep(session, sent)
        result.readded_no_run += len(sent)
        result.readded_ids.extend(sent)


def _sweep_open_runs(
    res: Resources,
    enqueue: Enqueue,
    result: SweepResult,
    model_calls: bool,
    lock: Lock,
    view: BrokerView,
    held: set[str | None],
) -> None:
    settings = res.settings
    cutoff = utcnow() - timedelta(seconds=settings.stall_after)

    def read(session: Session, after_id: int) -> list[Candidate]:
        statement = open_runs(after_id, settings.sweep_batch_size, model_calls, cutoff)
        return [Candidate(*row) for row in session.execute(statement)]

    for batch in _batches(res, view, lock, read):
        rows = [row for row in batch if row.mailbox not in held]
        read_at = utcnow()
        places = {row.email_id: Place(row.lane, row.mailbox) for row in rows}
        absent = view.lost(list(places), result)
        # A run that waits for model calls has no job of its own: its stage starts now.
        waiting = [row.email_id for row in rows if row.waiting and row.email_id in absent]
        started = in_lanes(enqueue, waiting, places, TaskName.CLASSIFY_EMAIL)
        if started:
            with res.db.transaction() as session:
                interventions.start_waiting(session, started, read_at)
        result.started_waiting += len(started)
        result.readded_ids.extend(started)

        sweeps = {row.email_id: row.sweep_count for row in rows if not row.waiting}
        converted = {row.email_id for row in rows if row.converted}
        lost = [i for i in absent if i in sweeps]
        exhausted = [i for i in lost if sweeps[i] >= settings.max_sweeps]
        retry = [i for i in lost if sweeps[i] < settings.max_sweeps]
        if exhausted:
            reason = (
                f"stalled: its job was lost {settings.max_sweeps + 1} times (re-added "
                f"{settings.max_sweeps} times by the sweeper)"
            )
            with res.db.transaction() as session:
                failed = interventions.fail_stalled(session, exhausted, reason)
            result.marked_for_review += len(failed)
        # A run past its CPU stage needs only its model stage: no parse, no conversion again.
        sent = [
            *in_lanes(
                enqueue, [i for i in retry if i not in converted], places, TaskName.PROCESS_EMAIL
            ),
            *in_lanes(
                enqueue, [i for i in retry if i in converted], places, TaskName.CLASSIFY_EMAIL
            ),
        ]
        if sent:
            with res.db.transaction() as session:
                interventions.count_sweep(session, sent)
        result.readded_stalled += len(sent)
        result.readded_ids.extend(sent)


class Candidate(NamedTuple):
    """An open run the sweep looks at, as `open_runs` reads it."""

    id: int
    email_id: int
    sweep_count: int
    converted: bool
    waiting: bool
    lane: str
    mailbox: str | None
