"""The acts on an email's own row that leave its run as it is: the review mark and the lane;
and whether the email is being forgotten, as the database's fence says.

A run's acts that also take an email off the review list (`interventions.reopen`,
`interventions.dismiss`) or put it on (`interventions.fail_stalled`) come through here for that
part.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from mailpipe.broker.queues import Lane
from mailpipe.broker.sending import Place
from mailpipe.resources import Resources
from mailpipe.storage.models import EmailMessage, ForgottenEmail, clip_error


@dataclass(frozen=True)
class Mailbox:
    mailbox: str | None  # as the row holds it: None is the default mailbox


def mailbox_of(res: Resources, email_id: int) -> Mailbox | None:
    """The email's mailbox, in one statement of its own; None when the email has no row."""
    with res.db.transaction() as session:
        found = session.execute(
            select(EmailMessage.mailbox).where(EmailMessage.id == email_id)
        ).first()
    return None if found is None else Mailbox(found.mailbox)


def mailbox_in(session: Session, email_id: int) -> str | None:
    """The email's mailbox as its row holds it (None: the default one, or no row)."""
    return session.scalar(select(EmailMessage.mailbox).where(EmailMessage.id == email_id))


def mark_for_review(session: Session, email_ids: list[int], reason: str) -> None:
    """Put the emails on the review list with `reason`."""
    session.execute(
        update(EmailMessage)
        .where(EmailMessage.id.in_(email_ids))
        .values(needs_review=True, review_reason=clip_error(reason))
    )


def clear_review(session: Session, email_ids: list[int]) -> list[int]:
    """Take the emails among `email_ids` off the review list. Returns the emails that were on
    it."""
    return sorted(
        session.scalars(
            update(EmailMessage)
            .where(EmailMessage.id.in_(email_ids), EmailMessage.needs_review)
            .values(needs_review=False, review_reason=None)
            .returning(EmailMessage.id)
        )
    )


def move(session: Session, email_ids: list[int], lane: Lane) -> list[int]:
    """Put the emails among `email_ids` in `lane`, the lane their next jobs are sent in. Returns
    the emails found (those in it already included)."""
    return sorted(
        session.scalars(
            update(EmailMessage)
            .where(EmailMessage.id.in_(email_ids))
            .values(lane=lane.value)
            .returning(EmailMessage.id)
        )
    )


def places(session: Session, email_ids: list[int]) -> dict[int, Place]:
    """The lane and mailbox of each email among `email_ids`."""
    found = session.execute(
        select(EmailMessage.id, EmailMessage.lane, EmailMessage.mailbox).where(
            EmailMessage.id.in_(email_ids)
        )
    )
    return {row.id: Place(row.lane, row.mailbox) for row in found}


def being_forgotten(session: Session, email_id: int) -> bool:
    """Whether `mailpipe forget` fenced the email off (`forgotten_email`, kept as long as the
    fence in Redis): what a job asks when Redis has no fence, which a Redis restarted without
    its data would not have."""
    found = session.scalar(
        select(ForgottenEmail.email_id).where(ForgottenEmail.email_id == email_id)
    )
    return found is not None
