"""`mailpipe forget` on the command line (click's runner, in this process): it says what it would
delete and asks first, unless `--yes`; `--dry-run` changes nothing; a selection is one of ids,
a Message-ID and a sender's whole address."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from mailpipe.cli import main as cli
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.pipeline import job
from tests.support.erasure import rows_naming, with_document

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
        ([], 2, "give email ids, --message-id or --sender: one of them"),
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
