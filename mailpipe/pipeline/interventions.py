"""What is done to runs from outside a delivery: the operator's acts (retry, dismiss and undo,
reprocess), the sweeper's (count a re-added job, stop waiting, fail a stalled run) and erasure's
(close before the deletion, hand an origin on to its copies).

None of these holds a claim. Each locks or updates the runs it acts on in the caller's
transaction, and bumps no claim token: a delivery in flight is fenced off at its next write
whenever the act closed or reopened its run (mailpipe.pipeline.runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, update
from sqlalchemy.orm import Session

from mailpipe.pipeline import emails, runs
from mailpipe.storage.models import (
    ErrorClass,
    ModelInput,
    PipelineRun,
    Reprocess,
    RunStatus,
    utcnow,
)


def count_sweep(session: Session, email_ids: list[int]) -> None:
    """The sweeper re-added the jobs of these open runs."""
    session.execute(
        update(PipelineRun)
        .where(PipelineRun.email_id.in_(email_ids), PipelineRun.status == RunStatus.OPEN)
        .values(sweep_count=PipelineRun.sweep_count + 1, last_swept_at=utcnow())
    )


def start_waiting(session: Session, email_ids: list[int], read_at: datetime) -> None:
    """The sweeper sent the model stage of these runs, which waited for model calls: they wait
    no more. A run that began waiting again after `read_at` (its stage met the switch off once
    more) keeps waiting."""
    session.execute(
        update(PipelineRun)
        .where(
            PipelineRun.email_id.in_(email_ids),
            PipelineRun.status == RunStatus.OPEN,
            PipelineRun.waiting_since <= read_at,
        )
        .values(waiting_since=None)
    )


def fail_stalled(session: Session, email_ids: list[int], reason: str) -> list[int]:
    """Fail the open runs among `email_ids` and put their emails on the review list: their jobs
    were lost more often than the sweeper re-adds one. Returns the emails failed. No attempt's
    row is written: the jobs are lost, not running (one still running is fenced off), and the
    run's error (`Stalled`) says what happened."""
    failed = list(
        session.scalars(
            update(PipelineRun)
            .where(PipelineRun.email_id.in_(email_ids), PipelineRun.status == RunStatus.OPEN)
            .values(runs.closed_columns(RunStatus.FAILED, reason, ErrorClass.STALLED))
            .returning(PipelineRun.email_id)
        )
    )
    if failed:
        emails.mark_for_review(session, failed, reason)
    return failed


def close_to_forget(session: Session, email_ids: list[int], reason: str) -> None:
    """Fail the open runs of emails about to be forgotten, creating those missing, from outside
    any claim (erasure, which deletes them next): a delivery in flight is fenced off at its next
    write, and none claims another attempt. Should the deletion not follow, the run is on the
    failed list, with `reason`."""
    runs.ensure_runs(session, email_ids)
    session.execute(
        update(PipelineRun)
        .where(PipelineRun.email_id.in_(email_ids), PipelineRun.status == RunStatus.OPEN)
        .values(runs.closed_columns(RunStatus.FAILED, reason, ErrorClass.FORGOTTEN))
    )


def reopen(session: Session, email_id: int) -> bool:
    """Put a failed run back to open with a fresh attempt budget (`mailpipe failed --retry`).
    Its classification is kept but no longer counts: the reopened run calls the model again.
    The email leaves the review list in the same transaction: the operator's retry answers the
    review, and a run that stalls again is marked again by the sweeper. Its claims go on growing:
    a delivery of before the reopen stays fenced off. Its error is cleared: each attempt's
    error stays in the history."""
    run = session.scalars(
        select(PipelineRun).where(PipelineRun.email_id == email_id).with_for_update()
    ).one_or_none()
    if run is None or run.status is not RunStatus.FAILED:
        return False
    _reopen(run)
    # A manual retry runs the whole job again, the CPU stage included.
    run.converted_at = None
    emails.clear_review(session, [email_id])
    return True


def _reopen(run: PipelineRun) -> None:
    """Open a locked run that ended, with a fresh attempt budget, no error, and no answer that
    counts: its model stage calls the model again."""
    run.status = RunStatus.OPEN
    run.error = None
    run.error_class = None
    run.attempts = 0
    run.sweep_count = 0
    run.cutoffs = 0
    run.attempt_started_at = None
    run.classified_at = None
    # Asked for by its id, a dismissed run is taken back onto the failed list should it fail again.
    run.dismissed_at = None
    run.closed_at = None
    run.reopened_at = utcnow()


def reopen_failed(
    session: Session, email_ids: list[int] | None
) -> tuple[list[int], dict[int, RunStatus]]:
    """Reopen the failed runs among `email_ids` (None: every failed run). Returns the emails
    reopened and the status each asked-for email's run had (no entry: it has no run). A dismissed
    run among `email_ids` is reopened too; None passes over them."""
    query = select(PipelineRun.email_id, PipelineRun.status).order_by(PipelineRun.email_id)
    if email_ids is None:
        query = query.where(
            PipelineRun.status == RunStatus.FAILED, PipelineRun.dismissed_at.is_(None)
        )
    else:
        query = query.where(PipelineRun.email_id.in_(email_ids))
    # Locked, so that the statuses read are those reopen finds.
    statuses: dict[int, RunStatus] = dict(session.execute(query.with_for_update()).all())
    reopened = [
        email_id
        for email_id, status in statuses.items()
        if status is RunStatus.FAILED and reopen(session, email_id)
    ]
    return reopened, statuses


def dismiss(session: Session, email_ids: list[int]) -> list[int]:
    """An operator gives up on the failed runs among `email_ids` not dismissed yet: each stays
    failed, leaves the failed list and the review list, and no retry-all or sweep reopens it (a
    retry by its id does). Returns the emails dismissed."""
    dismissed = _set_dismissed(session, email_ids, utcnow())
    if dismissed:
        emails.clear_review(session, dismissed)
    return dismissed


def undismiss(session: Session, email_ids: list[int]) -> list[int]:
    """Take the operator's dismiss back from the dismissed runs among `email_ids`: each is on
    the failed list again, as it was. Returns the emails taken back."""
    return _set_dismissed(session, email_ids, None)


def _set_dismissed(session: Session, email_ids: list[int], at: datetime | None) -> list[int]:
    """Dismiss the failed runs among `email_ids` at `at`, or with None take their dismiss back,
    each only if it is not so already. Returns the emails changed, in order."""
    dismissed = PipelineRun.dismissed_at.is_not(None)
    changed = dismissed if at is None else ~dismissed
    return sorted(
        session.scalars(
            update(PipelineRun)
            .where(
                PipelineRun.email_id.in_(email_ids),
                PipelineRun.status == RunStatus.FAILED,
                changed,
            )
            .values(dismissed_at=at)
            .returning(PipelineRun.email_id)
        )
    )


@dataclass(frozen=True)
class Reprocessing:
    """The runs a reprocess counted at `as_of` (the latest reprocess then) leaves alone: those a
    reprocess after it took, since it was counted, and those of the reprocesses up to it that
    are still under way (`busy`: a run of theirs is open). So the same reprocess sent again, or
    twice at once, takes no email twice; one sent once the first has ended takes them anew."""

    as_of: int
    busy: tuple[int, ...]

    def free(self, run: Any = PipelineRun) -> ColumnElement[bool]:
        """Whether `run` (the model or an alias of it) is one a reprocess may take."""
        taken = run.reprocess_id
        return or_(taken.is_(None), and_(taken <= self.as_of, taken.not_in(self.busy)))


def reprocessing(session: Session, as_of: int | None = None) -> Reprocessing:
    """What a reprocess counted now leaves alone; `as_of`: as counted when the latest reprocess
    was that one (a plan confirmed later), never past the latest there is."""
    latest = session.scalar(select(func.max(Reprocess.id))) or 0
    as_of = latest if as_of is None else min(as_of, latest)
    busy = session.scalars(
        select(Reprocess.id)
        .where(
            Reprocess.id <= as_of,
            select(PipelineRun.id)
            .where(PipelineRun.reprocess_id == Reprocess.id, PipelineRun.status == RunStatus.OPEN)
            .exists(),
        )
        .order_by(Reprocess.id)
    )
    return Reprocessing(as_of, tuple(busy))


def reopen_to_reprocess(
    session: Session,
    email_ids: list[int],
    reprocess_id: int,
    *,
    keep_documents: bool,
    leaving: Reprocessing,
) -> tuple[list[int], list[int]]:
    """Reopen the succeeded runs among `email_ids` for an operator's reprocess `reprocess_id`,
    with a fresh attempt budget, locked so that none changes meanwhile, but those `leaving`
    leaves alone, as they are once locked (another reprocess may have taken one since it was
    read). `keep_documents`: a run whose documents and model input are stored goes on from its
    model stage; any other runs its CPU stage again. The classification and labels stay until
    the new answer replaces them; the runs' claims go on growing, so no delivery of before is
    taken for a new one. Returns the emails whose CPU stage runs next, and those whose model
    stage does."""
    runs = _locked_runs(session, email_ids, RunStatus.SUCCEEDED, leaving.free())
    with_input = set(
        session.scalars(
            select(ModelInput.email_id).where(ModelInput.email_id.in_([r.email_id for r in runs]))
        )
    )
    cpu: list[int] = []
    model: list[int] = []
    for run in runs:
        from_model = keep_documents and run.converted_at is not None and run.email_id in with_input
        _reopen(run)
        run.reprocess_id = reprocess_id
        if not from_model:
            run.converted_at = None
        (model if from_model else cpu).append(run.email_id)
    return cpu, model


def reopen_copies(session: Session, email_ids: list[int]) -> list[int]:
    """Reopen the runs among `email_ids` that ended as a copy's (`duplicate`), each email now
    its origin's first (the email it copied is being forgotten), with a fresh attempt budget:
    its job runs the steps a copy skips, the CPU stage from the parse, then the model stage.
    Locked, so that none changes meanwhile. Returns the emails reopened."""
    found = _locked_runs(session, email_ids, RunStatus.DUPLICATE)
    for run in found:
        _reopen(run)
        run.converted_at = None
    return [run.email_id for run in found]


def _locked_runs(
    session: Session, email_ids: list[int], status: RunStatus, *also: ColumnElement[bool]
) -> list[PipelineRun]:
    """The runs among `email_ids` with `status` (and the conditions `also`), locked, in email
    order."""
    return list(
        session.scalars(
            select(PipelineRun)
            .where(PipelineRun.email_id.in_(email_ids), PipelineRun.status == status, *also)
            .order_by(PipelineRun.email_id)
            .with_for_update()
        )
    )
