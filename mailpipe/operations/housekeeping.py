"""Housekeeping: what only grows is pruned, by beat's lock holder every
`MAILPIPE_HOUSEKEEPING_INTERVAL` seconds (mailpipe.app.scheduler), once per fleet, or by
`mailpipe housekeeping` (docs/operations.md, "Housekeeping").

- The attempt history of closed runs that closed more than `MAILPIPE_KEEP_ATTEMPTS_DAYS` ago, a
  run's history going whole. An open run keeps its attempts, and so does a failed run on the
  failed list (not dismissed); the run row itself stays, with its status, times and error.
- Sweep reports older than the same.
- The model input of a run that succeeded with the model's answer stored: only a retry of the
  model stage reads it, and a succeeded run has none. A reprocess from `classify` of such an
  email runs its CPU stage again (`interventions.reopen_to_reprocess`).
- The database's fences of forgotten emails (`forgotten_email`) once Redis's lapse
  (`forgotten.fence_ttl`): no delivery of their jobs can come after.

The metrics report prunes its own lane samples. Each batch is a transaction of at most
`MAILPIPE_HOUSEKEEPING_BATCH` rows, read by primary key from where the last batch ended: row
locks on that many rows for milliseconds, never a table's, and a pass's cost grows with what it
deletes and the few old rows it keeps, not with the tables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, exists, not_, select
from sqlalchemy.orm import Session

from mailpipe.coordination import forgotten
from mailpipe.resources import Resources
from mailpipe.storage.models import (
    ForgottenEmail,
    ModelInput,
    PipelineRun,
    RunAttempt,
    RunStatus,
    SweepReport,
    utcnow,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pruned:
    """The rows one pass deleted, per table."""

    attempts: int
    sweep_reports: int
    model_inputs: int
    fences: int = 0

    def summary(self) -> str:
        return (
            f"{self.attempts} attempts, {self.sweep_reports} sweep reports, "
            f"{self.model_inputs} model inputs, {self.fences} fences of forgotten emails"
        )


def prune(res: Resources, now: datetime | None = None) -> Pruned:
    """One pass: every table in turn, batch after batch until nothing is left to delete."""
    settings = res.settings
    now = now or utcnow()
    cutoff = now - timedelta(days=settings.keep_attempts_days)
    lapsed = now - timedelta(seconds=forgotten.fence_ttl(settings))
    batch = settings.housekeeping_batch
    pruned = Pruned(
        attempts=_in_batches(res, lambda s, after: _attempts(s, after, batch, cutoff)),
        sweep_reports=_in_batches(res, lambda s, after: _sweep_reports(s, after, batch, cutoff)),
        model_inputs=_in_batches(res, lambda s, after: _model_inputs(s, after, batch)),
        fences=_in_batches(res, lambda s, after: _fences(s, after, batch, lapsed)),
    )
    log.info("housekeeping: deleted %s", pruned.summary())
    return pruned


# A batch: (the last key it read, or None when it read none; the rows it deleted).
Batch = Callable[[Session, int], tuple[int | None, int]]


def _in_batches(res: Resources, batch: Batch) -> int:
    deleted, after = 0, 0
    while True:
        with res.db.transaction() as session:
            last, count = batch(session, after)
        deleted += count
        if last is None:
            return deleted
        after = last


def _attempts(session: Session, after: int, size: int, cutoff: datetime) -> tuple[int | None, int]:
    """The next `size` attempts older than the cutoff; those of runs closed before it and not
    on the failed list are deleted."""
    ids = _next(session, RunAttempt.id, after, size, RunAttempt.ended_at < cutoff)
    if not ids:
        return None, 0
    gone = exists().where(
        PipelineRun.id == RunAttempt.run_id,
        PipelineRun.status != RunStatus.OPEN,
        PipelineRun.closed_at < cutoff,
        not_(_listed()),
    )
    deleted = session.execute(
        delete(RunAttempt)
        .where(RunAttempt.id.in_(ids), gone)
        .execution_options(synchronize_session=False)
    )
    return ids[-1], _count(deleted)


def _sweep_reports(
    session: Session, after: int, size: int, cutoff: datetime
) -> tuple[int | None, int]:
    return _older(session, SweepReport.id, after, size, SweepReport.started_at < cutoff)


def _fences(session: Session, after: int, size: int, lapsed: datetime) -> tuple[int | None, int]:
    return _older(
        session, ForgottenEmail.email_id, after, size, ForgottenEmail.forgotten_at < lapsed
    )


def _older(session: Session, key: Any, after: int, size: int, old: Any) -> tuple[int | None, int]:
    """The next `size` rows after `after` whose `old` holds, every one deleted."""
    ids = _next(session, key, after, size, old)
    if not ids:
        return None, 0
    deleted = session.execute(
        delete(key.class_).where(key.in_(ids)).execution_options(synchronize_session=False)
    )
    return ids[-1], _count(deleted)


def _model_inputs(session: Session, after: int, size: int) -> tuple[int | None, int]:
    """The next `size` model inputs; those of runs that succeeded with the model's answer
    stored are deleted. The runs are locked (a reprocess that reopens one meanwhile keeps its
    input: the lock waits for it, then the run is seen open) and skipped when locked already."""
    email_ids = _next(session, ModelInput.email_id, after, size)
    if not email_ids:
        return None, 0
    answered = session.scalars(
        select(PipelineRun.email_id)
        .where(
            PipelineRun.email_id.in_(email_ids),
            PipelineRun.status == RunStatus.SUCCEEDED,
            PipelineRun.classified_at.is_not(None),
        )
        .with_for_update(skip_locked=True)
    ).all()
    deleted = 0
    if answered:
        deleted = _count(
            session.execute(
                delete(ModelInput)
                .where(ModelInput.email_id.in_(answered))
                .execution_options(synchronize_session=False)
            )
        )
    return email_ids[-1], deleted


def _next(session: Session, key: Any, after: int, size: int, *where: Any) -> list[int]:
    """The next `size` keys after `after` of the rows that match `where`, in order."""
    return list(session.scalars(select(key).where(key > after, *where).order_by(key).limit(size)))


def _listed() -> Any:
    """A run on the failed list: failed, not dismissed."""
    return and_(PipelineRun.status == RunStatus.FAILED, PipelineRun.dismissed_at.is_(None))


def _count(result: Any) -> int:
    return int(result.rowcount or 0)
