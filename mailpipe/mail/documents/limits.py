"""The bounds one attachment's conversion must stay within.

Every limit is checked as early as the format allows: the payload size before anything is opened,
a zip's entry count and sizes from its central directory before any entry is inflated, a PDF's page
count before any page is read. Limits that can only be enforced during the work (inflated stream
sizes, time, text length) are handed to the parser or checked as the text is collected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class _DocumentSettings(Protocol):
    """The fields of `mailpipe.settings.Settings` that the limits read."""

    @property
    def doc_max_bytes(self) -> int: ...

    @property
    def doc_max_pages(self) -> int: ...

    @property
    def doc_max_uncompressed_bytes(self) -> int: ...

    @property
    def doc_max_zip_entries(self) -> int: ...

    @property
    def doc_max_zip_ratio(self) -> float: ...

    @property
    def doc_time_limit(self) -> float: ...

    @property
    def doc_max_text_chars(self) -> int: ...

    @property
    def max_mime_depth(self) -> int: ...

    @property
    def max_mime_parts(self) -> int: ...


@dataclass(frozen=True)
class DocumentLimits:
    max_bytes: int  # payload size; larger attachments are never opened
    max_pages: int  # PDF pages
    max_uncompressed_bytes: int  # a zip's total inflated size; also each PDF stream's
    max_zip_entries: int
    max_zip_ratio: float  # inflated / compressed, for the whole zip and for each large entry
    time_limit: float  # seconds per attachment, attached emails included
    max_text_chars: int  # text kept per attachment; the rest is not extracted at all
    max_depth: int  # attached emails nested inside attached emails
    # Parts of one attached email, the same bound the outer email's parser applies. Defaulted so
    # that callers building limits by hand need only the fields above.
    max_parts: int = 1000

    @classmethod
    def from_settings(cls, settings: _DocumentSettings) -> DocumentLimits:
        return cls(
            max_bytes=settings.doc_max_bytes,
            max_pages=settings.doc_max_pages,
            max_uncompressed_bytes=settings.doc_max_uncompressed_bytes,
            max_zip_entries=settings.doc_max_zip_entries,
            max_zip_ratio=settings.doc_max_zip_ratio,
            time_limit=settings.doc_time_limit,
            max_text_chars=settings.doc_max_text_chars,
            max_depth=settings.max_mime_depth,
            max_parts=settings.max_mime_parts,
        )
