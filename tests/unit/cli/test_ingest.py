"""`mailpipe ingest` on hostile sources: bounded reads, bounded batches, honest rejections."""

from __future__ import annotations

import mailbox
import os
import subprocess
import sys
import threading
from email.message import EmailMessage
from pathlib import Path

import pytest
from sqlalchemy import func, select

from mailpipe.broker import layout
from mailpipe.broker.queues import Lane, Stage, stage_queue
from mailpipe.cli import ingest as ingest_module
from mailpipe.cli.ingest import RawEmail, Rejected, ingest, read_sources
from mailpipe.storage.models import EmailMessage as EmailRow
from tests.support.bounds import bounded

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

LIMIT = 50 * 1024 * 1024  # MAILPIPE_MAX_EMAIL_BYTES' default, which the suite keeps


def message(n: int, body: str = "hello") -> bytes:
    msg = EmailMessage()
    msg["From"] = f"s{n}@example.org"
    msg["Subject"] = f"message {n}"
    msg["Message-ID"] = f"<ingest-{n}@example.org>"
    msg.set_content(f"{body} {n}")
    return msg.as_bytes()


def read(*paths: Path, max_bytes: int = LIMIT, follow: bool = False) -> list[RawEmail | Rejected]:
    return list(read_sources(paths, max_bytes=max_bytes, follow_symlinks=follow))


def reasons(items: list[RawEmail | Rejected]) -> dict[str, str]:
    return {Path(i.source).name: i.reason for i in items if isinstance(i, Rejected)}


def stored(items: list[RawEmail | Rejected]) -> list[str]:
    return [Path(i.source).name for i in items if isinstance(i, RawEmail)]


def mailpipe(*args: str) -> subprocess.CompletedProcess[str]:
    """`mailpipe ARGS` as operators run it, with the suite's environment."""
    return subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )


# --- reading within the limit -------------------------------------------------------------------


def test_a_file_over_the_limit_is_rejected_without_being_read(tmp_path: Path) -> None:
    big = tmp_path / "big.eml"
    with big.open("wb") as handle:
        handle.write(message(1))
        handle.truncate(LIMIT + 10 * 1024 * 1024)  # sparse: 60 MB that cost nothing to write
    with bounded(mib=5):
        items = read(big)
    assert reasons(items) == {
        "big.eml": f"{LIMIT + 10 * 1024 * 1024} bytes, over the limit of {LIMIT}"
    }


def test_dev_zero_is_rejected_not_a_memory_error() -> None:
    with bounded(mib=5):
        items = read(Path("/dev/zero"))
    assert reasons(items) == {"zero": "a device, not a file"}


def test_a_pipe_is_read_up_to_the_limit_plus_one_byte() -> None:
    limit = 1024 * 1024
    read_end, write_end = os.pipe()
    written = []

    def writer() -> None:
        try:
            with os.fdopen(write_end, "wb") as out:
                for _ in range(64):  # 64 MiB if nobody stopped reading
                    out.write(b"x" * limit)
                    written.append(limit)
        except BrokenPipeError:
            pass

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        with bounded(mib=10):
            items = read(Path(f"/proc/self/fd/{read_end}"), max_bytes=limit)
    finally:
        os.close(read_end)
        thread.join(timeout=10)
    assert list(reasons(items).values()) == [f"over the limit of {limit} bytes"]
    assert sum(written) < 8 * limit


def test_a_file_within_the_limit_is_read_whole(tmp_path: Path) -> None:
    (tmp_path / "one.eml").write_bytes(message(1))
    [item] = read(tmp_path / "one.eml")
    assert isinstance(item, RawEmail) and item.data == message(1)


# --- mbox ---------------------------------------------------------------------------------------


def test_an_unescaped_from_line_in_a_body_neither_splits_nor_is_stored_silently(
    tmp_path: Path,
) -> None:
    mbox = tmp_path / "inbox.mbox"
    mbox.write_bytes(
        b"From a@example.org Mon Jan  1 00:00:00 2024\n"
        b"From: a@example.org\nSubject: one\n\nHello\n"
        b"From the desk of Bob: things\nSubject: x\n\nmore text\n\n"  # no From line: body text
        b"From b@example.org Mon Jan  1 00:00:00 2024\n"
        b"From: b@example.org\nSubject: two\n\nbody two\n\n"
        b"From c@example.org Tue Jan  2 10:00:00 2024\n"  # a real From line, then no email
        b"the rest of a forwarded text\n"
    )
    items = read(mbox)
    first = items[0]
    assert isinstance(first, RawEmail) and b"From the desk of Bob" in first.data
    assert stored(items) == ["inbox.mbox#0", "inbox.mbox#1", "inbox.mbox#2"]

    from mailpipe.cli.ingest import _rejection
    from mailpipe.settings import get_settings

    verdicts = [_rejection(i, get_settings()) for i in items if isinstance(i, RawEmail)]
    assert verdicts == [
        None,
        None,
        "not an email: no header block after an mbox From line (one in a body?)",
    ]


def test_mbox_messages_read_as_the_mailbox_module_reads_well_formed_ones(tmp_path: Path) -> None:
    box = mailbox.mbox(tmp_path / "inbox.mbox")
    for n in range(5):
        box.add(message(n, body="From here on\n\nFrom the start"))  # escaped as >From
    box.close()
    reader = mailbox.mbox(tmp_path / "inbox.mbox")
    expected = [reader.get_bytes(key) for key in reader.iterkeys()]
    reader.close()
    assert len(expected) == 5
    items = read(tmp_path / "inbox.mbox")
    assert [i.data for i in items if isinstance(i, RawEmail)] == expected


def test_an_mbox_message_over_the_limit_is_rejected_and_not_held(tmp_path: Path) -> None:
    limit = 64 * 1024
    mbox = tmp_path / "big.mbox"
    with mbox.open("wb") as out:
        out.write(b"From a@example.org Mon Jan  1 00:00:00 2024\n" + message(1) + b"\n")
        out.write(b"From b@example.org Mon Jan  1 00:00:00 2024\n" + message(2))
        out.write((b"x" * 1000 + b"\n") * 20_000)  # 20 MB in one message
        out.write(b"\nFrom c@example.org Mon Jan  1 00:00:00 2024\n" + message(3))
        out.write(b"\nFrom d@example.org Mon Jan  1 00:00:00 2024\n" + b"y" * (3 * limit))
    with bounded(mib=2):
        items = read(mbox, max_bytes=limit)
    assert stored(items) == ["big.mbox#0", "big.mbox#2"]
    assert reasons(items) == {
        "big.mbox#1": f"over the limit of {limit} bytes",
        "big.mbox#3": f"over the limit of {limit} bytes",
    }


# --- symlinks -----------------------------------------------------------------------------------


@pytest.fixture
def linked(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.eml").write_bytes(message(9))
    (outside / "dir").mkdir()
    (outside / "dir" / "deep.eml").write_bytes(message(8))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.eml").write_bytes(message(1))
    (folder / "inside.eml").symlink_to(folder / "a.eml")
    (folder / "out.eml").symlink_to(outside / "secret.eml")
    (folder / "outdir").symlink_to(outside / "dir")
    (folder / "loop").symlink_to(tmp_path)  # through it, folder/ again
    (folder / "broken.eml").symlink_to(tmp_path / "nothing")
    return folder


def test_symlinks_out_of_the_folder_are_refused(linked: Path) -> None:
    items = read(linked)
    assert stored(items) == ["a.eml", "inside.eml"]
    refused = reasons(items)
    assert set(refused) == {"out.eml", "outdir", "loop", "broken.eml"}
    assert refused["out.eml"].startswith("symlink to ")
    assert refused["out.eml"].endswith(f"outside {linked} (--follow-symlinks reads it)")
    assert refused["broken.eml"] == "broken symlink"


def test_follow_symlinks_reads_them_once_even_through_a_loop(linked: Path) -> None:
    items = read(linked, follow=True)
    names = stored(items)
    assert {"a.eml", "inside.eml", "out.eml", "deep.eml", "secret.eml"} <= set(names)
    assert reasons(items) == {"broken.eml": "broken symlink"}
    assert len(names) == len(set(Path(i.source) for i in items if isinstance(i, RawEmail)))


def test_symlink_loops_and_unreadable_folders_are_reported_and_the_rest_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a.eml").write_bytes(message(1))
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "b.eml").write_bytes(message(2))
    real_scandir = os.scandir

    def scandir(path):  # type: ignore[no-untyped-def]
        if Path(path) == locked:  # as for a folder of mode 0 (the tests may run as root)
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(ingest_module.os, "scandir", scandir)
    items = read(tmp_path, follow=True)
    assert stored(items) == ["a.eml"]
    assert reasons(items) == {
        "loop1": "symlink loop",
        "loop2": "symlink loop",
        "locked": "unreadable: Permission denied",
    }


def test_a_symlink_named_on_the_command_line_is_read(linked: Path) -> None:
    assert stored(read(linked / "out.eml")) == ["out.eml"]


def test_symlinks_in_a_maildir_out_of_it_are_refused(tmp_path: Path) -> None:
    box = mailbox.Maildir(tmp_path / "Maildir")
    box.add(message(1))
    (tmp_path / "secret.eml").write_bytes(message(2))
    (tmp_path / "Maildir" / "new" / "123.linked").symlink_to(tmp_path / "secret.eml")
    items = read(tmp_path / "Maildir")
    assert len(stored(items)) == 1
    assert list(reasons(items).values()) == [
        f"symlink to {tmp_path / 'secret.eml'}, outside {tmp_path / 'Maildir'} "
        "(--follow-symlinks reads it)"
    ]
    assert len(stored(read(tmp_path / "Maildir", follow=True))) == 2


@pytest.mark.parametrize("linked", ["cur", "new"])
def test_a_maildir_s_cur_or_new_linked_out_of_it_is_refused_as_in_a_folder(
    res, tmp_path: Path, linked: str
) -> None:  # type: ignore[no-untyped-def]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for n in (1, 2):
        (elsewhere / f"17000000{n}.M1.host").write_bytes(message(n))
    maildir = tmp_path / "Maildir"
    for name in ("cur", "new", "tmp"):
        (maildir / name).mkdir(parents=True, exist_ok=True)
    other = "new" if linked == "cur" else "cur"
    (maildir / other / "1700000003.M1.host").write_bytes(message(3))
    (maildir / linked).rmdir()
    (maildir / linked).symlink_to(elsewhere)
    refusal = f"symlink to {elsewhere}, outside {maildir} (--follow-symlinks reads it)"

    run = mailpipe("ingest", "--no-enqueue", str(maildir))
    assert run.returncode == 2, run.stderr
    assert "stored 1, enqueued 0, already queued 0, rejected 1" in run.stdout
    assert f"rejected {maildir / linked}: {refusal}" in run.stdout
    # The same link in a plain folder is refused in the same words.
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / linked).symlink_to(elsewhere)
    assert reasons(read(folder)) == {linked: refusal.replace(str(maildir), str(folder))}
    assert len(stored(read(maildir, follow=True))) == 3


def test_maildir_files_that_share_a_key_are_each_stored(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    maildir = tmp_path / "Maildir"
    for name in ("cur", "new", "tmp"):
        (maildir / name).mkdir(parents=True)
    names = ["cur/1700.M1.host:2,RS", "cur/1700.M1.host:2,S", "new/1700.M1.host"]
    for n, name in enumerate(names):
        (maildir / name).write_bytes(message(n))
    (maildir / "cur" / "1600.M1.host:2,").write_bytes(message(9))

    run = mailpipe("ingest", "--no-enqueue", str(maildir))
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("stored 4, enqueued 0, already queued 0, rejected 0")
    with res.db.session() as session:
        assert session.scalar(select(func.count()).select_from(EmailRow)) == 4
    # In key order, each named by its own file.
    assert [Path(i.source).relative_to(maildir).as_posix() for i in read(maildir)] == [
        "cur/1600.M1.host:2,",
        *names,
    ]


def test_a_symlink_loop_in_a_maildir_is_rejected_and_the_rest_read(tmp_path: Path) -> None:
    box = mailbox.Maildir(tmp_path / "Maildir")
    box.add(message(1))
    new = tmp_path / "Maildir" / "new"
    (new / "1.loop").symlink_to(new / "2.loop")
    (new / "2.loop").symlink_to(new / "1.loop")
    items = read(tmp_path / "Maildir")
    assert len(stored(items)) == 1
    assert reasons(items) == {"1.loop": "symlink loop", "2.loop": "symlink loop"}


# --- batches and the command ----------------------------------------------------------------


def test_batches_are_bounded_by_bytes_as_well_as_count(
    res, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    for n in range(12):
        (tmp_path / f"{n:02d}.eml").write_bytes(message(n, body="x" * 40_000))
    batches: list[list[int]] = []
    real = ingest_module.store_emails

    def spy(res, raws, lane, mailbox):  # type: ignore[no-untyped-def]
        batches.append([len(raw) for raw in raws])
        return real(res, raws, lane, mailbox)

    monkeypatch.setattr(ingest_module, "store_emails", spy)
    monkeypatch.setattr(ingest_module, "BATCH_BYTES", 100_000)
    report = ingest(res, [tmp_path], enqueue=False)
    assert report.stored == 12 and report.rejected == []
    assert [len(b) for b in batches] == [2, 2, 2, 2, 2, 2]
    assert all(sum(b) <= 100_000 for b in batches)
    with res.db.session() as session:
        assert session.scalar(select(func.count()).select_from(EmailRow)) == 12


def test_ingest_exits_2_when_anything_was_rejected_unless_allowed(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    good = tmp_path / "good"
    good.mkdir()
    (good / "one.eml").write_bytes(message(1))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "two.eml").write_bytes(message(2))
    (mixed / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (mixed / "parts.eml").write_bytes(
        b'From: a@example.org\r\nContent-Type: multipart/mixed; boundary="x"\r\n\r\n'
        + b"--x\n\n" * 400_000
    )

    ok = mailpipe("ingest", "--no-enqueue", str(good))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("stored 1, enqueued 0, already queued 0, rejected 0")

    refused = mailpipe("ingest", "--no-enqueue", str(mixed), "/dev/zero")
    assert refused.returncode == 2, refused.stderr
    assert "stored 1, enqueued 0, already queued 0, rejected 3" in refused.stdout
    assert f"rejected {mixed / 'photo.png'}: not an email: no header block" in refused.stdout
    assert f"rejected {mixed / 'parts.eml'}: email has more than 1000 MIME parts" in refused.stdout
    assert "rejected /dev/zero: a device, not a file" in refused.stdout
    assert "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "Error: 3 rejected (listed above); the rest was stored. --allow-rejects exits 0 for them."
    ]

    allowed = mailpipe("ingest", "--no-enqueue", "--allow-rejects", str(mixed / "photo.png"))
    assert allowed.returncode == 0, allowed.stderr
    assert "rejected 1" in allowed.stdout


def test_ingest_lane_bulk_stores_the_rows_and_sends_the_jobs_in_bulk(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for n in range(2):
        (tmp_path / f"{n}.eml").write_bytes(message(n))
    run = mailpipe("ingest", "--lane", "bulk", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("stored 2, enqueued 2")
    with res.db.session() as session:
        stored = dict(session.execute(select(EmailRow.id, EmailRow.lane)).all())
    assert set(stored.values()) == {"bulk"}
    bulk = stage_queue(Stage.CPU, res.settings, Lane.BULK)
    assert layout.emails_in_broker(res.redis, [bulk]) == set(stored)
    assert layout.emails_in_broker(res.redis, [res.settings.queue]) == set()
