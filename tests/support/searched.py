"""A small set of emails for the search, written straight into the database as the pipeline
leaves them: distinct senders, subjects, Message-IDs (on their origins), received times, labels,
lanes, mailboxes, run states and error classes, a copy (delivered to another mailbox), one marked
for review and one no job has read."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import insert, select, update

from mailpipe.resources import Resources
from mailpipe.storage.models import (
    EmailLabel,
    EmailMessage,
    EmailOrigin,
    PipelineRun,
    RunStatus,
    utcnow,
)

T0 = datetime(2026, 3, 1, 9, 0, 0)


@dataclass(frozen=True)
class Mail:
    name: str
    sender: str | None  # None, with subject and message_id: no job has read it
    subject: str | None
    message_id: str | None  # as the origin stores it: normalised
    hours: int  # received T0 + this many hours
    state: str  # as the search names it
    error_class: str | None = None
    labels: tuple[str, ...] = ()
    lane: str = "live"
    review: bool = False
    copy_of: str | None = None  # the name of the email it is a copy of
    mailbox: str | None = None  # as the row holds it: None is the default mailbox


# In the order they are stored: ids ascending, so the search lists them bottom up.
MAILS = (
    Mail(
        "invoice",
        "Billing <billing@acme.example>",
        "Invoice 2026-0142 for March",
        "inv-0142@acme.example",
        0,
        "succeeded",
        labels=("invoice",),
        mailbox="acme",
    ),
    Mail(
        "newsletter",
        "news@lists.example",
        "This week in storage",
        "week-9@lists.example",
        1,
        "succeeded",
        labels=("newsletter",),
        lane="bulk",
    ),
    Mail(
        "alert",
        "IT Desk <it@corp.example>",
        "Security alert: a new sign-in",
        "alert-7@corp.example",
        2,
        "failed",
        error_class="BlobMissing",
        labels=("security",),
        review=True,
        mailbox="acme",
    ),
    Mail(
        "lunch",
        "carol@corp.example",
        "Lunch on Friday?",
        "lunch-1@corp.example",
        3,
        "open",
        error_class="OperationalError",
        labels=("personal",),
    ),
    Mail(
        "copy",
        "Billing <billing@acme.example>",
        "Invoice 2026-0142 for March",
        "inv-0142@acme.example",
        4,
        "duplicate",
        copy_of="invoice",
        mailbox="globex",
    ),
    Mail(
        "overdue",
        "billing@shop.example",
        "Invoice 2026-0190 overdue",
        "inv-0190@shop.example",
        5,
        "dismissed",
        error_class="InputRejected",
        labels=("invoice",),
        lane="bulk",
        review=True,
    ),
    Mail("unread", None, None, None, 6, "no_run"),
    Mail(
        "wildcards",
        "odd_name%@odd.example",
        "50% off_today",
        "odd@odd.example",
        7,
        "succeeded",
    ),
)


def received(mail: Mail) -> datetime:
    return T0 + timedelta(hours=mail.hours)


def store_searched(res: Resources) -> dict[str, int]:
    """MAILS in the database of `res`; each one's email id by its name."""
    ids: dict[str, int] = {}
    with res.db.transaction() as session:
        for mail in MAILS:
            email_id = session.scalar(
                insert(EmailMessage)
                .values(
                    blob_key=f"raw/{mail.name}",
                    size=1,
                    sha256="0" * 64,
                    received_at=received(mail),
                    sender=mail.sender,
                    subject=mail.subject,
                    lane=mail.lane,
                    mailbox=mail.mailbox,
                    needs_review=mail.review,
                    review_reason="looked odd" if mail.review else None,
                    has_run=mail.state != "no_run",
                )
                .returning(EmailMessage.id)
            )
            assert email_id is not None
            ids[mail.name] = email_id
            if mail.message_id is not None:
                _link_origin(session, mail, email_id, ids)
            if mail.state != "no_run":
                session.execute(
                    insert(PipelineRun).values(
                        email_id=email_id,
                        status=RunStatus.FAILED if mail.state == "dismissed" else mail.state,
                        attempts=1,
                        error_class=mail.error_class,
                        error=None if mail.error_class is None else f"{mail.error_class}: e",
                        dismissed_at=utcnow() if mail.state == "dismissed" else None,
                        closed_at=None if mail.state == "open" else received(mail),
                    )
                )
            for label in mail.labels:
                session.execute(
                    insert(EmailLabel).values(email_id=email_id, label=label, source="rules")
                )
    return ids


def _link_origin(session, mail: Mail, email_id: int, ids: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
    """The origin step's writes: a new origin for a first email, a link for a copy."""
    if mail.copy_of is None:
        origin_id = session.scalar(
            insert(EmailOrigin)
            .values(fingerprint=mail.name, message_id=mail.message_id, first_email_id=email_id)
            .returning(EmailOrigin.id)
        )
        duplicate_of = None
    else:
        origin_id = session.scalar(
            select(EmailOrigin.id).where(EmailOrigin.fingerprint == mail.copy_of)
        )
        duplicate_of = ids[mail.copy_of]
    session.execute(
        update(EmailMessage)
        .where(EmailMessage.id == email_id)
        .values(origin_id=origin_id, duplicate_of=duplicate_of)
    )
