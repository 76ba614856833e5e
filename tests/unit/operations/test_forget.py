"""`mailpipe forget` as an operation, on real PostgreSQL, Redis and the S3 server, its jobs run
in this process: what it deletes and leaves, its dry run, its choice of emails, and a job whose
email is forgotten while it converts the documents. The same with real workers and a job held at
its model call: tests/integration/test_forget.py."""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta

import pytest
from sqlalchemy import select

from mailpipe.broker.queues import Lane, TaskName
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.coordination.forgotten import fence_ttl
from mailpipe.enqueue import sender
from mailpipe.errors import BlobUnavailable
from mailpipe.operations import actions, erasure
from mailpipe.operations.housekeeping import prune
from mailpipe.operations.search import BadSearch
from mailpipe.pipeline import job, policy, runs
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.keys import document_texts
from mailpipe.storage.models import (
    Base,
    Classification,
    Document,
    EmailLabel,
    EmailMessage,
    EmailOrigin,
    ForgottenEmail,
    PipelineRun,
    Reprocess,
    utcnow,
)
from tests.support.erasure import redis_naming, rows_naming, stored_keys, with_document

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

USER = "test:operator"


def processed(res: Resources, raws: list[bytes], *, model_calls: bool = True) -> list[int]:
    """Stored and run through the CPU stage in this process: with model calls on, classified
    by the rules (labels, classification); off, waiting with their model input."""
    with res.db.transaction() as session:
        flags.set_model_calls(session, model_calls)
    ids = store_emails(res, raws)
    for email_id in ids:
        job.process_email(res, email_id)
    return ids


def blob_key(res: Resources, email_id: int) -> str:
    with res.db.session() as session:
        return session.get_one(EmailMessage, email_id).blob_key


def links(res: Resources) -> dict[int, tuple[int | None, int | None]]:
    """Each email's origin's first email and its `duplicate_of`."""
    with res.db.session() as session:
        rows = session.execute(
            select(EmailMessage.id, EmailOrigin.first_email_id, EmailMessage.duplicate_of)
            .outerjoin(EmailOrigin, EmailOrigin.id == EmailMessage.origin_id)
            .order_by(EmailMessage.id)
        )
        return {email_id: (first, copy_of) for email_id, first, copy_of in rows}


def test_every_table_keyed_by_an_email_is_one_forget_deletes() -> None:
    """A table added with a reference to an email fails here until forget deletes its rows."""
    referring = {
        table.name
        for table in Base.metadata.sorted_tables
        for column in table.columns
        for key in column.foreign_keys
        if key.column.table.name == "email_message"
    }
    handled = {model.__tablename__ for model in erasure.BY_EMAIL} | {
        "email_origin",
        "email_message",
    }
    assert referring == handled


def test_a_done_email_leaves_one_audit_line_and_nothing_else(res, caplog) -> None:  # type: ignore[no-untyped-def]
    raw = with_document(sender="anna@acme.example", subject="Salary review")
    [email_id, other] = processed(res, [raw, with_document()])
    key = blob_key(res, email_id)
    assert rows_naming(res, email_id)["document.email_id"] == 1
    assert {key, f"{document_texts(email_id)}0.txt"} <= stored_keys(res)
    res.redis.set(redis_keys.job_marker(email_id), 1)  # a job queued for it
    res.redis.zadd(redis_keys.deferred_sets()[0], {str(email_id): 1.0})

    with caplog.at_level(logging.INFO, "mailpipe.operations.actions"):
        done = actions.forget(res, [email_id], enqueue=sender(res), user=USER)

    assert done.email_ids == [email_id] and done.refused == {}
    assert rows_naming(res, email_id) == {}
    kept = stored_keys(res)
    assert key not in kept and not any(k.startswith(document_texts(email_id)) for k in kept)
    assert blob_key(res, other) in kept  # the other email keeps its blob
    assert redis_naming(res, email_id) == {f"forgotten:{email_id}"}
    assert done.rows["email_message"] == 1 and done.rows["email_origin"] == 1
    assert done.blobs == 2 and done.redis == 2
    [line] = [r for r in caplog.records if getattr(r, "action", None) == "forget"]
    message_id = raw.split(b"Message-ID: <")[1].split(b">")[0].lower()
    assert line.getMessage() == (
        f"forget by {USER} email_id={email_id} "
        f"message_id_sha256={hashlib.sha256(message_id).hexdigest()}"
    )
    audit = "\n".join(r.getMessage() for r in caplog.records if r.name == actions.log.name)
    for content in ("anna", "Salary", "acme", "pay by"):
        assert content not in audit


def test_an_email_no_job_has_read_is_audited_by_its_raw_header(res, caplog) -> None:  # type: ignore[no-untyped-def]
    raw = with_document()
    [email_id] = store_emails(res, [raw])
    with caplog.at_level(logging.INFO, "mailpipe.operations.actions"):
        actions.forget(res, [email_id], enqueue=sender(res), user=USER)
    message_id = raw.split(b"Message-ID: <")[1].split(b">")[0].lower()
    [line] = [r for r in caplog.records if getattr(r, "action", None) == "forget"]
    assert line.message_id_sha256 == hashlib.sha256(message_id).hexdigest()  # type: ignore[attr-defined]


def test_an_origin_passes_to_its_next_copy_and_its_blob_stays_theirs(res) -> None:  # type: ignore[no-untyped-def]
    raw = with_document()
    first, copy1, copy2 = processed(res, [raw, raw, raw])
    assert links(res) == {first: (first, None), copy1: (first, first), copy2: (first, first)}
    shared = blob_key(res, first)

    done = actions.forget(res, [first], enqueue=sender(res), user=USER)

    assert done.handed_on == 1 and done.rows["email_origin"] == 0
    assert rows_naming(res, first) == {}
    assert links(res) == {copy1: (copy1, None), copy2: (copy1, copy1)}
    assert shared in stored_keys(res)  # the copies are stored as the same raw bytes
    # The next copy is completed (test_a_copy_whose_origin_is_forgotten_is_completed); the
    # other stays a copy, of it.
    with res.db.session() as session:
        statuses = session.scalars(select(PipelineRun.status).order_by(PipelineRun.email_id))
        assert [s.value for s in statuses] == ["open", "duplicate"]

    # A copy forgotten: its pointers go with it; the last one takes the origin and the blob.
    actions.forget(res, [copy2], enqueue=sender(res), user=USER)
    assert links(res) == {copy1: (copy1, None)}
    last = actions.forget(res, [copy1], enqueue=sender(res), user=USER)
    assert last.rows["email_origin"] == 1 and shared not in stored_keys(res)
    with res.db.session() as session:
        assert session.scalars(select(EmailOrigin)).all() == []


def test_a_dry_run_counts_what_forget_deletes_and_deletes_nothing(res) -> None:  # type: ignore[no-untyped-def]
    raw = with_document()
    waiting = processed(res, [raw, raw, with_document()], model_calls=False)
    done_ids = processed(res, [with_document()])
    chosen = [waiting[0], waiting[2], done_ids[0]]  # an origin whose copy stays, and two more
    before = {email_id: rows_naming(res, email_id) for email_id in waiting + done_ids}

    planned = actions.forget(res, chosen, enqueue=sender(res), user=USER, dry_run=True, batch=2)

    assert planned.dry_run and planned.email_ids == chosen
    assert {email_id: rows_naming(res, email_id) for email_id in waiting + done_ids} == before
    assert not any(res.redis.exists(redis_keys.forgotten(i)) for i in chosen)
    done = actions.forget(res, chosen, enqueue=sender(res), user=USER, batch=2)
    assert (planned.rows, planned.blobs, planned.handed_on) == (
        done.rows,
        done.blobs,
        done.handed_on,
    )
    assert planned.rows["model_input"] == 2 and planned.rows["classification"] == 1
    assert planned.handed_on == 1 and planned.rows["email_origin"] == 2


def test_forget_by_sender_takes_every_email_from_that_address_in_batches(res) -> None:  # type: ignore[no-untyped-def]
    ids = processed(
        res,
        [with_document("bob@acme.example") for _ in range(5)]
        + [
            with_document("jimbob@acme.example"),
            with_document("bob@acme.example.org"),
            with_document("list@lists.example", name='"bob@acme.example via the list"'),
        ],
    )
    filt = erasure.selection(sender="BOB@acme.example")

    done = actions.forget(res, filt=filt, enqueue=sender(res), user=USER, batch=2)

    assert done.email_ids == ids[:5]
    assert all(rows_naming(res, email_id) == {} for email_id in ids[:5])
    with res.db.session() as session:
        assert list(session.scalars(select(EmailMessage.id))) == ids[5:]


@pytest.mark.parametrize("sender", ["@acme.example", "acme.example", "bob", "a@b, c@d", "a@@b"])
def test_a_sender_to_forget_is_one_whole_address(sender: str) -> None:
    with pytest.raises(BadSearch, match="one whole address"):
        erasure.selection(sender=sender)


def test_forget_by_message_id_takes_the_origin_and_its_copies(res) -> None:  # type: ignore[no-untyped-def]
    raw = with_document()
    ids = processed(res, [raw, raw, with_document()])
    message_id = raw.split(b"Message-ID: ")[1].split(b"\r\n")[0].decode()

    done = actions.forget(
        res, filt=erasure.selection(message_id=message_id), enqueue=sender(res), user=USER
    )

    assert done.email_ids == ids[:2]
    assert links(res) == {ids[2]: (ids[2], None)}


def test_a_job_that_writes_its_texts_once_its_email_is_forgotten_deletes_them(  # type: ignore[no-untyped-def]
    res, monkeypatch, caplog
) -> None:
    """Forget runs between the job's look at the fence and its blob writes: the job's rows
    are fenced off, and it deletes the blobs written after forget deleted the email's, an
    outcome it expects."""
    [email_id] = store_emails(res, [with_document()])
    real_rows = job.document_rows

    def forgotten_first(*args, **kwargs):  # type: ignore[no-untyped-def]
        actions.forget(res, [email_id], enqueue=sender(res), user=USER)
        written = real_rows(*args, **kwargs)
        assert f"{document_texts(email_id)}0.txt" in stored_keys(res)
        return written

    monkeypatch.setattr(job, "document_rows", forgotten_first)

    outcome = job.process_email(res, email_id)

    assert outcome.kind is Kind.CLOSED
    assert rows_naming(res, email_id) == {}
    assert not any(key.startswith(document_texts(email_id)) for key in stored_keys(res))
    assert redis_naming(res, email_id) == {f"forgotten:{email_id}"}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_job_whose_email_is_forgotten_during_its_conversion_writes_no_blob(  # type: ignore[no-untyped-def]
    res, monkeypatch
) -> None:
    [email_id] = store_emails(res, [with_document()])
    real_convert = job.convert_documents

    def then_forgotten(*args, **kwargs):  # type: ignore[no-untyped-def]
        converted = real_convert(*args, **kwargs)
        actions.forget(res, [email_id], enqueue=sender(res), user=USER)
        return converted

    monkeypatch.setattr(job, "convert_documents", then_forgotten)
    writes: list[str] = []
    monkeypatch.setattr(res.blobs, "put", lambda key, data: writes.append(key))

    assert job.process_email(res, email_id).kind is Kind.CLOSED
    assert writes == [] and rows_naming(res, email_id) == {}


def test_a_deleted_run_reads_as_superseded(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [with_document()])
    with res.db.transaction() as session:
        claim = runs.claim(session, email_id, policy.Limits.of(res.settings))
    assert claim is not None
    actions.forget(res, [email_id], enqueue=sender(res), user=USER)
    with res.db.transaction() as session, pytest.raises(runs.Superseded, match="gone"):
        runs.lock_current(session, claim)
    with res.db.transaction() as session:
        refused = runs.claim(session, email_id, policy.Limits.of(res.settings))
    assert refused == runs.Refused(runs.Refusal.NO_EMAIL)
    # Its next delivery ends without a failure, and without writing anything.
    assert job.process_email(res, email_id).kind is Kind.CLOSED
    assert rows_naming(res, email_id) == {}


def test_a_claim_whose_run_is_deleted_under_it_ends_without_writing(  # type: ignore[no-untyped-def]
    res, monkeypatch
) -> None:
    """Forget commits between the claim's look at the email and its lock of the run."""
    [email_id] = store_emails(res, [with_document()])
    with res.db.transaction() as session:
        runs.ensure_runs(session, [email_id])
    real_ensure = runs.ensure_runs
    calls = []

    def then_forgotten(session, email_ids):  # type: ignore[no-untyped-def]
        real_ensure(session, email_ids)
        calls.append(email_ids)
        if len(calls) == 1:  # the claim's; forget's own comes next
            actions.forget(res, [email_id], enqueue=sender(res), user=USER)

    monkeypatch.setattr(runs, "ensure_runs", then_forgotten)

    # A delivery after a hard time limit: the claim that locks and looks, without the upsert.
    outcome = job.process_email(res, email_id, cut_off=25.0)

    assert (outcome.kind, outcome.error) == (Kind.CLOSED, f"email {email_id}: the run is gone")
    assert rows_naming(res, email_id) == {}


def test_a_forget_cut_short_leaves_the_run_failed_and_is_finished_again(  # type: ignore[no-untyped-def]
    res, monkeypatch
) -> None:
    [email_id] = processed(res, [with_document()], model_calls=False)
    real_delete = res.blobs.delete

    def unavailable(key: str) -> None:
        raise BlobUnavailable(f"S3 unavailable for DeleteObject of {key}: 503")

    monkeypatch.setattr(res.blobs, "delete", unavailable)
    with pytest.raises(BlobUnavailable):
        actions.forget(res, [email_id], enqueue=sender(res), user=USER)
    with res.db.session() as session:
        run = session.scalars(select(PipelineRun)).one()
    assert (run.status.value, run.error_class) == ("failed", "Forgotten")
    assert "run `mailpipe forget` again" in (run.error or "")
    # Its next delivery claims nothing: the run is closed.
    assert job.process_email(res, email_id).kind is Kind.CLOSED

    monkeypatch.setattr(res.blobs, "delete", real_delete)
    assert actions.forget(res, [email_id], enqueue=sender(res), user=USER).email_ids == [email_id]
    assert rows_naming(res, email_id) == {}


def test_unknown_ids_are_refused_and_the_rest_forgotten(res) -> None:  # type: ignore[no-untyped-def]
    [email_id] = processed(res, [with_document()])
    done = actions.forget(res, [email_id, 999], enqueue=sender(res), user=USER)
    assert done.email_ids == [email_id] and done.refused == {999: "no such email"}


def labels_of(res: Resources, email_id: int) -> list[tuple[str, str]]:
    with res.db.session() as session:
        rows = session.execute(
            select(EmailLabel.label, EmailLabel.source)
            .where(EmailLabel.email_id == email_id)
            .order_by(EmailLabel.label)
        )
        return [tuple(row) for row in rows]  # type: ignore[misc]


def status_of(res: Resources, email_id: int) -> str:
    with res.db.session() as session:
        return (
            session.scalars(select(PipelineRun.status).where(PipelineRun.email_id == email_id))
            .one()
            .value
        )


@pytest.mark.parametrize("model_calls", [True, False])
def test_a_copy_whose_origin_is_forgotten_is_completed(res, model_calls: bool) -> None:  # type: ignore[no-untyped-def]
    """The copy the origin passes to was never classified and has no documents of its own: it
    takes the labels of the email forgotten in place of those it showed as a copy of it, and
    runs the steps a copy skips, its job sent; with model calls off it waits for them with
    those labels."""
    raw = with_document()
    first, copy = processed(res, [raw, raw])
    shown = labels_of(res, first)
    assert shown and status_of(res, copy) == "duplicate"
    assert labels_of(res, copy) == [(label, "origin") for label, _ in shown]

    planned = actions.forget(res, [first], enqueue=sender(res), user=USER, dry_run=True)
    assert planned.completed == [copy] and status_of(res, copy) == "duplicate"

    sent: list[tuple[list[int], TaskName, Lane]] = []

    def enqueue(ids, task, lane, boxes):  # type: ignore[no-untyped-def]
        sent.append((list(ids), task, lane))
        return list(ids)

    done = actions.forget(res, [first], enqueue=enqueue, user=USER)

    assert (done.completed, done.enqueued) == ([copy], 1)
    assert sent == [([copy], TaskName.PROCESS_EMAIL, Lane.LIVE)]
    assert status_of(res, copy) == "open" and labels_of(res, copy) == shown
    with res.db.transaction() as session:
        flags.set_model_calls(session, model_calls)
    outcome = job.process_email(res, copy)

    assert outcome.kind is (Kind.SUCCEEDED if model_calls else Kind.WAITING)
    assert labels_of(res, copy) == shown
    with res.db.session() as session:
        assert session.scalars(select(Document.email_id)).all() == [copy]
        classified = session.scalars(select(Classification.email_id)).all()
    assert classified == ([copy] if model_calls else [])
    assert status_of(res, copy) == ("succeeded" if model_calls else "open")


def test_the_origin_passes_to_a_copy_the_forget_leaves(res) -> None:  # type: ignore[no-untyped-def]
    """Forgetting an origin and its next copy in two batches: the origin goes to the copy that
    stays, which alone is completed."""
    raw = with_document()
    first, copy1, copy2 = processed(res, [raw, raw, raw])

    done = actions.forget(res, [first, copy1], enqueue=sender(res), user=USER, batch=1)

    assert (done.completed, done.handed_on) == ([copy2], 1)  # never to copy1 on the way
    assert links(res) == {copy2: (copy2, None)}
    assert status_of(res, copy2) == "open"


def test_the_fence_outlives_a_redis_that_lost_it(res, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Forget runs between the job's look at the fence and its blob writes, and Redis restarts
    without its data: the job finds the fence in the database and deletes what it wrote. The
    database's fence goes once Redis's would have lapsed."""
    [email_id] = store_emails(res, [with_document()])
    real_rows = job.document_rows

    def forgotten_first(*args, **kwargs):  # type: ignore[no-untyped-def]
        actions.forget(res, [email_id], enqueue=sender(res), user=USER)
        res.redis.delete(redis_keys.forgotten(email_id))  # what a restart without data leaves
        return real_rows(*args, **kwargs)

    monkeypatch.setattr(job, "document_rows", forgotten_first)

    assert job.process_email(res, email_id).kind is Kind.CLOSED
    assert not any(key.startswith(document_texts(email_id)) for key in stored_keys(res))
    assert rows_naming(res, email_id) == {}
    # Its next delivery ends without a failure, fenced off by the database alone.
    assert job.process_email(res, email_id).kind is Kind.CLOSED

    lapsed = utcnow() + timedelta(seconds=fence_ttl(res.settings) + 1)
    assert prune(res, utcnow()).fences == 0
    assert prune(res, lapsed).fences == 1
    with res.db.session() as session:
        assert session.scalars(select(ForgottenEmail)).all() == []


def test_a_long_from_header_keeps_its_address_and_forget_finds_it(res) -> None:  # type: ignore[no-untyped-def]
    long_name = " ".join(f"Dora{n:04d}" for n in range(150))  # 1,349 characters
    raw = with_document(sender="dora@acme.example", name=long_name)
    assert raw.split(b"\r\nSubject:")[0].count(b"\r\n ") > 10  # folded, as mail clients do
    [email_id, other] = processed(res, [raw, with_document()])
    with res.db.session() as session:
        assert session.get_one(EmailMessage, email_id).sender == "dora@acme.example"

    filt = erasure.selection(sender="Dora@Acme.example")
    done = actions.forget(res, filt=filt, enqueue=sender(res), user=USER)

    assert done.email_ids == [email_id] and rows_naming(res, email_id) == {}
    assert rows_naming(res, other)


def test_a_reprocess_keeps_its_filter_by_name_and_forget_empties_older_ones(res) -> None:  # type: ignore[no-untyped-def]
    raw = with_document(sender="erin@acme.example", subject="Payslip")
    [email_id] = processed(res, [raw])
    filt = erasure.selection(sender="erin@acme.example")
    filt = type(filt)(sender=filt.sender, subject=("payslip",))
    done = actions.reprocess(res, filt, actions.Step.CLASSIFY, enqueue=sender(res), user=USER)
    assert done.emails == 1
    with res.db.transaction() as session:
        # A reprocess of the release before, which stored the filter's values.
        session.add(
            Reprocess(
                created_by=USER,
                from_step="classify",
                lane="bulk",
                search={"sender": "erin@acme.example", "subject": "payslip", "label": ""},
                emails=1,
            )
        )
    with res.db.session() as session:
        stored = session.execute(select(Reprocess.search, Reprocess.filters)).all()
    assert stored[0] == ({}, ["sender", "subject"])

    actions.forget(res, [email_id], enqueue=sender(res), user=USER)

    with res.db.session() as session:
        stored = session.execute(select(Reprocess.search, Reprocess.filters)).all()
    assert stored == [({}, ["sender", "subject"]), ({}, ["sender", "subject"])]
