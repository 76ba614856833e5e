"""Untrusted attachment names become readable display names and are never used as paths."""

from __future__ import annotations

import os

import pytest

from mailpipe.mail.documents import safe_filename
from mailpipe.mail.documents.filenames import MAX_FILENAME_CHARS
from tests.support.document_samples import attachment


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("../../etc/passwd", "passwd"),
        ("..\\..\\Windows\\system32\\drivers\\etc\\hosts", "hosts"),
        ("/abs/path/report.pdf", "report.pdf"),
        ("report.pdf/..", "report.pdf"),
        ("..", "attachment-3"),
        ("../", "attachment-3"),
        ("", "attachment-3"),
        (None, "attachment-3"),
        ("   ", "attachment-3"),
        (".hidden", "hidden"),
        ("in\x00voice\r\n.pdf", "invoice .pdf"),
        ("invoice\u202egpj.exe", "invoicegpj.exe"),  # right-to-left override removed
        ('a<b>c:d|e?f*g".txt', "a_b_c_d_e_f_g_.txt"),
        ("Rechnung März 2024.pdf", "Rechnung März 2024.pdf"),
        ("tab\tand  spaces.txt", "tab and spaces.txt"),
        ("trailing dots...", "trailing dots"),
    ],
)
def test_safe_filename(name, expected) -> None:
    assert safe_filename(name, 3) == expected


def test_long_names_keep_their_extension() -> None:
    name = safe_filename("x" * 500 + ".pdf", 1)
    assert len(name) == MAX_FILENAME_CHARS
    assert name.endswith("xxx.pdf")


def test_long_name_without_extension() -> None:
    assert safe_filename("y" * 500, 1) == "y" * MAX_FILENAME_CHARS


def test_traversal_name_is_only_displayed(convert, limits, tmp_path, monkeypatch) -> None:
    # The audit hook in `convert` fails the test on any file written anywhere; the working
    # folder is also checked, where a careless `open(name, "w")` would have landed.
    monkeypatch.chdir(tmp_path)
    document = convert(attachment(b"root:x:0:0", "text/plain", "../../etc/passwd", "utf-8"), limits)
    assert document.safe_filename == "passwd"
    assert document.text == "root:x:0:0"
    assert os.listdir(tmp_path) == []
