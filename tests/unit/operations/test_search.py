"""The search on real PostgreSQL, with its trigram and partial indexes, and on SQLite, the demo's
database, without them: each filter alone and two together find exactly their emails, newest
first, 50 a page."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select, text

from mailpipe.operations.search import PART_CHARS, find, read_search
from mailpipe.resources import Resources
from mailpipe.settings import Settings
from mailpipe.storage.migrate import upgrade
from mailpipe.storage.models import EmailMessage
from tests.support.failed_runs import add_emails
from tests.support.searched import MAILS, T0, store_searched

pytestmark = pytest.mark.services  # PostgreSQL

NEWEST_FIRST = [mail.name for mail in reversed(MAILS)]


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request: pytest.FixtureRequest, res: Resources, tmp_path: Path) -> Iterator[Resources]:
    if request.param == "postgresql":
        yield res
        return
    url = f"sqlite:///{tmp_path / 'search.db'}"
    upgrade(url)
    local = Resources(Settings(**{**res.settings.model_dump(), "database_url": url}))
    yield local
    local.db.dispose()


def found(db: Resources, values: dict[str, str], ids: dict[str, int]) -> list[str]:
    """The names of the emails the search finds, in its order."""
    names = {email_id: name for name, email_id in ids.items()}
    filt, before = read_search(values)
    with db.db.session() as session:
        page = find(session, filt, before)
    assert page.next_before is None
    return [names[row["email_id"]] for row in page.rows]


def hours(n: int) -> str:
    return T0.replace(hour=T0.hour + n).isoformat()


ALONE = [
    ({}, NEWEST_FIRST),
    ({"message_id": "<INV-0142@Acme.example>"}, ["copy", "invoice"]),  # the copy too
    ({"message_id": "alert-7@corp.example"}, ["alert"]),
    ({"message_id": "<alert-7@corp>"}, []),  # exact, not a part
    ({"sender": "billing@"}, ["overdue", "copy", "invoice"]),
    ({"sender": "ACME.EXAMPLE"}, ["copy", "invoice"]),
    ({"sender": "IT Desk"}, ["alert"]),  # the name too
    ({"sender": "@corp.example"}, ["lunch", "alert"]),  # the domain
    ({"sender": "t_desk"}, []),  # as written: LIKE's _ would find "IT Desk"
    ({"subject": "invoice"}, ["overdue", "copy", "invoice"]),
    ({"subject": "INVOICE march"}, ["copy", "invoice"]),
    ({"subject": "0%4"}, []),  # as written: LIKE's % would find "2026-0142"
    ({"subject": "off_today"}, ["wildcards"]),
    ({"since": hours(5)}, ["wildcards", "unread", "overdue"]),  # inclusive
    ({"until": hours(2)}, ["newsletter", "invoice"]),  # exclusive
    ({"since": T0.isoformat() + "+01:00", "until": hours(0)}, []),  # 08:00 to 09:00 UTC
    ({"state": "no_run"}, ["unread"]),
    ({"state": "open"}, ["lunch"]),
    ({"state": "succeeded"}, ["wildcards", "newsletter", "invoice"]),
    ({"state": "duplicate"}, ["copy"]),
    ({"state": "failed"}, ["alert"]),  # the dismissed one is not among them
    ({"state": "dismissed"}, ["overdue"]),
    ({"error_class": "BlobMissing"}, ["alert"]),
    ({"error_class": "OperationalError"}, ["lunch"]),  # an open run's, retrying
    ({"error_class": "InputRejected"}, ["overdue"]),
    ({"error_class": "blobmissing"}, []),
    ({"label": "invoice"}, ["overdue", "invoice"]),
    ({"label": "security"}, ["alert"]),
    ({"label": "spam"}, []),
    ({"lane": "bulk"}, ["overdue", "newsletter"]),
    ({"lane": "live"}, ["wildcards", "unread", "copy", "lunch", "alert", "invoice"]),
    ({"review": "yes"}, ["overdue", "alert"]),
    ({"review": "no"}, ["wildcards", "unread", "copy", "lunch", "newsletter", "invoice"]),
    ({"mailbox": "acme"}, ["alert", "invoice"]),
    ({"mailbox": "globex"}, ["copy"]),  # the copy, delivered to another mailbox
    ({"mailbox": "default"}, ["wildcards", "unread", "overdue", "lunch", "newsletter"]),
    ({"mailbox": "ACME"}, []),  # a name as it is written
    ({"q": "mailbox:globex"}, ["copy"]),
    # The search box: a Message-ID in brackets, an address, or subject words.
    ({"q": "<Alert-7@corp.example>"}, ["alert"]),
    ({"q": "carol@corp.example"}, ["lunch"]),
    ({"q": "storage week"}, ["newsletter"]),
]


@pytest.mark.parametrize(("values", "names"), ALONE, ids=str)
def test_each_filter_alone_finds_exactly_its_emails(
    db: Resources, values: dict[str, str], names: list[str]
) -> None:
    assert found(db, values, store_searched(db)) == names


TOGETHER = [
    ({"sender": "billing@", "state": "dismissed"}, ["overdue"]),
    ({"subject": "invoice", "lane": "bulk"}, ["overdue"]),
    ({"subject": "invoice", "state": "failed"}, []),
    ({"label": "invoice", "review": "yes"}, ["overdue"]),
    ({"message_id": "inv-0142@acme.example", "state": "duplicate"}, ["copy"]),
    ({"message_id": "inv-0142@acme.example", "since": hours(1)}, ["copy"]),
    ({"since": hours(1), "label": "invoice"}, ["overdue"]),
    ({"since": hours(2), "until": hours(4)}, ["lunch", "alert"]),
    ({"error_class": "BlobMissing", "review": "yes"}, ["alert"]),
    ({"error_class": "InputRejected", "state": "failed"}, []),
    ({"state": "succeeded", "lane": "bulk"}, ["newsletter"]),
    ({"sender": "corp.example", "until": hours(3)}, ["alert"]),
    ({"sender": "corp.example", "label": "personal"}, ["lunch"]),
    ({"subject": "invoice 2026-0142", "sender": "acme.example"}, ["copy", "invoice"]),
    ({"state": "no_run", "lane": "live"}, ["unread"]),
    ({"q": "invoice", "review": "yes"}, ["overdue"]),
    ({"q": "mailbox:acme invoice"}, ["invoice"]),
    ({"mailbox": "default", "label": "invoice"}, ["overdue"]),
    ({"message_id": "inv-0142@acme.example", "mailbox": "globex"}, ["copy"]),
]


@pytest.mark.parametrize(("values", "names"), TOGETHER, ids=str)
def test_two_filters_together_find_the_emails_both_find(
    db: Resources, values: dict[str, str], names: list[str]
) -> None:
    assert found(db, values, store_searched(db)) == names


def test_a_row_carries_what_the_results_show(db: Resources) -> None:
    ids = store_searched(db)
    filt, _ = read_search({"state": "dismissed"})
    with db.db.session() as session:
        [row] = find(session, filt).rows
    assert row == {
        "email_id": ids["overdue"],
        "received_at": hours(5) + "Z",
        "sender": "billing@shop.example",
        "subject": "Invoice 2026-0190 overdue",
        "lane": "bulk",
        "mailbox": "default",
        "state": "dismissed",
        "error_class": "InputRejected",
        "needs_review": True,
    }


def test_pages_of_fifty_follow_one_another_newest_first(db: Resources) -> None:
    ids = add_emails(db, 120)
    filt, _ = read_search({})
    pages, before = [], None
    with db.db.session() as session:
        while True:
            page = find(session, filt, before)
            pages.append([row["email_id"] for row in page.rows])
            if page.next_before is None:
                break
            before = page.next_before
        newest = list(reversed(ids))
        assert pages == [newest[:50], newest[50:100], newest[100:]]
        # Exactly fifty left: a full page, and no next one.
        last_full = find(session, filt, newest[69])
        assert [row["email_id"] for row in last_full.rows] == newest[70:]
        assert last_full.next_before is None


INDEXED = [
    ({"message_id": "inv-0142@acme.example"}, ["ix_email_origin_message_id"]),
    ({"sender": "billing@acme.example"}, ["ix_email_message_sender_words"]),
    ({"subject": "invoice march"}, ["ix_email_message_subject_words"]),
    ({"since": hours(1), "until": hours(2)}, ["ix_email_message_received_at"]),
    ({"state": "no_run"}, ["ix_email_message_no_run"]),
    ({"state": "open"}, ["ix_pipeline_run_status", "ix_pipeline_run_open"]),
    ({"state": "duplicate"}, ["ix_pipeline_run_status", "ix_pipeline_run_duplicate"]),
    ({"state": "failed"}, ["ix_pipeline_run_status", "ix_pipeline_run_listed"]),
    ({"state": "dismissed"}, ["ix_pipeline_run_dismissed", "ix_pipeline_run_failed"]),
    ({"error_class": "BlobMissing"}, ["ix_pipeline_run_error_class"]),
    ({"label": "invoice"}, ["ix_email_label_label"]),
    ({"lane": "bulk"}, ["ix_email_message_bulk"]),
    ({"review": "yes"}, ["ix_email_message_needs_review"]),
    ({"mailbox": "acme"}, ["ix_email_message_mailbox"]),
]


@pytest.mark.parametrize(("values", "indexes"), INDEXED, ids=str)
def test_each_selective_filter_can_read_its_index(
    res: Resources, values: dict[str, str], indexes: list[str]
) -> None:
    """The conditions as the search writes them are the ones the migration's indexes cover
    (an expression that differs by a cast is never matched), asked of PostgreSQL's planner
    with table scans priced out."""
    store_searched(res)
    filt, _ = read_search(values)
    with res.db.session() as session:
        session.execute(text("SET LOCAL enable_seqscan = off"))
        session.execute(text("SET LOCAL enable_indexscan = off"))  # bitmaps: no walk of the key
        query = select(EmailMessage.id).where(*filt.where(full_text=True))
        plan = "\n".join(session.scalars(text(f"EXPLAIN {_literal_sql(session, query)}")))
    assert any(index in plan for index in indexes), plan


def _literal_sql(session: Any, query: Any) -> str:
    return str(query.compile(session.get_bind(), compile_kwargs={"literal_binds": True}))


# A subject an outsider may send, and a query against it: a substring check (`ILIKE '%...%'`)
# compares them at every position of the subject, the query's length each time, for every email
# whose words the full-text index finds (here all of them: the query's only word is `x`).
CRAFTED = "x " + "!" * 997
CRAFTED_QUERY = "!" * 498 + "x"
# A word as long as a query may be: its first PART_CHARS characters are all the check compares.
LONG_QUERY = "!" * 498 + "x" * 500


@pytest.mark.parametrize("field", ["subject", "sender"])
def test_an_outsider_s_text_is_checked_by_a_bounded_part_of_the_query_in_every_plan(
    res: Resources, field: str
) -> None:
    """In every plan PostgreSQL may choose, reading the words' index or walking the newest
    emails, each email's text is compared with at most PART_CHARS characters of the query (the
    LIKE pattern, `~~*`) and parsed once for its words (`@@`), whatever the query's length."""
    crafted = add_emails(res, 120, **{field: CRAFTED})
    store_searched(res)
    for query, part, found in (
        (CRAFTED_QUERY, "x", crafted[::-1][:50]),
        (LONG_QUERY, "x" * PART_CHARS, []),
        # Its lowest word is `/a_b%20c`: LIKE's wildcards compared as written.
        ("http://foo.example/a_b%20c", r"/a\_b\%20c", []),
    ):
        page, plans = planned(res, {field: query})
        assert [row["email_id"] for row in page.rows] == found
        for plan in plans:
            assert re.findall(r"~~\* '([^']*)'", plan) == [f"%{part}%"], plan
            assert "@@ '''" in plan and "!" not in plan, plan


def planned(res: Resources, values: dict[str, str]) -> tuple[Any, list[str]]:
    """The page `find` answers `values` with, and the plans PostgreSQL makes of the statement
    that finds its ids when it reads the words' index and when it walks the newest emails."""
    filt, _ = read_search(values)
    statements: list[tuple[str, Any]] = []

    def seen(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        statements.append((statement, parameters))

    event.listen(res.db.engine, "before_cursor_execute", seen)
    try:
        with res.db.session() as session:
            page = find(session, filt)
    finally:
        event.remove(res.db.engine, "before_cursor_execute", seen)
    [(ids, parameters)] = [s for s in statements if "LIMIT" in s[0] and "ORDER BY" in s[0]]
    plans = []
    for priced_out in ("enable_indexscan", "enable_bitmapscan"):  # the words' index; the walk
        with res.db.session() as session:
            session.execute(text("SET LOCAL enable_seqscan = off"))
            session.execute(text(f"SET LOCAL {priced_out} = off"))
            explained = session.connection().exec_driver_sql(f"EXPLAIN {ids}", parameters)
            plans.append("\n".join(row[0] for row in explained))
    assert "Index Scan Backward using pk_email_message" in plans[1], plans[1]
    return page, plans


def test_a_row_shows_its_mailbox_by_name(db: Resources) -> None:
    ids = store_searched(db)
    filt, _ = read_search({"message_id": "inv-0142@acme.example"})
    with db.db.session() as session:
        rows = find(session, filt).rows
    assert [(row["email_id"], row["mailbox"]) for row in rows] == [
        (ids["copy"], "globex"),
        (ids["invoice"], "acme"),
    ]
