"""PDF text with pypdf, under its decompression limits.

pypdf bounds each stream it inflates and each structure it walks through a `Configuration`
applied per context (a ContextVar), so the limits here do not leak into other code in the process.
What it does not bound is the sum over streams; the page limit, the text budget (pages are not
read once it is spent) and the time limit bound that.
"""

from __future__ import annotations

import io
import logging
from typing import Any

from pypdf import PasswordType, PdfReader, apply_configuration
from pypdf.errors import LimitReachedError
from pypdf.generic import DictionaryObject

from mailpipe.mail.documents.errors import TooLarge, Unreadable
from mailpipe.mail.documents.limits import DocumentLimits
from mailpipe.mail.documents.result import Extracted, TextBudget

log = logging.getLogger(__name__)


class _PypdfAtDebug(logging.Handler):
    """pypdf logs what it got past in a document at WARNING, with a dump of the document's
    objects (a font it cannot fully read: over a thousand lines for the shared PDF corpus). They
    say nothing an operator can act on, and the dumps are the document's content: each becomes a
    DEBUG line naming where pypdf reported it, without its text."""

    def emit(self, record: logging.LogRecord) -> None:
        log.debug("pypdf %s at %s:%d", record.levelname.lower(), record.name, record.lineno)


_pypdf_log = logging.getLogger("pypdf")
_pypdf_log.addHandler(_PypdfAtDebug())
_pypdf_log.propagate = False

# A stream is inflated whole into memory, and zlib's growing output buffer peaks near twice the
# limit before pypdf notices it was reached (measured: 358 MiB of growth for a 200 MiB limit). So
# one stream gets at most this much, below pypdf's own 75 MB default, even when
# `max_uncompressed_bytes` allows more; no text-bearing content stream comes close.
MAX_STREAM_BYTES = 64 * 1024 * 1024
# Every bound pypdf puts on a stream's decoded output, so that none is left at pypdf's default.
_OUTPUT_LIMITS = (
    "zlib_maximum_output_length",
    "lzw_maximum_output_length",
    "run_length_maximum_output_length",
    "jbig2_maximum_output_length",
    "brotli_maximum_output_length",
    "array_based_stream_maximum_output_length",
    "stream_decoding_work_maximum_length",
)


def convert_pdf(payload: bytes, limits: DocumentLimits) -> Extracted:
    per_stream = min(limits.max_uncompressed_bytes, MAX_STREAM_BYTES)
    overrides: dict[str, Any] = {name: per_stream for name in _OUTPUT_LIMITS}
    # A stream cannot honestly be longer than the file it is in.
    overrides["maximum_declared_stream_length"] = limits.max_bytes
    # JBIG2 images are decoded by running the jbig2dec program when it is installed; text
    # extraction never needs it, and a converter of untrusted input starts no programs.
    overrides["jbig2dec_binary"] = None
    try:
        with apply_configuration(**overrides):
            return _extract(payload, limits)
    except LimitReachedError as exc:
        raise TooLarge(f"pdf limit reached: {exc}") from exc


def _extract(payload: bytes, limits: DocumentLimits) -> Extracted:
    reader = PdfReader(io.BytesIO(payload))
    # The empty user password is how "no password to open, but restricted" PDFs are encrypted.
    if reader.is_encrypted and reader.decrypt("") == PasswordType.NOT_DECRYPTED:
        raise Unreadable("encrypted")
    declared = _declared_page_count(reader)
    if declared is not None and declared > limits.max_pages:
        raise TooLarge(f"pdf pages {declared} exceed {limits.max_pages}")
    page_count = len(reader.pages)  # walks the page tree, which the declared count may misstate
    if page_count > limits.max_pages:
        raise TooLarge(f"pdf pages {page_count} exceed {limits.max_pages}")
    budget = TextBudget(limits.max_text_chars)
    for page in reader.pages:
        if not budget.add(page.extract_text()):
            break
    return Extracted(budget.text(), page_count)


def _declared_page_count(reader: PdfReader) -> int | None:
    """/Count of the page tree's root: checked before walking a tree of a million pages."""
    try:
        pages = reader.root_object["/Pages"].get_object()
    except Exception:
        return None
    count = pages.get("/Count") if isinstance(pages, DictionaryObject) else None
    return count if isinstance(count, int) else None
