"""What an operator does, from `mailpipe` or the console: to failed runs, the review list and
lanes, to emails to forget, and to the fleet's switches (model calls, a stage's pause).

Every write goes through mailpipe.pipeline.runs (a forget's deletions through
mailpipe.operations.erasure), in batches of one transaction each, so that acting on ten thousand
runs never holds ten thousand row locks; a retry enqueues each batch's jobs after its commit,
through the deduplicated enqueue it is handed (`mailpipe.enqueue.sender`: this layer never
imports Celery). Nothing asked for is passed over without saying why (`Done.refused`), and each
batch is logged with the action, the user and the email ids (ids only: never an email's
content); a switch leaves one line with the action and the user, a forgotten email one line with
its id and the SHA-256 of its Message-ID.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session, aliased

from mailpipe.broker.queues import Lane, Stage, TaskName
from mailpipe.coordination import pauses
from mailpipe.operations import erasure, search
from mailpipe.operations.search import EmailFilter
from mailpipe.operations.status import FailedFilter
from mailpipe.operations.sweeper import Enqueue, in_lanes
from mailpipe.pipeline import emails, runs
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
    batch: int = BATCH,
) -> Done:
    """Reopen failed runs with a fresh attempt budget and enqueue their jobs, which run the whole
    job again, each in its email's lane. `email_ids`: those (a dismissed one included); else
    every listed failed run that `filt` matches (no dismissed one). The review mark of each
    reopened email is cleared."""
    # Reopened runs wait for a job: with Redis down, change nothing rather than strand them.
    res.redis.ping()
    done: list[int] = []
    refused: dict[int, str] = {}
    enqueued = 0
    lanes: dict[int, str] = {}

    def reopen(session: Session, ids: list[int]) -> list[int]:
        reopened = runs.reopen_failed(session, ids)[0]
        lanes.update(emails.lanes(session, reopened))
        return reopened

    for reopened, not_reopened in _in_batches(res, email_ids, filt, batch, reopen):
        _logged("retry", user, reopened)
        done.extend(reopened)
        refused.update(not_reopened)
        enqueued += len(in_lanes(enqueue, reopened, lanes, TaskName.PROCESS_EMAIL))
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
    batch: int = BATCH,
) -> Done:
    """Dismiss failed runs: each stays failed, leaves the failed list and the review list, and
    no retry-all or sweep reopens it. `email_ids`: those; else every listed failed run that
    `filt` matches."""
    batches = _in_batches(res, email_ids, filt, batch, runs.dismiss)
    return _logged_batches("dismiss", user, batches)


def undo_dismiss(
    res: Resources, email_ids: Sequence[int], *, user: str, batch: int = BATCH
) -> Done:
    """Put dismissed runs back on the failed list, failed as they were."""
    batches = _in_batches(res, email_ids, None, batch, runs.undismiss)
    return _logged_batches("undo_dismiss", user, batches)


def clear_review(
    res: Resources, email_ids: Sequence[int], *, user: str, batch: int = BATCH
) -> Done:
    """Take emails off the review list without a retry; their runs are left as they are."""
    batches = _in_batches(res, email_ids, None, batch, emails.clear_review, _not_marked)
    return _logged_batches("clear_review", user, batches)


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
) -> Iterator[tuple[list[int], dict[int, str]]]:
    """`act` on batches of emails, each in a transaction of its own; yields after each commit
    the emails acted on, and why not (`why_not`, by default `_why_not`) for the others.
    The batches: `email_ids` in chunks, or the failed runs `filt` lists in keyset batches,
    locked in the batch's transaction so that none changes before it is acted on."""
    if email_ids is not None and filt is not None:
        raise ValueError("either email ids or a filter, not both")
    if size < 1:
        raise ValueError(f"batch size {size}: must be at least 1")
    pending = None if email_ids is None else list(dict.fromkeys(email_ids))
    after = 0
    while True:
        with res.db.transaction() as session:
            if pending is None:
                chunk = _listed(session, filt or FailedFilter(), after, size)
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
    emails: int  # the succeeded runs the filter found (a dry run: what it would take)
    model_calls: int  # what it costs: one call per email with a remote model, none with rules
    reprocess_id: int | None = None  # None for a dry run
    enqueued: int = 0  # jobs sent (an email whose job is queued already gets none)


def reprocess(
    res: Resources,
    filt: EmailFilter,
    step: Step,
    *,
    lane: Lane = Lane.BULK,
    enqueue: Enqueue,
    user: str,
    dry_run: bool = False,
    batch: int = BATCH,
) -> Reprocessed:
    """Run again, from `step`, the emails `filt` finds whose run succeeded: reopened in batches
    under one reprocess (its progress: `status.reprocesses`), their jobs sent in `lane`, the bulk
    one by default. Their classification and labels stay until the new answer replaces them. A
    run already reopened is open, so the same filter twice reopens and sends nothing twice."""
    with res.db.session() as session:
        found = _succeeded(session, filt).subquery()
        emails = session.scalar(select(func.count()).select_from(found)) or 0
    model_calls = emails if res.classifier.remote else 0
    if dry_run or not emails:
        return Reprocessed(emails, model_calls)
    res.redis.ping()  # reopened runs wait for a job: with Redis down, change nothing
    with res.db.transaction() as session:
        record = Reprocess(
            created_by=user,
            from_step=step.value,
            lane=lane.value,
            search={},
            filters=filt.names(),
            emails=emails,
        )
        session.add(record)
        session.flush()
        reprocess_id = record.id
    _audited(f"reprocess_{reprocess_id}_from_{step.value}", user)
    enqueued, after = 0, 0
    while True:
        with res.db.transaction() as session:
            chunk = list(
                session.scalars(
                    _succeeded(session, filt)
                    .where(EmailMessage.id > after)
                    .order_by(EmailMessage.id)
                    .limit(batch)
                )
            )
            if not chunk:
                break
            cpu, model = runs.reopen_to_reprocess(
                session, chunk, reprocess_id, keep_documents=step is Step.CLASSIFY
            )
        after = chunk[-1]
        _logged(f"reprocess_{reprocess_id}", user, cpu + model)
        enqueued += len(enqueue(cpu, TaskName.PROCESS_EMAIL, lane)) if cpu else 0
        enqueued += len(enqueue(model, TaskName.CLASSIFY_EMAIL, lane)) if model else 0
    return Reprocessed(emails, model_calls, reprocess_id, enqueued)


def _succeeded(session: Session, filt: EmailFilter) -> Select[Any]:
    """The emails `filt` finds whose run succeeded, by id, as the search finds them in
    `session`'s transaction (`search.matching`: the same words, through the same indexes). The
    filter's conditions on a run are EXISTS over `pipeline_run`; the run read here is an alias,
    so that they stay its own."""
    run = aliased(PipelineRun)
    return (
        select(EmailMessage.id)
        .join(run, run.email_id == EmailMessage.id)
        .where(*search.matching(session, filt), run.status == RunStatus.SUCCEEDED)
    )


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
        enqueued += len(in_lanes(enqueue, completed, erased.lanes, TaskName.PROCESS_EMAIL))
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
