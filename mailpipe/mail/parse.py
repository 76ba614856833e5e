"""Step 4: read raw bytes as an email, defensively.

Emails come from strangers. Size, lines, header blocks, MIME headers, part count and nesting
depth are bounded by a pre-scan of the bytes (`mailpipe.mail.prescan`) before the standard
library's parser builds anything, and the parts it builds are counted as it builds them; every
header read is guarded (the standard library raises on some malformed headers only when they are
read); header blocks are read tolerantly (a malformed line is skipped and counted as a defect);
text is decoded only with allowed charsets (`mailpipe.mail.text.ALLOWED_CODECS`), with fallbacks;
and every text field of the result is storable (no NUL, no lone surrogate). An email that breaks
a limit raises `InputRejected`, which fails its run without a retry.
"""

from __future__ import annotations

import email.header
import email.parser
import email.policy
import email.utils
import functools
import hashlib
from dataclasses import dataclass
from email.headerregistry import BaseHeader, HeaderRegistry
from email.message import EmailMessage, Message
from typing import Any

from mailpipe.errors import InputRejected, describe
from mailpipe.mail.headers import normalise_message_id, plain_value
from mailpipe.mail.prescan import (
    NESTED_TOO_DEEPLY,
    PARSED_PARTS_PER_PART,
    prescan,
    too_many_parsed_parts,
    top_header_names,
)
from mailpipe.mail.text import decode_text, html_to_text, storable

# An email, or a MIME entity stored as one (a bounce's delivery-status part), has at least one.
_EMAIL_HEADERS = {"from", "to", "date", "subject", "message-id", "mime-version", "content-type"}
NOT_AN_EMAIL = "not an email: no header block (From, To, Subject, Content-Type, ...)"


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
    # The parser's defects, plus each header line skipped and each charset label not allowed.
    defect_count: int
    skipped_header_lines: tuple[str, ...] = ()  # the first ones skipped (prescan.MAX_LISTED_SKIPS)


def parse_email(raw: bytes, limits: ParseLimits) -> ParsedEmail:
    if len(raw) > limits.max_bytes:
        raise InputRejected(f"email is {len(raw)} bytes, over the limit of {limits.max_bytes}")
    if not raw.strip():
        raise InputRejected("email is empty")
    if not top_header_names(raw) & _EMAIL_HEADERS:
        raise InputRejected(NOT_AN_EMAIL)
    scan = prescan(raw, max_parts=limits.max_parts, max_depth=limits.max_depth)
    try:
        message = _parse_bytes(scan.raw, limits.max_parts)
    except RecursionError:
        raise InputRejected(NESTED_TOO_DEEPLY) from None
    if not _looks_like_email(message):
        raise InputRejected(NOT_AN_EMAIL)

    body_plain: list[str] = []
    body_html: list[str] = []
    attachments: list[Attachment] = []
    part_count = 0
    defect_count = len(message.defects) + scan.skipped_lines + scan.relabelled
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
                stack.extend(
                    (child, depth + 1) for child in reversed(children) if isinstance(child, Message)
                )
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
        body_text=storable(body[: limits.body_max_chars]),
        attachments=tuple(attachments),
        body_sha256=hashlib.sha256(_raw_body(raw)).hexdigest(),
        part_count=part_count,
        defect_count=defect_count,
        skipped_header_lines=tuple(storable(line) for line in scan.skipped),
    )


class _CachedHeaders(HeaderRegistry):
    """The default policy's header factory, remembering what it parsed for one email.

    The policy parses a header again each time it is read, and the parser reads the parent's
    Content-Type once per child part (and every part's a few times): the same header is parsed
    once here. A header object is immutable, so handing the same one out again changes nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self._parsed: dict[tuple[str, str], BaseHeader] = {}

    def __call__(self, name: str, value: str) -> BaseHeader:
        key = (name, value)
        parsed = self._parsed.get(key)
        if parsed is None:
            parsed = self._parsed[key] = super().__call__(name, value)
        return parsed

    def __getitem__(self, name: str) -> type[BaseHeader]:
        # The registry builds a new class each time it parses a header; one per kind of header
        # will do (a few dozen kinds: every name it does not know shares one).
        kind = self.registry.get(name.lower(), self.default_class)
        return _header_class(kind, self.base_class)


@functools.cache
def _header_class(kind: type, base: type) -> type[BaseHeader]:
    return type("_" + kind.__name__, (kind, base), {})


def _parse_bytes(raw: bytes, max_parts: int) -> Message:
    """The email package's parse of `raw` (default policy), stopped once it has built more parts
    than the pre-scan allows in all: its count is an estimate, this one is the parser's own."""
    policy = email.policy.default.clone(header_factory=_CachedHeaders())
    built = -1  # the parser calls the factory once to try it

    def new_part(policy: Any = policy) -> EmailMessage:
        nonlocal built
        built += 1
        if built > max_parts * PARSED_PARTS_PER_PART:
            raise InputRejected(too_many_parsed_parts(max_parts))
        return EmailMessage(policy=policy)

    return email.parser.BytesParser(new_part, policy=policy).parsebytes(raw)


# The default policy parses a header into a token tree when it is read: a 200 KB Subject (a real
# one, in the shared corpus) took 0.54 s and 350 MB at its peak, enough to recycle the worker
# child that read it. A header this long is decoded by the plain RFC 2047 decoder instead, which
# gives the same text for an unstructured header and the raw addresses for an address header.
LONG_HEADER_CHARS = 4096


def header(message: Message, name: str) -> str:
    """A header's decoded value, or "" when absent; storable (`text.storable`). Never raises.

    A plain value (`headers.plain_value`: printable ASCII that needs no decoding) is read as the
    default policy would read it, without building its header object. The default policy parses
    every other value when it is read and raises on some malformed ones; then the raw value is
    decoded by hand, and failing that returned as it is. Headers longer than LONG_HEADER_CHARS are
    always decoded by hand.
    """
    raw_value = next(
        (value for key, value in message.raw_items() if key.lower() == name.lower()), None
    )
    if raw_value is None:
        return ""
    if len(raw_value) > LONG_HEADER_CHARS:
        return _decode_raw_header(str(raw_value))
    plain = plain_value(name, str(raw_value))
    if plain is not None:
        return plain.strip()
    try:
        value = message.get(name)
        return "" if value is None else storable(str(value).strip())
    except Exception:
        return _decode_raw_header(str(raw_value))


def _decode_raw_header(value: str) -> str:
    """RFC 2047 decoding by hand, each encoded word with `decode_text` (allowed charsets only).

    8-bit bytes in the raw value (kept by the parser as surrogates) are read as UTF-8 first; the
    text between encoded words, which `decode_header` hands back as raw-unicode-escape bytes, is
    turned back into the text it was.
    """
    value = storable(value)
    try:
        chunks = email.header.decode_header(value)
        return storable(
            "".join(
                _decoded_chunk(chunk, charset) if isinstance(chunk, bytes) else chunk
                for chunk, charset in chunks
            ).strip()
        )
    except Exception:
        return value.strip()


def _decoded_chunk(chunk: bytes, charset: str | None) -> str:
    if charset is None:
        return chunk.decode("raw-unicode-escape", errors="replace")
    return decode_text(chunk, charset)


def _looks_like_email(message: Message) -> bool:
    names = {key.lower() for key, _ in message.raw_items()}
    return bool(names & _EMAIL_HEADERS)


def looks_like_email(raw: bytes) -> bool:
    """A cheap check for ingest: does `raw` start with a header block with one of the email's
    headers, read as `parse_email` reads it (a malformed line followed by a header is skipped)?"""
    return bool(raw.strip()) and bool(top_header_names(raw) & _EMAIL_HEADERS)


def _content_type(part: Message) -> str:
    try:
        return storable(part.get_content_type().lower())
    except Exception:
        return "text/plain"


def _filename(part: Message) -> str | None:
    try:
        name = part.get_filename()
    except Exception:
        return None
    return None if name is None else storable(name)


def _is_attachment(part: Message, content_type: str, depth: int) -> bool:
    if content_type == "message/rfc822":
        return True
    try:
        disposition = part.get_content_disposition()
    except Exception:
        disposition = None
    if disposition == "attachment" or _filename(part):
        return True
    return not content_type.startswith("text/") and depth > 0


def _attachment(part: Message, content_type: str, index: int, depth: int) -> Attachment:
    filename = _filename(part)
    charset = _charset(part)
    try:
        payload = _payload_bytes(part, content_type)
    except Exception as exc:
        return Attachment(index, filename, content_type, b"", charset, depth, error=describe(exc))
    return Attachment(index, filename, content_type, payload, charset, depth)


def _payload_bytes(part: Message, content_type: str) -> bytes:
    if content_type == "message/rfc822":
        inner = part.get_payload()
        if isinstance(inner, list) and inner and isinstance(inner[0], Message):
            try:
                return inner[0].as_bytes(policy=_serializing_policy(inner[0]))
            except Exception:
                return inner[0].as_bytes(policy=email.policy.compat32)
    payload = part.get_payload(decode=True)
    return payload if isinstance(payload, bytes) else b""


def _serializing_policy(message: Message) -> Any:
    """The attached email's own policy; with headers written as they came if any is longer than
    LONG_HEADER_CHARS (the policy would refold it through the header parser, 350 MB for 200 KB)."""
    policy: Any = message.policy
    long_header = any(
        len(value) > LONG_HEADER_CHARS for part in message.walk() for _, value in part.raw_items()
    )
    return policy.clone(refold_source="none") if long_header else policy


def _charset(part: Message) -> str | None:
    try:
        charset = part.get_content_charset()
    except Exception:
        return None
    return None if charset is None else storable(charset)


def _part_text(part: Message) -> str:
    try:
        payload = part.get_payload(decode=True)
    except Exception:
        return ""
    if not isinstance(payload, bytes):
        return ""
    return decode_text(payload, _charset(part))


def _addresses(value: str) -> list[str]:
    try:
        return [addr for _, addr in email.utils.getaddresses([value])]
    except Exception:
        return []


def _raw_body(raw: bytes) -> bytes:
    for separator in (b"\r\n\r\n", b"\n\n"):
        _, found, body = raw.partition(separator)
        if found:
            return body
    return b""
