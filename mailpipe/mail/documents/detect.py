"""Which converter reads an attachment: from its bytes first, then its declared type and name.

Senders' mail clients label attachments carelessly (`application/octet-stream` for everything, a
PDF named `.docx`), and the label is the sender's claim while the bytes are the fact. So the
signatures of the binary formats decide first; the declared type and then the extension of the
sanitised name decide for formats without a reliable signature (text, HTML).
"""

from __future__ import annotations

import enum
import zipfile


class Format(enum.Enum):
    PDF = "pdf"
    DOCX = "docx"
    XLSX = "xlsx"
    HTML = "html"
    TEXT = "text"
    MESSAGE = "message"
    ZIP = "zip"  # a zip that is not (yet) known to be DOCX or XLSX
    OLE2 = "ole2"  # legacy Office files, and Office's container for password-protected DOCX/XLSX
    UNSUPPORTED = "unsupported"


DOCX_TYPE = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
XLSX_TYPE = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"

_PDF_MAGIC = b"%PDF-"
_PDF_MAGIC_WINDOW = 1024  # readers accept junk before the header; Acrobat looks this far
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a first entry, or an empty archive
_OLE2_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"

_BY_TYPE = {
    "application/pdf": Format.PDF,
    "application/x-pdf": Format.PDF,
    DOCX_TYPE: Format.DOCX,
    XLSX_TYPE: Format.XLSX,
    "text/html": Format.HTML,
    "application/xhtml+xml": Format.HTML,
    "message/rfc822": Format.MESSAGE,
    "application/csv": Format.TEXT,
}
_BY_SUFFIX = {
    "pdf": Format.PDF,
    "docx": Format.DOCX,
    "xlsx": Format.XLSX,
    "html": Format.HTML,
    "htm": Format.HTML,
    "eml": Format.MESSAGE,
    "txt": Format.TEXT,
    "csv": Format.TEXT,
    "tsv": Format.TEXT,
    "md": Format.TEXT,
    "log": Format.TEXT,
}


def detect_format(payload: bytes, content_type: str, safe_name: str) -> Format:
    """The format to read `payload` as. Zips come back as ZIP until `ooxml_format` looks inside."""
    if content_type == "message/rfc822":
        # The parser rebuilt this payload from a parsed email; its first bytes are headers, which
        # may quote anything, so no signature is looked for.
        return Format.MESSAGE
    if _PDF_MAGIC in payload[:_PDF_MAGIC_WINDOW]:
        return Format.PDF
    if payload.startswith(_ZIP_MAGICS):
        return Format.ZIP
    if payload.startswith(_OLE2_MAGIC):
        return Format.OLE2
    return declared_format(content_type, safe_name)


def declared_format(content_type: str, safe_name: str) -> Format:
    """The format the declared type names, else the one the name's extension names."""
    by_type = _BY_TYPE.get(content_type)
    if by_type is not None:
        return by_type
    if content_type.startswith("text/"):
        return Format.TEXT
    _, dot, suffix = safe_name.rpartition(".")
    return _BY_SUFFIX.get(suffix.lower(), Format.UNSUPPORTED) if dot else Format.UNSUPPORTED


def ooxml_format(archive: zipfile.ZipFile, content_type: str, safe_name: str) -> Format:
    """DOCX, XLSX or plain ZIP: by the part names Word and Excel always write, else by the
    declared type or name (a generator may name its main part differently)."""
    names = set(archive.namelist())
    if "word/document.xml" in names:
        return Format.DOCX
    if "xl/workbook.xml" in names:
        return Format.XLSX
    declared = declared_format(content_type, safe_name)
    return declared if declared in (Format.DOCX, Format.XLSX) else Format.ZIP
