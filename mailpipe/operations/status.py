"""What `mailpipe status`, `failed`, `review` and `show` report, as plain data."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, not_, select
from sqlalchemy.orm import Session

from mailpipe.broker.layout import queue_stats
from mailpipe.coordination import pauses
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.models import (
    Classification,
    Document,
    EmailLabel,
    EmailMessage,
    PipelineRun,
    RunStatus,
    SweepReport,
)


def fleet_status(res: Resources) -> dict[str, Any]:
    """The JSON contract of `mailpipe status --json` (README), plus the last sweep."""
    with res.db.session() as session:
        emails = session.scalar(select(func.count()).select_from(EmailMessage)) or 0
        no_run = session.scalar(
            select(func.count()).select_from(EmailMessage).where(not_(EmailMessage.has_run))
        )
        counts = dict(
            session.execute(
                select(PipelineRun.status, func.count()).group_by(PipelineRun.status)
            ).all()
        )
        needs_review = session.scalar(
            select(func.count())
            .select_from(EmailMessage)
            .where(EmailMessage.needs_review.is_(True))
        )
        model_calls = flags.model_calls_enabled(session)
        last_sweep = session.scalars(
            select(SweepReport).order_by(SweepReport.id.desc()).limit(1)
        ).first()
    stats = queue_stats(res.redis, res.settings.queue)
    paused = {
        stage.value: {
            "error": pause.error,
            "since": datetime.fromtimestamp(pause.since, UTC).isoformat(),
            "by": pause.by,
        }
        for stage, pause in pauses.paused(res.redis).items()
    }
    return {
        "emails": emails,
        "no_run": no_run or 0,
        "runs": {status.value: counts.get(status, 0) for status in RunStatus},
        "needs_review": needs_review or 0,
        "queue": {"depth": stats.depth, "oldest_age_s": stats.oldest_age_s},
        "model_calls": model_calls,
        "paused": paused,
        "last_sweep": _sweep_dict(last_sweep),
    }


def failed_runs(session: Session, limit: int) -> list[dict[str, Any]]:
    """`mailpipe failed`: the failed runs, the latest first."""
    rows = session.execute(
        select(PipelineRun.email_id, PipelineRun.attempts, PipelineRun.closed_at, PipelineRun.error)
        .where(PipelineRun.status == RunStatus.FAILED)
        .order_by(PipelineRun.closed_at.desc())
        .limit(limit)
    )
    return [
        {
            "email_id": row.email_id,
            "attempts": row.attempts,
            "failed_at": _iso(row.closed_at),
            "error": row.error,
        }
        for row in rows
    ]


def review_list(session: Session, limit: int) -> list[dict[str, Any]]:
    """`mailpipe review`: the emails marked for review and why, the oldest first."""
    rows = session.execute(
        select(EmailMessage.id, EmailMessage.subject, EmailMessage.review_reason)
        # The bare column, as the partial index over the marked emails is written.
        .where(EmailMessage.needs_review)
        .order_by(EmailMessage.id)
        .limit(limit)
    )
    return [
        {"email_id": row.id, "subject": row.subject, "reason": row.review_reason} for row in rows
    ]


def email_detail(session: Session, email_id: int) -> dict[str, Any] | None:
    """`mailpipe show`: the email's run, documents, labels and classification."""
    email = session.get(EmailMessage, email_id)
    if email is None:
        return None
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
    return {
        "id": email.id,
        "subject": email.subject,
        "from": email.sender,
        "size": email.size,
        "blob_key": email.blob_key,
        "received_at": _iso(email.received_at),
        "duplicate_of": email.duplicate_of,
        "needs_review": email.needs_review,
        "review_reason": email.review_reason,
        "run": None
        if run is None
        else {
            "status": run.status.value,
            "attempts": run.attempts,
            "sweep_count": run.sweep_count,
            "error": run.error,
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
                "error": d.error,
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
    }


def _sweep_dict(report: SweepReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {
        "finished_at": _iso(report.finished_at),
        "readded_no_run": report.readded_no_run,
        "readded_stalled": report.readded_stalled,
        "skipped_queued": report.skipped_queued,
        "marked_for_review": report.marked_for_review,
        "queue_depth": report.queue_depth,
        "backlog_per_task": report.backlog_per_task,
    }


def _iso(value: Any) -> str | None:
    return value.isoformat() + "Z" if value is not None else None
