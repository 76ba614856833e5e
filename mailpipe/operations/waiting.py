"""The waiting work by mailbox: which mailboxes have the most, and how long the worst-off one's
oldest email has waited (docs/mailboxes.md, "The mailboxes with waiting work").

An email waits while its run is open, or while it is stored with no run yet. It is aged from
when it began waiting for the stage it is at: its CPU stage from when it was stored, or from
when its ended run was opened again (`reopened_at`: a retry, a reprocess); its model stage from
when its CPU stage handed it on (`converted_at`), or from its reopening when that came later (a
reprocess that keeps the documents). Aged by the email's own time instead, a reprocess of last
year's mail would read as a year of waiting.

Each answer is one grouped statement over the open runs (their partial index) joined to their
emails, and the emails with no run (theirs). Mailbox names are shown to the operator by status
and the console; the metrics report sends none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import CompoundSelect, and_, case, func, literal, not_, select, union_all
from sqlalchemy.orm import Session

from mailpipe.broker import mailboxes
from mailpipe.broker.queues import Lane, Stage
from mailpipe.storage.models import EmailMessage, PipelineRun, RunStatus

# The mailboxes status and the console list.
TOP = 10


@dataclass(frozen=True)
class MailboxWaiting:
    mailbox: str  # as shown: the default mailbox is "default"
    waiting: int  # emails waiting
    oldest_age_s: float  # how long its oldest waiting email has waited


@dataclass(frozen=True)
class TopMailboxes:
    mailboxes: int  # the mailboxes with waiting work
    top: list[MailboxWaiting]  # the TOP with the most, the most first


def _waiting(*, switched: bool) -> CompoundSelect:
    """(stage, lane, mailbox, since) of each waiting email. `switched`: with the runs past their
    CPU stage that wait for model calls to be switched on, which wait for no turn."""
    run, email = PipelineRun, EmailMessage
    since = case(
        (run.converted_at.is_(None), func.coalesce(run.reopened_at, email.created_at)),
        (run.reopened_at > run.converted_at, run.reopened_at),
        else_=run.converted_at,
    )
    stage = case(
        (run.converted_at.is_(None), literal(Stage.CPU.value)), else_=literal(Stage.MODEL.value)
    )
    open_runs = run.status == RunStatus.OPEN
    with_runs = (
        select(
            stage.label("stage"),
            email.lane.label("lane"),
            email.mailbox.label("mailbox"),
            since.label("since"),
        )
        .select_from(run)
        .join(email, email.id == run.email_id)
        .where(open_runs if switched else and_(open_runs, run.waiting_since.is_(None)))
    )
    # The bare column, as the partial index over the emails with no run is written.
    no_run = select(
        literal(Stage.CPU.value).label("stage"),
        email.lane.label("lane"),
        email.mailbox.label("mailbox"),
        email.created_at.label("since"),
    ).where(not_(email.has_run))
    return union_all(with_runs, no_run)


def top_mailboxes(session: Session, now: datetime, limit: int = TOP) -> TopMailboxes:
    """The `limit` mailboxes with the most waiting work, each with its count and its oldest
    email's age at `now` (naive UTC), and how many mailboxes have waiting work: the most first,
    then the longest waiting, then by name."""
    waiting = _waiting(switched=True).subquery()
    oldest = func.min(waiting.c.since).label("oldest")
    count = func.count().label("waiting")
    per = select(waiting.c.mailbox, count, oldest).group_by(waiting.c.mailbox).subquery()
    rows = session.execute(
        select(per.c.mailbox, per.c.waiting, per.c.oldest, func.count().over().label("total"))
        .order_by(
            per.c.waiting.desc(), per.c.oldest, func.coalesce(per.c.mailbox, "").label("name")
        )
        .limit(limit)
    ).all()
    return TopMailboxes(
        mailboxes=rows[0].total if rows else 0,
        top=[
            MailboxWaiting(
                mailbox=mailboxes.shown(row.mailbox),
                waiting=row.waiting,
                oldest_age_s=_age(now, row.oldest),
            )
            for row in rows
        ],
    )


def oldest_mailbox_waits(session: Session, now: datetime) -> dict[tuple[Stage, Lane], float]:
    """For each stage and lane, the largest over its mailboxes of the age at `now` of each one's
    oldest waiting email, leaving out the mailbox with the most waiting work there (of two with
    as much, the one whose oldest email is younger): a flood alone reads 0, a mailbox starved
    behind it its wait. 0 where no other mailbox waits. The runs that wait for model calls to be
    switched on wait for the switch, not their turn, and are left out."""
    waiting = _waiting(switched=False).subquery()
    per = (
        select(
            waiting.c.stage,
            waiting.c.lane,
            func.count().label("waiting"),
            func.min(waiting.c.since).label("oldest"),
        )
        .group_by(waiting.c.stage, waiting.c.lane, waiting.c.mailbox)
        .subquery()
    )
    ranked = select(
        per,
        func.row_number()
        .over(
            partition_by=(per.c.stage, per.c.lane),
            order_by=(per.c.waiting.desc(), per.c.oldest.desc()),
        )
        .label("rank"),
    ).subquery()
    found = {
        (Stage(stage), Lane(lane)): _age(now, oldest)
        for stage, lane, oldest in session.execute(
            select(ranked.c.stage, ranked.c.lane, func.min(ranked.c.oldest))
            .where(ranked.c.rank > 1)
            .group_by(ranked.c.stage, ranked.c.lane)
        )
    }
    return {(stage, lane): found.get((stage, lane), 0.0) for stage in Stage for lane in Lane}


def _age(now: datetime, since: datetime) -> float:
    return max(0.0, round((now - since).total_seconds(), 3))
