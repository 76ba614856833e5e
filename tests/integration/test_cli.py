"""The `mailpipe` command line, run as operators run it: a subprocess with the environment."""

from __future__ import annotations

import json
import mailbox
import os
import subprocess
import sys
from email.message import EmailMessage
from pathlib import Path

from sqlalchemy import select

from mailpipe import flags, redis_keys
from mailpipe.ingest import store_emails
from mailpipe.models import EmailMessage as EmailRow
from mailpipe.models import PipelineRun
from mailpipe.pipeline import job
from mailpipe.queues import control_queue


def mailpipe(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mailpipe.cli", *args],
        capture_output=True, text=True, env=dict(os.environ), cwd=cwd, timeout=300,
    )


def message(n: int) -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = f"s{n}@example.org"
    msg["Subject"] = f"message {n}"
    msg["Message-ID"] = f"<cli-{n}@example.org>"
    msg.set_content(f"body {n}")
    return msg


def test_ingest_reads_mbox_maildir_and_files_and_reports_rejections(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    box = mailbox.mbox(tmp_path / "inbox.mbox")
    for n in range(3):
        box.add(message(n))
    box.close()
    maildir = mailbox.Maildir(tmp_path / "Maildir")
    for n in range(3, 5):
        maildir.add(message(n))
    (tmp_path / "loose").mkdir()
    (tmp_path / "loose" / "one.eml").write_bytes(message(5).as_bytes())
    (tmp_path / "loose" / "empty.eml").write_bytes(b"")
    (tmp_path / "loose" / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")

    run = mailpipe("ingest", str(tmp_path / "inbox.mbox"), str(tmp_path / "Maildir"),
                   str(tmp_path / "loose"), str(tmp_path / "missing.eml"))
    assert run.returncode == 0, run.stderr
    assert "stored 6, enqueued 6, already queued 0, rejected 3" in run.stdout
    assert "empty.eml: empty file" in run.stdout
    assert "photo.png: not an email" in run.stdout
    assert "missing.eml: unreadable" in run.stdout
    with res.db.session() as session:
        subjects = set(session.scalars(select(EmailRow.blob_key)))
    assert len(subjects) == 6
    # Enqueued after the commit, each once, through the deduplicated path.
    ids = list(range(1, 7))
    assert all(res.redis.exists(redis_keys.job_marker(i)) or _has_run(res, i) for i in ids)


def _has_run(res, email_id: int) -> bool:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        return session.scalar(select(PipelineRun.id).where(PipelineRun.email_id == email_id)) is not None


def test_status_json_contract(res) -> None:  # type: ignore[no-untyped-def]
    store_emails(res, [message(1).as_bytes()])
    run = mailpipe("status", "--json")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["emails"] == 1 and data["no_run"] == 1
    assert set(data["runs"]) == {"open", "succeeded", "duplicate", "failed"}
    assert data["needs_review"] == 0
    assert set(data["queue"]) >= {"depth", "oldest_age_s"}
    assert mailpipe("status").returncode == 0


def test_failed_list_retry_and_show(res) -> None:  # type: ignore[no-untyped-def]
    bad, good = store_emails(res, [b"\x00 not an email", message(2).as_bytes()])
    assert job.process_email(res, bad) is job.Outcome.FAILED
    listed = mailpipe("failed")
    assert listed.returncode == 0 and str(bad) in listed.stdout and "not an email" in listed.stdout

    retried = mailpipe("failed", "--retry", str(bad))
    assert "reopened 1, enqueued 1" in retried.stdout
    with res.db.session() as session:
        run = session.scalars(select(PipelineRun).where(PipelineRun.email_id == bad)).one()
    assert (run.status.value, run.attempts) == ("open", 0)
    assert res.redis.exists(redis_keys.job_marker(bad))

    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    job.process_email(res, good)
    shown = json.loads(mailpipe("show", str(good)).stdout)
    assert shown["run"]["status"] == "succeeded"
    assert shown["classification"]["model_id"] == "rules"
    assert mailpipe("show", "424242").returncode != 0


def test_model_calls_switch_is_durable_and_on_enqueues_a_sweep(res) -> None:  # type: ignore[no-untyped-def]
    control = redis_keys.queue_list(control_queue(res.settings))
    before = res.redis.llen(control)
    assert "model calls on" in mailpipe("model-calls", "on").stdout
    with res.db.session() as session:
        assert flags.model_calls_enabled(session)
    assert res.redis.llen(control) == before + 1
    assert mailpipe("model-calls").stdout.strip() == "on"
    mailpipe("model-calls", "off")
    with res.db.session() as session:
        assert not flags.model_calls_enabled(session)


def test_demo_runs_end_to_end(tmp_path: Path, services: None) -> None:
    run = mailpipe("demo", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "every sample reached its expected state" in run.stdout
    assert not (tmp_path / "var" / "demo").exists()  # it cleans up after itself
