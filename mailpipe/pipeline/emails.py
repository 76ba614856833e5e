"""The acts on an email's own row that leave its run as it is: the review mark and the lane;
and whether the email is being forgotten, as the database's fence says.

A run's acts that also take an email off the review list (`interventions.reopen`,
`interventions.dismiss`) or put it on (`interventions.fail_stalled`) come through here for that
part.
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from mailpipe.broker.queues import Lane
from mailpipe.storage.models import EmailMessage, ForgottenEmail, clip_error


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


def lanes(session: Session, email_ids: list[int]) -> dict[int, str]:
    """The lane of each email among `email_ids`."""
    return dict(
        session.execute(
            select(EmailMessage.id, EmailMessage.lane).where(EmailMessage.id.in_(email_ids))
        ).all()
    )


def being_forgotten(session: Session, email_id: int) -> bool:
    """Whether `mailpipe forget` fenced the email off (`forgotten_email`, kept as long as the
    fence in Redis): what a job asks when Redis has no fence, which a Redis restarted without
    its data would not have."""
    found = session.scalar(
        select(ForgottenEmail.email_id).where(ForgottenEmail.email_id == email_id)
    )
    return found is not None
