"""Documents built at run time, benign and hostile, for the tests and for bench/documents.py.

No binary blobs are committed: every sample is generated here from a few lines, so a reader can
see exactly what makes it hostile. Large payloads are produced by streaming compressors, so
building a 64 MB zip bomb costs kilobytes of memory, not 64 MB.

Run as a script (`python document_samples.py`), it is the child process that measures the peak
memory of one conversion: see `measure_in_child`.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path

import docx
import openpyxl

from mailpipe.mail.documents import DocumentLimits
from mailpipe.mail.parse import Attachment
from tests.support.paths import CORPUS as SHARED_CORPUS
from tests.support.paths import REPO

CORPUS = SHARED_CORPUS / "documents"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
MiB = 1024 * 1024

DEFAULT_LIMITS = DocumentLimits(
    max_bytes=25 * MiB,
    max_pages=500,
    max_uncompressed_bytes=200 * MiB,
    max_zip_entries=5000,
    max_zip_ratio=200.0,
    time_limit=30.0,
    max_text_chars=2_000_000,
    max_depth=25,
)
# The shared corpus's files are tested for what they convert to, not for the time limit
# (test_document_timeout.py is): the largest takes seconds, and a loaded machine many more.
CORPUS_LIMITS = dataclasses.replace(DEFAULT_LIMITS, time_limit=300.0)


def attachment(
    payload: bytes,
    content_type: str = "application/octet-stream",
    filename: str | None = "document",
    charset: str | None = None,
    index: int = 1,
) -> Attachment:
    return Attachment(index, filename, content_type, payload, charset, depth=1)


def corpus_files(*patterns: str) -> list[Path]:
    return sorted(path for pattern in patterns for path in CORPUS.glob(pattern))


# --- PDF -------------------------------------------------------------------------------------


def text_operators(text: str) -> bytes:
    return b"BT /F1 12 Tf 72 720 Td (%s) Tj ET\n" % text.encode("latin-1")


def build_pdf(pages: Iterable[Iterable[bytes]]) -> bytes:
    """A PDF with one FlateDecode content stream per page, each given as chunks to compress.

    Written by hand rather than with pypdf's writer, so that the file is exactly what the test
    says it is (a stream of many MB of zeros, a page tree of 600 pages) and nothing is repaired.
    """
    objects: list[bytes] = [b"", b""]  # 1: catalog, 2: page tree, filled in below
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")  # 3
    kids = []
    for chunks in pages:
        compressor = zlib.compressobj(9)
        data = b"".join(compressor.compress(chunk) for chunk in chunks) + compressor.flush()
        objects.append(
            b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(data), data)
        )
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % len(objects)
        )
        kids.append(len(objects))
    objects[0] = b"<< /Type /Catalog /Pages 2 0 R >>"
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (
        b" ".join(b"%d 0 R" % kid for kid in kids),
        len(kids),
    )
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref,
    )
    return bytes(out)


def pdf_with_pages(count: int) -> bytes:
    return build_pdf([text_operators(f"page {n}")] for n in range(1, count + 1))


def pdf_stream_bomb(inflated_mib: int) -> bytes:
    """One page whose content stream inflates to `inflated_mib` MiB of zeros (a few KB on disk)."""
    return build_pdf([_chunks(text_operators("bomb"), b"\0", inflated_mib)])


def pdf_slow(whitespace_mib: int) -> bytes:
    """A valid PDF that pypdf takes seconds to read: its content stream is MBs of white space,
    which the content parser walks in Python, under every size limit."""
    return build_pdf([_chunks(text_operators("slow"), b" ", whitespace_mib)])


def _chunks(head: bytes, fill: bytes, mib: int) -> Iterable[bytes]:
    yield head
    block = fill * MiB
    for _ in range(mib):
        yield block


# --- DOCX and XLSX ---------------------------------------------------------------------------


def docx_bytes(paragraphs: Iterable[str] = ("Hello from a DOCX.",), table: bool = False) -> bytes:
    document = docx.Document()
    for text in paragraphs:
        document.add_paragraph(text)
    if table:
        grid = document.add_table(rows=2, cols=3)
        grid.cell(0, 0).merge(grid.cell(0, 1)).text = "merged"
        grid.cell(0, 2).text = "right"
        for column, text in enumerate(("a", "b", "c")):
            grid.cell(1, column).text = text
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def docx_with_text(text: str) -> bytes:
    """A DOCX of one paragraph of `text`, put into the part directly: python-docx adds text a
    character at a time, which takes seconds for megabytes."""
    package = docx_bytes(["PLACEHOLDER"])
    with zipfile.ZipFile(io.BytesIO(package)) as archive:
        body = archive.read("word/document.xml")
    return rezip(
        package, replace={"word/document.xml": body.replace(b"PLACEHOLDER", text.encode())}
    )


def xlsx_bytes(rows: Iterable[Iterable[object]] = (("name", "amount"), ("Alice", 42))) -> bytes:
    workbook = openpyxl.Workbook()
    sheet = workbook.active
    sheet.title = "Invoices"
    for row in rows:
        sheet.append(list(row))
    out = io.BytesIO()
    workbook.save(out)
    return out.getvalue()


def rezip(
    package: bytes,
    replace: dict[str, bytes] | None = None,
    extra: Iterable[tuple[zipfile.ZipInfo, Iterable[bytes]]] = (),
) -> bytes:
    """`package` with some entries replaced and extra entries streamed in chunk by chunk."""
    replace = replace or {}
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(package)) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            target.writestr(info, replace.get(info.filename, source.read(info)))
        for info, chunks in extra:
            with target.open(info, "w", force_zip64=True) as stream:
                for chunk in chunks:
                    stream.write(chunk)
    return out.getvalue()


def entry(name: str, compress: int = zipfile.ZIP_DEFLATED) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
    info.compress_type = compress
    return info


def with_encrypted_flag(package: bytes, name: str) -> bytes:
    """`package` with the central directory marking entry `name` as encrypted (zipfile cannot
    write encrypted entries; the flag is all a reader sees before trying to decrypt)."""
    record = package.rindex(b"PK\x01\x02", 0, package.rindex(name.encode()))
    flags = int.from_bytes(package[record + 8 : record + 10], "little") | 0x1
    return package[: record + 8] + flags.to_bytes(2, "little") + package[record + 10 :]


def docx_zip_bomb(inflated_mib: int = 64) -> bytes:
    """A real DOCX plus one entry of zeros: ~1000x compression, the zip's overall ratio explodes."""
    return rezip(
        docx_bytes(), extra=[(entry("word/media/padding.bin"), _chunks(b"", b"\0", inflated_mib))]
    )


def docx_hidden_bomb() -> bytes:
    """A bomb entry hidden behind incompressible images: the zip's overall ratio looks normal
    (about 15), only the entry's own ratio (about 1000) gives it away."""
    noise = os.urandom(2 * MiB)
    return rezip(
        docx_bytes(),
        extra=[
            (entry("word/media/photo.jpg", zipfile.ZIP_STORED), [noise]),
            (entry("word/media/padding.bin"), _chunks(b"", b"\0", 24)),
        ],
    )


BILLION_LAUGHS = b"""<?xml version="1.0" encoding="UTF-8" standalone="yes"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
 <!ENTITY lol5 "&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;">
 <!ENTITY lol6 "&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;">
 <!ENTITY lol7 "&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;">
 <!ENTITY lol8 "&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;">
 <!ENTITY lol9 "&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;">
]>
"""


def with_doctype(part: bytes, doctype: bytes, text: bytes, entity_ref: bytes) -> bytes:
    """`part` with its XML declaration replaced by `doctype` and `text` replaced by an entity."""
    body = part.split(b"?>", 1)[1] if part.startswith(b"<?xml") else part
    return doctype + body.replace(text, entity_ref, 1)


def xlsx_billion_laughs() -> bytes:
    """An XLSX whose first cell is a billion laughs: 10^9 "lol"s, 3 GB, if the entity expands."""
    package = xlsx_bytes([("PLACEHOLDER",)])
    with zipfile.ZipFile(io.BytesIO(package)) as archive:
        sheet = archive.read("xl/worksheets/sheet1.xml")
    bomb = with_doctype(sheet, BILLION_LAUGHS, b"PLACEHOLDER", b"&lol9;")
    return rezip(package, replace={"xl/worksheets/sheet1.xml": bomb})


def docx_external_entity(url: str) -> bytes:
    """A DOCX whose body text is an external entity loaded from `url`."""
    package = docx_bytes(["PLACEHOLDER"])
    with zipfile.ZipFile(io.BytesIO(package)) as archive:
        body = archive.read("word/document.xml")
    doctype = (
        b'<?xml version="1.0"?>\n<!DOCTYPE w:document [<!ENTITY ext SYSTEM "%s">]>\n' % url.encode()
    )
    return rezip(
        package,
        replace={"word/document.xml": with_doctype(body, doctype, b"PLACEHOLDER", b"&ext;")},
    )


# --- Email -----------------------------------------------------------------------------------


def nested_email(levels: int, innermost_pdf: bytes | None = None) -> bytes:
    """An email with an attached email with an attached email... `levels` attached emails deep.

    Returns the payload of the outermost attached email, as the parser hands it over.
    """
    message = b"From: level%d@example.com\r\nTo: you@example.com\r\nSubject: level %d\r\n" % (
        levels,
        levels,
    )
    if innermost_pdf is None:
        message += b"\r\nbody of level %d\r\n" % levels
    else:
        message += (
            b'MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary="pdf"\r\n\r\n'
            b"--pdf\r\nContent-Type: text/plain\r\n\r\nbody of level %d\r\n"
            b"--pdf\r\nContent-Type: application/pdf\r\n"
            b'Content-Disposition: attachment; filename="deep.pdf"\r\n'
            b"Content-Transfer-Encoding: base64\r\n\r\n%s\r\n--pdf--\r\n"
        ) % (levels, base64.encodebytes(innermost_pdf).replace(b"\n", b"\r\n"))
    for level in range(levels - 1, 0, -1):
        message = (
            b"From: level%d@example.com\r\nTo: you@example.com\r\nSubject: level %d\r\n"
            b'MIME-Version: 1.0\r\nContent-Type: multipart/mixed; boundary="b%d"\r\n\r\n'
            b"--b%d\r\nContent-Type: text/plain\r\n\r\nbody of level %d\r\n"
            b"--b%d\r\nContent-Type: message/rfc822\r\n\r\n%s\r\n--b%d--\r\n"
        ) % (level, level, level, level, level, level, message, level)
    return message


# --- Peak memory in a child process ----------------------------------------------------------


def measure_in_child(att: Attachment, limits: DocumentLimits) -> dict[str, object]:
    """Convert `att` in a fresh interpreter; return its outcome and peak RSS against its baseline.

    The payload goes over stdin, so the child's high-water mark before converting covers only
    the interpreter, the imports and the payload itself, as in a worker, not the building of it.
    """
    header = {
        "limits": dataclasses.asdict(limits),
        "content_type": att.content_type,
        "filename": att.filename,
        "charset": att.charset,
    }
    completed = subprocess.run(
        [sys.executable, "-m", "tests.support.document_samples"],
        input=json.dumps(header).encode() + b"\n" + att.payload,
        capture_output=True,
        cwd=REPO,
        check=True,
    )
    return json.loads(completed.stdout)


def _peak_rss_kib() -> int:
    """This process's peak RSS. VmHWM belongs to the process's own address space; ru_maxrss
    would not do, as Linux carries the parent's high-water mark at fork across exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status: peak memory is measured on Linux only")


def _child_main() -> None:
    from mailpipe.mail.documents import convert_attachment

    header = json.loads(sys.stdin.buffer.readline())
    payload = sys.stdin.buffer.read()
    att = attachment(payload, header["content_type"], header["filename"], header["charset"])
    limits = DocumentLimits(**header["limits"])
    baseline_kib = _peak_rss_kib()
    document = convert_attachment(att, limits)
    peak_kib = _peak_rss_kib()
    print(
        json.dumps(
            {
                "status": document.status,
                "error": document.error,
                "baseline_mib": baseline_kib / 1024,
                "peak_mib": peak_kib / 1024,
                "growth_mib": (peak_kib - baseline_kib) / 1024,
            }
        )
    )


if __name__ == "__main__":
    _child_main()
