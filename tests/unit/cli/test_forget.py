"""`mailpipe forget` on the command line (click's runner, in this process): it says what it would
delete and asks first, unless `--yes`; `--dry-run` changes nothing; a selection is one of ids,
a Message-ID, a sender's whole address and a mailbox."""

from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import func, select

from mailpipe.cli import main as cli
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.operations import actions
from mailpipe.pipeline import job
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.keys import document_texts
from mailpipe.storage.models import EmailLabel, EmailMessage, EmailOrigin, PipelineRun
from tests.support.erasure import redis_naming, rows_naming, stored_keys, with_document

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def forget(*args: str, answer: str | None = None) -> Result:
    return CliRunner().invoke(cli.main, ["forget", *args], input=answer)


def test_forget_says_what_it_would_delete_and_asks_first(res) -> None:  # type: ignore[no-untyped-def]
    ids = store_emails(res, [with_document(), with_document()])
    shown = " ".join(map(str, ids))

    declined = forget(*map(str, ids), answer="n\n")
    assert declined.exit_code == 0 and declined.output.endswith("[y/N]: n\nnothing done\n")
    assert f"2 emails: {shown}\n" in declined.output
    assert "rows: email_message 2, pipeline_run 2; blobs: 2; Redis entries: 0" in declined.output
    assert "Forget these 2 emails for good? [y/N]" in declined.output
    assert all(rows_naming(res, email_id) for email_id in ids)
    assert not res.redis.exists(*(redis_keys.forgotten(email_id) for email_id in ids))

    unanswered = forget(*map(str, ids), answer="")
    assert unanswered.exit_code == 2
    assert unanswered.stderr == "Error: no answer, so nothing done: --yes acts without asking\n"
    assert all(rows_naming(res, email_id) for email_id in ids)

    confirmed = forget(*map(str, ids), answer="y\n")
    assert confirmed.exit_code == 0, confirmed.output
    assert "forgot 2: rows: email_message 2, pipeline_run 2;" in confirmed.output
    assert all(rows_naming(res, email_id) == {} for email_id in ids)


def test_a_dry_run_lists_and_changes_nothing_and_yes_asks_nothing(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [with_document(sender="carol@acme.example")])

    dry = forget("--sender", "carol@acme.example", "--dry-run")
    # The sender is what a job reads from the headers: none has read this email yet.
    assert dry.exit_code == 0 and "no email found" in dry.output
    dry = forget(str(email_id), "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert dry.output == (
        f"1 emails: {email_id}\n"
        "rows: email_message 1, pipeline_run 1; blobs: 1; Redis entries: 0; "
        "origins handed on to a copy: 0\n"
    )
    assert rows_naming(res, email_id) == {"email_message.id": 1}

    done = forget(str(email_id), "--yes")
    assert done.exit_code == 0 and "[y/N]" not in done.output
    assert rows_naming(res, email_id) == {}


@pytest.mark.parametrize(
    ("args", "code", "error"),
    [
        ([], 2, "give email ids, --message-id, --sender or --mailbox: one of them"),
        (["--mailbox", "acme", "--sender", "a@example.org"], 2, "one of them"),
        (["--mailbox", " "], 2, "the Message-ID, sender or mailbox given is blank"),
        (["--message-id", " "], 2, "the Message-ID, sender or mailbox given is blank"),
        (["1", "--sender", "a@example.org"], 2, "one of them"),
        (["--sender", "@example.org"], 2, "sender is one whole address"),
        (["--message-id", "<>"], 2, "message_id is a Message-ID"),
        (["999"], 3, "no email with id 999"),
    ],
)
def test_a_selection_is_one_of_ids_a_message_id_and_an_address(  # type: ignore[no-untyped-def]
    res, args: list[str], code: int, error: str
) -> None:
    refused = forget(*args, "--yes")
    assert refused.exit_code == code, refused.output
    assert error in refused.stderr


def test_forget_says_what_becomes_of_a_copy_before_it_forgets(res) -> None:  # type: ignore[no-untyped-def]
    raw = with_document()
    first, copy = store_emails(res, [raw, raw])
    for email_id in (first, copy):
        job.process_email(res, email_id)

    dry = forget(str(first), "--dry-run")

    assert dry.exit_code == 0, dry.output
    assert (
        f"copies that become their origin's first email: {copy}; each keeps the labels of the "
        "email forgotten and runs the steps a copy skips (documents, then classification), from "
        "its CPU stage\n"
    ) in dry.output
    done = forget(str(first), "--yes")
    assert done.exit_code == 0, done.output
    assert f"copies completed: {copy}, jobs sent 1\n" in done.output


def labels_of(res: Resources, email_id: int) -> list[tuple[str, str]]:
    with res.db.session() as session:
        rows = session.execute(
            select(EmailLabel.label, EmailLabel.source)
            .where(EmailLabel.email_id == email_id)
            .order_by(EmailLabel.label)
        )
        return [(label, source) for label, source in rows]


def test_forget_by_mailbox_erases_the_account_and_a_copy_elsewhere_keeps_working(  # type: ignore[no-untyped-def]
    res, caplog
) -> None:
    """A customer's account erased: nothing of its emails in any table, the blob store or Redis
    (their fences aside), while the copy of one of them delivered to another mailbox takes its
    origin with its labels and runs on; the default mailbox's email is left alone."""
    box, other = "acme-account-7", "globex"
    shared = with_document()
    # The same email delivered to another mailbox: its own bytes (a header the delivery adds),
    # the same Message-ID, so the same origin.
    elsewhere = b"Delivered-To: someone@globex.example\r\n" + shared
    account = store_emails(res, [with_document(), shared], mailbox=box)
    [copy] = store_emails(res, [elsewhere], mailbox=other)
    [kept] = store_emails(res, [with_document()])
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    for email_id in (*account, copy, kept):
        job.process_email(res, email_id)
    first = account[1]
    shown = labels_of(res, first)
    # A copy shows its origin's labels as its own.
    assert shown and labels_of(res, copy) == [(label, "origin") for label, _ in shown]
    with res.db.session() as session:
        raw_keys = dict(session.execute(select(EmailMessage.id, EmailMessage.blob_key)).all())
    assert all(stored_keys(res) >= {raw_keys[i], f"{document_texts(i)}0.txt"} for i in account)
    res.redis.set(redis_keys.job_marker(account[0]), 1)  # a job queued for it

    declined = forget("--mailbox", box, answer="n\n")
    assert declined.exit_code == 0, declined.output
    assert f"2 emails: {' '.join(map(str, account))}\n" in declined.output
    assert f"copies that become their origin's first email: {copy};" in declined.output
    assert all(rows_naming(res, email_id) for email_id in account)

    with caplog.at_level(logging.INFO, actions.log.name):
        done = forget("--mailbox", box, answer="y\n")

    assert done.exit_code == 0, done.output
    assert f"copies completed: {copy}, jobs sent 1\n" in done.output
    with res.db.session() as session:
        left = session.scalar(select(func.count()).where(EmailMessage.mailbox == box))
        moved = session.get_one(EmailMessage, copy)
        heir = (moved.duplicate_of, session.get_one(EmailOrigin, moved.origin_id).first_email_id)
    assert left == 0
    assert all(rows_naming(res, email_id) == {} for email_id in account)
    kept_keys = stored_keys(res)
    for email_id in account:
        assert raw_keys[email_id] not in kept_keys
        assert not [key for key in kept_keys if key.startswith(document_texts(email_id))]
        assert redis_naming(res, email_id) == {f"forgotten:{email_id}"}
    assert {raw_keys[copy], raw_keys[kept]} <= kept_keys
    audit = [r for r in caplog.records if r.name == actions.log.name]
    assert sorted(r.email_id for r in audit if r.action == "forget") == account  # type: ignore[attr-defined]
    assert not [r for r in audit if box in r.getMessage()]

    # The copy in the other mailbox is its origin's first email now, with the labels.
    assert heir == (None, copy)
    assert labels_of(res, copy) == shown
    assert job.process_email(res, copy).kind is Kind.SUCCEEDED
    assert labels_of(res, copy) == shown
    with res.db.session() as session:
        statuses = dict(session.execute(select(PipelineRun.email_id, PipelineRun.status)).all())
    assert {i: s.value for i, s in statuses.items()} == {copy: "succeeded", kept: "succeeded"}
