"""Every PDF and DOCX of the shared corpus, through `convert_attachment` as the pipeline would."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from mailpipe.mail.documents import ConvertedDocument, DocumentLimits
from mailpipe.mail.parse import Attachment
from tests.support.document_samples import CORPUS_LIMITS, attachment, corpus_files

# Files that cannot be converted, and the reason each must be recorded with. Every other file of
# the corpus must convert. The password one does not open with the empty password (checked with
# pypdf: decrypt("") is NOT_DECRYPTED), so it must fail as encrypted rather than convert.
EXPECTED_FAILURES = {
    "libreoffice-writer-password.pdf": "encrypted",
    "unreadablemetadata.pdf": "PdfReadError (pypdf.errors)",
}
# Files whose text is known, to show the text is really extracted, not just that nothing raised.
EXPECTED_TEXT = {
    "pdflatex-4-pages.pdf": "here is some text without a meaning",
    "GeoTopo-komprimiert.pdf": "Topologie",
    "par-known-paragraphs.docx": "paragraph",
    "tbl-2x2-table.docx": "\t",
}

CORPUS = corpus_files("pdf-sample-files/**/*.pdf", "python-docx/**/*.docx")


def test_the_corpus_is_there() -> None:
    assert len(CORPUS) >= 70


@dataclass(frozen=True)
class Conversion:
    document: ConvertedDocument
    logged: list[logging.LogRecord]  # what reached the root logger's handlers, as in a worker


@pytest.fixture(scope="module")
def converted(
    convert: Callable[[Attachment, DocumentLimits], ConvertedDocument],
) -> Callable[[Path], Conversion]:
    """Each corpus file converted once for the module: the GeoTopo PDF, seconds of CPU, serves
    two tests."""

    @functools.cache
    def conversion(path: Path) -> Conversion:
        # Declared as octet-stream, as careless mail clients do: the format comes from the bytes.
        att = attachment(path.read_bytes(), "application/octet-stream", path.name)
        logged: list[logging.LogRecord] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                logged.append(record)

        root, handler = logging.getLogger(), Keep()
        level = root.level
        root.addHandler(handler)
        root.setLevel(logging.DEBUG)
        try:
            return Conversion(convert(att, CORPUS_LIMITS), logged)
        finally:
            root.removeHandler(handler)
            root.setLevel(level)

    return conversion


@pytest.mark.parametrize("path", CORPUS, ids=lambda path: path.name)
def test_corpus_file_converts_or_fails_with_a_reason(path: Path, converted) -> None:
    document = converted(path).document

    assert document.size == path.stat().st_size
    assert document.safe_filename == path.name
    if path.name in EXPECTED_FAILURES:
        assert (document.status, document.error) == ("failed", EXPECTED_FAILURES[path.name])
        assert document.text is None
        return
    assert document.status == "converted", document.error
    assert document.error is None
    assert isinstance(document.text, str)
    if path.suffix == ".pdf":
        assert document.page_count and document.page_count >= 1
    if path.name in EXPECTED_TEXT:
        assert EXPECTED_TEXT[path.name] in document.text


def test_pypdf_s_warnings_about_a_document_are_debug_lines_without_its_content(
    converted,
) -> None:
    """The GeoTopo PDF's Type 1 fonts make pypdf warn over a thousand times with some releases
    of fontTools (and not at all with others), each warning with a dump of a font dictionary:
    what reaches the process's handlers (the root logger's, as a worker has them) is at most
    DEBUG lines of mailpipe's, none carrying the dump. The handler itself is tested with a
    warning of its own in test_document_formats."""
    [path] = [p for p in CORPUS if p.name == "GeoTopo-komprimiert.pdf"]
    conversion = converted(path)
    assert conversion.document.status == "converted"
    seen = conversion.logged
    assert [r.name for r in seen if r.name.startswith("pypdf")] == []
    reported = [r.getMessage() for r in seen if r.name == "mailpipe.mail.documents.pdf"]
    assert {r.levelno for r in seen if r.name == "mailpipe.mail.documents.pdf"} <= {logging.DEBUG}
    assert all(m.startswith("pypdf warning at pypdf.") for m in reported)
    assert not any("Font" in m or "fontTools" in m for m in reported)
