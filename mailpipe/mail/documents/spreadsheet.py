"""XLSX text with openpyxl, after the zip and its XML have passed `ooxml.check_package`.

`read_only=True` streams each sheet's XML instead of building every cell; `data_only=True` reads
the values Excel last calculated rather than formulas (nothing is evaluated either way);
`keep_links=False` skips external workbook links. Each sheet is a heading line, then one line per
non-empty row of tab-separated values.
"""

from __future__ import annotations

import io
from collections.abc import Iterable

from openpyxl import load_workbook

from mailpipe.mail.documents import ooxml
from mailpipe.mail.documents.limits import DocumentLimits
from mailpipe.mail.documents.result import Extracted, TextBudget

# Read-only openpyxl reads sheets row by row; everything else (shared strings included, which it
# keeps as one list) it holds whole.
_STREAMED_PARTS = ("xl/worksheets/",)


def convert_xlsx(payload: bytes, limits: DocumentLimits) -> Extracted:
    with ooxml.open_package(payload, limits) as archive:
        ooxml.check_package(archive, len(payload), limits, streamed=_STREAMED_PARTS)
    workbook = load_workbook(io.BytesIO(payload), read_only=True, data_only=True, keep_links=False)
    try:
        budget = TextBudget(limits.max_text_chars)
        for sheet in workbook.worksheets:
            if not budget.add(f"# {sheet.title}"):
                break
            # The sheet's declared dimensions come from the file; a sheet claiming A1:XFD1048576
            # would otherwise have every row padded to 16,384 empty cells.
            sheet.reset_dimensions()
            if not _add_rows(budget, sheet.iter_rows(values_only=True)):
                break
        return Extracted(budget.text())
    finally:
        workbook.close()  # read-only workbooks keep the archive open until closed


def _add_rows(budget: TextBudget, rows: Iterable[tuple[object, ...]]) -> bool:
    """Add each non-empty row; return whether the budget has room left."""
    for row in rows:
        values = ["" if value is None else str(value) for value in row]
        while values and not values[-1]:
            values.pop()
        if values and not budget.add("\t".join(values)):
            return False
    return not budget.full
