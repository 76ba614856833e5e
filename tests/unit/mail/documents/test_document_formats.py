"""Each format's text, format detection, charsets and attached emails."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import replace

import pytest

from mailpipe.mail.documents import DocumentLimits
from mailpipe.settings import Settings
from tests.support.document_samples import (
    attachment,
    docx_bytes,
    nested_email,
    pdf_with_pages,
    xlsx_bytes,
)


def test_limits_come_from_the_settings() -> None:
    settings = Settings()
    limits = DocumentLimits.from_settings(settings)
    assert limits.max_bytes == settings.doc_max_bytes
    assert limits.max_pages == settings.doc_max_pages
    assert limits.max_uncompressed_bytes == settings.doc_max_uncompressed_bytes
    assert limits.max_zip_entries == settings.doc_max_zip_entries
    assert limits.max_zip_ratio == settings.doc_max_zip_ratio
    assert limits.time_limit == settings.doc_time_limit
    assert limits.max_text_chars == settings.doc_max_text_chars
    assert limits.max_depth == settings.max_mime_depth
    assert limits.max_parts == settings.max_mime_parts


def test_every_outcome_records_identity_size_and_hash(convert, limits) -> None:
    payload = b"\x89PNG\r\n\x1a\n" + b"\0" * 100
    document = convert(attachment(payload, "image/png", "photo.png", index=7), limits)
    assert document.part_index == 7
    assert document.safe_filename == "photo.png"
    assert document.content_type == "image/png"
    assert document.size == len(payload)
    assert document.sha256 == hashlib.sha256(payload).hexdigest()
    assert (document.status, document.text, document.error) == (
        "unsupported",
        None,
        "unsupported type image/png",
    )


def test_pdf_inside_octet_stream_is_read_as_pdf(convert, limits) -> None:
    document = convert(attachment(pdf_with_pages(2), "application/octet-stream", "scan"), limits)
    assert document.status == "converted"
    assert document.page_count == 2
    assert "page 1" in document.text and "page 2" in document.text


def test_a_pypdf_warning_is_a_debug_line_of_mailpipe_s_without_its_text() -> None:
    """pypdf warns with a dump of the document's objects: what reaches the process's handlers
    (the root logger's, as a worker has them) is a DEBUG line naming where pypdf reported it,
    and nothing of the dump."""
    import mailpipe.mail.documents.pdf  # noqa: F401 (installs the handler)

    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    root, handler = logging.getLogger(), Keep()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        logging.getLogger("pypdf._cmap").warning("Advanced encoding /Font dump: %s", "secret")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert [(r.name, r.levelno) for r in seen] == [("mailpipe.mail.documents.pdf", logging.DEBUG)]
    [message] = [r.getMessage() for r in seen]
    assert message.startswith("pypdf warning at pypdf._cmap:")
    assert "secret" not in message and "Font" not in message


def test_docx_paragraphs_and_tables_in_order(convert, limits) -> None:
    payload = docx_bytes(["Dear customer,", "your invoice follows."], table=True)
    document = convert(attachment(payload, "application/octet-stream", "letter.docx"), limits)
    assert document.status == "converted"
    assert document.text == "Dear customer,\nyour invoice follows.\nmerged\tright\na\tb\tc"
    assert document.page_count is None


def test_xlsx_values_by_sheet(convert, limits) -> None:
    payload = xlsx_bytes([("name", "amount", None), ("Alice", 42, None), (None, None, None)])
    document = convert(attachment(payload, "application/octet-stream", "sheet.xlsx"), limits)
    assert document.status == "converted"
    assert document.text == "# Invoices\nname\tamount\nAlice\t42"


def test_html_keeps_readable_text_drops_scripts_and_fetches_nothing(
    convert, limits, http_server
) -> None:
    base, requested = http_server
    markup = f"""<html><head><title>t</title>
        <link rel="stylesheet" href="{base}/style.css">
        <style>.secret-style {{ color: red }}</style>
        <script src="{base}/app.js"></script>
        <script>document.write("secret-script")</script></head>
        <body><h1>Quarterly report</h1><p>Revenue grew <b>12%</b>.</p>
        <img src="{base}/tracking-pixel.png" alt="pixel">
        <iframe src="{base}/frame.html"></iframe>
        <object data="{base}/object.swf"></object></body></html>"""
    document = convert(attachment(markup.encode(), "text/html", "report.html", "utf-8"), limits)

    assert document.status == "converted"
    assert "Quarterly report" in document.text
    assert "Revenue grew\n12%" in document.text
    assert "secret-script" not in document.text
    assert "secret-style" not in document.text
    assert requested == []


def test_text_with_a_wrong_declared_charset(convert, limits) -> None:
    text = (
        "Grüße aus Köln,\nSehr geehrte Damen und Herren, die Rechnung über 300 € liegt bei.\n" * 5
    )
    # Declared UTF-8, written in Windows-1252: the declared charset fails and detection takes over.
    document = convert(attachment(text.encode("cp1252"), "text/plain", "note.txt", "utf-8"), limits)
    assert document.status == "converted"
    assert document.text == text


def test_csv_with_an_unknown_charset(convert, limits) -> None:
    text = "name,city\nJosé,São Paulo\nZoë,Zürich\n"
    document = convert(
        attachment(text.encode(), "text/csv", "people.csv", "x-no-such-charset"), limits
    )
    assert document.status == "converted"
    assert document.text == text


def test_csv_found_by_its_extension(convert, limits) -> None:
    document = convert(attachment(b"a,b\n1,2\n", "application/octet-stream", "data.csv"), limits)
    assert (document.status, document.text) == ("converted", "a,b\n1,2\n")


@pytest.mark.parametrize(
    ("payload", "content_type", "name", "error"),
    [
        (b"PK\x05\x06" + b"\0" * 18, "application/zip", "files.zip", "zip archive"),
        (
            b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + b"\0" * 504,
            "application/msword",
            "old.doc",
            "OLE2",
        ),
        (b"GIF89a", "image/gif", "x.gif", "unsupported type image/gif"),
        (b"{}", "application/json", "x.json", "unsupported type application/json"),
    ],
)
def test_other_types_are_unsupported_with_their_type(
    convert, limits, payload, content_type, name, error
) -> None:
    document = convert(attachment(payload, content_type, name), limits)
    assert document.status == "unsupported"
    assert error in document.error
    assert content_type in document.error
    assert document.size == len(payload)


def test_nul_characters_are_removed_from_text(convert, limits) -> None:
    document = convert(attachment(b"a\x00b", "text/plain", "x.txt", "utf-8"), limits)
    assert document.text == "ab"  # PostgreSQL refuses NUL in text columns


def test_attached_email_three_levels_deep_with_a_pdf_inside(convert, limits) -> None:
    payload = nested_email(3, innermost_pdf=pdf_with_pages(1))
    document = convert(attachment(payload, "message/rfc822", None), limits)

    assert document.status == "converted", document.error
    assert document.safe_filename == "attachment-1"
    text = document.text
    for level in (1, 2, 3):
        assert f"Subject: level {level}" in text
        assert f"body of level {level}" in text
    assert "--- attachment deep.pdf (application/pdf) ---\npage 1" in text
    assert text.index("level 1") < text.index("level 2") < text.index("level 3")


def test_failed_part_inside_an_attached_email_is_noted_not_fatal(convert, limits) -> None:
    payload = nested_email(1, innermost_pdf=b"%PDF-1.7\nnot really a PDF")
    document = convert(attachment(payload, "message/rfc822", "fwd.eml"), limits)
    assert document.status == "converted"
    assert "body of level 1" in document.text
    note = "[failed: PdfStreamError (pypdf.errors)]"
    assert f"--- attachment deep.pdf (application/pdf) {note} ---" in document.text


def test_attached_emails_nested_past_the_limit_are_too_large(convert, limits) -> None:
    document = convert(attachment(nested_email(30), "message/rfc822", "fwd.eml"), limits)
    assert (document.status, document.error) == (
        "too_large",
        "attached emails nested deeper than 25 levels",
    )


def test_attached_emails_a_thousand_levels_deep(convert, limits) -> None:
    document = convert(attachment(nested_email(1000), "message/rfc822", "fwd.eml"), limits)
    # The standard library's parser recurses per level and gives up first; the parser turns that
    # into a rejection, which fails the document.
    assert document.status == "failed"
    assert document.error == "attached email rejected: MIME structure is nested too deeply to parse"
    assert document.text is None


def test_attached_email_that_is_not_an_email(convert, limits) -> None:
    document = convert(attachment(b"\x00\x01 not headers", "message/rfc822", "x.eml"), limits)
    assert document.status == "failed"
    assert document.error.startswith("attached email rejected: not an email")


def test_text_budget_is_shared_across_an_attached_email(convert, limits) -> None:
    small = replace(limits, max_text_chars=60)
    document = convert(attachment(nested_email(3), "message/rfc822", "fwd.eml"), small)
    assert document.status == "converted"
    assert len(document.text) == 60


def test_zip_contents_decide_over_the_declared_type(convert, limits) -> None:
    docx_type = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
    document = convert(attachment(xlsx_bytes(), docx_type, "mislabelled.docx"), limits)
    assert document.status == "converted"
    assert document.text.startswith("# Invoices")
