"""`mailpipe ingest`: store raw emails, insert their rows, commit, then enqueue their jobs.

Sources: .eml files, folders of them (every file below, recursively), mbox files (detected by
their leading "From " line) and Maildir folders (cur/ and new/). A file that cannot be read, or
whose bytes are not an email, is reported and skipped; it never aborts the batch. Work is done in
batches: one transaction and two Redis round trips per batch, not per email.
"""

from __future__ import annotations

import hashlib
import mailbox
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import insert

from mailpipe.blobstore import raw_email_key
from mailpipe.enqueue import enqueue_emails
from mailpipe.models import EmailMessage, utcnow
from mailpipe.pipeline.parse import looks_like_email
from mailpipe.resources import Resources

BATCH_SIZE = 500
BLOB_WRITERS = 8


@dataclass(frozen=True)
class RawEmail:
    source: str  # where it came from, for the report: a path, or "mbox#12"
    data: bytes


@dataclass(frozen=True)
class Rejected:
    source: str
    reason: str


@dataclass
class IngestReport:
    stored: int = 0
    enqueued: int = 0
    already_queued: int = 0
    rejected: list[Rejected] = field(default_factory=list)
    email_ids: list[int] = field(default_factory=list)


def read_sources(paths: Iterable[Path]) -> Iterator[RawEmail | Rejected]:
    for path in paths:
        yield from _read_path(path)


def ingest(
    res: Resources,
    paths: Iterable[Path],
    *,
    enqueue: bool = True,
    on_progress: Callable[[int], None] | None = None,
) -> IngestReport:
    report = IngestReport()
    batch: list[RawEmail] = []
    for item in read_sources(paths):
        if isinstance(item, Rejected):
            report.rejected.append(item)
        elif (reason := _rejection(item.data, res.settings.max_email_bytes)) is not None:
            report.rejected.append(Rejected(item.source, reason))
        else:
            batch.append(item)
        if on_progress is not None:
            on_progress(1)
        if len(batch) >= BATCH_SIZE:
            _store_batch(res, batch, report, enqueue)
            batch = []
    if batch:
        _store_batch(res, batch, report, enqueue)
    return report


def store_emails(res: Resources, raws: list[bytes]) -> list[int]:
    """Store raw emails and insert their rows in one transaction; returns their ids in order.

    What upstream storage does before it calls `enqueue_email`; also used by tests and the demo.
    """
    rows = []
    for data in raws:
        digest = hashlib.sha256(data).hexdigest()
        rows.append(
            {"blob_key": raw_email_key(digest), "size": len(data), "sha256": digest, "received_at": utcnow()}
        )
    # Blob writes are round trips to S3 in production: overlap them (boto3 clients are
    # thread-safe). Every blob is written before any row that points at it is committed.
    with ThreadPoolExecutor(max_workers=BLOB_WRITERS) as pool:
        list(pool.map(res.blobs.put, [row["blob_key"] for row in rows], raws))
    with res.db.transaction() as session:
        ids = session.scalars(
            insert(EmailMessage).returning(EmailMessage.id, sort_by_parameter_order=True), rows
        )
        return list(ids)


def _store_batch(res: Resources, batch: list[RawEmail], report: IngestReport, enqueue: bool) -> None:
    ids = store_emails(res, [item.data for item in batch])
    report.stored += len(ids)
    report.email_ids.extend(ids)
    if enqueue:
        result = enqueue_emails(ids, res)
        report.enqueued += len(result.sent)
        report.already_queued += len(result.already_queued)


def _rejection(data: bytes, max_bytes: int) -> str | None:
    if not data.strip():
        return "empty file"
    if len(data) > max_bytes:
        return f"{len(data)} bytes, over the limit of {max_bytes}"
    if not looks_like_email(data):
        return "not an email: no header block"
    return None


def _read_path(path: Path) -> Iterator[RawEmail | Rejected]:
    try:
        if path.is_dir():
            if (path / "cur").is_dir() and (path / "new").is_dir():
                yield from _read_maildir(path)
                return
            for child in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
                yield from _read_file(child)
            return
        yield from _read_file(path)
    except OSError as exc:
        yield Rejected(str(path), f"unreadable: {exc.strerror or exc}")


def _read_file(path: Path) -> Iterator[RawEmail | Rejected]:
    try:
        with path.open("rb") as handle:
            start = handle.read(5)
        if start == b"From ":
            yield from _read_mbox(path)
            return
        yield RawEmail(str(path), path.read_bytes())
    except OSError as exc:
        yield Rejected(str(path), f"unreadable: {exc.strerror or exc}")


def _read_mbox(path: Path) -> Iterator[RawEmail | Rejected]:
    box = mailbox.mbox(path, create=False)
    try:
        for number, key in enumerate(box.iterkeys()):
            yield RawEmail(f"{path}#{number}", box.get_bytes(key))
    finally:
        box.close()


def _read_maildir(path: Path) -> Iterator[RawEmail | Rejected]:
    box = mailbox.Maildir(path, factory=None, create=False)
    for key in sorted(box.iterkeys()):
        try:
            yield RawEmail(f"{path}/{key}", box.get_bytes(key))
        except OSError as exc:
            yield Rejected(f"{path}/{key}", f"unreadable: {exc.strerror or exc}")
