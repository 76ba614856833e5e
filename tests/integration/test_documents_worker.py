"""Attachments through a real worker: the shared corpus and hostile inputs built here.

Each ends `converted`, or `failed`/`unsupported`/`too_large` with a reason, or (for an email
that breaks a parse limit) a failed run with the reason; no child crashes and memory stays bounded.
"""

from __future__ import annotations

import threading
from email.message import EmailMessage

import psutil
import pytest
from sqlalchemy import select

from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import enqueue_emails
from mailpipe.storage import flags
from mailpipe.storage.models import Document, PipelineRun
from tests.support.document_samples import (
    DOCX,
    corpus_files,
    docx_zip_bomb,
    nested_email,
    pdf_stream_bomb,
    xlsx_billion_laughs,
)
from tests.support.waits import wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

XLSX = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"


def with_attachment(payload: bytes, filename: str, content_type: str, tag: str) -> bytes:
    message = EmailMessage()
    message["From"] = "docs@example.org"
    message["Subject"] = f"document {tag}"
    message["Message-ID"] = f"<doc-{tag}@example.org>"
    message.set_content(f"see the attached {filename}")
    maintype, subtype = content_type.split("/", 1)
    message.add_attachment(payload, maintype=maintype, subtype=subtype, filename=filename)
    return message.as_bytes()


def many_parts(count: int) -> bytes:
    parts = b"".join(
        b"--p\r\nContent-Type: text/plain\r\n\r\npart %d\r\n" % i for i in range(count)
    )
    return (
        b'From: a@example.org\r\nSubject: parts\r\nContent-Type: multipart/mixed; boundary="p"\r\n\r\n'
        + parts
        + b"--p--\r\n"
    )


def attached_email(inner: bytes) -> bytes:
    """An email with `inner` attached as message/rfc822, as mail clients attach one (7bit)."""
    return (
        b'From: a@example.org\r\nSubject: forwarded\r\nContent-Type: multipart/mixed; boundary="o"\r\n\r\n'
        b"--o\r\nContent-Type: text/plain\r\n\r\nforwarded below\r\n"
        b"--o\r\nContent-Type: message/rfc822\r\n\r\n" + inner + b"\r\n--o--\r\n"
    )


def html_email() -> bytes:
    message = EmailMessage()
    message["From"] = "news@example.org"
    message["Subject"] = "html"
    message.set_content("plain part")
    message.add_attachment(
        b"<html><head><script>exfiltrate()</script><style>p{}</style></head><body><p>Visible words"
        b'</p><img src="https://tracker.example/pixel.gif"><iframe src="https://evil.example/"></iframe></body></html>',
        maintype="text",
        subtype="html",
        filename="page.html",
    )
    return message.as_bytes()


class PeakRss:
    """Samples the RSS of a worker's children while the test runs."""

    def __init__(self, worker) -> None:  # type: ignore[no-untyped-def]
        self.worker = worker
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            for pid in self.worker.child_pids():
                try:
                    self.peak = max(self.peak, psutil.Process(pid).memory_info().rss)
                except psutil.NoSuchProcess:
                    pass


def documents_of(res, email_id: int) -> list[Document]:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return list(session.scalars(select(Document).where(Document.email_id == email_id)))


def test_corpus_and_hostile_documents_through_a_worker(res, live_worker) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    corpus = corpus_files("pdf-sample-files/**/*.pdf", "python-docx/**/*.docx")
    assert len(corpus) > 60
    emails = {
        f"corpus:{path.name}": with_attachment(
            path.read_bytes(),
            path.name,
            "application/pdf" if path.suffix == ".pdf" else DOCX,
            f"c{n}",
        )
        for n, path in enumerate(corpus)
    }
    emails |= {
        "docx_zip_bomb": with_attachment(docx_zip_bomb(), "bomb.docx", DOCX, "zip"),
        "pdf_stream_bomb": with_attachment(
            pdf_stream_bomb(300), "bomb.pdf", "application/pdf", "pdf"
        ),
        "xlsx_billion_laughs": with_attachment(xlsx_billion_laughs(), "laughs.xlsx", XLSX, "lol"),
        "hostile_name": with_attachment(b"plain text", "../../etc/passwd", "text/plain", "name"),
        "html": html_email(),
        "parts_10000": many_parts(10_000),
        "nested_1000": attached_email(nested_email(1000)),
    }
    ids = dict(zip(emails, store_emails(res, list(emails.values())), strict=True))
    with PeakRss(live_worker) as rss:
        enqueue_emails(list(ids.values()), res)
        statuses = wait_until_closed(res, list(ids.values()), timeout=240)

    for name, email_id in ids.items():
        if not name.startswith("corpus:"):
            continue
        assert statuses[email_id] == "succeeded", name
        [document] = documents_of(res, email_id)
        assert document.status.value in ("converted", "failed", "unsupported"), (
            name,
            document.status,
        )
        if document.status.value != "converted":
            assert document.error, name
    converted = sum(
        documents_of(res, i)[0].status.value == "converted"
        for n, i in ids.items()
        if n.startswith("corpus:")
    )
    assert converted >= len(corpus) - 3

    def only_document(name: str) -> Document:
        assert statuses[ids[name]] == "succeeded", name
        [document] = documents_of(res, ids[name])
        return document

    bomb = only_document("docx_zip_bomb")
    assert bomb.status.value == "too_large" and bomb.error
    stream_bomb = only_document("pdf_stream_bomb")
    assert stream_bomb.status.value in ("too_large", "failed") and stream_bomb.error
    laughs = only_document("xlsx_billion_laughs")
    assert laughs.status.value == "failed" and laughs.error
    named = only_document("hostile_name")
    assert "/" not in named.filename and ".." not in named.filename and named.text == "plain text"
    page = only_document("html")
    assert "Visible words" in page.text and "exfiltrate" not in page.text

    with res.db.session() as session:
        errors = dict(session.execute(select(PipelineRun.email_id, PipelineRun.error)).all())
    assert statuses[ids["parts_10000"]] == "failed" and "MIME parts" in errors[ids["parts_10000"]]
    nested = ids["nested_1000"]
    if statuses[nested] == "failed":
        assert "nested too deeply" in errors[nested]
    else:
        [document] = documents_of(res, nested)
        assert document.status.value in ("failed", "too_large") and "nest" in document.error

    # Bounded: no child grew anywhere near what the bombs would expand to (GBs).
    assert 0 < rss.peak < 1024 * 1024 * 1024, rss.peak
