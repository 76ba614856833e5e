"""Step 4: read raw bytes as an email, defensively.

Emails come from strangers. Size, nesting depth and part count are bounded before anything large
is built; every header read is guarded (the standard library raises on some malformed headers
only when they are read); text is decoded with charset fallbacks. An email that breaks a limit
raises `InputRejected`, which fails its run without a retry.
"""

from __future__ import annotations

import email
import email.header
import email.policy
import email.utils
import hashlib
from dataclasses import dataclass
import email.parser
from email.message import Message

from mailpipe.errors import InputRejected
from mailpipe.text import decode_text, html_to_text


# An email, or a MIME entity stored as one (a bounce's delivery-status part), has at least one.
_EMAIL_HEADERS = {"from", "to", "date", "subject", "message-id", "mime-version", "content-type"}


@dataclass(frozen=True)
class ParseLimits:
    max_bytes: int
    max_depth: int
    max_parts: int
    body_max_chars: int


@dataclass(frozen=True)
class Attachment:
    """One attachment part. `filename` is untrusted text: never a path."""

    index: int  # position of the part in a depth-first walk of the email; stable across runs
    filename: str | None
    content_type: str  # lowercase maintype/subtype as declared
    payload: bytes  # transfer-decoded bytes; the whole attached email for message/rfc822
    charset: str | None
    depth: int
    error: str | None = None  # set when the payload could not be extracted


@dataclass(frozen=True)
class ParsedEmail:
    message_id: str | None  # normalised: no angle brackets or white space, lowercase
    subject: str
    sender: str
    recipients: tuple[str, ...]
    date: str | None
    body_text: str
    attachments: tuple[Attachment, ...]
    body_sha256: str  # hash of the raw bytes after the header block
    part_count: int
    defect_count: int


def parse_email(raw: bytes, limits: ParseLimits) -> ParsedEmail:
    if len(raw) > limits.max_bytes:
        raise InputRejected(f"email is {len(raw)} bytes, over the limit of {limits.max_bytes}")
    if not raw.strip():
        raise InputRejected("email is empty")
    try:
        message = email.message_from_bytes(raw, policy=email.policy.default)
    except RecursionError:
        raise InputRejected("MIME structure is nested too deeply to parse") from None
    if not _looks_like_email(message):
        raise InputRejected("not an email: no header block (From, To, Subject, Content-Type, ...)")

    body_plain: list[str] = []
    body_html: list[str] = []
    attachments: list[Attachment] = []
    part_count = 0
    defect_count = len(message.defects)
    stack: list[tuple[Message, int]] = [(message, 0)]
    while stack:
        part, depth = stack.pop()
        part_count += 1
        if part_count > limits.max_parts:
            raise InputRejected(f"email has more than {limits.max_parts} MIME parts")
        if depth > limits.max_depth:
            raise InputRejected(f"MIME parts nested deeper than {limits.max_depth} levels")
        defect_count += len(part.defects)
        content_type = _content_type(part)
        if part.is_multipart() and content_type.startswith("multipart/"):
            children = part.get_payload()
            if isinstance(children, list):
                stack.extend((child, depth + 1) for child in reversed(children))
                continue
        if _is_attachment(part, content_type, depth):
            attachments.append(_attachment(part, content_type, len(attachments), depth))
        elif content_type == "text/html":
            body_html.append(_part_text(part))
        else:
            body_plain.append(_part_text(part))

    body = "\n\n".join(t for t in body_plain if t.strip())
    if not body.strip() and body_html:
        body = "\n\n".join(html_to_text(h) for h in body_html)
    return ParsedEmail(
        message_id=normalise_message_id(header(message, "Message-ID")),
        subject=header(message, "Subject"),
        sender=header(message, "From"),
        recipients=tuple(
            addr for name in ("To", "Cc") for addr in _addresses(header(message, name)) if addr
        ),
        date=header(message, "Date") or None,
        body_text=body[: limits.body_max_chars],
        attachments=tuple(attachments),
        body_sha256=hashlib.sha256(_raw_body(raw)).hexdigest(),
        part_count=part_count,
        defect_count=defect_count,
    )


# The default policy parses a header into a token tree when it is read: a 200 KB Subject (a real
# one, in the shared corpus) took 0.54 s and 350 MB at its peak, enough to recycle the worker
# child that read it. A header this long is decoded by the plain RFC 2047 decoder instead, which
# gives the same text for an unstructured header and the raw addresses for an address header.
LONG_HEADER_CHARS = 4096


def header(message: Message, name: str) -> str:
    """A header's decoded value, or "" when absent. Never raises.

    The default policy parses a header when it is read and raises on some malformed ones; then the
    raw value is decoded by hand, and failing that returned as it is. Headers longer than
    LONG_HEADER_CHARS are always decoded by hand.
    """
    raw_value = next(
        (value for key, value in message.raw_items() if key.lower() == name.lower()), None
    )
    if raw_value is None:
        return ""
    if len(raw_value) > LONG_HEADER_CHARS:
        return _decode_raw_header(str(raw_value))
    try:
        value = message.get(name)
        return "" if value is None else str(value).strip()
    except Exception:  # noqa: BLE001 - the stdlib raises many types here; the raw value follows
        return _decode_raw_header(str(raw_value))


def normalise_message_id(value: str) -> str | None:
    value = "".join(value.split()).strip("<>").lower()
    return value or None


def _decode_raw_header(value: str) -> str:
    try:
        chunks = email.header.decode_header(value)
        return "".join(
            decode_text(chunk, charset) if isinstance(chunk, bytes) else chunk
            for chunk, charset in chunks
        ).strip()
    except Exception:  # noqa: BLE001 - an undecodable header is kept as the raw text it is
        return value.strip()


def _looks_like_email(message: Message) -> bool:
    names = {key.lower() for key, _ in message.raw_items()}
    return bool(names & _EMAIL_HEADERS)


def looks_like_email(raw: bytes) -> bool:
    """A cheap check for ingest: does the start of `raw` read as an email header block?"""
    head = raw[:65536].partition(b"\n\n")[0].partition(b"\r\n\r\n")[0]
    message = email.parser.BytesHeaderParser(policy=email.policy.compat32).parsebytes(head)
    return bool(raw.strip()) and _looks_like_email(message)


def _content_type(part: Message) -> str:
    try:
        return part.get_content_type().lower()
    except Exception:  # noqa: BLE001 - a broken Content-Type reads as the RFC 2045 default
        return "text/plain"


def _filename(part: Message) -> str | None:
    try:
        return part.get_filename()
    except Exception:  # noqa: BLE001 - a filename we cannot decode is treated as missing
        return None


def _is_attachment(part: Message, content_type: str, depth: int) -> bool:
    if content_type == "message/rfc822":
        return True
    try:
        disposition = part.get_content_disposition()
    except Exception:  # noqa: BLE001 - an unreadable disposition says nothing either way
        disposition = None
    if disposition == "attachment" or _filename(part):
        return True
    return not content_type.startswith("text/") and depth > 0


def _attachment(part: Message, content_type: str, index: int, depth: int) -> Attachment:
    filename = _filename(part)
    charset = _charset(part)
    try:
        payload = _payload_bytes(part, content_type)
    except Exception as exc:  # noqa: BLE001 - recorded on the document, the email goes on
        return Attachment(index, filename, content_type, b"", charset, depth, error=repr(exc))
    return Attachment(index, filename, content_type, payload, charset, depth)


def _payload_bytes(part: Message, content_type: str) -> bytes:
    if content_type == "message/rfc822":
        inner = part.get_payload()
        if isinstance(inner, list) and inner:
            try:
                return inner[0].as_bytes()
            except Exception:  # noqa: BLE001 - compat32 folds broken headers without raising
                return inner[0].as_bytes(policy=email.policy.compat32)
    payload = part.get_payload(decode=True)
    return payload if isinstance(payload, bytes) else b""


def _charset(part: Message) -> str | None:
    try:
        return part.get_content_charset()
    except Exception:  # noqa: BLE001 - an unreadable charset falls back to detection
        return None


def _part_text(part: Message) -> str:
    try:
        payload = part.get_payload(decode=True)
    except Exception:  # noqa: BLE001 - an undecodable body part contributes no text
        return ""
    if not isinstance(payload, bytes):
        return ""
    return decode_text(payload, _charset(part))


def _addresses(value: str) -> list[str]:
    try:
        return [addr for _, addr in email.utils.getaddresses([value])]
    except Exception:  # noqa: BLE001 - unparsable address lists carry no addresses
        return []


def _raw_body(raw: bytes) -> bytes:
    for separator in (b"\r\n\r\n", b"\n\n"):
        head, found, body = raw.partition(separator)
        if found:
            return body
    return b""
