from __future__ import annotations

import pytest
from sqlalchemy import select

from mailpipe.classifiers import LabelScore
from mailpipe.cli.ingest import store_emails
from mailpipe.mail.parse import ParseLimits, parse_email
from mailpipe.pipeline.labels import sync_model_labels
from mailpipe.pipeline.origin import (
    MAX_ADDRESSES_CHARS,
    find_origin,
    fingerprint,
    link_to_origin,
    stored_sender,
)
from mailpipe.storage.models import EmailLabel, EmailMessage, EmailOrigin

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

LIMITS = ParseLimits(1 << 20, 25, 100, 10_000)


def email(message_id: str | None, body: str, received: str = "mx1") -> bytes:
    mid = f"Message-ID: <{message_id}>\r\n" if message_id else ""
    return (
        f"Received: from {received}\r\nFrom: a@example.org\r\nSubject: hello\r\n"
        f"Date: Mon, 30 Nov 2026 10:00:00 +0000\r\n{mid}\r\n{body}\r\n"
    ).encode()


def test_fingerprint_links_copies_and_keeps_different_emails_apart() -> None:
    same_a = parse_email(email("m1@x", "body", received="mx1"), LIMITS)
    same_b = parse_email(email("M1@X", "body", received="mx2"), LIMITS)
    reused_id = parse_email(email("m1@x", "another body"), LIMITS)
    no_id_1 = parse_email(email(None, "first"), LIMITS)
    no_id_2 = parse_email(email(None, "second"), LIMITS)
    assert fingerprint(same_a) == fingerprint(same_b)
    assert fingerprint(same_a) != fingerprint(reused_id)
    assert fingerprint(no_id_1) != fingerprint(no_id_2)


def test_the_origin_is_idempotent_and_links_the_copy(res) -> None:  # type: ignore[no-untyped-def]
    first_id, copy_id = store_emails(res, [email("m1@x", "b", "mx1"), email("m1@x", "b", "mx2")])
    first_email = parse_email(email("m1@x", "b", "mx1"), LIMITS)
    copy_email = parse_email(email("m1@x", "b", "mx2"), LIMITS)
    for _ in range(2):  # running the step twice changes nothing
        with res.db.transaction() as session:
            first = find_origin(session, first_id, first_email)
            link_to_origin(session, first_id, first_email, first)
            copy = find_origin(session, copy_id, copy_email)
            link_to_origin(session, copy_id, copy_email, copy)
        assert first.duplicate_of is None
        assert copy.duplicate_of == first_id
        assert copy.origin_id == first.origin_id
    with res.db.session() as session:
        assert session.scalar(select(EmailOrigin.first_email_id)) == first_id
        assert len(session.scalars(select(EmailOrigin)).all()) == 1
        assert session.get_one(EmailMessage, copy_id).duplicate_of == first_id


def test_label_sync_adds_removes_and_keeps_other_sources(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [email("m2@x", "b")])
    with res.db.transaction() as session:
        session.add(EmailLabel(email_id=email_id, label="vip", source="person", confidence=None))
        sync_model_labels(session, email_id, [LabelScore("invoice", 0.8), LabelScore("spam", 0.6)])
    with res.db.transaction() as session:
        sync_model_labels(session, email_id, [LabelScore("invoice", 0.9), LabelScore("vip", 0.5)])
    with res.db.session() as session:
        rows = {
            (row.label, row.source, row.confidence)
            for row in session.scalars(select(EmailLabel).where(EmailLabel.email_id == email_id))
        }
    # spam removed (stale model label); invoice updated; vip kept as the person's label.
    assert rows == {("invoice", "model", 0.9), ("vip", "person", None)}


def test_a_long_from_header_is_kept_as_its_addresses_whole() -> None:
    name = " ".join(f"Dora{n:04d}" for n in range(150))  # 1,349 characters
    assert stored_sender("Dora <dora@acme.example>") == "Dora <dora@acme.example>"
    assert stored_sender(f"{name} <dora@acme.example>") == "dora@acme.example"
    assert stored_sender(f"{name} <dora@acme.example>, b@x.example") == (
        "dora@acme.example, b@x.example"
    )
    many = ", ".join(f"user{n:05d}@example.org" for n in range(5000))  # 130,000 characters
    kept = stored_sender(many).split(", ")
    assert kept[0] == "user00000@example.org" and len(", ".join(kept)) <= MAX_ADDRESSES_CHARS
    assert all(address.endswith("@example.org") for address in kept)
