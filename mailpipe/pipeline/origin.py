"""Step 5: record where an email comes from, and link copies to the first one seen.

The fingerprint joins the normalised Message-ID with the sender, date, subject and a hash of the
raw body. A copy delivered twice (other Received lines, same content) shares it; two different
emails never do, even when a sender reuses a Message-ID or leaves it out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from mailpipe.db import insert_ignore
from mailpipe.models import EmailMessage, EmailOrigin
from mailpipe.pipeline.parse import ParsedEmail

FINGERPRINT_VERSION = "v1"


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


def record_origin(session: Session, email: EmailMessage, parsed: ParsedEmail) -> OriginResult:
    """Idempotent: the first email to record a fingerprint owns it, whoever runs it again."""
    key = fingerprint(parsed)
    insert_ignore(
        session,
        EmailOrigin,
        [{"fingerprint": key, "message_id": parsed.message_id, "first_email_id": email.id}],
        ["fingerprint"],
    )
    origin = session.scalars(select(EmailOrigin).where(EmailOrigin.fingerprint == key)).one()
    duplicate_of = None if origin.first_email_id == email.id else origin.first_email_id
    email.origin_id = origin.id
    email.duplicate_of = duplicate_of
    email.subject = parsed.subject[:1000]
    email.sender = parsed.sender[:1000]
    return OriginResult(origin.id, duplicate_of)
