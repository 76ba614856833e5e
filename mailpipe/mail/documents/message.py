"""Attached emails (message/rfc822): one document of headers, body and each part's own text.

The attached email is read by the same defensive parser as the outer one (`parse_email`), with the
same per-email bounds. Its attachments are converted by the caller's converter, so they get every
check a top-level attachment gets; an attachment that fails is noted in the text and the rest of
the email is still kept. Nesting is the exception: attached emails inside attached emails deeper
than `max_depth` fail the whole outermost document, since the depth belongs to all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from mailpipe.mail.documents.errors import NestingTooDeep
from mailpipe.mail.documents.limits import DocumentLimits
from mailpipe.mail.documents.result import ConvertedDocument, Extracted, TextBudget
from mailpipe.mail.parse import Attachment, ParsedEmail, ParseLimits, parse_email

# (attachment, limits, nesting level) -> outcome; passed in so this module does not import the
# dispatcher that imports it.
ConvertPart = Callable[[Attachment, DocumentLimits, int], ConvertedDocument]


def convert_message(
    payload: bytes, limits: DocumentLimits, level: int, convert_part: ConvertPart
) -> Extracted:
    """Text of the email attached at nesting `level` (0: attached to the email being processed)."""
    if level >= limits.max_depth:
        raise NestingTooDeep(f"attached emails nested deeper than {limits.max_depth} levels")
    parsed = parse_email(
        payload,
        ParseLimits(
            max_bytes=limits.max_bytes,
            max_depth=limits.max_depth,
            max_parts=limits.max_parts,
            body_max_chars=limits.max_text_chars,
        ),
    )
    budget = TextBudget(limits.max_text_chars)
    budget.add(_header_block(parsed))
    budget.add(parsed.body_text)
    for attachment in parsed.attachments:
        if budget.full:
            break
        inner_limits = replace(limits, max_text_chars=budget.remaining)
        document = convert_part(attachment, inner_limits, level + 1)
        budget.add(_part_heading(document))
        budget.add(document.text or "")
    return Extracted(budget.text())


def _header_block(parsed: ParsedEmail) -> str:
    headers = {
        "From": parsed.sender,
        "To": ", ".join(parsed.recipients),
        "Date": parsed.date,
        "Subject": parsed.subject,
    }
    return "".join(f"{name}: {value}\n" for name, value in headers.items() if value)


def _part_heading(document: ConvertedDocument) -> str:
    heading = f"\n--- attachment {document.safe_filename} ({document.content_type})"
    if document.status != "converted":
        heading += f" [{document.status}: {document.error}]"
    return heading + " ---"
