"""DOCX text with python-docx, after the zip and its XML have passed `ooxml.check_package`.

Body paragraphs and tables in document order; a table row becomes one line of tab-separated cells.
Headers, footers, comments and text boxes are left out: they repeat on every page or sit outside
the reading order, and the classifier is better served by the body within its text budget.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

from docx import Document
from docx.table import Table
from docx.text.paragraph import Paragraph

from mailpipe.mail.documents import ooxml
from mailpipe.mail.documents.limits import DocumentLimits
from mailpipe.mail.documents.result import Extracted, TextBudget


def convert_docx(payload: bytes, limits: DocumentLimits) -> Extracted:
    with ooxml.open_package(payload, limits) as archive:
        ooxml.check_package(archive, len(payload), limits)
    document = Document(io.BytesIO(payload))
    budget = TextBudget(limits.max_text_chars)
    for block in document.iter_inner_content():
        lines = [block.text] if isinstance(block, Paragraph) else _table_lines(block)
        if not all(budget.add(line) for line in lines):
            break
    return Extracted(budget.text())


def _table_lines(table: Table) -> Iterator[str]:
    for row in table.rows:
        cells: list[str] = []
        previous = None
        for cell in row.cells:
            # A cell spanning columns is returned once per column (the same object each time);
            # its text is kept once.
            if cell is not previous:
                cells.append(cell.text)
            previous = cell
        yield "\t".join(cells)
