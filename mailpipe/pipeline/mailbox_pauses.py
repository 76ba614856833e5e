"""Paused mailboxes: which they are, with the pauses a flushed or restarted Redis lost put back
from the database first, and which of their emails wait for the resume.

A delivery of a paused mailbox's job ends without claiming anything (mailpipe.pipeline.job), and
the sweeper leaves the mailbox's emails alone, so what waits is what the database says: the
mailbox's open runs and its emails with no run yet. Its resume sends their jobs again. It never
imports Celery.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, Select, func, not_, select
from sqlalchemy.orm import Session

from mailpipe.coordination import pauses
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.models import EmailMessage, PipelineRun, RunStatus


def in_force(res: Resources) -> dict[str, pauses.MailboxPause]:
    """Every paused mailbox, by the name shown; the kept pauses Redis lost are put back on the
    way."""
    found = pauses.paused_mailboxes_if_known(res.redis)
    return restore(res) if found is None else found


def restore(res: Resources) -> dict[str, pauses.MailboxPause]:
    """Put the mailbox pauses the database keeps back into Redis; every paused mailbox. The kept
    rows are held while Redis is written, so that a resume meanwhile waits and then removes what
    was put back."""
    with res.db.transaction() as session:
        return pauses.restore_mailboxes(res.redis, flags.mailbox_pauses(session, hold=True))


def _of(mailbox: str | None) -> ColumnElement[bool]:
    """The emails of `mailbox`, as the column holds it (None: the default mailbox)."""
    column = EmailMessage.mailbox
    return column.is_(None) if mailbox is None else column == mailbox


def open_runs(mailbox: str | None, after_id: int, limit: int) -> Select:
    """A keyset batch, by email id, of the mailbox's open runs, with each one's lane and mailbox,
    whether its CPU stage is done and whether it waits for model calls."""
    return (
        select(
            PipelineRun.email_id,
            EmailMessage.lane,
            EmailMessage.mailbox,
            PipelineRun.converted_at.is_not(None).label("converted"),
            PipelineRun.waiting_since.is_not(None).label("waiting"),
        )
        .join(EmailMessage, EmailMessage.id == PipelineRun.email_id)
        .where(PipelineRun.status == RunStatus.OPEN, _of(mailbox), PipelineRun.email_id > after_id)
        .order_by(PipelineRun.email_id)
        .limit(limit)
    )


def without_run(mailbox: str | None, after_id: int, limit: int) -> Select:
    """A keyset batch of the mailbox's emails that have no run yet, with their lane and mailbox,
    from the partial index over them."""
    return (
        select(EmailMessage.id, EmailMessage.lane, EmailMessage.mailbox)
        .where(not_(EmailMessage.has_run), _of(mailbox), EmailMessage.id > after_id)
        .order_by(EmailMessage.id)
        .limit(limit)
    )


def waiting(session: Session, mailbox: str | None) -> int:
    """How many of the mailbox's emails wait for their job: its open runs and its emails with no
    run, each counted from its small partial index."""
    runs = select(func.count()).select_from(PipelineRun)
    runs = runs.join(EmailMessage, EmailMessage.id == PipelineRun.email_id)
    open_count = session.scalar(runs.where(PipelineRun.status == RunStatus.OPEN, _of(mailbox)))
    no_run = session.scalar(
        select(func.count())
        .select_from(EmailMessage)
        .where(not_(EmailMessage.has_run), _of(mailbox))
    )
    return (open_count or 0) + (no_run or 0)
