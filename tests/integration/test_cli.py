"""The `mailpipe` command line, run as operators run it: a subprocess with the environment."""

from __future__ import annotations

import getpass
import importlib.metadata
import json
import mailbox
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import click
import psycopg
import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import insert, select, update

from mailpipe.broker import layout
from mailpipe.broker.queues import control_queue
from mailpipe.cli.demo.servers import free_port
from mailpipe.cli.ingest import store_emails
from mailpipe.cli.main import main
from mailpipe.coordination import pauses, redis_keys
from mailpipe.enqueue import enqueue_emails
from mailpipe.operations import sweeper
from mailpipe.pipeline import job
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.migrate import MIGRATIONS
from mailpipe.storage.models import EmailMessage as EmailRow
from mailpipe.storage.models import PipelineRun, RunStatus
from tests.conftest import PG_ADMIN_URL, RUN_ID
from tests.support.searched import store_searched
from tests.support.services import Database
from tests.support.switches import set_model_calls

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

NOT_AN_EMAIL = b"\x00 not an email"


def mailpipe(
    *args: str, cwd: Path | None = None, answer: str = "", **env: str
) -> subprocess.CompletedProcess[str]:
    """`mailpipe ARGS` in a subprocess, `answer` on its stdin (none: the end of input at once);
    `env`: MAILPIPE_ variables to set for it alone."""
    return subprocess.run(
        [sys.executable, "-m", "mailpipe.cli.main", *args],
        capture_output=True,
        text=True,
        input=answer,
        env={**os.environ, **env},
        cwd=cwd,
        timeout=300,
    )


def errors(run: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines of stderr but the actions' audit lines."""
    return [line for line in run.stderr.splitlines() if "mailpipe.operations.actions]" not in line]


def one_error_line(run: subprocess.CompletedProcess[str]) -> str:
    """The single line a failure prints on stderr (asserted single, with no traceback)."""
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


def statuses(res: Resources) -> dict[int, str]:
    with res.db.session() as session:
        rows = session.execute(select(PipelineRun.email_id, PipelineRun.status))
        return {email_id: status.value for email_id, status in rows}


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

    run = mailpipe(
        "ingest",
        str(tmp_path / "inbox.mbox"),
        str(tmp_path / "Maildir"),
        str(tmp_path / "loose"),
        str(tmp_path / "missing.eml"),
    )
    assert run.returncode == 2, run.stderr  # bad input: the rest is stored all the same
    assert "3 rejected (listed above); the rest was stored" in run.stderr
    assert "stored 6, enqueued 6, already queued 0, rejected 3" in run.stdout
    assert "empty.eml: empty file" in run.stdout
    assert "photo.png: not an email" in run.stdout
    assert "missing.eml: unreadable" in run.stdout
    with res.db.session() as session:
        stored = sorted(session.scalars(select(EmailRow.id)))
        blobs = set(session.scalars(select(EmailRow.blob_key)))
    assert len(stored) == len(blobs) == 6
    # Enqueued each once, through the deduplicated path. No worker runs in this module: every
    # job is still in the queue.
    assert queued_email_ids(res) == stored
    assert all(res.redis.exists(redis_keys.job_marker(i)) for i in stored)


def queued_headers(res: Resources) -> list[dict[str, Any]]:
    """The headers of every job waiting in the email queue, one entry a job."""
    return [
        json.loads(raw)["headers"]
        for name in layout.family_lists(res.settings.queue)
        for raw in res.redis.lrange(name, 0, -1)
    ]


def queued_email_ids(res: Resources) -> list[int]:
    """The email of every job waiting in the email queue, one entry a job."""
    return sorted(headers[layout.EMAIL_ID_HEADER] for headers in queued_headers(res))


def test_status_json_contract_and_values(res) -> None:  # type: ignore[no-untyped-def]
    bad, good, queued, _idle = store_emails(
        res, [NOT_AN_EMAIL, *(message(n).as_bytes() for n in (1, 2, 3))]
    )
    set_model_calls(res, True)
    assert job.process_email(res, bad).kind.value == "failed"
    assert job.process_email(res, good).kind.value == "succeeded"
    assert enqueue_emails([queued], res).sent == [queued]
    [headers] = queued_headers(res)
    enqueued_at = headers[layout.ENQUEUED_AT_HEADER]

    asked_from = time.time()
    run = mailpipe("status", "--json")
    answered_by = time.time()
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["emails"] == 4
    assert data["no_run"] == 2  # the queued one and the idle one
    assert data["runs"] == {"open": 0, "succeeded": 1, "duplicate": 0, "failed": 1}
    assert data["needs_review"] == 0
    assert data["estimated"] == []  # every figure counted, as on any database this small
    assert data["queue"]["depth"] == 1
    # The queued job's age, from the enqueue time it carries, as of a moment during the command.
    assert asked_from - enqueued_at <= data["queue"]["oldest_age_s"] <= answered_by - enqueued_at
    assert data["model_calls"] is True
    table = mailpipe("status")
    assert table.returncode == 0 and "queue depth" in table.stdout


def test_failed_list_retry_and_show(res) -> None:  # type: ignore[no-untyped-def]
    bad, good = store_emails(res, [NOT_AN_EMAIL, message(2).as_bytes()])
    assert job.process_email(res, bad).kind.value == "failed"
    listed = mailpipe("failed")
    assert listed.returncode == 0 and str(bad) in listed.stdout and "not an email" in listed.stdout

    retried = mailpipe("failed", "--retry", str(bad))
    assert "reopened 1, enqueued 1" in retried.stdout
    with res.db.session() as session:
        run = session.scalars(select(PipelineRun).where(PipelineRun.email_id == bad)).one()
    assert (run.status.value, run.attempts) == ("open", 0)
    assert res.redis.exists(redis_keys.job_marker(bad))

    # Past its CPU stage with model calls off, the email waits: `show` says for what.
    with res.db.transaction() as session:
        flags.set_model_calls(session, False)
    assert job.process_email(res, good).kind.value == "waiting"
    shown = json.loads(mailpipe("show", str(good)).stdout)
    assert shown["job"] == {"state": "waiting", "waiting_for": "model_calls"}

    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    job.classify_email(res, good)
    shown = json.loads(mailpipe("show", str(good)).stdout)
    assert shown["job"] == {"state": "succeeded", "waiting_for": None}
    assert shown["run"]["status"] == "succeeded"
    assert shown["classification"]["model_id"] == "rules"


def test_failed_json_and_retry_all(res) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, [NOT_AN_EMAIL + bytes([n]) for n in range(3)])
    for email_id in ids:
        assert job.process_email(res, email_id).kind.value == "failed"

    listed = mailpipe("failed", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["rows"]
    assert sorted(row["email_id"] for row in rows) == ids
    for row in rows:
        assert set(row) == {
            "email_id",
            "attempts",
            "failed_at",
            "stage",
            "error_class",
            "error",
            "needs_review",
            "lane",
            "mailbox",
            "dismissed_at",
        }
        assert row["attempts"] == 1 and "not an email" in row["error"]
        assert (row["stage"], row["needs_review"]) == ("cpu", False)
        datetime.fromisoformat(row["failed_at"])
    first = json.loads(mailpipe("failed", "--json", "--limit", "2").stdout)
    assert (len(first["rows"]), first["page"], first["pages"], first["total"]) == (2, 1, 2, 3)
    second = json.loads(mailpipe("failed", "--json", "--limit", "2", "--page", "2").stdout)
    assert [row["email_id"] for row in first["rows"] + second["rows"]] == [
        row["email_id"] for row in rows
    ]

    said = "3 failed runs match; 3 of them failed as InputRejected: their input is rejected"
    no = mailpipe("failed", "--retry-all", answer="n\n")
    assert no.returncode == 0, no.stderr
    assert no.stdout.startswith(said) and no.stdout.endswith("nothing done\n")
    unanswered = mailpipe("failed", "--retry-all")
    assert unanswered.returncode == 2
    assert one_error_line(unanswered).endswith("--yes acts without asking")
    assert statuses(res) == {email_id: "failed" for email_id in ids}
    retried = mailpipe("failed", "--retry-all", answer="y\n")
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.startswith(said)
    assert retried.stdout.splitlines()[-1].endswith("Retry these 3? [y/N]: reopened 3, enqueued 3")
    assert statuses(res) == {email_id: "open" for email_id in ids}
    assert all(res.redis.exists(redis_keys.job_marker(i)) for i in ids)
    assert json.loads(mailpipe("failed", "--json").stdout)["rows"] == []


def test_retry_names_the_ids_it_cannot_retry_and_retries_the_rest(res) -> None:  # type: ignore[no-untyped-def]
    bad, done, idle = store_emails(
        res, [NOT_AN_EMAIL, message(1).as_bytes(), message(2).as_bytes()]
    )
    set_model_calls(res, True)
    job.process_email(res, bad)
    job.process_email(res, done)

    run = mailpipe(
        "failed",
        "--retry",
        str(bad),
        "--retry",
        str(done),
        "--retry",
        str(idle),
        "--retry",
        "424242",
    )
    assert run.returncode == 3
    assert run.stdout.strip() == "reopened 1, enqueued 1"
    assert "Traceback" not in run.stderr
    assert errors(run) == [
        f"email {done}: not retried, its run is succeeded",
        f"email {idle}: not retried, it has no run",
        "email 424242: not retried, it has no run",
    ]
    assert statuses(res) == {bad: "open", done: "succeeded"}
    assert res.redis.exists(redis_keys.job_marker(bad))


def lose_the_job_until_marked_for_review(res: Resources) -> int:
    """An email whose job the broker loses at every sweep, until the sweeper gives up on it
    (tests/integration/test_sweeper.py), as a `celery purge` between sweeps does."""
    set_model_calls(res, True)
    [stuck] = store_emails(res, [message(7).as_bytes()])
    for _ in range(res.settings.max_sweeps + 1):
        sweeper.sweep(
            res,
            enqueue=lambda ids, task, lane, boxes: enqueue_emails(ids, res, task, lane, boxes).sent,
            in_flight_grace=0.0,  # the job just sent is lost already: the purge below
        )
        for name in layout.family_lists(res.settings.queue):
            res.redis.delete(name)
    return stuck


def test_review_lists_the_marked_emails_and_a_retry_clears_the_mark(res) -> None:  # type: ignore[no-untyped-def]
    stuck = lose_the_job_until_marked_for_review(res)
    [marked] = json.loads(mailpipe("review", "--json").stdout)["rows"]
    # Its job never ran, so nothing was parsed: no subject yet.
    assert (marked["email_id"], marked["subject"], marked["status"]) == (stuck, None, "failed")
    assert "re-added 3 times" in marked["reason"]
    assert str(stuck) in mailpipe("review").stdout
    assert json.loads(mailpipe("status", "--json").stdout)["needs_review"] == 1

    retried = mailpipe("failed", "--retry", str(stuck))
    assert retried.returncode == 0, retried.stderr
    assert json.loads(mailpipe("review", "--json").stdout)["rows"] == []
    shown = json.loads(mailpipe("show", str(stuck)).stdout)
    assert (shown["needs_review"], shown["review_reason"]) == (False, None)
    assert shown["run"]["status"] == "open"
    assert json.loads(mailpipe("status", "--json").stdout)["needs_review"] == 0


def test_sweep_prints_its_summary(res) -> None:  # type: ignore[no-untyped-def]
    store_emails(res, [message(1).as_bytes()])  # stored without a job, as if its enqueue failed
    run = mailpipe("sweep")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert (summary["ran"], summary["readded_no_run"], summary["readded_stalled"]) == (True, 1, 0)
    assert summary["queue_depth"] == 1
    status = json.loads(mailpipe("status", "--json").stdout)
    assert status["last_sweep"]["readded_no_run"] == 1
    assert status["queue"]["depth"] == 1


def test_show_of_an_unknown_email_is_one_line_and_exit_3(res) -> None:  # type: ignore[no-untyped-def]
    run = mailpipe("show", "424242")
    assert run.returncode == 3
    assert "424242" in one_error_line(run)
    assert run.stdout == ""


def test_bad_input_is_one_line_and_exit_2(services: None) -> None:
    run = mailpipe("failed", "--limit", "many")
    assert run.returncode == 2
    assert "--limit" in one_error_line(run)
    assert mailpipe("review", "--limit", "0").returncode == 2
    assert mailpipe("no-such-command").returncode == 2
    setting = mailpipe("status", MAILPIPE_MAX_SWEEPS="0")
    assert setting.returncode == 2
    assert "MAILPIPE_MAX_SWEEPS" in one_error_line(setting)


def test_redis_down_is_one_line_and_exit_4_and_a_retry_changes_nothing(res) -> None:  # type: ignore[no-untyped-def]
    [bad] = store_emails(res, [NOT_AN_EMAIL])
    job.process_email(res, bad)
    down = f"redis://:secret@127.0.0.1:{free_port()}/0"
    run = mailpipe("status", MAILPIPE_BROKER_URL=down)
    assert run.returncode == 4
    line = one_error_line(run)
    assert "Redis unavailable" in line and down.replace("secret", "***") in line
    assert "secret" not in line
    retry = mailpipe("failed", "--retry", str(bad), MAILPIPE_BROKER_URL=down)
    assert retry.returncode == 4 and "Redis" in one_error_line(retry)
    assert statuses(res) == {bad: "failed"}  # not reopened only to wait for a job never sent


def test_database_unreachable_is_one_line_and_exit_4(services: None) -> None:
    url = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/mailpipe"
    run = mailpipe("status", MAILPIPE_DATABASE_URL=url)
    assert run.returncode == 4
    line = one_error_line(run)
    assert line.startswith("Error: database unavailable at postgresql://postgres:***@127.0.0.1:")
    assert "secret" not in line


def test_a_missing_postgresql_database_is_exit_5_and_says_to_create_it(services: None) -> None:
    # The server answers; only the database is not there: not an outage, a set-up step missed.
    missing = Database(PG_ADMIN_URL, f"mailpipe_test_{RUN_ID}_none")
    missing.drop()
    run = mailpipe("status", MAILPIPE_DATABASE_URL=missing.url)
    assert run.returncode == 5, run.stderr
    assert one_error_line(run) == (
        f"Error: no database {missing.name} on the server at {missing.url}: create it "
        f"(`createdb {missing.name}`), then run `mailpipe db upgrade`"
    )


def test_a_missing_sqlite_database_is_named_and_not_created(tmp_path: Path, services: None) -> None:
    path = tmp_path / "var" / "none.db"
    url = f"sqlite:///{path}"
    run = mailpipe("status", MAILPIPE_DATABASE_URL=url)
    assert run.returncode == 5
    assert one_error_line(run) == (
        f"Error: no database at {url} (no such file); run `mailpipe db upgrade`"
    )
    assert not path.parent.exists()


@pytest.fixture
def fresh_database() -> Iterator[Database]:
    """A PostgreSQL database of the test's own with no table in it, dropped after."""
    database = Database(PG_ADMIN_URL, f"mailpipe_test_{RUN_ID}_cli").create()
    yield database
    database.drop()


def tables(database: Database) -> set[str]:
    with psycopg.connect(database.url) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        )
        return {name for (name,) in rows}


def test_a_database_without_schema_is_named_and_db_upgrade_migrates_it(
    fresh_database: Database, services: None
) -> None:
    # A password on the URL, to see it masked (the local server trusts and ignores it).
    url = fresh_database.url.replace("postgres@", "postgres:secret@")
    shown = url.replace("secret", "***")
    run = mailpipe("status", MAILPIPE_DATABASE_URL=url)
    assert run.returncode == 5
    assert one_error_line(run) == (
        f"Error: the database at {shown} has no schema; run `mailpipe db upgrade`"
    )
    assert tables(fresh_database) == set()

    assert (
        mailpipe("db", "upgrade", "--revision", "0001", MAILPIPE_DATABASE_URL=url).returncode == 0
    )
    behind = mailpipe("show", "1", MAILPIPE_DATABASE_URL=url)
    assert behind.returncode == 5
    head = ScriptDirectory(str(MIGRATIONS)).get_current_head()
    assert f"is at schema revision 0001, this mailpipe needs {head}" in one_error_line(behind)

    upgraded = mailpipe("db", "upgrade", MAILPIPE_DATABASE_URL=url)
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout.strip() == f"database at head: {shown}"
    assert tables(fresh_database) >= {
        "alembic_version",
        "email_message",
        "pipeline_run",
        "document",
        "classification",
        "sweep_report",
    }
    status = mailpipe("status", "--json", MAILPIPE_DATABASE_URL=url)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["emails"] == 0


def test_version_is_the_installed_package_version(services: None) -> None:
    run = mailpipe("--version")
    assert run.returncode == 0
    assert run.stdout.strip() == f"mailpipe, version {importlib.metadata.version('mailpipe')}"


def test_every_option_has_help() -> None:
    def commands(group: click.Group) -> Iterator[click.Command]:
        for command in group.commands.values():
            yield command
            if isinstance(command, click.Group):
                yield from commands(command)

    missing = [
        f"{command.name} {option.opts[0]}"
        for command in [main, *commands(main)]
        for option in command.params
        if isinstance(option, click.Option) and not option.help
    ]
    assert missing == []


def test_model_calls_switch_is_durable_and_on_enqueues_a_sweep(res) -> None:  # type: ignore[no-untyped-def]
    control = layout.queue_list(control_queue(res.settings))
    before = res.redis.llen(control)
    switched = mailpipe("model-calls", "on")
    assert "model calls on" in switched.stdout
    assert f"model_calls_on by cli:{getpass.getuser()}" in switched.stderr
    with res.db.session() as session:
        assert flags.model_calls_enabled(session)
    assert res.redis.llen(control) == before + 1
    assert mailpipe("model-calls").stdout.strip() == "on"
    mailpipe("model-calls", "off")
    with res.db.session() as session:
        assert not flags.model_calls_enabled(session)


def test_a_pause_and_a_resume_from_the_cli_leave_their_audit_line(res) -> None:  # type: ignore[no-untyped-def]
    paused = mailpipe("pause", "model", "--reason", "provider maintenance")
    assert "model stage paused (operator): provider maintenance" in paused.stdout
    assert f"pause_model by cli:{getpass.getuser()}" in paused.stderr
    resumed = mailpipe("resume", "model")
    assert f"resume_model by cli:{getpass.getuser()}" in resumed.stderr
    assert pauses.paused(res.redis) == {}


def test_demo_runs_end_to_end(tmp_path: Path, services: None) -> None:
    run = mailpipe("demo", cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "every sample reached its expected state" in run.stdout
    assert not (tmp_path / "var" / "demo").exists()  # it cleans up after itself


def test_failed_filters_apply_to_the_list_and_to_retry_all(res) -> None:  # type: ignore[no-untyped-def]
    from tests.support.failed_runs import add_failed

    early = add_failed(res, 1, "BlobMissing")
    model = add_failed(res, 30, "BlobMissing", model_stage=True)
    late = add_failed(res, 60, "Stalled")

    def listed(*args: str) -> list[int]:
        run = mailpipe("failed", "--json", *args)
        assert run.returncode == 0, run.stderr
        return [row["email_id"] for row in json.loads(run.stdout)["rows"]]

    assert listed() == [late, model, early]
    assert listed("--error-class", "BlobMissing") == [model, early]
    assert listed("--stage", "model") == [model]
    assert listed("--since", "2026-01-01T12:30:00") == [late, model]
    assert listed("--until", "2026-01-01T12:30:00") == [early]
    assert listed("--limit", "1", "--page", "3") == [early]
    assert mailpipe("failed", "--stage", "gpu").returncode == 2
    assert mailpipe("failed", "--retry", str(early), "--stage", "cpu").returncode == 2

    retried = mailpipe(
        "failed", "--retry-all", "--error-class", "BlobMissing", "--stage", "cpu", "--yes"
    )
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.splitlines()[-1] == "reopened 1, enqueued 1"
    assert statuses(res) == {early: "open", model: "failed", late: "failed"}
    assert queued_email_ids(res) == [early]


def test_dismiss_takes_runs_off_the_list_and_show_prints_the_history(res) -> None:  # type: ignore[no-untyped-def]
    from tests.support.failed_runs import add_failed

    first = add_failed(res, 1, "Stalled", review=True)
    second = add_failed(res, 2, "Stalled")
    kept = add_failed(res, 3, "InputRejected")
    assert mailpipe("dismiss").returncode == 2  # ids or --all
    one = mailpipe("dismiss", str(first), "424242")
    assert one.returncode == 3
    assert one.stdout.strip() == "dismissed 1"
    assert errors(one) == ["email 424242: not dismissed, it has no run"]
    rest = mailpipe("dismiss", "--all", "--error-class", "Stalled", answer="y\n")
    assert (rest.returncode, rest.stdout.splitlines()[0]) == (
        0,
        "1 failed runs match; 0 of them failed as InputRejected",
    )
    assert rest.stdout.endswith("Dismiss these 1? [y/N]: dismissed 1\n")
    assert statuses(res) == {first: "failed", second: "failed", kept: "failed"}
    assert [row["email_id"] for row in json.loads(mailpipe("failed", "--json").stdout)["rows"]] == [
        kept
    ]
    assert json.loads(mailpipe("review", "--json").stdout)["total"] == 0
    retried = mailpipe("failed", "--retry-all", "--yes").stdout.splitlines()
    assert retried == [
        "1 failed runs match; 1 of them failed as InputRejected: their input is rejected, and "
        "a retry fails again",
        "reopened 1, enqueued 1",
    ]
    assert statuses(res) == {first: "failed", second: "failed", kept: "open"}

    dismissed = json.loads(mailpipe("failed", "--dismissed", "--json").stdout)["rows"]
    assert [row["email_id"] for row in dismissed] == [second, first]
    assert all(row["dismissed_at"] is not None for row in dismissed)
    undone = mailpipe("dismiss", "--undo", str(second), str(kept))
    assert (undone.returncode, undone.stdout.strip()) == (3, "back on the failed list: 1")
    assert errors(undone) == [f"email {kept}: not taken back, its run is open"]
    assert f"undo_dismiss by cli:{getpass.getuser()}: 1 email(s): {second}" in undone.stderr
    listed = json.loads(mailpipe("failed", "--json").stdout)["rows"]
    assert [row["email_id"] for row in listed] == [second]

    shown = json.loads(mailpipe("show", str(first)).stdout)
    assert shown["dismissed_at"] is not None
    assert shown["history"] == []  # no attempt recorded for a run written straight in
    assert shown["run"]["error_class"] == "Stalled"


def test_the_lists_and_their_acts_take_a_mailbox_and_show_it(res) -> None:  # type: ignore[no-untyped-def]
    from tests.support.failed_runs import add_emails, add_failed, add_run

    acme = add_failed(res, 1, "Stalled", mailbox="acme", review=True)
    other = add_failed(res, 2, "Stalled", mailbox="globex")
    default = add_failed(res, 3, "Stalled")

    def listed(*args: str) -> list[tuple[int, str]]:
        run = mailpipe(*args, "--json")
        assert run.returncode == 0, run.stderr
        return [(row["email_id"], row["mailbox"]) for row in json.loads(run.stdout)["rows"]]

    assert listed("failed", "--mailbox", "acme") == [(acme, "acme")]
    assert listed("failed", "--mailbox", "default") == [(default, "default")]
    assert listed("find", "--mailbox", "globex") == [(other, "globex")]
    assert listed("review") == [(acme, "acme")]
    table = mailpipe("find", "--mailbox", "acme", COLUMNS="200")
    assert table.returncode == 0 and "mailbox" in table.stdout and " acme " in table.stdout
    assert json.loads(mailpipe("show", str(other)).stdout)["mailbox"] == "globex"
    bad = mailpipe("find", "--mailbox", "a\x07b")
    assert bad.returncode == 2 and "mailbox is text without control characters" in bad.stderr

    dismissed = mailpipe("dismiss", "--all", "--mailbox", "globex", "--yes")
    assert dismissed.stdout.splitlines()[-1] == "dismissed 1", dismissed.stderr
    retried = mailpipe("failed", "--retry-all", "--mailbox", "default", "--yes")
    assert retried.stdout.splitlines()[-1] == "reopened 1, enqueued 1", retried.stderr
    assert statuses(res) == {acme: "failed", other: "failed", default: "open"}
    assert listed("failed", "--dismissed") == [(other, "globex")]
    assert queued_email_ids(res) == [default]
    for run in (dismissed, retried):
        assert "globex" not in run.stderr and "default" not in run.stderr

    for box in ("acme", "globex", None):
        [succeeded] = add_emails(res, 1, mailbox=box)
        add_run(res, succeeded, RunStatus.SUCCEEDED)
    planned = mailpipe("reprocess", "--mailbox", "acme", "--from", "classify", "--dry-run")
    assert planned.stdout.startswith("1 succeeded emails match, from classify"), planned.stderr


def test_status_lists_each_queue(res) -> None:  # type: ignore[no-untyped-def]
    table = mailpipe("status")
    assert table.returncode == 0, table.stderr
    for role in ("email", "email.bulk", "model", "model.bulk", "control"):
        assert f"{role} queue depth" in table.stdout
    assert "live workers" in table.stdout
    data = json.loads(mailpipe("status", "--json").stdout)
    assert set(data["queues"]) == {"email", "email.bulk", "model", "model.bulk", "control"}
    assert data["workers"] == []


def test_status_prints_the_mailboxes_with_the_most_waiting_work(res) -> None:  # type: ignore[no-untyped-def]
    row = {"blob_key": "blobs/none", "size": 1, "sha256": "0" * 64}
    with res.db.transaction() as session:
        session.execute(
            insert(EmailRow),
            [{**row, "mailbox": "[bold]ops[/]@example.com"}] * 2 + [{**row, "mailbox": None}],
        )
    table = mailpipe("status", COLUMNS="200")
    assert table.returncode == 0, table.stderr
    assert "mailboxes with waiting work: 2, the most first" in table.stdout
    # A name is upstream's text: printed as it is, never read as markup.
    lines = [
        line for line in table.stdout.splitlines() if "@example.com" in line or "default" in line
    ]
    assert ["[bold]ops[/]@example.com" in lines[0], "default" in lines[1]] == [True, True]
    assert lines[0].split("│")[2].strip() == "2"


def test_find_prints_the_emails_it_finds_newest_first(res) -> None:  # type: ignore[no-untyped-def]
    ids = store_searched(res)
    with res.db.transaction() as session:
        session.execute(
            update(EmailRow)
            .where(EmailRow.id == ids["lunch"])
            .values(subject="[bold red]Lunch[/] on Friday?")
        )
    table = mailpipe("find", "--sender", "corp.example", "--review", COLUMNS="200")
    assert table.returncode == 0, table.stderr
    assert "emails found: 1, newest first" in table.stdout
    assert "Security alert: a new sign-in" in table.stdout and "BlobMissing" in table.stdout
    # A subject's markup is the sender's text: printed as it is.
    lunch = mailpipe("find", "carol@corp.example", COLUMNS="200")
    assert "[bold red]Lunch[/] on Friday?" in lunch.stdout

    found = mailpipe("find", "--subject", "invoice", "--json")
    assert found.returncode == 0, found.stderr
    answer = json.loads(found.stdout)
    assert [row["email_id"] for row in answer["rows"]] == [
        ids["overdue"],
        ids["copy"],
        ids["invoice"],
    ]
    assert answer["next_before"] is None
    by_id = json.loads(mailpipe("find", str(ids["alert"]), "--json").stdout)
    assert [row["email_id"] for row in by_id["rows"]] == [ids["alert"]]
    marked = json.loads(mailpipe("find", "--no-review", "--lane", "bulk", "--json").stdout)
    assert [row["email_id"] for row in marked["rows"]] == [ids["newsletter"]]

    none = mailpipe("find", "--message-id", "<nobody@nowhere.example>")
    assert (none.returncode, none.stderr) == (0, "")
    assert none.stdout.strip() == (
        "no email found (Message-ID, sender and subject find only emails a job has read)"
    )
    assert mailpipe("find", "--state", "open", "--label", "spam").stdout.strip() == "no email found"


def test_find_pages_with_before(res) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, [message(n).as_bytes() for n in range(60)])
    first = mailpipe("find")
    assert first.returncode == 0, first.stderr
    assert f"more: the same filters with --before {ids[10]}" in first.stdout
    rest = json.loads(mailpipe("find", "--before", str(ids[10]), "--json").stdout)
    assert [row["email_id"] for row in rest["rows"]] == list(reversed(ids[:10]))
    assert rest["next_before"] is None


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("--since", "yesterday"), "since is a date or a date and time"),
        (("--state", "lost"), "state is one of no_run, open, succeeded, duplicate, failed"),
        (("--lane", "fast"), "lane is one of live, bulk"),
        (("--sender", "a\x1b[2Jb"), "sender is text without control characters"),
        (("--before", "99999999999999999999"), "before is a whole number from 1 to"),
        (("--subject", "?!"), "subject has a word (a letter or a digit)"),
        (("--since", "2026-02-01", "--until", "2026-01-01"), "since is earlier than until"),
        (("--since", "0001-01-01T00:00+01:00"), "since is out of range: from 0001-01-01"),
    ],
)
def test_find_refuses_bad_input_in_one_line_with_exit_2(
    args: tuple[str, ...], reason: str, services: None
) -> None:
    run = mailpipe("find", *args)
    assert run.returncode == 2
    line = one_error_line(run)
    assert line.startswith("Error: ") and reason in line, line
    assert run.stdout == ""


def test_reprocess_by_filter_says_what_it_takes_then_takes_it_once(res) -> None:  # type: ignore[no-untyped-def]
    from tests.unit.operations.test_reprocess import OTHER
    from tests.unit.pipeline.test_job import INVOICE, PLAIN

    set_model_calls(res, True)
    ids = store_emails(res, [INVOICE, PLAIN])
    [other] = store_emails(res, [OTHER])
    assert [job.process_email(res, i).kind.value for i in [*ids, other]] == ["succeeded"] * 3
    # No filter, or one that leaves out no succeeded email: refused.
    for everything in ((), ("--state", "succeeded"), ("--no-review",), ("--since", "1970-01-01")):
        refused = mailpipe("reprocess", *everything, "--from", "classify")
        assert refused.returncode == 2, refused.stdout
        assert "every email is not a filter" in one_error_line(refused)
    dry = mailpipe("reprocess", "--label", "invoice", "--from", "classify", "--dry-run")
    assert dry.stdout.strip() == (
        "2 succeeded emails match, from classify, in the bulk lane: 0 model calls"
    )
    no = mailpipe("reprocess", "--label", "invoice", "--from", "parse", answer="n\n")
    assert (no.returncode, no.stdout.splitlines()[-1]) == (0, "Reprocess them? [y/N]: nothing done")
    over = mailpipe(
        "reprocess", "--label", "invoice", "--from", "parse", "--yes", MAILPIPE_REPROCESS_MAX="1"
    )
    assert over.returncode == 2
    assert one_error_line(over).endswith("narrow the filters, or --over-max takes them")
    assert statuses(res) == dict.fromkeys([*ids, other], "succeeded")
    done = mailpipe(
        "reprocess",
        *("--label", "invoice", "--from", "parse", "--over-max"),
        answer="y\n",
        MAILPIPE_REPROCESS_MAX="1",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].endswith("reopened 2, enqueued 2")
    assert statuses(res) == {**dict.fromkeys(ids, "open"), other: "succeeded"}
    assert f"_from_parse by cli:{getpass.getuser()}" in done.stderr
    again = mailpipe("reprocess", "--label", "invoice", "--from", "parse", "--yes")
    assert again.stdout.strip().startswith("0 succeeded emails match")
    [progress] = json.loads(mailpipe("status", "--json").stdout)["reprocesses"]
    assert (progress["emails"], progress["taken"], progress["left"], progress["lane"]) == (
        2,
        2,
        2,
        "bulk",
    )
    assert progress["filters"] == ["label"]  # by name: its values may name an email's sender
