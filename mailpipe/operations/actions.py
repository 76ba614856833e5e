"""What an operator does, from `mailpipe` or the console: to failed runs, the review list and
lanes, to emails to forget, and to the fleet's switches (model calls, a stage's or a mailbox's
pause).

Every write goes through mailpipe.pipeline.interventions (a forget's deletions through
mailpipe.operations.erasure), in batches of one transaction each, so that acting on ten thousand
runs never holds ten thousand row locks; a retry enqueues each batch's jobs after its commit,
through the deduplicated enqueue it is handed (`mailpipe.enqueue.sender`: this layer never
imports Celery). Nothing asked for is passed over without saying why (`Done.refused`), and each
batch is logged with the action, the user and the email ids (ids only: never an email's
content); a switch leaves one line with the action and the user (a mailbox's pause and resume the
SHA-256 of its name, never the name), a forgotten email one line with its id and the SHA-256 of
its Message-ID.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Select, and_, false, func, not_, select, update
from sqlalchemy.orm import Session, aliased

from mailpipe.broker import mailboxes
from mailpipe.broker.queues import Lane, Stage, TaskName
from mailpipe.broker.sending import Enqueue, Place, in_lanes
from mailpipe.coordination import pauses
from mailpipe.errors import input_rejections
from mailpipe.operations import erasure, search
from mailpipe.operations.search import EmailFilter
from mailpipe.operations.status import FailedFilter
from mailpipe.pipeline import emails, interventions, mailbox_pauses
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.models import EmailMessage, PipelineRun, Reprocess, RunStatus

log = logging.getLogger(__name__)

BATCH = 500


@dataclass(frozen=True)
class Done:
    done: list[int]  # the emails acted on
    enqueued: int = 0  # jobs sent (retry only; an email whose job is queued already gets none)
    refused: dict[int, str] = field(default_factory=dict)  # email id -> why not


def retry(
    res: Resources,
    email_ids: Sequence[int] | None = None,
    filt: FailedFilter | None = None,
    *,
    enqueue: Enqueue,
    user: str,
    expect: int | None = None,
    batch: int = BATCH,
) -> Done:
    """Reopen failed runs with a fresh attempt budget and enqueue their jobs, which run the whole
    job again, each in its email's lane. `email_ids`: those (a dismissed one included); else
    every listed failed run that `filt` matches (no dismissed one). The review mark of each
    reopened email is cleared. `expect`: the count the operator confirmed (`confirmed`)."""
    most = confirmed(res, email_ids, filt, expect)
    # Reopened runs wait for a job: with Redis down, change nothing rather than strand them.
    res.redis.ping()
    done: list[int] = []
    refused: dict[int, str] = {}
    enqueued = 0
    places: dict[int, Place] = {}

    def reopen(session: Session, ids: list[int]) -> list[int]:
        reopened = interventions.reopen_failed(session, ids)[0]
        places.update(emails.places(session, reopened))
        return reopened

    for reopened, not_reopened in _in_batches(res, email_ids, filt, batch, reopen, most=most):
        _logged("retry", user, reopened)
        done.extend(reopened)
        refused.update(not_reopened)
        enqueued += len(in_lanes(enqueue, reopened, places, TaskName.PROCESS_EMAIL))
    return Done(done, enqueued, refused)


def move(
    res: Resources, email_ids: Sequence[int], lane: Lane, *, user: str, batch: int = BATCH
) -> Done:
    """Put emails in `lane`. Their next job is sent in it (the sweeper's re-add, a retry); a job
    already queued stays in the lane it was sent in, and so do its deferrals, retries and the
    hand-off to the model stage, which carry the lane of their message."""
    batches = _in_batches(
        res,
        email_ids,
        None,
        batch,
        lambda session, ids: emails.move(session, ids, lane),
        lambda session, ids: dict.fromkeys(ids, "no such email"),
    )
    return _logged_batches(f"move_to_{lane}", user, batches)


def dismiss(
    res: Resources,
    email_ids: Sequence[int] | None = None,
    filt: FailedFilter | None = None,
    *,
    user: str,
    expect: int | None = None,
    batch: int = BATCH,
) -> Done:
    """Dismiss failed runs: each stays failed, leaves the failed list and the review list, and
    no retry-all or sweep reopens it. `email_ids`: those; else every listed failed run that
    `filt` matches. `expect`: the count the operator confirmed (`confirmed`)."""
    most = confirmed(res, email_ids, filt, expect)
    batches = _in_batches(res, email_ids, filt, batch, interventions.dismiss, most=most)
    return _logged_batches("dismiss", user, batches)


def undo_dismiss(
    res: Resources, email_ids: Sequence[int], *, user: str, batch: int = BATCH
) -> Done:
    """Put dismissed runs back on the failed list, failed as they were."""
    batches = _in_batches(res, email_ids, None, batch, interventions.undismiss)
    return _logged_batches("undo_dismiss", user, batches)


def clear_review(
    res: Resources,
    email_ids: Sequence[int],
    *,
    user: str,
    expect: int | None = None,
    batch: int = BATCH,
) -> Done:
    """Take emails off the review list without a retry; their runs are left as they are.
    `expect`: the count the operator confirmed (`confirmed`)."""
    confirmed(res, email_ids, None, expect)
    batches = _in_batches(res, email_ids, None, batch, emails.clear_review, _not_marked)
    return _logged_batches("clear_review", user, batches)


@dataclass(frozen=True)
class Counted:
    """What a mass action on failed runs or marked emails would take, for its confirmation."""

    runs: int  # the runs (or emails) it takes
    # Of them, runs failed as an input rejection (`errors.input_rejections`): a retry reads the
    # same bytes and fails again.
    rejected: int = 0


def count_failed(res: Resources, filt: FailedFilter) -> Counted:
    """The failed runs `filt` lists, as retry and dismiss take them, and the rejected ones."""
    with res.db.session() as session:
        return _counted(session, filt.where())


def count_of(res: Resources, email_ids: Sequence[int]) -> Counted:
    """The emails `email_ids` names, and those among them whose run failed as rejected input."""
    ids = list(dict.fromkeys(email_ids))
    with res.db.session() as session:
        rejected = sum(
            _counted(session, [PipelineRun.email_id.in_(ids[at : at + BATCH])]).rejected
            for at in range(0, len(ids), BATCH)
        )
    return Counted(len(ids), rejected)


def _counted(session: Session, where: list[Any]) -> Counted:
    rejected = PipelineRun.error_class.in_(input_rejections()) & (
        PipelineRun.status == RunStatus.FAILED
    )
    total, rejections = session.execute(
        select(func.count(), func.count().filter(rejected)).select_from(PipelineRun).where(*where)
    ).one()
    return Counted(total, rejections)


def marked(res: Resources) -> list[int]:
    """Every email on the review list, by id: what its "all" actions take."""
    with res.db.session() as session:
        # The bare column, as the partial index over the marked emails is written.
        return list(
            session.scalars(
                select(EmailMessage.id).where(EmailMessage.needs_review).order_by(EmailMessage.id)
            )
        )


def confirmed(
    res: Resources,
    email_ids: Sequence[int] | None,
    filt: FailedFilter | None,
    expect: int | None,
) -> int | None:
    """The most a mass action may take: `expect`, the count its operator confirmed, once the
    selection holds that many now (the emails named, or the failed runs `filt` lists), or
    Changed with the count now. None when nothing was confirmed (ids an operator ticked)."""
    if expect is None:
        return None
    now = (
        count_of(res, email_ids)
        if email_ids is not None
        else count_failed(res, filt or FailedFilter())
    )
    if now.runs != expect:
        raise Changed(f"{expect} were confirmed; {now.runs} are there now", now)
    return expect


Act = Callable[[Session, list[int]], list[int]]
Why = Callable[[Session, list[int]], dict[int, str]]


def _logged_batches(
    action: str, user: str, batches: Iterator[tuple[list[int], dict[int, str]]]
) -> Done:
    """Each batch's emails logged once its transaction committed; all of them, and why not the
    others, in one `Done`."""
    done: list[int] = []
    refused: dict[int, str] = {}
    for acted, not_acted in batches:
        _logged(action, user, acted)
        done.extend(acted)
        refused.update(not_acted)
    return Done(done, refused=refused)


def _in_batches(
    res: Resources,
    email_ids: Sequence[int] | None,
    filt: FailedFilter | None,
    size: int,
    act: Act,
    why_not: Why | None = None,
    most: int | None = None,
) -> Iterator[tuple[list[int], dict[int, str]]]:
    """`act` on batches of emails, each in a transaction of its own; yields after each commit
    the emails acted on, and why not (`why_not`, by default `_why_not`) for the others.
    The batches: `email_ids` in chunks, or the failed runs `filt` lists in keyset batches,
    locked in the batch's transaction so that none changes before it is acted on, `most` of
    them at the most (what its operator confirmed)."""
    if email_ids is not None and filt is not None:
        raise ValueError("either email ids or a filter, not both")
    if size < 1:
        raise ValueError(f"batch size {size}: must be at least 1")
    pending = None if email_ids is None else list(dict.fromkeys(email_ids))
    after, listed = 0, 0
    while True:
        with res.db.transaction() as session:
            if pending is None:
                room = size if most is None else min(size, most - listed)
                chunk = _listed(session, filt or FailedFilter(), after, room) if room else []
                listed += len(chunk)
            else:
                chunk, pending = pending[:size], pending[size:]
            if not chunk:
                return
            acted = act(session, chunk)
            left = sorted(set(chunk) - set(acted))
            refused = (why_not or _why_not)(session, left) if left else {}
        after = chunk[-1]
        yield acted, refused


def _listed(session: Session, filt: FailedFilter, after: int, size: int) -> list[int]:
    """The next keyset batch of the failed runs `filt` lists, locked."""
    return list(
        session.scalars(
            select(PipelineRun.email_id)
            .where(*filt.where(), PipelineRun.email_id > after)
            .order_by(PipelineRun.email_id)
            .limit(size)
            .with_for_update()
        )
    )


def _why_not(session: Session, email_ids: list[int]) -> dict[int, str]:
    """Why a run was not acted on: its state, read in the transaction that acted."""
    found = {
        email_id: (status, dismissed_at)
        for email_id, status, dismissed_at in session.execute(
            select(PipelineRun.email_id, PipelineRun.status, PipelineRun.dismissed_at).where(
                PipelineRun.email_id.in_(email_ids)
            )
        )
    }
    reasons = {}
    for email_id in email_ids:
        status, dismissed_at = found.get(email_id, (None, None))
        if status is None:
            reasons[email_id] = "it has no run"
        elif status is RunStatus.FAILED and dismissed_at is not None:
            reasons[email_id] = "its run is dismissed already"
        else:
            reasons[email_id] = f"its run is {status.value}"
    return reasons


class Step(enum.StrEnum):
    """Where a reprocess starts: the model stage alone, or the CPU stage and the model stage
    after it (the CPU stage parses the email and converts its documents together)."""

    CLASSIFY = "classify"
    DOCUMENTS = "documents"
    PARSE = "parse"


@dataclass(frozen=True)
class Reprocessed:
    """A reprocess's plan (a dry run: what it would take), or what it took."""

    emails: int  # the succeeded runs the filter finds that no other reprocess holds
    model_calls: int  # what it costs: one call per email with a remote model, none with rules
    as_of: int  # the latest reprocess when counted: what one after it took is left to that one
    most: int  # MAILPIPE_REPROCESS_MAX: more only with `over_max`
    reprocess_id: int | None = None  # None for a dry run
    enqueued: int = 0  # jobs sent (an email whose job is queued already gets none)
    taken: int = 0  # runs reopened: at most `emails`, fewer when some changed meanwhile


class Refused(Exception):
    """A mass action refused before it changed anything: why (the exception's text), and its
    figures as they are now (`plan`: a `Reprocessed` or a `Counted`), for the face to show, so
    that the operator can confirm those instead."""

    def __init__(self, why: str, plan: Reprocessed | Counted) -> None:
        super().__init__(why)
        self.plan = plan


class NotAFilter(Refused):
    """The filter takes every succeeded email: reprocessing every email is not a filter."""


class OverMax(Refused):
    """More emails than MAILPIPE_REPROCESS_MAX, without the override."""


class Changed(Refused):
    """The figures are not those the operator confirmed (`expect`)."""


def plan_reprocess(res: Resources, filt: EmailFilter, *, as_of: int | None = None) -> Reprocessed:
    """What `reprocess` would take and cost: the emails `filt` finds whose run succeeded, as of
    `as_of` (a plan's, confirmed later; by default the latest reprocess now), leaving out the
    emails a reprocess still under way took and those one after `as_of` took
    (`interventions.Reprocessing`). NotAFilter when the filter takes every succeeded email and more than
    one: a state of `succeeded`, `review=no` with none marked or a time range around every
    email narrows nothing."""
    return _planned(res, filt, as_of)[0]


def _planned(
    res: Resources, filt: EmailFilter, as_of: int | None
) -> tuple[Reprocessed, interventions.Reprocessing]:
    """The plan, and what it left alone: the batches leave alone the same."""
    with res.db.session() as session:
        leaving = interventions.reprocessing(session, as_of)
        found = _succeeded(session, filt, leaving).subquery()
        emails = session.scalar(select(func.count()).select_from(found)) or 0
        every = filt == EmailFilter() or (emails > 1 and not _leaves_out_one(session, filt))
    plan = Reprocessed(
        emails, emails if res.classifier.remote else 0, leaving.as_of, res.settings.reprocess_max
    )
    if every:
        raise NotAFilter(
            "a reprocess needs a filter that leaves out some succeeded email: every email is "
            "not a filter",
            plan,
        )
    return plan, leaving


def reprocess(
    res: Resources,
    filt: EmailFilter,
    step: Step,
    *,
    lane: Lane = Lane.BULK,
    enqueue: Enqueue,
    user: str,
    expect: int | None = None,
    as_of: int | None = None,
    over_max: bool = False,
    batch: int = BATCH,
) -> Reprocessed:
    """Run again, from `step`, the emails its plan (`plan_reprocess`) counts: reopened in
    batches under one reprocess (its progress: `status.reprocesses`), their jobs sent in `lane`,
    the bulk one by default, at most as many as the plan counted. The same request sent again,
    or twice at once, takes no email twice. Their classification and labels stay until the new
    answer replaces them. Refused (`Refused`, nothing changed) as the plan is, when the count
    is not `expect`, the one the operator confirmed (`Changed`), or past MAILPIPE_REPROCESS_MAX
    without `over_max` (`OverMax`)."""
    plan, leaving = _planned(res, filt, as_of)
    planned = plan.emails
    if expect is not None and expect != planned:
        raise Changed(f"the plan confirmed took {expect} emails; it takes {planned} now", plan)
    if planned > plan.most and not over_max:
        raise OverMax(
            f"{planned} emails is more than MAILPIPE_REPROCESS_MAX ({plan.most}) takes at once",
            plan,
        )
    if not planned:
        return plan
    res.redis.ping()  # reopened runs wait for a job: with Redis down, change nothing
    with res.db.transaction() as session:
        record = Reprocess(
            created_by=user,
            from_step=step.value,
            lane=lane.value,
            search={},
            filters=filt.names(),
            emails=planned,
            taken=0,
        )
        session.add(record)
        session.flush()
        reprocess_id = record.id
    _audited(f"reprocess_{reprocess_id}_from_{step.value}", user)
    enqueued, taken, after = 0, 0, 0
    # No more than the plan counted: an email that succeeded since is the next plan's.
    while (room := min(batch, planned - taken)) > 0:
        with res.db.transaction() as session:
            chunk = list(
                session.scalars(
                    _succeeded(session, filt, leaving)
                    .where(EmailMessage.id > after)
                    .order_by(EmailMessage.id)
                    .limit(room)
                )
            )
            if not chunk:
                break
            cpu, model = interventions.reopen_to_reprocess(
                session,
                chunk,
                reprocess_id,
                keep_documents=step is Step.CLASSIFY,
                leaving=leaving,
            )
            session.execute(
                update(Reprocess)
                .where(Reprocess.id == reprocess_id)
                .values(taken=Reprocess.taken + len(cpu) + len(model))
            )
            boxes = {i: place.mailbox for i, place in emails.places(session, cpu + model).items()}
        after = chunk[-1]
        taken += len(cpu) + len(model)
        _logged(f"reprocess_{reprocess_id}", user, cpu + model)
        enqueued += len(enqueue(cpu, TaskName.PROCESS_EMAIL, lane, boxes)) if cpu else 0
        enqueued += len(enqueue(model, TaskName.CLASSIFY_EMAIL, lane, boxes)) if model else 0
    return replace(plan, reprocess_id=reprocess_id, enqueued=enqueued, taken=taken)


def _succeeded(
    session: Session, filt: EmailFilter, leaving: interventions.Reprocessing
) -> Select[Any]:
    """The emails `filt` finds whose run succeeded and is free to take (`leaving`), by id, as
    the search finds them in `session`'s transaction (`search.matching`: the same words,
    through the same indexes). The filter's conditions on a run are EXISTS over
    `pipeline_run`; the run read here is an alias, so that they stay its own."""
    run = aliased(PipelineRun)
    return (
        select(EmailMessage.id)
        .join(run, run.email_id == EmailMessage.id)
        .where(
            *search.matching(session, filt),
            run.status == RunStatus.SUCCEEDED,
            leaving.free(run),
        )
    )


def _leaves_out_one(session: Session, filt: EmailFilter) -> bool:
    """Whether some succeeded email is one `filt` does not find: a state of `succeeded`, a
    time range around every email or `review=no` with none marked narrow nothing. A search's
    condition on a column without a value is unknown, which leaves that email out too."""
    run = aliased(PipelineRun)
    found = and_(*search.matching(session, filt))
    left_out = (
        select(EmailMessage.id)
        .join(run, run.email_id == EmailMessage.id)
        .where(run.status == RunStatus.SUCCEEDED, not_(func.coalesce(found, false())))
        .limit(1)
    )
    return session.scalar(left_out) is not None


@dataclass(frozen=True)
class Forgotten:
    email_ids: list[int]  # the emails forgotten (a dry run: those it would forget)
    rows: dict[str, int]  # rows deleted per table (a dry run: that it would delete)
    blobs: int  # raw emails and document texts
    redis: int  # keys and sorted-set members kept by email id
    handed_on: int  # origins passed to their next copy
    refused: dict[int, str] = field(default_factory=dict)  # email id -> why not
    dry_run: bool = False
    # The copies that become their origin's first email, take the labels of the email forgotten
    # and run the steps a copy skips (a dry run: those that would); their jobs sent.
    completed: list[int] = field(default_factory=list)
    enqueued: int = 0  # jobs sent for `completed` (one already queued gets none)


def forget(
    res: Resources,
    email_ids: Sequence[int] | None = None,
    filt: EmailFilter | None = None,
    *,
    enqueue: Enqueue,
    user: str,
    dry_run: bool = False,
    batch: int = BATCH,
) -> Forgotten:
    """Erase emails everywhere (`mailpipe.operations.erasure`): `email_ids`, or every email that
    `filt` finds (a Message-ID, a sender's address: only emails whose From holds it whole). Their
    rows, blobs and Redis state go, their origins pass to their next copy, their jobs in flight
    are fenced off; in batches, each in a few short transactions. A copy that becomes the first
    email of its origin is completed: it takes the labels of the email forgotten, its run is
    reopened and its job sent (`enqueue`, after the batch's commit) to run the steps a copy
    skips. Each email leaves one audit line: who, the email id and the SHA-256 of its
    Message-ID ("none" without one), nothing of its content; the copies completed one line with
    their ids. `dry_run`: what it would delete and complete, changing nothing."""
    if (email_ids is None) == (filt is None):
        raise ValueError("either email ids or a filter")
    if batch < 1:
        raise ValueError(f"batch size {batch}: must be at least 1")
    chosen, refused = _to_forget(res, email_ids, filt, batch)
    if dry_run:
        return _forgotten(chosen, erasure.plan(res, chosen, set(chosen), batch), refused, None)
    # Without the fence, a job in flight could write a blob after the email's were deleted.
    res.redis.ping()
    done: list[int] = []
    tally = erasure.Tally()
    enqueued = 0
    for start in range(0, len(chosen), batch):
        erased = erasure.erase(res, chosen[start : start + batch], set(chosen))
        completed = erased.tally.completed
        _logged("forget_completes_copy", user, completed)
        enqueued += len(in_lanes(enqueue, completed, erased.places, TaskName.PROCESS_EMAIL))
        for email_id in erased.email_ids:
            _audited(
                "forget",
                user,
                email_id=email_id,
                message_id_sha256=erased.message_ids.get(email_id) or "none",
            )
        done.extend(erased.email_ids)
        tally.add(erased.tally)
    refused.update(dict.fromkeys(sorted(set(chosen) - set(done)), "no such email"))
    return _forgotten(done, tally, refused, enqueued)


def _forgotten(
    email_ids: list[int], tally: erasure.Tally, refused: dict[int, str], enqueued: int | None
) -> Forgotten:
    """What a forget did, or with `enqueued` None (a dry run) would do."""
    return Forgotten(
        email_ids,
        dict(tally.rows),
        tally.blobs,
        tally.redis,
        tally.handed_on,
        refused,
        dry_run=enqueued is None,
        completed=tally.completed,
        enqueued=enqueued or 0,
    )


def _to_forget(
    res: Resources, email_ids: Sequence[int] | None, filt: EmailFilter | None, batch: int
) -> tuple[list[int], dict[int, str]]:
    """The emails to forget, in id order, and why not for the ids asked for that name none."""
    with res.db.session() as session:
        if email_ids is not None:
            asked = sorted(set(email_ids))
            found = [
                i
                for start in range(0, len(asked), batch)
                for i in erasure.existing(session, asked[start : start + batch])
            ]
            return found, dict.fromkeys(sorted(set(asked) - set(found)), "no such email")
        assert filt is not None
        found, after = [], 0
        while True:
            chunk, last = erasure.chosen(session, filt, after, batch)
            if last is None:
                return found, {}
            found.extend(chunk)
            after = last


def switch_model_calls(
    res: Resources, on: bool, *, send_sweep: Callable[[], object], user: str
) -> None:
    """Switch model calls on or off; the workers read the switch per job. Switched on, a sweep
    is sent (`send_sweep`: this layer never imports Celery), so that the runs waiting for the
    switch go on now rather than at the next scheduled sweep."""
    with res.db.transaction() as session:
        flags.set_model_calls(session, on)
    _audited(f"model_calls_{'on' if on else 'off'}", user)
    if on:
        send_sweep()


def pause(res: Resources, stage: Stage, reason: str, *, user: str) -> pauses.Pause:
    """Pause `stage` with `reason` (an outage's pause is taken over); its workers stop taking
    its work until it is resumed, through a flushed or restarted Redis too."""
    held = pauses.pause(res.redis, stage, reason)
    with res.db.transaction() as session:
        flags.set_operator_pause(session, stage.value, held.error, held.since)
    _audited(f"pause_{stage.value}", user)
    return held


def resume(res: Resources, stage: Stage, *, user: str) -> bool:
    """End `stage`'s pause, an operator's or an outage's; False when it was not paused. The kept
    pause goes first: a worker that puts the kept pauses back meanwhile cannot revive it."""
    with res.db.transaction() as session:
        flags.clear_operator_pause(session, stage.value)
    ended = pauses.resume(res.redis, stage)
    if ended:
        _audited(f"resume_{stage.value}", user)
    return ended


def pause_mailbox(res: Resources, mailbox: str, reason: str, *, user: str) -> pauses.MailboxPause:
    """Pause `mailbox` (its name as shown and typed: "default" for the default one) with
    `reason`: its jobs end without claiming anything and the sweeper leaves its emails alone
    until it is resumed, through a flushed or restarted Redis too; a mailbox paused already
    keeps its pause. ValueError for a name no mailbox can have."""
    name = mailboxes.shown(mailboxes.stored(mailbox))
    with res.db.transaction() as session:
        since = flags.set_mailbox_pause(session, name, reason, time.time())
        reason = flags.mailbox_pauses(session)[name][0]
    held = pauses.MailboxPause(name, reason, since)
    pauses.pause_mailbox(res.redis, held)
    _audited("pause_mailbox", user, mailbox_sha256=_hashed(name))
    return held


@dataclass(frozen=True)
class Resumed:
    was_paused: bool
    enqueued: int = 0  # jobs sent again (one queued already gets none)


def resume_mailbox(
    res: Resources, mailbox: str, *, enqueue: Enqueue, user: str, batch: int = BATCH
) -> Resumed:
    """End `mailbox`'s pause and send its waiting jobs again, in batches, each in its email's
    lane and mailbox, through the deduplicated `enqueue`: the CPU stage of its emails with no
    run and of its open runs not past it, the model stage of those past it (a run that waits
    for model calls has no job: the sweeper starts it once they are on). Sent even when it was
    not paused, so that a resume run again sends what a failed one left. The kept pause goes
    first: a worker that puts the kept pauses back meanwhile cannot revive it."""
    name = mailboxes.shown(mailboxes.stored(mailbox))
    with res.db.transaction() as session:
        kept = flags.clear_mailbox_pause(session, name)
    mirrored = pauses.resume_mailbox(res.redis, name)
    if kept or mirrored:
        _audited("resume_mailbox", user, mailbox_sha256=_hashed(name))
    column = mailboxes.stored(name)
    enqueued = 0
    after = 0
    while True:
        with res.db.session() as session:
            rows = session.execute(mailbox_pauses.without_run(column, after, batch)).all()
        if not rows:
            break
        after = rows[-1].id
        places = {row.id: Place(row.lane, row.mailbox) for row in rows}
        enqueued += len(in_lanes(enqueue, list(places), places, TaskName.PROCESS_EMAIL))
    after = 0
    while True:
        with res.db.session() as session:
            found = session.execute(mailbox_pauses.open_runs(column, after, batch)).all()
        if not found:
            break
        after = found[-1].email_id
        places = {row.email_id: Place(row.lane, row.mailbox) for row in found}
        cpu = [row.email_id for row in found if not row.converted]
        model = [row.email_id for row in found if row.converted and not row.waiting]
        enqueued += len(in_lanes(enqueue, cpu, places, TaskName.PROCESS_EMAIL))
        enqueued += len(in_lanes(enqueue, model, places, TaskName.CLASSIFY_EMAIL))
    return Resumed(kept or mirrored, enqueued)


def _hashed(mailbox: str) -> str:
    """What an audit line says of a mailbox: the SHA-256 of its name."""
    return hashlib.sha256(mailbox.encode()).hexdigest()


def _not_marked(session: Session, email_ids: list[int]) -> dict[int, str]:
    """Why an email was not taken off the review list."""
    known = set(session.scalars(select(EmailMessage.id).where(EmailMessage.id.in_(email_ids))))
    return {i: "not on the review list" if i in known else "no such email" for i in email_ids}


def _audited(action: str, user: str, **fields: object) -> None:
    shown = "".join(f" {name}={value}" for name, value in fields.items())
    log.info("%s by %s%s", action, user, shown, extra={"action": action, "user": user, **fields})


def _logged(action: str, user: str, email_ids: list[int]) -> None:
    if email_ids:
        log.info(
            "%s by %s: %d email(s): %s",
            action,
            user,
            len(email_ids),
            " ".join(map(str, email_ids)),
            extra={"action": action, "user": user, "email_ids": email_ids},
        )
