"""Checks on DOCX and XLSX zips before python-docx or openpyxl read a byte of them.

Three threats, all cheap to rule out from the zip alone:

- Zip bombs. The entry count is bounded before `zipfile` builds an object per entry; the total
  inflated size and the compression ratio come from the central directory. Those sizes can be
  trusted as upper bounds: `zipfile` stops each entry at its declared size (and then fails its CRC
  check), so an entry cannot inflate past what the directory claims.
- XML entity tricks (billion laughs, external entities). OPC, the packaging standard under DOCX
  and XLSX (ECMA-376 Part 2), forbids DTDs in parts and allows only UTF-8 and UTF-16, so a part
  with a DOCTYPE, or in an encoding where one could hide, is refused outright. The libraries are
  safe on their own only in part: python-docx parses with `resolve_entities=False`; openpyxl
  parses sheets and shared strings through defusedxml (when installed and not switched off with
  `OPENPYXL_DEFUSEDXML`) but `workbook.xml` and others through lxml without entity resolution.
  Refusing here gives one clear outcome for every part, whatever a library version does.
- Parse trees. A part parsed whole takes about twelve times its size in memory, so each such part
  is bounded on its own (`MAX_XML_PART_BYTES`), well below the zip's total.
"""

from __future__ import annotations

import io
import re
import zipfile

from mailpipe.mail.documents.errors import TooLarge, Unreadable
from mailpipe.mail.documents.filenames import printable
from mailpipe.mail.documents.limits import DocumentLimits

# Every central directory record starts with this; counting it in the payload bounds the number of
# entries `zipfile` would build, without building them (a 25 MB zip can list 500,000 entries).
_CENTRAL_DIRECTORY_SIGNATURE = b"PK\x01\x02"
# Below this size an entry's compression ratio does not matter: it cannot inflate into anything
# big. Above it, one highly compressed entry hidden among incompressible images is caught even
# when the zip's overall ratio looks normal. Real DOCX/XLSX parts compress by 20x at most.
_RATIO_MIN_ENTRY_BYTES = 1024 * 1024
# An XML part parsed into a tree costs about 12 bytes of memory per byte (measured: 262 MiB for
# a 22 MB document.xml), so `max_uncompressed_bytes` alone would let one DOCX take gigabytes.
# This bounds each part a library parses whole to about 200 MiB; parts it streams are exempt.
MAX_XML_PART_BYTES = 16 * 1024 * 1024
_ENCRYPTED_FLAG = 0x1
_SCAN_CHUNK = 1024 * 1024
_DOCTYPE = "<!doctype"
_PROLOG_BYTES = 400  # enough for any XML declaration
_ENCODING_DECLARATION = re.compile(r"""\s*<\?xml[^>]*?encoding\s*=\s*["']([^"']*)["']""")
_UTF8_NAMES = {"utf-8", "utf8"}
_UTF16_NAMES = {"utf-16", "utf16", "utf-16le", "utf-16be"}
# Byte order marks and first bytes by which XML parsers pick an encoding (XML 1.0 appendix F).
_UTF8_BOM = b"\xef\xbb\xbf"
_UNSUPPORTED_XML_STARTS = (
    b"\x00\x00\xfe\xff",  # UCS-4 with byte order marks
    b"\xff\xfe\x00\x00",
    b"\x00\x00\x00<",  # UCS-4 without
    b"<\x00\x00\x00",
    b"\x00\x00<\x00",
    b"\x00<\x00\x00",
    b"\x4c\x6f\xa7\x94",  # EBCDIC "<?xm"
)


def open_package(payload: bytes, limits: DocumentLimits) -> zipfile.ZipFile:
    """Open a zip whose entry count is within the limit; sizes are checked by `check_package`."""
    entries = payload.count(_CENTRAL_DIRECTORY_SIGNATURE)
    if entries > limits.max_zip_entries:
        raise TooLarge(f"zip entries exceed {limits.max_zip_entries}")
    return zipfile.ZipFile(io.BytesIO(payload))


def check_package(
    archive: zipfile.ZipFile,
    payload_size: int,
    limits: DocumentLimits,
    streamed: tuple[str, ...] = (),
) -> None:
    """Refuse bombs, encrypted entries and XML parts with DTDs, before a library parses them.

    `streamed`: name prefixes of the parts the library reads as a stream rather than as a whole
    tree, which are exempt from `MAX_XML_PART_BYTES`.
    """
    infos = archive.infolist()
    total = sum(info.file_size for info in infos)
    if total > limits.max_uncompressed_bytes:
        raise TooLarge(f"zip uncompressed size {total} exceeds {limits.max_uncompressed_bytes}")
    ratio = total / max(payload_size, 1)
    if ratio > limits.max_zip_ratio:
        raise TooLarge(f"zip compression ratio {ratio:.0f} exceeds {limits.max_zip_ratio:g}")
    for info in infos:
        if info.flag_bits & _ENCRYPTED_FLAG:
            raise Unreadable("encrypted")
        entry_ratio = info.file_size / max(info.compress_size, 1)
        if info.file_size >= _RATIO_MIN_ENTRY_BYTES and entry_ratio > limits.max_zip_ratio:
            raise TooLarge(
                f"zip entry {_entry_name(info)} compression ratio {entry_ratio:.0f} "
                f"exceeds {limits.max_zip_ratio:g}"
            )
    for info in infos:
        whole = not info.filename.startswith(streamed)
        _check_xml_part(archive, info, MAX_XML_PART_BYTES if whole else None)


def _check_xml_part(archive: zipfile.ZipFile, info: zipfile.ZipInfo, max_bytes: int | None) -> None:
    """Refuse a part that a parser would read as XML with a DTD or an encoding outside OPC's,
    or (when `max_bytes` is given) too large to parse into a tree.

    Every entry is sniffed, not only `*.xml`: python-docx decides by content type, not by name.
    An entry that does not start like XML (images, fonts) is not scanned further. SVG images are
    XML that often carries the SVG 1.1 DOCTYPE; both libraries keep them as opaque blobs, and even
    a renamed one would meet their entity-free parsers, so they are let through.
    """
    if info.filename.lower().endswith(".svg"):
        return
    with archive.open(info) as stream:
        chunk = stream.read(_SCAN_CHUNK)
        encoding = _xml_encoding(chunk, info)
        if encoding is None:
            return
        if max_bytes is not None and info.file_size > max_bytes:
            raise TooLarge(
                f"xml part {_entry_name(info)} is {info.file_size} bytes, over {max_bytes}"
            )
        # Lower-casing bytes touches only ASCII letters, so it works for UTF-16 too; it can only
        # add matches, never hide one. A "<!DOCTYPE" quoted in a CDATA section is refused as
        # well: a false alarm no real Office file raises.
        needle = _DOCTYPE.encode(encoding)
        carry = b""
        while chunk:
            window = carry + chunk.lower()
            if needle in window:
                raise Unreadable(f"xml part {_entry_name(info)} declares a DTD")
            carry = window[-(len(needle) - 1) :]
            chunk = stream.read(_SCAN_CHUNK)


def _xml_encoding(head: bytes, info: zipfile.ZipInfo) -> str | None:
    """The encoding to look for a DOCTYPE in, or None when `head` does not start like XML.

    The declared encoding must agree with the bytes: a part starting in ASCII that declares UTF-7
    or an EBCDIC code page could spell "<!DOCTYPE" with bytes the scan would not recognise.
    """
    if head.startswith(_UNSUPPORTED_XML_STARTS):
        raise Unreadable(f"xml part {_entry_name(info)} is not UTF-8 or UTF-16")
    if head.startswith((b"\xff\xfe", b"<\x00")):
        encoding, allowed = "utf-16-le", _UTF16_NAMES
    elif head.startswith((b"\xfe\xff", b"\x00<")):
        encoding, allowed = "utf-16-be", _UTF16_NAMES
    elif head.removeprefix(_UTF8_BOM).lstrip().startswith(b"<"):
        encoding, allowed = "utf-8", _UTF8_NAMES
    else:
        return None
    prolog = head[:_PROLOG_BYTES].decode(encoding, errors="replace").lstrip("\ufeff")
    declared = _ENCODING_DECLARATION.match(prolog)
    if declared and declared.group(1).lower() not in allowed:
        name = printable(declared.group(1))[:20]
        raise Unreadable(
            f"xml part {_entry_name(info)} declares encoding {name!r}, not UTF-8 or UTF-16"
        )
    return encoding


def _entry_name(info: zipfile.ZipInfo) -> str:
    """An entry name fit for an error message: it comes from the sender too."""
    return printable(info.filename)[:80]
