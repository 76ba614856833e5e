"""What `mailpipe status`, `failed`, `review` and `show`, and the web console, report, as plain
JSON-ready data. Every list is a page: a page number, how many pages, and the total."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, exists, func, not_, select, text
from sqlalchemy.orm import Session

from mailpipe.broker import layout, mailboxes
from mailpipe.broker.queues import Lane, Stage, control_queue, stage_queue
from mailpipe.coordination import markers, redis_keys
from mailpipe.coordination.heartbeat import live_worker_list
from mailpipe.errors import mask_aws
from mailpipe.operations.metrics import read_backlog
from mailpipe.operations.waiting import top_mailboxes
from mailpipe.pipeline import mailbox_pauses, stage_pauses
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.models import (
    AttemptOutcome,
    Classification,
    Document,
    EmailLabel,
    EmailMessage,
    EmailOrigin,
    ModelBatch,
    ModelBatchRecord,
    PipelineRun,
    Reprocess,
    RunAttempt,
    RunStatus,
    SweepReport,
    utcnow,
)


@dataclass(frozen=True)
class FailedFilter:
    """Which failed runs to list or act on: those on the failed list, or with `dismissed` those
    an operator dismissed instead."""

    error_class: str | None = None
    stage: Stage | None = None  # CPU: failed before its documents were stored; MODEL: after
    since: datetime | None = None  # closed_at >= since (naive UTC)
    until: datetime | None = None  # closed_at < until (naive UTC)
    dismissed: bool = False
    mailbox: str | None = None  # as shown and typed: "default" is the emails without one

    def where(self) -> list[ColumnElement[bool]]:
        """The conditions on `pipeline_run` of the runs this filter lists (its email's mailbox
        as EXISTS, so that the runs are found and sorted in that table alone)."""
        dismissed_at = PipelineRun.dismissed_at
        listed = dismissed_at.is_not(None) if self.dismissed else dismissed_at.is_(None)
        conditions = [PipelineRun.status == RunStatus.FAILED, listed]
        if self.error_class is not None:
            conditions.append(PipelineRun.error_class == self.error_class)
        if self.stage is Stage.CPU:
            conditions.append(PipelineRun.converted_at.is_(None))
        elif self.stage is Stage.MODEL:
            conditions.append(PipelineRun.converted_at.is_not(None))
        if self.since is not None:
            conditions.append(PipelineRun.closed_at >= self.since)
        if self.until is not None:
            conditions.append(PipelineRun.closed_at < self.until)
        if self.mailbox is not None:
            conditions.append(
                exists().where(EmailMessage.id == PipelineRun.email_id, in_mailbox(self.mailbox))
            )
        return conditions


def in_mailbox(name: str) -> ColumnElement[bool]:
    """Whether an email is in the mailbox of this name, as shown and typed (`mailboxes.shown`):
    a named one's emails are found by `ix_email_message_mailbox` (mailbox, id); the default
    mailbox's, NULL, by no index of their own."""
    value = mailboxes.stored(name)
    return EmailMessage.mailbox.is_(None) if value is None else EmailMessage.mailbox == value


@dataclass(frozen=True)
class Page:
    rows: list[dict[str, Any]]
    page: int  # 1-based
    pages: int  # at least 1, even when there is nothing to list
    total: int

    def as_json(self) -> dict[str, Any]:
        return {"rows": self.rows, "page": self.page, "pages": self.pages, "total": self.total}


def fleet_status(res: Resources, *, estimates: bool = False) -> dict[str, Any]:
    """The JSON contract of `mailpipe status --json` (docs/operations.md, "The fleet's status as
    JSON"), plus the last sweep, every queue and the live workers. Every figure is counted, so that a script can wait on one; with
    `estimates` (the console's overview), the totals that no operator acts on are PostgreSQL's
    planner estimate past EXACT_UP_TO, named in `estimated`."""
    total = _count_or_estimate if estimates else _counted
    with res.db.reading() as session:
        emails, emails_exact = total(session, select(EmailMessage.id))
        no_run = _count(session, select(EmailMessage.id).where(not_(EmailMessage.has_run)))
        runs: dict[str, int] = {}
        estimated = [] if emails_exact else ["emails"]
        for status in RunStatus:
            listed = select(PipelineRun.id).where(PipelineRun.status == status)
            if status in _ACTED_ON:
                runs[status.value] = _count(session, listed)
                continue
            runs[status.value], exact = total(session, listed)
            if not exact:
                estimated.append(f"runs.{status.value}")
        # The bare column, as the partial index over the marked emails is written.
        needs_review = _count(session, select(EmailMessage.id).where(EmailMessage.needs_review))
        model_calls = flags.model_calls_enabled(session)
        # Counted only while the switch holds them: with calls on, a run waits for no switch.
        waiting_for_model_calls = 0 if model_calls else _waiting_for_model_calls(session)
        last_sweep = session.scalars(
            select(SweepReport).order_by(SweepReport.id.desc()).limit(1)
        ).first()
        reprocessing = reprocesses(session)
        waiting = top_mailboxes(session, utcnow())
    settings = res.settings
    # Each stage's live lane under the stage's role, its bulk lane after it.
    names = {
        "email": stage_queue(Stage.CPU, settings),
        "email.bulk": stage_queue(Stage.CPU, settings, Lane.BULK),
        "model": stage_queue(Stage.MODEL, settings),
        "model.bulk": stage_queue(Stage.MODEL, settings, Lane.BULK),
        "control": control_queue(settings),
    }
    queues = {role: _queue_dict(res, name) for role, name in names.items()}
    paused = {
        stage.value: {
            "error": mask_aws(pause.error),
            "since": datetime.fromtimestamp(pause.since, UTC).isoformat(),
            "by": pause.by,
            "dependency": pause.dependency or None,
            "alarm": pause.alarming(settings.outage_alarm_after),
        }
        for stage, pause in stage_pauses.in_force(res).items()
    }
    paused_mailboxes = _paused_mailboxes(res)
    workers = live_worker_list(res.redis, settings.worker_dead_after, list(names.values()))
    return {
        "emails": emails,
        "no_run": no_run,
        "runs": runs,
        "needs_review": needs_review,
        # The figures above that are PostgreSQL's planner estimates, not counts.
        "estimated": estimated,
        # The email queue's, as before the other queues were reported.
        "queue": {key: queues["email"][key] for key in ("depth", "oldest_age_s")},
        "queues": queues,
        "workers": [
            {
                "id": worker.worker_id,
                "hostname": worker.hostname,
                "last_seen_s": round(worker.last_seen_s, 3),
                "queues": worker.queues,
            }
            for worker in workers
        ],
        "model_calls": model_calls,
        "waiting_for_model_calls": waiting_for_model_calls,
        "paused": paused,
        "paused_mailboxes": paused_mailboxes,
        "last_sweep": _sweep_dict(last_sweep),
        "reprocesses": reprocessing,
        "mailboxes": {
            "waiting": waiting.mailboxes,
            "top": [asdict(mailbox) for mailbox in waiting.top],
        },
    }


def _paused_mailboxes(res: Resources) -> list[dict[str, Any]]:
    """The paused mailboxes, by name, each with its reason, since when and how many of its emails
    wait for the resume."""
    paused = sorted(mailbox_pauses.in_force(res).values(), key=lambda pause: pause.mailbox)
    if not paused:
        return []
    with res.db.reading() as session:
        return [
            {
                "mailbox": pause.mailbox,
                "reason": pause.reason,
                "since": datetime.fromtimestamp(pause.since, UTC).isoformat(),
                "waiting": mailbox_pauses.waiting(session, mailboxes.stored(pause.mailbox)),
            }
            for pause in paused
        ]


def reprocesses(session: Session, latest: int = 3) -> list[dict[str, Any]]:
    """The latest reprocesses, newest first, with their progress: of the runs each took, those
    done (succeeded or duplicate), failed, left (open: queued, running or retrying), and taken
    again by a later reprocess once it had ended (`retaken`), which add up to `taken`."""
    found = session.scalars(select(Reprocess).order_by(Reprocess.id.desc()).limit(latest)).all()
    counts: dict[int | None, dict[RunStatus, int]] = {r.id: {} for r in found}
    for reprocess_id, status, n in session.execute(
        select(PipelineRun.reprocess_id, PipelineRun.status, func.count())
        .where(PipelineRun.reprocess_id.in_(list(counts)))
        .group_by(PipelineRun.reprocess_id, PipelineRun.status)
    ):
        counts[reprocess_id][status] = n
    return [_progress(r, counts[r.id]) for r in found]


def _progress(reprocess: Reprocess, runs: dict[RunStatus, int]) -> dict[str, Any]:
    # A reprocess of the release before kept no count of its own: it took what it counted.
    taken = reprocess.emails if reprocess.taken is None else reprocess.taken
    progress = {
        "done": runs.get(RunStatus.SUCCEEDED, 0) + runs.get(RunStatus.DUPLICATE, 0),
        "failed": runs.get(RunStatus.FAILED, 0),
        "left": runs.get(RunStatus.OPEN, 0),
    }
    return {
        "id": reprocess.id,
        "created_at": _iso(reprocess.created_at),
        "created_by": reprocess.created_by,
        "from": reprocess.from_step,
        "lane": reprocess.lane,
        # By name: a filter's values are kept nowhere (a reprocess of the release before: [])
        "filters": reprocess.filters or [],
        "emails": reprocess.emails,
        "taken": taken,
        **progress,
        "retaken": max(0, taken - sum(progress.values())),
    }


# Exact counts where an operator acts on the figure; each has a partial index, so that the count
# costs what it counts (docs/decisions/console-counts.md).
_ACTED_ON = (RunStatus.OPEN, RunStatus.FAILED)
# Counted exactly up to this many; past it, the planner's estimate.
EXACT_UP_TO = 10_000


def _count(session: Session, query: Select) -> int:
    return session.scalar(select(func.count()).select_from(query.subquery())) or 0


def _counted(session: Session, query: Select) -> tuple[int, bool]:
    return _count(session, query), True


def _count_or_estimate(session: Session, query: Select) -> tuple[int, bool]:
    """How many rows `query` returns, and whether that is exact: counted up to EXACT_UP_TO, past
    it PostgreSQL's planner estimate (the table's statistics, scaled to its size now), for the
    totals that grow with every email and that no operator acts on. SQLite counts them all."""
    if session.get_bind().dialect.name != "postgresql":
        return _count(session, query), True
    counted = _count(session, query.limit(EXACT_UP_TO + 1))
    if counted <= EXACT_UP_TO:
        return counted, True
    statement = query.compile(session.get_bind(), compile_kwargs={"literal_binds": True})
    [plan] = session.execute(text(f"EXPLAIN (FORMAT JSON) {statement}")).scalar_one()
    # Never less than what was just counted, however stale the statistics; three significant
    # figures, as much as an estimate knows.
    estimate = max(counted, int(plan["Plan"]["Plan Rows"]))
    return round(estimate, 3 - len(str(estimate))), False


def _queue_dict(res: Resources, name: str) -> dict[str, Any]:
    backlog = read_backlog(res, name)
    return {
        "name": name,
        "depth": backlog.queue_depth,
        # None when nothing waits, as `mailpipe status` has always shown it.
        "oldest_age_s": backlog.oldest_job_age_s if backlog.queue_depth else None,
        "deferred": backlog.deferred_jobs,
        "workers": backlog.running_tasks,
    }


def failed_page(
    session: Session, filt: FailedFilter | None = None, page: int = 1, per_page: int = 50
) -> Page:
    """`mailpipe failed` and the console's failed list: the failed runs `filt` lists, the latest
    first."""
    where = (filt or FailedFilter()).where()
    total = session.scalar(select(func.count()).select_from(PipelineRun).where(*where)) or 0
    # The page's run ids first: an offset into the partial indexes over the listed runs, read
    # from the index alone. Only the page's runs and their emails are read from the tables.
    order = (PipelineRun.closed_at.desc(), PipelineRun.id.desc())
    page_ids = _paged(select(PipelineRun.id).where(*where).order_by(*order), page, per_page)
    paged = page_ids.subquery()
    query = (
        select(
            PipelineRun.email_id,
            PipelineRun.attempts,
            PipelineRun.closed_at,
            PipelineRun.converted_at,
            PipelineRun.error_class,
            PipelineRun.error,
            PipelineRun.dismissed_at,
            EmailMessage.needs_review,
            EmailMessage.lane,
            EmailMessage.mailbox,
        )
        .join(paged, paged.c.id == PipelineRun.id)
        .join(EmailMessage, EmailMessage.id == PipelineRun.email_id)
        # The id breaks ties: runs failed in one statement (a sweep) share their closed_at.
        .order_by(*order)
    )
    rows = [
        {
            "email_id": row.email_id,
            "attempts": row.attempts,
            "failed_at": _iso(row.closed_at),
            "stage": (Stage.CPU if row.converted_at is None else Stage.MODEL).value,
            "error_class": row.error_class,
            "error": _shown(row.error),
            "needs_review": row.needs_review,
            "lane": row.lane,
            "mailbox": mailboxes.shown(row.mailbox),
            "dismissed_at": _iso(row.dismissed_at),
        }
        for row in session.execute(query)
    ]
    return _page(rows, page, per_page, total)


def error_classes(session: Session) -> list[tuple[str, int]]:
    """The error classes among the listed failed runs, each with its count, the commonest first."""
    count = func.count().label("count")
    rows = session.execute(
        select(PipelineRun.error_class, count)
        .where(*FailedFilter().where(), PipelineRun.error_class.is_not(None))
        .group_by(PipelineRun.error_class)
        .order_by(count.desc(), PipelineRun.error_class)
    )
    return [(str(name), n) for name, n in rows]


def review_page(session: Session, page: int = 1, per_page: int = 50) -> Page:
    """`mailpipe review` and the console's review list: the emails marked for review and why,
    the oldest first, with their run's status (None: no run yet)."""
    # The bare column, as the partial index over the marked emails is written.
    marked = EmailMessage.needs_review
    total = session.scalar(select(func.count()).select_from(EmailMessage).where(marked)) or 0
    query = (
        select(
            EmailMessage.id,
            EmailMessage.subject,
            EmailMessage.review_reason,
            EmailMessage.mailbox,
            PipelineRun.status,
        )
        .outerjoin(PipelineRun, PipelineRun.email_id == EmailMessage.id)
        .where(marked)
        .order_by(EmailMessage.id)
    )
    rows = [
        {
            "email_id": row.id,
            "subject": row.subject,
            "reason": row.review_reason,
            "mailbox": mailboxes.shown(row.mailbox),
            "status": None if row.status is None else row.status.value,
        }
        for row in session.execute(_paged(query, page, per_page))
    ]
    return _page(rows, page, per_page, total)


def _paged(query: Select, page: int, per_page: int) -> Select:
    if page < 1 or per_page < 1:
        raise ValueError(f"page {page} of {per_page} rows: both must be at least 1")
    return query.offset((page - 1) * per_page).limit(per_page)


def _page(rows: list[dict[str, Any]], page: int, per_page: int, total: int) -> Page:
    return Page(rows, page, max(1, math.ceil(total / per_page)), total)


def email_detail(
    session: Session, email_id: int, history_before: int | None = None
) -> dict[str, Any] | None:
    """`mailpipe show` and the console's email page: the email's run, documents, labels,
    classification, origin and a page of the history of its attempts (`history`, before
    attempt `history_before`); None when there is no such email."""
    email = session.get(EmailMessage, email_id)
    if email is None:
        return None
    origin = None if email.origin_id is None else session.get(EmailOrigin, email.origin_id)
    run = session.scalars(select(PipelineRun).where(PipelineRun.email_id == email_id)).first()
    classification = None
    if run is not None:
        classification = session.scalars(
            select(Classification).where(Classification.run_id == run.id)
        ).first()
    documents = session.scalars(
        select(Document).where(Document.email_id == email_id).order_by(Document.part_index)
    ).all()
    labels = session.scalars(
        select(EmailLabel).where(EmailLabel.email_id == email_id).order_by(EmailLabel.label)
    ).all()
    # The next copy, which a forget of this email hands the origin on to (`erasure`).
    next_copy = session.scalar(
        select(EmailMessage.id)
        .where(EmailMessage.duplicate_of == email_id)
        .order_by(EmailMessage.id)
        .limit(1)
    )
    return {
        "id": email.id,
        "subject": email.subject,
        "from": email.sender,
        "size": email.size,
        "blob_key": email.blob_key,
        "received_at": _iso(email.received_at),
        "duplicate_of": email.duplicate_of,
        "next_copy": next_copy,
        "lane": email.lane,
        "mailbox": mailboxes.shown(email.mailbox),
        "origin": None
        if origin is None
        else {
            "id": origin.id,
            "message_id": origin.message_id,
            "first_email_id": origin.first_email_id,
            "created_at": _iso(origin.created_at),
        },
        "needs_review": email.needs_review,
        "review_reason": email.review_reason,
        "dismissed_at": None if run is None else _iso(run.dismissed_at),
        "run": None
        if run is None
        else {
            "status": run.status.value,
            "attempts": run.attempts,
            "sweep_count": run.sweep_count,
            "error_class": run.error_class,
            "error": _shown(run.error),
            "parse_defects": run.parse_defects,
            "created_at": _iso(run.created_at),
            "updated_at": _iso(run.updated_at),
            "last_swept_at": _iso(run.last_swept_at),
            "classified_at": _iso(run.classified_at),
            "closed_at": _iso(run.closed_at),
        },
        "documents": [
            {
                "part": d.part_index,
                "filename": d.filename,
                "content_type": d.content_type,
                "size": d.size,
                "status": d.status.value,
                "pages": d.page_count,
                "text_chars": len(d.text) if d.text is not None else None,
                "text_blob_key": d.text_blob_key,
                "error": _shown(d.error),
            }
            for d in documents
        ],
        "labels": [
            {"label": row.label, "source": row.source, "confidence": row.confidence}
            for row in labels
        ],
        "classification": None
        if classification is None
        else {
            "model_id": classification.model_id,
            "prompt_version": classification.prompt_version,
            "output": classification.output,
            "input_tokens": classification.input_tokens,
            "output_tokens": classification.output_tokens,
            "latency_ms": classification.latency_ms,
        },
        **history(session, email_id, history_before),
    }


# The attempts a page of an email's history holds, the last ones first asked for.
HISTORY_PAGE = 50


def history(
    session: Session, email_id: int, before: int | None = None, limit: int = HISTORY_PAGE
) -> dict[str, Any]:
    """A page of the attempts of the email's run, of both stages: `history`, the last `limit`
    that ended before attempt `before` (the last ones with None), in the order they ended; and
    `older_history`, the `before` of the page before it (None on the first). A deferral's row
    stands for `deferrals` deferrals in a row, the last one's time, error and host in its
    other fields. `run_again` marks the first row after the run ended and was opened again (a
    retry, a reprocess): the run counts its attempts from 1 again there."""
    statement = select(RunAttempt).where(RunAttempt.email_id == email_id)
    if before is not None:
        statement = statement.where(RunAttempt.id < before)
    rows = session.scalars(statement.order_by(RunAttempt.id.desc()).limit(limit + 1)).all()
    shown = list(reversed(rows[:limit]))
    # Each row's predecessor: the row before the page is the one fetched past the limit.
    previous = [rows[limit] if len(rows) > limit else None, *shown][: len(shown)]
    return {
        "history": [
            {
                "id": row.id,
                "stage": row.stage,
                "attempt": row.attempt,
                "run_again": before_it is not None and before_it.outcome in _ENDED_THE_RUN,
                "started_at": _iso(row.started_at),
                "ended_at": _iso(row.ended_at),
                "outcome": row.outcome,
                "deferrals": _deferrals(row),
                "error_class": row.error_class,
                "error": _shown(row.error),
                "host": row.host,
            }
            for row, before_it in zip(shown, previous, strict=True)
        ],
        "older_history": shown[0].id if len(rows) > limit else None,
    }


# The outcomes that close the run: a row after one belongs to the run opened again.
_ENDED_THE_RUN = {AttemptOutcome.SUCCEEDED, AttemptOutcome.DUPLICATE, AttemptOutcome.FAILED}


def _deferrals(row: RunAttempt) -> int | None:
    """A deferral's count: its row's, or 1 on a row of the release before (one per deferral)."""
    if row.outcome != AttemptOutcome.DEFERRED:
        return None
    return row.deferrals or 1


def job_state(
    res: Resources, session: Session, email_id: int, history_before: int | None = None
) -> dict[str, Any] | None:
    """The job status API (`GET /api/jobs/<email_id>`); None when there is no such email.
    `state` and `waiting_for` are `_where_the_job_is`'s; `history` is a page, as
    `email_detail`'s."""
    email = session.execute(
        select(
            EmailMessage.needs_review,
            EmailMessage.created_at,
            EmailMessage.lane,
            EmailMessage.mailbox,
        ).where(EmailMessage.id == email_id)
    ).one_or_none()
    if email is None:
        return None
    run = session.execute(
        select(
            PipelineRun.id,
            PipelineRun.status,
            PipelineRun.attempts,
            PipelineRun.attempt_started_at,
            PipelineRun.converted_at,
            PipelineRun.dismissed_at,
            PipelineRun.error_class,
            PipelineRun.error,
            PipelineRun.updated_at,
        ).where(PipelineRun.email_id == email_id)
    ).one_or_none()
    labels = session.scalars(
        select(EmailLabel.label).where(EmailLabel.email_id == email_id).order_by(EmailLabel.label)
    ).all()
    state, waiting_for = _where_the_job_is(
        res, session, email_id, Lane(email.lane), email.mailbox, run
    )
    return {
        "email_id": email_id,
        "state": state,
        "waiting_for": waiting_for,
        # The batch inference job its model stage waits for, once submitted.
        "batch_job": _batch_wait(session, email_id) or None if waiting_for == "batch" else None,
        "lane": email.lane,
        "mailbox": mailboxes.shown(email.mailbox),
        "attempts": 0 if run is None else run.attempts,
        "error_class": None if run is None else run.error_class,
        "error": None if run is None else _shown(run.error),
        "needs_review": email.needs_review,
        "labels": list(labels),
        "updated_at": _iso(email.created_at if run is None else run.updated_at),
        **history(session, email_id, history_before),
    }


# The deferrals that wait for a shared limit (the fleet's rate limit, the provider's quota).
_RATE_LIMITED = ("RateLimited", "Throttled")


def _where_the_job_is(
    res: Resources, session: Session, email_id: int, lane: Lane, mailbox: str | None, run: Any
) -> tuple[str, str | None]:
    """The job's state, and for `waiting` what it waits for, from the run row and Redis:

    - a closed run: its status (succeeded, duplicate, failed), or dismissed;
    - a delivery holds the email's lease: running;
    - its stage is paused: waiting for `paused_stage`;
    - its mailbox is paused: waiting for `paused_mailbox`, run or none (its delivery released
      its marker, and the resume sends it again);
    - a deferred delivery is due later: waiting for `rate_limit` when its last attempt was
      deferred by a rate limit or the provider's throttling, else for `deferral`;
    - converted, with model calls off: waiting for `model_calls`;
    - its model stage waits for a model batch: waiting for `batch` (mailpipe.pipeline.batches);
    - an error and no attempt running: retrying (a failed attempt waits for its next);
    - the job is in the broker (in one of its stage's queues, or delivered and not yet taken)
      or was sent a moment ago (its enqueue marker is that young): queued;
    - otherwise lost: open, in no queue and not running, until a sweep re-adds it. The broker
      is read as the sweeper reads it, so a job lost with a purged or flushed queue reads
      lost whatever its marker says.
    An email with no run and no marker is not_enqueued; with a marker, its job is read as
    above.
    """
    if run is not None and run.status is not RunStatus.OPEN:
        failed = run.status is RunStatus.FAILED
        return ("dismissed" if failed and run.dismissed_at else run.status.value), None
    stage = Stage.CPU if run is None or run.converted_at is None else Stage.MODEL
    pipe = res.redis.pipeline(transaction=False)
    pipe.exists(redis_keys.lease(email_id))
    pipe.get(redis_keys.job_marker(email_id))
    pipe.zscore(redis_keys.deferred(stage_queue(stage, res.settings, lane)), str(email_id))
    leased, marker, due = pipe.execute()
    held = mailboxes.shown(mailbox) in mailbox_pauses.in_force(res)
    if run is None and marker is None and not held:
        return "not_enqueued", None
    if leased:
        return "running", None
    if stage in stage_pauses.in_force(res):
        return "waiting", "paused_stage"
    if held:
        return "waiting", "paused_mailbox"
    if due is not None and due > time.time():
        limited = run is not None and _last_deferred_by_a_limit(session, run.id)
        return "waiting", "rate_limit" if limited else "deferral"
    if run is not None and stage is Stage.MODEL and not flags.model_calls_enabled(session):
        return "waiting", "model_calls"
    if run is not None and stage is Stage.MODEL and _batch_wait(session, email_id) is not None:
        return "waiting", "batch"
    if run is not None and run.error is not None and run.attempt_started_at is None:
        return "retrying", None
    if marker is None:
        return "lost", None
    if markers.just_sent(marker):
        return "queued", None
    queues = [stage_queue(stage, res.settings, each) for each in Lane]
    return ("queued" if email_id in layout.emails_in_broker(res.redis, queues) else "lost"), None


def _batch_wait(session: Session, email_id: int) -> str | None:
    """When the email's model stage waits for a model batch: the id of the batch inference job
    it is in, or "" before one is submitted for it; None when it waits for none."""
    row = session.execute(
        select(ModelBatchRecord.realtime, ModelBatch.job_arn)
        .outerjoin(ModelBatch, ModelBatch.id == ModelBatchRecord.batch_id)
        .where(ModelBatchRecord.email_id == email_id)
    ).one_or_none()
    if row is None or row.realtime:
        return None
    return "" if row.job_arn is None else row.job_arn.rsplit("/", 1)[-1]


def _last_deferred_by_a_limit(session: Session, run_id: int) -> bool:
    last = session.execute(
        select(RunAttempt.outcome, RunAttempt.error_class)
        .where(RunAttempt.run_id == run_id)
        .order_by(RunAttempt.id.desc())
        .limit(1)
    ).one_or_none()
    if last is None or last.outcome != AttemptOutcome.DEFERRED:
        return False
    return last.error_class in _RATE_LIMITED


def _waiting_for_model_calls(session: Session) -> int:
    """Open runs past their CPU stage that wait for model calls to be switched on; a run of the
    release before that waits has no `waiting_since`, and is counted once it is claimed again."""
    return _count(
        session,
        select(PipelineRun.id).where(
            PipelineRun.status == RunStatus.OPEN, PipelineRun.waiting_since.is_not(None)
        ),
    )


def _sweep_dict(report: SweepReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {
        "finished_at": _iso(report.finished_at),
        "readded_no_run": report.readded_no_run,
        "readded_stalled": report.readded_stalled,
        "started_waiting": report.started_waiting or 0,
        "skipped_queued": report.skipped_queued,
        "marked_for_review": report.marked_for_review,
        "queue_depth": report.queue_depth,
        "backlog_per_task": report.backlog_per_task,
    }


def _iso(value: Any) -> str | None:
    return value.isoformat() + "Z" if value is not None else None


def _shown(error: str | None) -> str | None:
    """A stored error as viewers see it: AWS account ids and ARNs masked, errors stored before
    they were masked at the source included."""
    return None if error is None else mask_aws(error)
