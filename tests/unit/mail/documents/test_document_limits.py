"""Hostile documents, built at run time: each ends with a clear status and reason, within bounds."""

from __future__ import annotations

import io
import os
import zipfile
from dataclasses import replace

import defusedxml
import docx.oxml.parser
import lxml.etree
import openpyxl.xml.functions
import pytest

from mailpipe.mail.documents import DocumentLimits
from mailpipe.mail.documents.ooxml import MAX_XML_PART_BYTES
from mailpipe.mail.text import MAX_MARKUP_CHARS
from mailpipe.settings import Settings
from tests.support.document_samples import (
    BILLION_LAUGHS,
    DEFAULT_LIMITS,
    MiB,
    attachment,
    docx_bytes,
    docx_external_entity,
    docx_hidden_bomb,
    docx_with_text,
    docx_zip_bomb,
    entry,
    measure_in_child,
    pdf_stream_bomb,
    pdf_with_pages,
    rezip,
    with_doctype,
    with_encrypted_flag,
    xlsx_billion_laughs,
    xlsx_bytes,
)

DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
XLSX = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"


def test_payload_over_the_size_limit_is_not_opened(convert, limits) -> None:
    small = replace(limits, max_bytes=1000)
    document = convert(attachment(pdf_with_pages(30), "application/pdf", "big.pdf"), small)
    assert document.status == "too_large"
    assert document.error.startswith("size ") and document.error.endswith(" bytes exceeds 1000")
    assert document.size > 1000


def test_payload_the_parser_could_not_extract(convert, limits) -> None:
    att = replace(attachment(b"", "application/pdf", "x.pdf"), error="ValueError")
    document = convert(att, limits)
    assert (document.status, document.error) == ("failed", "payload unreadable: ValueError")


def test_docx_zip_bomb(convert, limits) -> None:
    payload = docx_zip_bomb(inflated_mib=64)
    document = convert(attachment(payload, DOCX, "bomb.docx"), limits)
    assert document.status == "too_large"
    assert document.error.startswith("zip compression ratio ")
    assert document.error.endswith(" exceeds 200")


def test_bomb_entry_hidden_behind_incompressible_entries(convert, limits) -> None:
    document = convert(attachment(docx_hidden_bomb(), DOCX, "photos.docx"), limits)
    assert document.status == "too_large"
    assert document.error.startswith("zip entry word/media/padding.bin compression ratio ")


def test_zip_uncompressed_size_limit(convert, limits) -> None:
    small = replace(limits, max_uncompressed_bytes=10_000)
    document = convert(attachment(docx_bytes(), DOCX, "a.docx"), small)
    assert document.status == "too_large"
    assert document.error.startswith("zip uncompressed size ")
    assert document.error.endswith(" exceeds 10000")


def test_zip_entry_count_is_checked_before_the_directory_is_read(convert, limits) -> None:
    extra = [(entry(f"word/extra{n}.bin"), [b"x"]) for n in range(20)]
    payload = rezip(docx_bytes(), extra=extra)
    document = convert(attachment(payload, DOCX, "many.docx"), replace(limits, max_zip_entries=20))
    assert (document.status, document.error) == ("too_large", "zip entries exceed 20")


def test_encrypted_zip_entry(convert, limits) -> None:
    payload = with_encrypted_flag(
        rezip(xlsx_bytes(), extra=[(entry("xl/secret.bin"), [b"x"])]), "xl/secret.bin"
    )
    document = convert(attachment(payload, XLSX, "locked.xlsx"), limits)
    assert (document.status, document.error) == ("failed", "encrypted")


def test_password_protected_office_file(convert, limits) -> None:
    # Office saves password-protected DOCX/XLSX inside an OLE2 container.
    ole2 = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + b"\0" * 504
    document = convert(attachment(ole2, DOCX, "locked.docx"), limits)
    assert document.status == "failed"
    assert document.error.startswith("encrypted")


def test_pdf_stream_inflating_past_the_limit(convert, limits) -> None:
    payload = pdf_stream_bomb(inflated_mib=24)  # about 24 KB on disk
    document = convert(
        attachment(payload, "application/pdf", "bomb.pdf"),
        replace(limits, max_uncompressed_bytes=8 * MiB),
    )
    assert document.status == "too_large"
    assert document.error.startswith("pdf limit reached: Limit reached while decompressing")


def test_pdf_with_more_pages_than_the_limit(convert, limits) -> None:
    document = convert(
        attachment(pdf_with_pages(12), "application/pdf", "long.pdf"), replace(limits, max_pages=10)
    )
    assert (document.status, document.error) == ("too_large", "pdf pages 12 exceed 10")


def test_pdf_declaring_more_pages_than_the_limit(convert, limits) -> None:
    # The page tree's /Count is checked before the tree is walked: a lie costs the liar.
    payload = pdf_with_pages(1).replace(b"/Count 1", b"/Count 9")
    document = convert(
        attachment(payload, "application/pdf", "lie.pdf"), replace(limits, max_pages=5)
    )
    assert (document.status, document.error) == ("too_large", "pdf pages 9 exceed 5")


def test_pdf_page_count_at_the_limit_converts(convert, limits) -> None:
    document = convert(
        attachment(pdf_with_pages(10), "application/pdf", "ok.pdf"), replace(limits, max_pages=10)
    )
    assert (document.status, document.page_count) == ("converted", 10)


def test_text_is_cut_at_the_limit(convert, limits) -> None:
    document = convert(
        attachment(pdf_with_pages(50), "application/pdf", "x.pdf"),
        replace(limits, max_text_chars=1000),
    )
    assert document.status == "converted"
    assert len(document.text) <= 1000
    assert document.text.startswith("page 1\npage 2")


def test_xlsx_billion_laughs_fails_with_bounded_memory(limits) -> None:
    # In a fresh interpreter, so that its peak RSS is the conversion's alone.
    outcome = measure_in_child(attachment(xlsx_billion_laughs(), XLSX, "lol.xlsx"), limits)
    assert outcome["status"] == "failed"
    assert outcome["error"] == "xml part xl/worksheets/sheet1.xml declares a DTD"
    assert outcome["growth_mib"] < 50  # the expanded entity would be 3 GB


def test_external_entity_is_neither_fetched_nor_resolved(convert, limits, http_server) -> None:
    base, requested = http_server
    payload = docx_external_entity(f"{base}/secret.dtd")
    document = convert(attachment(payload, DOCX, "ext.docx"), limits)
    assert (document.status, document.error) == (
        "failed",
        "xml part word/document.xml declares a DTD",
    )
    assert requested == []


@pytest.mark.parametrize(
    ("prolog", "error"),
    [
        (
            b'<?xml version="1.0" encoding="UTF-7"?>',
            "declares encoding 'UTF-7', not UTF-8 or UTF-16",
        ),
        (b"\x00\x00\x00<\x00\x00\x00?", "is not UTF-8 or UTF-16"),
    ],
)
def test_xml_parts_in_encodings_that_could_hide_a_dtd(convert, limits, prolog, error) -> None:
    package = docx_bytes()
    with zipfile.ZipFile(io.BytesIO(package)) as archive:
        body = archive.read("word/document.xml").split(b"?>", 1)[1]
    payload = rezip(package, replace={"word/document.xml": prolog + body})
    document = convert(attachment(payload, DOCX, "enc.docx"), limits)
    assert document.status == "failed"
    assert document.error == f"xml part word/document.xml {error}"


def test_dtd_in_utf16_part_is_found(convert, limits) -> None:
    package = xlsx_bytes()
    with zipfile.ZipFile(io.BytesIO(package)) as archive:
        workbook = archive.read("xl/workbook.xml")
    bomb = with_doctype(workbook, BILLION_LAUGHS.replace(b"UTF-8", b"UTF-16"), b"", b"")
    payload = rezip(package, replace={"xl/workbook.xml": bomb.decode().encode("utf-16")})
    document = convert(attachment(payload, XLSX, "u16.xlsx"), limits)
    assert (document.status, document.error) == (
        "failed",
        "xml part xl/workbook.xml declares a DTD",
    )


def test_the_libraries_themselves_do_not_expand_entities() -> None:
    # Defence in depth under the DTD check: python-docx's lxml parser (resolve_entities=False)
    # refuses the amplification in libxml2, and openpyxl parses sheets through defusedxml. Should
    # an upgrade change either, this fails.
    bomb = BILLION_LAUGHS + b"<root>&lol9;</root>"
    with pytest.raises(lxml.etree.XMLSyntaxError, match="amplification"):
        docx.oxml.parser.parse_xml(bomb)
    with pytest.raises(defusedxml.EntitiesForbidden):
        next(openpyxl.xml.functions.iterparse(io.BytesIO(bomb)))


def test_the_tests_limits_are_the_settings_defaults() -> None:
    # model_construct: the declared defaults, whatever MAILPIPE_* variables the environment sets.
    assert DocumentLimits.from_settings(Settings.model_construct()) == DEFAULT_LIMITS


def test_pdf_streams_are_capped_below_a_generous_zip_limit(convert, limits) -> None:
    # One stream is inflated whole into memory; MAX_STREAM_BYTES (64 MiB) holds even when
    # max_uncompressed_bytes (200 MiB) would allow more.
    document = convert(
        attachment(pdf_stream_bomb(inflated_mib=80), "application/pdf", "b.pdf"), limits
    )
    assert document.status == "too_large"
    assert document.error.startswith("pdf limit reached")


def test_docx_part_too_large_to_parse_whole(convert, limits) -> None:
    # Random text compresses about 2:1, so only the part-size bound can catch this one: the
    # text alone fills the bound, the part's markup takes it over.
    text = os.urandom(MAX_XML_PART_BYTES // 2).hex()
    document = convert(attachment(docx_with_text(text), DOCX, "long.docx"), limits)
    assert document.status == "too_large"
    assert document.error.startswith("xml part word/document.xml is ")
    assert document.error.endswith(f" bytes, over {MAX_XML_PART_BYTES}")


def test_html_markup_is_read_up_to_its_bound(convert, limits) -> None:
    # Cells of over 100 characters, most of them white space (which gives no text): the markup
    # passes its bound after some 10,000 tags, rather than the 100,000 that take the parser
    # seconds.
    count = MAX_MARKUP_CHARS // 100 + 100
    cells = "".join(f"<td>w{n}</td>{' ' * 100}" for n in range(count))
    document = convert(
        attachment(f"<table><tr>{cells}</tr></table>".encode(), "text/html", "t.html", "utf-8"),
        limits,
    )
    assert document.status == "converted"
    assert document.text.startswith("w0\nw1\n")
    assert f"w{count - 1}" not in document.text
