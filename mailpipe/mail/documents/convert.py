"""Step 6: one attachment in, one `ConvertedDocument` out, whatever the attachment holds.

Order of work, cheapest refusal first: the payload size, then the format (signature, declared
type, name), then the format's own pre-checks (zip directory, PDF page count), then the library,
all under the per-document time limit. Every exception a document can cause is mapped here to a
status and a short reason, so that a bad document fails that document and never the job.
"""

from __future__ import annotations

import hashlib
import logging

from billiard.exceptions import SoftTimeLimitExceeded

from mailpipe.errors import InputRejected, describe
from mailpipe.mail.documents import ooxml
from mailpipe.mail.documents.detect import Format, declared_format, detect_format, ooxml_format
from mailpipe.mail.documents.errors import NestingTooDeep, TooLarge, Unreadable, Unsupported
from mailpipe.mail.documents.filenames import printable, safe_filename
from mailpipe.mail.documents.limits import DocumentLimits
from mailpipe.mail.documents.markup import convert_html
from mailpipe.mail.documents.message import convert_message
from mailpipe.mail.documents.pdf import convert_pdf
from mailpipe.mail.documents.plaintext import convert_text
from mailpipe.mail.documents.result import ConvertedDocument, Extracted, Status
from mailpipe.mail.documents.spreadsheet import convert_xlsx
from mailpipe.mail.documents.timeout import ConversionTimeout, time_limit
from mailpipe.mail.documents.word import convert_docx
from mailpipe.mail.parse import Attachment

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 200
# The job's own soft time limit (billiard raises it in the child, as an Exception) must stop the
# job, not be recorded as one failed document while the job carries on. billiard is the worker
# pool, not Celery: the pipeline still runs without a broker.
_JOB_INTERRUPTS = (SoftTimeLimitExceeded,)


def convert_attachment(att: Attachment, limits: DocumentLimits) -> ConvertedDocument:
    """Never raises for bad input: every outcome is a ConvertedDocument.

    Idempotent: the same attachment and limits give the same document, so a retried job rewrites
    the same rows. (A document near the time limit may time out on one try and not another.)
    """
    try:
        with time_limit(limits.time_limit):
            return _convert(att, limits, level=0)
    except ConversionTimeout as exc:
        return document_for(att, "failed", error=str(exc))


def _convert(att: Attachment, limits: DocumentLimits, level: int) -> ConvertedDocument:
    """The outcome of one part; `level` counts the attached emails around it.

    For parts inside attached emails (level > 0), nesting errors are raised on to the outermost
    document instead of being recorded on the part.
    """
    if att.error:
        return document_for(att, "failed", error=_short(f"payload unreadable: {att.error}"))
    if len(att.payload) > limits.max_bytes:
        error = f"size {len(att.payload)} bytes exceeds {limits.max_bytes}"
        return document_for(att, "too_large", error=error)
    try:
        extracted = _extract(att, limits, level)
    except _JOB_INTERRUPTS:
        raise
    except NestingTooDeep as exc:
        if level:
            raise
        return document_for(att, "too_large", error=str(exc))
    except RecursionError:
        if level:
            raise
        return document_for(att, "failed", error="nested too deeply to read (RecursionError)")
    except TooLarge as exc:
        return document_for(att, "too_large", error=_short(str(exc)))
    except Unreadable as exc:
        return document_for(att, "failed", error=_short(str(exc)))
    except Unsupported as exc:
        return document_for(att, "unsupported", error=_short(str(exc)))
    except InputRejected as exc:
        return document_for(att, "failed", error=_short(f"attached email rejected: {exc}"))
    except MemoryError:
        return document_for(att, "failed", error="out of memory (MemoryError)")
    except Exception as exc:
        # Library errors on malformed files are expected; the traceback is logged in case one is
        # a bug of ours rather than of the file.
        logger.info("attachment %d failed to convert", att.index, exc_info=True)
        return document_for(att, "failed", error=_short(printable(describe(exc))))
    text = extracted.text[: limits.max_text_chars]
    return document_for(att, "converted", text=_storable(text), page_count=extracted.page_count)


def _extract(att: Attachment, limits: DocumentLimits, level: int) -> Extracted:
    name = safe_filename(att.filename, att.index)
    found = detect_format(att.payload, att.content_type, name)
    if found is Format.ZIP:
        with ooxml.open_package(att.payload, limits) as archive:
            found = ooxml_format(archive, att.content_type, name)
    match found:
        case Format.PDF:
            return convert_pdf(att.payload, limits)
        case Format.DOCX:
            return convert_docx(att.payload, limits)
        case Format.XLSX:
            return convert_xlsx(att.payload, limits)
        case Format.HTML:
            return convert_html(att.payload, att.charset)
        case Format.TEXT:
            return convert_text(att.payload, att.charset)
        case Format.MESSAGE:
            return convert_message(att.payload, limits, level, _convert)
        case Format.OLE2 if declared_format(att.content_type, name) in (Format.DOCX, Format.XLSX):
            # Office wraps password-protected DOCX and XLSX files in an OLE2 container.
            raise Unreadable("encrypted (or a legacy Office file named as DOCX/XLSX)")
        case Format.OLE2:
            raise Unsupported(f"unsupported type {att.content_type}: legacy Office (OLE2) file")
        case Format.ZIP:
            raise Unsupported(f"unsupported type {att.content_type}: zip archive")
        case _:
            raise Unsupported(f"unsupported type {att.content_type}")


def document_for(
    att: Attachment,
    status: Status,
    *,
    text: str | None = None,
    page_count: int | None = None,
    error: str | None = None,
) -> ConvertedDocument:
    return ConvertedDocument(
        part_index=att.index,
        safe_filename=safe_filename(att.filename, att.index),
        content_type=att.content_type,
        size=len(att.payload),
        sha256=hashlib.sha256(att.payload).hexdigest(),
        status=status,
        text=text,
        page_count=page_count,
        error=error,
    )


def _storable(text: str) -> str:
    """Text any database column takes: PostgreSQL refuses NUL in text, and UTF-8 encoders refuse
    the lone surrogates some PDF fonts decode to. Either would fail the job's commit."""
    return text.replace("\x00", "").encode("utf-8", "replace").decode("utf-8")


def _short(reason: str) -> str:
    return reason if len(reason) <= _MAX_ERROR_CHARS else reason[: _MAX_ERROR_CHARS - 3] + "..."
