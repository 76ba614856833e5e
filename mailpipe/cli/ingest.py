"""`mailpipe ingest`: store raw emails, insert their rows, commit, then enqueue their jobs.

Sources: .eml files, folders of them (every file below, recursively), mbox files (detected by
their leading "From " line) and Maildir folders (cur/ and new/). A file that cannot be read, or
whose bytes are not an email, is reported and skipped; it never aborts the batch. Work is done in
batches: one transaction and two Redis round trips per batch, not per email.

Memory is bounded: a file is stat'ed first and one over MAILPIPE_MAX_EMAIL_BYTES is rejected
without being read (past the five bytes that tell an mbox); no read takes more than the limit
plus one byte (a device such as /dev/zero is refused outright, a pipe is read up to the limit); an
mbox is read a line at a time, the limit being each message's; and a batch holds at most
BATCH_SIZE emails and BATCH_BYTES bytes (plus one email). Each email passes the parser's pre-scan (`mailpipe.mail.prescan`) before it is
stored, so one that the worker would reject at once is reported here instead.

In an mbox, a message starts at a "From " line at the start of the file or after a blank line that
reads as an mbox From line (a sender, a time and a year); any other "From " line is body text. A
message found that way that is still not an email (an unescaped From line in a body) is reported
as rejected, not stored.

A symlink found in a folder being ingested (a Maildir's cur/ and new/ among them) is read only if
it points inside that folder; one that points outside is rejected unless `follow_symlinks`
(`--follow-symlinks`). Paths named on the command line are read whatever they are links to.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import insert

from mailpipe.broker import mailboxes
from mailpipe.broker.queues import Lane
from mailpipe.enqueue import enqueue_emails
from mailpipe.errors import InputRejected
from mailpipe.mail.parse import looks_like_email
from mailpipe.mail.prescan import prescan
from mailpipe.resources import Resources
from mailpipe.settings import Settings
from mailpipe.storage.keys import raw_email_key
from mailpipe.storage.models import EmailMessage, utcnow

BATCH_SIZE = 500
# Bytes of the emails held for one batch: a batch is stored once it would pass this (an email
# larger than this is a batch of its own), so ingest holds at most this plus one email.
BATCH_BYTES = 64 * 1024 * 1024
BLOB_WRITERS = 8
_READ_CHUNK = 1024 * 1024
# An mbox From line: "From ", a sender, then a date with a time and a year, in any order
# (asctime's "Mon Jan  1 00:00:00 2024", "Mon Feb  8 02:53:47 PST 1993", "Thu, 01 Jan 2024 ...").
_MBOX_FROM = re.compile(rb"From \S+[ \t](?=.*\b\d{1,2}:\d{2}\b)(?=.*\b\d{4}\b)")


@dataclass(frozen=True)
class RawEmail:
    source: str  # where it came from, for the report: a path, or "mbox#12"
    data: bytes
    after_from_line: bool = False  # an mbox message after the first: split at a From line


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

    @classmethod
    def combined(cls, reports: Iterable[IngestReport]) -> IngestReport:
        total = cls()
        for report in reports:
            total.stored += report.stored
            total.enqueued += report.enqueued
            total.already_queued += report.already_queued
            total.rejected.extend(report.rejected)
            total.email_ids.extend(report.email_ids)
        return total


def by_mailbox(folders: Iterable[Path]) -> tuple[dict[str | None, list[Path]], list[Rejected]]:
    """The mailboxes in `folders` of mailboxes (`--mailbox-per-folder`): each folder directly in
    one is a mailbox, named as that folder, holding what the folder holds; and the files beside
    them, rejected. ValueError for a path that is not a folder, or a folder's name that cannot
    be a mailbox's."""
    found: dict[str | None, list[Path]] = {}
    loose: list[Rejected] = []
    for folder in folders:
        if not folder.is_dir():
            raise ValueError(f"{folder}: not a folder of mailboxes")
        for path in sorted(folder.iterdir()):
            if path.is_dir():
                found.setdefault(mailboxes.stored(path.name), []).append(path)
            else:
                loose.append(Rejected(str(path), "not in a mailbox's folder"))
    return found, loose


def read_sources(
    paths: Iterable[Path], *, max_bytes: int, follow_symlinks: bool = False
) -> Iterator[RawEmail | Rejected]:
    """Every email in `paths`, or why one could not be read; at most `max_bytes` read per email."""
    for path in paths:
        yield from _read_path(path, max_bytes, follow_symlinks)


def ingest(
    res: Resources,
    paths: Iterable[Path],
    *,
    enqueue: bool = True,
    on_progress: Callable[[int], None] | None = None,
    follow_symlinks: bool = False,
    lane: Lane = Lane.LIVE,
    mailbox: str | None = None,
) -> IngestReport:
    """Store every email in `paths`, each in `lane` and `mailbox` (None: the default one), and
    enqueue its job in them (unless not `enqueue`)."""
    settings = res.settings
    report = IngestReport()
    batch: list[RawEmail] = []
    batch_bytes = 0
    for item in read_sources(
        paths, max_bytes=settings.max_email_bytes, follow_symlinks=follow_symlinks
    ):
        if isinstance(item, Rejected):
            report.rejected.append(item)
        elif (reason := _rejection(item, settings)) is not None:
            report.rejected.append(Rejected(item.source, reason))
        else:
            if batch and (len(batch) >= BATCH_SIZE or batch_bytes + len(item.data) > BATCH_BYTES):
                _store_batch(res, batch, report, enqueue, lane, mailbox)
                batch, batch_bytes = [], 0
            batch.append(item)
            batch_bytes += len(item.data)
        if on_progress is not None:
            on_progress(1)
    if batch:
        _store_batch(res, batch, report, enqueue, lane, mailbox)
    return report


def store_emails(
    res: Resources, raws: list[bytes], lane: Lane = Lane.LIVE, mailbox: str | None = None
) -> list[int]:
    """Store raw emails and insert their rows, in `lane` and `mailbox`, in one transaction;
    returns their ids in order.

    What upstream storage does before it calls `enqueue_email`; also used by tests and the demo.
    """
    rows = []
    for data in raws:
        digest = hashlib.sha256(data).hexdigest()
        rows.append(
            {
                "blob_key": raw_email_key(digest),
                "size": len(data),
                "sha256": digest,
                "received_at": utcnow(),
                "lane": lane.value,
                "mailbox": mailbox,
            }
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


def _store_batch(
    res: Resources,
    batch: list[RawEmail],
    report: IngestReport,
    enqueue: bool,
    lane: Lane,
    mailbox: str | None,
) -> None:
    ids = store_emails(res, [item.data for item in batch], lane, mailbox)
    report.stored += len(ids)
    report.email_ids.extend(ids)
    if enqueue:
        result = enqueue_emails(ids, res, lane=lane, mailboxes=dict.fromkeys(ids, mailbox))
        report.enqueued += len(result.sent)
        report.already_queued += len(result.already_queued)


def _rejection(item: RawEmail, settings: Settings) -> str | None:
    data = item.data
    if not data.strip():
        return "empty file"
    if len(data) > settings.max_email_bytes:
        return f"{len(data)} bytes, over the limit of {settings.max_email_bytes}"
    if not looks_like_email(data):
        if item.after_from_line:
            return "not an email: no header block after an mbox From line (one in a body?)"
        return "not an email: no header block"
    try:
        prescan(data, max_parts=settings.max_mime_parts, max_depth=settings.max_mime_depth)
    except InputRejected as exc:
        return str(exc)
    return None


# --- Reading ---------------------------------------------------------------------------------


def _read_path(path: Path, max_bytes: int, follow: bool) -> Iterator[RawEmail | Rejected]:
    try:
        if path.is_dir():
            root = path.resolve()
            if (path / "cur").is_dir() and (path / "new").is_dir():
                yield from _read_maildir(path, root, max_bytes, follow)
                return
            for found in _folder_files(path, root, follow):
                if isinstance(found, Rejected):
                    yield found
                else:
                    yield from _read_file(found, max_bytes)
            return
        yield from _read_file(path, max_bytes)
    except OSError as exc:
        yield Rejected(str(path), _unreadable(exc))


def _folder_files(folder: Path, root: Path, follow: bool) -> list[Path | Rejected]:
    """The files below `folder` in path order (hidden files left out), and the entries refused:
    symlinks out of `root` (unless `follow`), broken ones or loops, what is not a regular file,
    and folders that cannot be read (each on its own: the rest is still read)."""
    found: list[tuple[Path, Rejected | None]] = []
    visited: set[tuple[int, int]] = set()
    pending = [folder]
    while pending:
        directory = pending.pop()
        try:
            info = directory.stat()
            if (info.st_dev, info.st_ino) in visited:
                continue  # reached again through a followed symlink
            visited.add((info.st_dev, info.st_ino))
            with os.scandir(directory) as scan:
                entries = list(scan)
        except OSError as exc:
            found.append((directory, Rejected(str(directory), _unreadable(exc))))
            continue
        for entry in entries:
            path = Path(entry.path)
            try:
                if entry.name.startswith(".") and not entry.is_dir(follow_symlinks=False):
                    continue  # hidden files, as before; hidden folders are walked
                if not entry.is_symlink():
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(path)
                    else:
                        found.append((path, _not_a_file(path)))
                    continue
                target = path.resolve()
                if not target.exists():
                    found.append((path, Rejected(str(path), "broken symlink")))
                    continue
                inside = target.is_relative_to(root)
                if not inside and not follow:
                    found.append((path, _outside(path, target, root)))
                elif target.is_dir():
                    if not inside:  # one inside the folder is walked as itself
                        pending.append(path)
                else:
                    found.append((path, _not_a_file(target)))
            except RuntimeError:  # Path.resolve's "Symlink loop"
                found.append((path, Rejected(str(path), "symlink loop")))
            except OSError as exc:
                found.append((path, Rejected(str(path), _unreadable(exc))))
    found.sort(key=lambda pair: pair[0])
    return [path if refused is None else refused for path, refused in found]


def _not_a_file(path: Path) -> Rejected | None:
    """Inside a folder only regular files are read: a FIFO would block, a device never end."""
    if stat.S_ISREG(path.stat().st_mode):
        return None
    return Rejected(str(path), "not a regular file")


def _read_file(path: Path, max_bytes: int, *, mbox: bool = True) -> Iterator[RawEmail | Rejected]:
    try:
        info = path.stat()
        if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode):
            yield Rejected(str(path), "a device, not a file")
            return
        regular = stat.S_ISREG(info.st_mode)
        with path.open("rb") as handle:
            start = handle.read(5)
            if mbox and start == b"From ":  # the limit is each message's
                handle.seek(0)
                yield from _read_mbox(handle, str(path), max_bytes)
                return
            if regular and info.st_size > max_bytes:
                yield Rejected(str(path), f"{info.st_size} bytes, over the limit of {max_bytes}")
                return
            hint = info.st_size if regular else _READ_CHUNK
            data = _read_at_most(handle, start, max_bytes, hint)
        if data is None:
            yield Rejected(str(path), f"over the limit of {max_bytes} bytes")
        else:
            yield RawEmail(str(path), data)
    except OSError as exc:
        yield Rejected(str(path), _unreadable(exc))


def _read_at_most(handle: BinaryIO, start: bytes, max_bytes: int, hint: int) -> bytes | None:
    """The rest of `handle` after `start`, or None if the whole is over `max_bytes`; never reads
    more than `max_bytes` + 1 bytes in all."""
    chunks = [start]
    total = len(start)
    size = max(1, min(hint, max_bytes) + 1 - total)  # a file's own size, then a chunk at a time
    while total <= max_bytes:
        chunk = handle.read(min(size, max_bytes + 1 - total))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        size = _READ_CHUNK
    return None


def _read_mbox(handle: BinaryIO, name: str, max_bytes: int) -> Iterator[RawEmail | Rejected]:
    """The messages of an mbox, read a line at a time; each as `mailbox.mbox` gives it (without
    its From line, and without the blank line before the next), split only at real From lines."""
    number = -1
    lines: list[bytes] = []
    size = 0
    last_blank = True
    while True:
        # A line is read in pieces of at most the limit, so a file without newlines is bounded.
        line = handle.readline(max_bytes + 1)
        starts = line.startswith(b"From ") and (
            number < 0 or (last_blank and _MBOX_FROM.match(line))
        )
        if starts or not line:
            if number >= 0:
                if lines and lines[-1] == b"\n":
                    size -= 1
                    lines.pop()
                if size > max_bytes:
                    yield Rejected(f"{name}#{number}", f"over the limit of {max_bytes} bytes")
                else:
                    yield RawEmail(f"{name}#{number}", b"".join(lines), after_from_line=number > 0)
            if not line:
                return
            number += 1
            lines, size, last_blank = [], 0, False
            continue
        size += len(line)
        if size <= max_bytes + 1:
            lines.append(line)
        elif lines:
            lines = [b""]  # over the limit: keep counting, stop holding
        last_blank = line in (b"\n", b"\r\n")


def _read_maildir(
    path: Path, root: Path, max_bytes: int, follow: bool
) -> Iterator[RawEmail | Rejected]:
    """The messages of a Maildir, in key order (the name before ":"): every file of cur/ and
    new/, each an email of its own. Files that share a key (a move to cur/ cut short, or a
    client that reused one) are all read: the email's origin, not its key, tells a copy from
    another email, as for the files of a folder. A cur/ or new/ that is a symlink out of the
    Maildir is refused, as a folder's link out of it is, unless `follow`."""
    files: list[Path] = []
    for subdir in (path / "cur", path / "new"):
        if (refused := _link_out(subdir, root, follow)) is not None:
            yield refused
            continue
        files += [entry for entry in subdir.iterdir() if not entry.is_dir()]
    for file in sorted(files, key=lambda file: (file.name.split(":")[0], file)):
        try:
            refused = _link_out(file, root, follow) or _not_a_file(file)
        except RuntimeError:  # Path.resolve's "Symlink loop"
            refused = Rejected(str(file), "symlink loop")
        except OSError as exc:
            refused = Rejected(str(file), _unreadable(exc))
        if refused is not None:
            yield refused
        else:
            yield from _read_file(file, max_bytes, mbox=False)


def _link_out(path: Path, root: Path, follow: bool) -> Rejected | None:
    """The refusal of `path` if it is a symlink out of `root` and links are not followed."""
    if follow or not path.is_symlink():
        return None
    target = path.resolve()
    return None if target.is_relative_to(root) else _outside(path, target, root)


def _outside(link: Path, target: Path, root: Path) -> Rejected:
    return Rejected(str(link), f"symlink to {target}, outside {root} (--follow-symlinks reads it)")


def _unreadable(exc: OSError) -> str:
    return f"unreadable: {exc.strerror or exc}"
