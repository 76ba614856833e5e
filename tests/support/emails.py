"""Emails built for tests: `raw_email` for ordinary mail, and shapes that real mail only
rarely has. Tests whose point is the exact bytes (malformed MIME, hostile input, header-parsing
edge cases) write them out instead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from email.message import EmailMessage
from email.policy import SMTP

BOUNDARY = "mailpipe-test-part"  # base64 parts and test bodies never hold it


def raw_email(
    subject: str = "hello",
    *,
    sender: str = "a@example.org",
    to: str | None = None,
    body: str = "hello",
    message_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    attachments: Sequence[tuple[str, str, bytes]] = (),
) -> bytes:
    """An email's bytes as a mail client writes them (CRLF line ends): a text body and each
    attachment as (filename, content type, bytes). `message_id` without angle brackets gets
    them; no `message_id`, no Message-ID header."""
    message = EmailMessage()
    message["From"] = sender
    if to is not None:
        message["To"] = to
    message["Subject"] = subject
    if message_id is not None:
        message["Message-ID"] = message_id if message_id.startswith("<") else f"<{message_id}>"
    for name, value in (headers or {}).items():
        message[name] = value
    message.set_content(body)
    for filename, content_type, data in attachments:
        maintype, subtype = content_type.split("/", 1)
        message.add_attachment(data, maintype=maintype, subtype=subtype, filename=filename)
    if attachments:
        message.set_boundary(BOUNDARY)  # the stdlib's is random: the same email, the same bytes
    return message.as_bytes(policy=SMTP)


def nested_multipart(levels: int) -> bytes:
    head = b"".join(
        b'Content-Type: multipart/mixed; boundary="b%d"\r\n\r\n--b%d\r\n' % (i, i)
        for i in range(levels)
    )
    tail = b"".join(b"\r\n--b%d--\r\n" % i for i in reversed(range(levels)))
    return (
        b"From: a@example.org\r\nSubject: deep\r\n"
        + head
        + b"Content-Type: text/plain\r\n\r\nhi"
        + tail
    )
