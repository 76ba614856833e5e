"""Step 5: record where an email comes from, and link copies to the first one seen.

The fingerprint joins the normalised Message-ID with the sender, date, subject and a hash of the
raw body. A copy delivered twice (other Received lines, same content) shares it; two different
emails never do, even when a sender reuses a Message-ID or leaves it out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from email.utils import getaddresses

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from mailpipe.mail.parse import ParsedEmail
from mailpipe.storage.db import insert_ignore
from mailpipe.storage.models import EmailMessage, EmailOrigin, table

FINGERPRINT_VERSION = "v1"
# What `email_message` keeps of a subject and of a From header as it came; a longer From keeps
# its addresses alone, each whole, up to MAX_ADDRESSES_CHARS (`stored_sender`).
MAX_HEADER_CHARS = 1000
MAX_ADDRESSES_CHARS = 64 * 1024

_EMAIL = table(EmailMessage)
# The columns to SET come from the parameters given with it.
_LINK = update(_EMAIL).where(_EMAIL.c.id == bindparam("link_email_id"))


def fingerprint(parsed: ParsedEmail) -> str:
    fields = (
        FINGERPRINT_VERSION,
        parsed.message_id or "",
        parsed.sender,
        parsed.date or "",
        parsed.subject,
        parsed.body_sha256,
    )
    return hashlib.sha256("\0".join(fields).encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class OriginResult:
    origin_id: int
    duplicate_of: int | None  # the first email with this origin, when this one is a copy
    recorded: bool = False  # recorded in this transaction: no copy can be linked to it yet


def find_origin(session: Session, email_id: int, parsed: ParsedEmail) -> OriginResult:
    """Idempotent: the first email to record a fingerprint owns it, whoever runs it again.

    One statement for a new origin (the insert returns its id), two for a copy (the insert yields
    nothing, the existing origin is read, and locked: its first email's label sync and a copy's
    labels wait for each other, `labels.copy_labels`). It locks neither the run nor the email
    row, so a transaction may run it before it locks the run."""
    key = fingerprint(parsed)
    inserted = insert_ignore(
        session,
        EmailOrigin,
        [{"fingerprint": key, "message_id": parsed.message_id, "first_email_id": email_id}],
        ["fingerprint"],
        EmailOrigin.id,
    )
    if inserted:
        return OriginResult(inserted[0], None, recorded=True)
    origin_id, first_email_id = session.execute(
        select(EmailOrigin.id, EmailOrigin.first_email_id)
        .where(EmailOrigin.fingerprint == key)
        .with_for_update(key_share=True)
    ).one()
    return OriginResult(origin_id, None if first_email_id == email_id else first_email_id)


def link_to_origin(
    session: Session, email_id: int, parsed: ParsedEmail, origin: OriginResult
) -> None:
    """Point the email row at its origin (and at the first email, for a copy), by id, unread."""
    link = {
        "origin_id": origin.origin_id,
        "duplicate_of": origin.duplicate_of,
        "subject": parsed.subject[:MAX_HEADER_CHARS],
        "sender": stored_sender(parsed.sender),
    }
    session.execute(_LINK, {"link_email_id": email_id, **link})


def stored_sender(sender: str) -> str:
    """The From header as `email_message.sender` keeps it, which the search and a forget by
    sender read: as it came when it is short; else its addresses alone, each whole, without the
    display names that made it long (a header cut short could lose the very address a forget
    looks for). Addresses past MAX_ADDRESSES_CHARS in all are left out, whole."""
    if len(sender) <= MAX_HEADER_CHARS:
        return sender
    kept: list[str] = []
    size = 0
    for _, address in getaddresses([sender]):
        if address and size + len(address) + 2 <= MAX_ADDRESSES_CHARS:
            kept.append(address)
            size += len(address) + 2
    return ", ".join(kept) or sender[:MAX_HEADER_CHARS]
