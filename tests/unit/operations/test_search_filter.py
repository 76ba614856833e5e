"""Reading a search from strings, as the console, the API and the CLI give it: every value
checked, every problem named in one line. Pure code: no service."""

from __future__ import annotations

from datetime import datetime

import pytest

from mailpipe.broker.queues import Lane
from mailpipe.operations.search import (
    MAX_ID,
    BadSearch,
    EmailFilter,
    failed_fields,
    read_failed,
    read_search,
)


def refused(values: dict[str, str]) -> str:
    with pytest.raises(BadSearch) as caught:
        read_search(values)
    reason = str(caught.value)
    assert "\n" not in reason
    return reason


def test_every_filter_is_read() -> None:
    filt, before = read_search(
        {
            "message_id": " <Abc.123@Mail.Example> ",
            "sender": "alice@example.org",
            "subject": "  quarterly   report ",
            "since": "2026-01-31",
            "until": "2026-02-01T14:30",
            "state": "dismissed",
            "error_class": "BlobMissing",
            "label": "invoice",
            "lane": "bulk",
            "review": "yes",
            "before": "1200",
        }
    )
    assert filt == EmailFilter(
        message_id="abc.123@mail.example",
        sender="alice@example.org",
        subject=("quarterly", "report"),
        since=datetime(2026, 1, 31),
        until=datetime(2026, 2, 1, 14, 30),
        state="dismissed",
        error_class="BlobMissing",
        label="invoice",
        lane=Lane.BULK,
        review=True,
    )
    assert before == 1200


def test_empty_values_are_no_filter() -> None:
    assert read_search({name: " " for name in ("sender", "state", "before", "q")}) == (
        EmailFilter(),
        None,
    )


def test_a_time_with_an_offset_is_read_as_utc() -> None:
    filt, _ = read_search({"since": "2026-01-31T14:00:00Z", "until": "2026-01-31T18:00+02:00"})
    assert (filt.since, filt.until) == (datetime(2026, 1, 31, 14), datetime(2026, 1, 31, 16))


@pytest.mark.parametrize(
    ("box", "read"),
    [
        ("4711", EmailFilter(email_id=4711)),
        ("<Id.1@Host>", EmailFilter(message_id="id.1@host")),
        ("alice@example.org", EmailFilter(sender="alice@example.org")),
        ("overdue invoice", EmailFilter(subject=("overdue", "invoice"))),
        ("١٢٣", EmailFilter(subject=("١٢٣",))),  # other scripts' digits: a word, not an id
        ("mailbox:acme", EmailFilter(mailbox="acme")),
        ("mailbox:default", EmailFilter(mailbox="default")),
        (
            "overdue mailbox:acme invoice",
            EmailFilter(subject=("overdue", "invoice"), mailbox="acme"),
        ),
        ("mailbox:acme alice@example.org", EmailFilter(sender="alice@example.org", mailbox="acme")),
    ],
)
def test_the_search_box_reads_an_id_a_message_id_a_sender_or_words(
    box: str, read: EmailFilter
) -> None:
    assert read_search({"q": box}) == (read, None)


def test_a_filter_reads_back_from_the_fields_it_shows() -> None:
    filt, _ = read_search(
        {"q": "<A@B>", "since": "2026-01-31T14:00:05", "until": "2026-02-01", "review": "no"}
    )
    fields = filt.fields()
    assert fields["message_id"] == "a@b" and fields["since"] == "2026-01-31T14:00:05"
    assert fields["until"] == "2026-02-01T00:00" and fields["review"] == "no"
    assert read_search(fields) == (filt, None)


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ({"since": "yesterday"}, "since is a date or a date and time, as 2026-01-31"),
        ({"until": "2026-02-30"}, "until is a date or a date and time"),
        ({"since": "99999-01-01"}, "since is a date or a date and time"),
        # Days datetime holds, whose UTC is a day before its first or after its last.
        (
            {"since": "0001-01-01T00:00+01:00"},
            "since is out of range: from 0001-01-01 to 9999-12-31 in UTC",
        ),
        ({"until": "9999-12-31T23:30-01:00"}, "until is out of range: from 0001-01-01 to"),
        ({"since": "2026-02-01", "until": "2026-01-01"}, "since is earlier than until"),
        (
            {"state": "lost"},
            "state is one of no_run, open, succeeded, duplicate, failed, dismissed",
        ),
        ({"lane": "fast"}, "lane is one of live, bulk"),
        ({"review": "maybe"}, "review is yes or no"),
        ({"sender": "ali\x00ce"}, "sender is text without control characters"),
        ({"subject": "bad\x1b[31m"}, "subject is text without control characters"),
        ({"label": "in\ufffdvoice"}, "label is text without control characters"),
        ({"error_class": "E" * 65}, "error_class is at most 64 characters"),
        ({"message_id": "<>"}, "message_id is a Message-ID, as <id@host>"),
        ({"subject": "-- !!"}, "subject has a word (a letter or a digit)"),
        ({"subject": " ".join(["word"] * 11)}, "subject is at most 10 words"),
        ({"sender": "<@>"}, "sender has a word (a letter or a digit)"),
        ({"before": "0"}, f"before is a whole number from 1 to {MAX_ID}"),
        ({"before": "-5"}, "before is a whole number"),
        ({"before": "1e9"}, "before is a whole number"),
        ({"before": "9" * 40}, "before is a whole number"),
        ({"before": str(MAX_ID + 1)}, "before is a whole number"),
        ({"q": "99999999999999999999"}, "an email id is a whole number from 1 to"),
        ({"q": "alice@example.org", "sender": "bob"}, "q and sender both give the sender"),
        ({"page": "2"}, "unknown filter page (known: q, message_id, sender"),
        ({"q": "mailbox:"}, "mailbox: a mailbox's name is empty"),
        ({"mailbox": "a" * 201}, "mailbox is at most 200 characters"),
        ({"mailbox": "ac\x07me"}, "mailbox is text without control characters"),
        ({"q": "mailbox:a mailbox:b"}, "q and mailbox give one mailbox between them"),
        ({"q": "mailbox:a", "mailbox": "b"}, "q and mailbox give one mailbox between them"),
    ],
    ids=repr,
)
def test_bad_input_is_refused_with_the_reason(values: dict[str, str], reason: str) -> None:
    assert reason in refused(values)


def test_the_first_and_last_days_in_utc_are_read() -> None:
    filt, _ = read_search({"since": "0001-01-01T00:00Z", "until": "9999-12-31T23:59-00:00"})
    assert (filt.since, filt.until) == (datetime(1, 1, 1), datetime(9999, 12, 31, 23, 59))


def test_a_failed_list_time_out_of_range_is_refused_with_the_reason() -> None:
    with pytest.raises(BadSearch, match=r"^until is out of range: from 0001-01-01 to 9999-12-31"):
        read_failed({"until": "0001-01-01T00:00+01:00"})


def test_every_problem_is_named_in_the_one_line() -> None:
    reason = refused({"state": "lost", "lane": "fast", "since": "soon", "extra": "1"})
    assert reason.split("; ") == [
        "unknown filter extra (known: q, message_id, sender, subject, since, until, state, "
        "error_class, label, lane, review, mailbox, before)",
        "since is a date or a date and time, as 2026-01-31 or 2026-01-31T14:00 (UTC unless given)",
        "state is one of no_run, open, succeeded, duplicate, failed, dismissed",
        "lane is one of live, bulk",
    ]


def test_a_mailbox_reads_back_from_the_fields_it_shows() -> None:
    filt, _ = read_search({"q": "mailbox:acme report"})
    assert filt.fields()["mailbox"] == "acme"
    assert read_search(filt.fields()) == (filt, None)
    assert filt.names() == ["subject", "mailbox"]


def test_the_failed_list_reads_a_mailbox() -> None:
    filt = read_failed({"mailbox": " acme ", "stage": "cpu"})
    assert filt.mailbox == "acme"
    assert failed_fields(filt)["mailbox"] == "acme"
    assert read_failed(failed_fields(filt)) == filt
    with pytest.raises(BadSearch, match=r"^mailbox: a mailbox's name holds a control character$"):
        read_failed({"mailbox": "\u200bacme"})
