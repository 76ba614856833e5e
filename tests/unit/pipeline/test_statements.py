"""What a job sends to PostgreSQL, statement by statement: a regression in the job's database
work (a statement more, a transaction more, a second read of the email row) fails here."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import event

from mailpipe.cli.ingest import store_emails
from mailpipe.pipeline import job, mailbox_pauses, runs, stage_pauses
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage import flags
from tests.unit.pipeline.test_job import remote_model

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

PLAIN = (
    b"From: billing@acme.example\r\nTo: team@mailpipe.example\r\nSubject: Invoice {n}\r\n"
    b"Message-ID: <s{n}@acme>\r\nDate: Mon, 30 Nov 2026 10:00:00 +0000\r\n\r\n"
    b"Amount due: {n} EUR, invoice attached to nothing.\r\n"
)
WITH_DOCUMENT = (
    b"From: billing@acme.example\r\nSubject: Notes {n}\r\nMessage-ID: <d{n}@acme>\r\n"
    b'Content-Type: multipart/mixed; boundary="b"\r\n\r\n'
    b"--b\r\nContent-Type: text/plain\r\n\r\nSee the notes\r\n"
    b'--b\r\nContent-Type: text/plain; name="notes.txt"\r\n'
    b'Content-Disposition: attachment; filename="notes.txt"\r\n\r\npay soon {n}\r\n--b--\r\n'
)
_VERB_TABLE = re.compile(r"^\s*(SELECT|INSERT INTO|UPDATE|DELETE FROM)\s.*?\b(\w+)\b", re.S)


def email(template: bytes, n: int) -> bytes:
    return template.replace(b"{n}", str(n).encode())


@contextmanager
def statements(res: Resources) -> Iterator[Counter[str]]:
    """Each statement by verb and first table, and the transactions, of this engine, counted
    when the block ends."""
    counted: Counter[str] = Counter()
    with statements_in_order(res) as seen:
        yield counted
    counted.update(seen)


@contextmanager
def statements_in_order(res: Resources) -> Iterator[list[str]]:
    """The same, as a list in the order sent: "transactions" marks where each one begins."""
    seen: list[str] = []

    def on_statement(_conn, _cursor, statement, *_) -> None:  # type: ignore[no-untyped-def]
        if statement.startswith("SELECT"):
            table = re.search(r"\bFROM (\w+)", statement)
            seen.append(f"SELECT {table.group(1) if table else '?'}")
        else:
            found = _VERB_TABLE.match(statement)
            seen.append(" ".join(found.groups()) if found else statement.split()[0])

    def on_begin(_conn) -> None:  # type: ignore[no-untyped-def]
        seen.append("transactions")

    engine = res.db.engine
    event.listen(engine, "before_cursor_execute", on_statement)
    event.listen(engine, "begin", on_begin)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", on_statement)
        event.remove(engine, "begin", on_begin)


def cached(res: Resources) -> Resources:
    """Resources as a worker child has them: the model-calls flag read at most every 5 s."""
    return Resources(res.settings.model_copy(update={"model_calls_cache_seconds": 5}))


def test_a_plain_email_takes_two_transactions_and_reads_its_row_once(res) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    worker = cached(res)
    first, second = store_emails(res, [email(PLAIN, 1), email(PLAIN, 2)])
    assert job.process_email(worker, first).kind is Kind.SUCCEEDED  # the flag is read here
    with statements(worker) as counted:
        assert job.process_email(worker, second).kind is Kind.SUCCEEDED
    assert dict(counted) == {
        "transactions": 2,
        # The claim: the run created or counted in one statement, which reads the email row's
        # blob key too, and the email flagged as having a run at its first attempt.
        "INSERT INTO pipeline_run": 1,
        "UPDATE email_message": 2,  # has_run at the first attempt; the origin's link
        # The steps, in one transaction: the origin, the attempt's row in the history and the
        # run's close (both fenced by this attempt, the close locking the run before the email
        # row), the email's link to its origin, the classification and the labels.
        "INSERT INTO run_attempt": 1,
        "UPDATE pipeline_run": 1,
        "INSERT INTO email_origin": 1,
        "INSERT INTO classification": 1,
        "SELECT email_label": 1,
        "INSERT INTO email_label": 1,
    }


@pytest.mark.parametrize("template", [PLAIN, WITH_DOCUMENT], ids=["plain", "with-a-document"])
def test_every_transaction_of_the_steps_locks_the_run_before_the_email_row(res, template) -> None:  # type: ignore[no-untyped-def]
    """The claim, the sweeper's review marking and `reopen` lock the run, then the email row: a
    job that took them the other way round could deadlock with them."""
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    worker = cached(res)
    first, second = store_emails(res, [email(template, 1), email(template, 2)])
    assert job.process_email(worker, first).kind is Kind.SUCCEEDED
    with statements_in_order(worker) as seen:
        assert job.process_email(worker, second).kind is Kind.SUCCEEDED
    starts = [i for i, sent in enumerate(seen) if sent == "transactions"]
    transactions = [seen[a:b] for a, b in zip(starts, [*starts[1:], len(seen)], strict=True)]
    assert len(transactions) == (2 if template is PLAIN else 3)
    locks_run = {"UPDATE pipeline_run", "SELECT pipeline_run", "INSERT INTO pipeline_run"}
    for sent in transactions:
        if "UPDATE email_message" in sent:
            before_email_row = sent[: sent.index("UPDATE email_message")]
            assert locks_run & set(before_email_row), seen


def test_an_email_with_a_document_records_its_origin_before_converting(res) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    worker = cached(res)
    first, second, copy = store_emails(
        res,
        [
            email(WITH_DOCUMENT, 1),
            email(WITH_DOCUMENT, 2),
            b"Received: x\r\n" + email(WITH_DOCUMENT, 2),
        ],
    )
    assert job.process_email(worker, first).kind is Kind.SUCCEEDED
    with statements(worker) as counted:
        assert job.process_email(worker, second).kind is Kind.SUCCEEDED
    assert counted["transactions"] == 3  # claim; origin; documents, labels and close
    assert counted["INSERT INTO document"] == 1
    assert counted["INSERT INTO run_attempt"] == 1  # written with the close
    # A copy stops after its origin: no document converted or stored.
    with statements(worker) as counted:
        assert job.process_email(worker, copy).kind is Kind.DUPLICATE
    assert counted["transactions"] == 2
    assert counted["INSERT INTO run_attempt"] == 1  # written with the close as a copy
    assert counted["SELECT email_origin"] == 1  # the first email's origin, found
    assert "INSERT INTO document" not in counted


def test_the_model_calls_flag_is_read_once_per_cache_window(res) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        flags.set_model_calls(session, False)
    worker = cached(res)
    ids = store_emails(res, [email(PLAIN, n) for n in range(3)])
    # A fleet's Redis holds the kept pauses already: putting them back is once per Redis.
    stage_pauses.restore(worker)
    mailbox_pauses.restore(worker)
    with statements(worker) as counted:
        assert [job.process_email(worker, i).kind for i in ids] == [Kind.WAITING] * 3
    # Once in the window for the jobs' own transactions; and once more by each run that ends
    # waiting, after its lease, so that a switch to "on" inside the window strands none.
    assert counted["SELECT runtime_flag"] == 1 + 3
    assert (counted["transactions"], counted["INSERT INTO run_attempt"]) == (6 + 3, 3)
    # Switched on, a worker that read it off keeps that for the window; a fresh one sees it.
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    [later] = store_emails(res, [email(PLAIN, 9)])
    assert job.process_email(cached(res), later).kind is Kind.SUCCEEDED


@contextmanager
def runs_asked(res: Resources, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """The state store's functions a delivery calls, by transaction: a list per transaction
    begun on this engine that asked it anything (one reading only a flag or the pauses asks
    nothing), each call named once."""
    by_transaction: list[list[str]] = []
    inside: list[str] = []  # a call of the store's own, under the one asked, is not asked

    def counted(name: str, function):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            inside.append(name)
            try:
                return function(*args, **kwargs)
            finally:  # a transaction begins at its first statement, in the call
                inside.pop()
                if not inside:
                    by_transaction[-1].append(name)

        return call

    for name in (
        "claim",
        "lock_current",
        "mark_parsed",
        "mark_converted",
        "mark_classified",
        "close",
        "give_back",
        "record_failed_attempt",
        "fail",
    ):
        monkeypatch.setattr(runs, name, counted(name, getattr(runs, name)))

    def on_begin(_conn) -> None:  # type: ignore[no-untyped-def]
        by_transaction.append([])

    asked: list[list[str]] = []
    event.listen(res.db.engine, "begin", on_begin)
    try:
        yield asked
    finally:
        event.remove(res.db.engine, "begin", on_begin)
        asked.extend(calls for calls in by_transaction if calls)


@pytest.mark.parametrize(
    ("template", "asked"),
    [
        (PLAIN, [["claim"], ["close"]]),
        (WITH_DOCUMENT, [["claim"], ["mark_parsed"], ["close"]]),
    ],
    ids=["plain", "with-a-document"],
)
def test_each_transaction_of_the_cpu_stage_asks_the_state_store_once(  # type: ignore[no-untyped-def]
    res, monkeypatch, template, asked
) -> None:
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    worker = cached(res)
    first, second = store_emails(res, [email(template, 1), email(template, 2)])
    assert job.process_email(worker, first).kind is Kind.SUCCEEDED
    with runs_asked(worker, monkeypatch) as seen:
        assert job.process_email(worker, second).kind is Kind.SUCCEEDED
    assert seen == asked, seen


def test_the_model_stage_asks_the_state_store_once_a_transaction(res, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    worker = remote_model(cached(res))
    [email_id] = store_emails(res, [email(PLAIN, 1)])
    with runs_asked(worker, monkeypatch) as seen:
        assert job.process_email(worker, email_id).kind is Kind.HANDED_OFF
        assert job.classify_email(worker, email_id).kind is Kind.SUCCEEDED
    # The CPU stage: claim, then convert; the model stage: claim, the run locked before the
    # model's input is read, the answer kept, then the labels and the close.
    assert seen == [
        ["claim"],
        ["mark_converted"],
        ["claim"],
        ["lock_current"],
        ["mark_classified"],
        ["close"],
    ]


def test_an_origin_s_copies_take_its_labels_in_the_same_statements_however_many(res) -> None:  # type: ignore[no-untyped-def]
    """The model stage's last transaction syncs the copies' labels with the origin's: the origin
    locked, then one statement for the stale and one for the rest, for 2 copies as for 40."""
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    worker = remote_model(cached(res))
    counts = []
    for n, copies in ((1, 2), (2, 40)):
        [first] = store_emails(res, [email(PLAIN, n)])
        assert job.process_email(worker, first).kind is Kind.HANDED_OFF
        ids = store_emails(res, [b"Received: %d\r\n" % i + email(PLAIN, n) for i in range(copies)])
        assert {job.process_email(worker, i).kind for i in ids} == {Kind.DUPLICATE}
        with statements_in_order(worker) as seen:
            assert job.classify_email(worker, first).kind is Kind.SUCCEEDED
        counts.append(seen)
    assert counts[0] == counts[1]
    close = counts[0][len(counts[0]) - counts[0][::-1].index("transactions") :]
    assert close == [
        "INSERT INTO run_attempt",
        "UPDATE pipeline_run",  # the close, fenced
        "SELECT email_origin",  # the origin locked
        "SELECT email_label",
        "INSERT INTO email_label",  # the origin's labels
        "DELETE FROM email_label",  # the copies' stale ones
        "INSERT INTO email_label",  # the copies' missing ones, and those changed
    ]
