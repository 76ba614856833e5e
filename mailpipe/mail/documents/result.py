"""What a conversion produces: the record the pipeline stores, and the format modules' output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["converted", "unsupported", "too_large", "failed"]


@dataclass(frozen=True)
class ConvertedDocument:
    """One attachment's outcome, one `document` row. Every outcome is one of these."""

    part_index: int
    safe_filename: str  # sanitised display name, never used as a path
    content_type: str  # as declared in the email; the format actually read may differ
    size: int  # bytes of the payload
    sha256: str  # hex of the payload
    status: Status
    text: str | None  # None unless converted (may be "" for a PDF of images)
    page_count: int | None  # PDF pages; None for formats without pages
    error: str | None  # reason for too_large/failed/unsupported, short and clear


@dataclass(frozen=True)
class Extracted:
    """A format module's output: text (possibly over the budget; the caller cuts it) and pages."""

    text: str
    page_count: int | None = None


class TextBudget:
    """Collects text up to a number of characters, so that a converter stops reading early.

    Cutting text after the fact would still spend the time and memory of extracting a 500-page
    PDF or a million-row sheet; asking `add` whether there is room lets each loop stop as soon as
    the document has given all the text that will be kept.
    """

    def __init__(self, max_chars: int) -> None:
        self._parts: list[str] = []
        self._left = max_chars

    @property
    def full(self) -> bool:
        return self._left <= 0

    @property
    def remaining(self) -> int:
        return max(self._left, 0)

    def add(self, text: str) -> bool:
        """Keep `text`, cut at the budget; return whether there is room for more."""
        if text and self._left > 0:
            kept = text[: self._left]
            self._parts.append(kept)
            self._left -= len(kept) + 1  # the line break that joins it to the next piece
        return self._left > 0

    def text(self) -> str:
        return "\n".join(self._parts)
