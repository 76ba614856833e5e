"""Copies in several mailboxes (docs/mailboxes.md): one origin, one model call, and every copy
showing the origin's labels, on PostgreSQL, Redis and the S3 server, the jobs run in this
process."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from sqlalchemy import select, text

from mailpipe.classifiers import ClassificationResult, EmailForClassifier, LabelScore
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import sender
from mailpipe.mail.parse import parse_email
from mailpipe.operations import actions, status
from mailpipe.operations.search import EmailFilter, find
from mailpipe.pipeline import interventions, job
from mailpipe.pipeline.labels import copy_labels, sync_model_labels
from mailpipe.pipeline.origin import find_origin, link_to_origin
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage.models import EmailLabel, PipelineRun, Reprocess, RunStatus
from tests.support.switches import set_model_calls
from tests.support.waits import wait_for
from tests.unit.pipeline.test_job import INVOICE, PLAIN
from tests.unit.pipeline.test_origin_and_labels import LIMITS

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

USER = "test:operator"


class Answers:
    """A classifier whose answer the test sets (`labels`), counting its calls; `remote` as a
    paid model is, answered in the model stage, or local as the rules, in the CPU stage."""

    def __init__(self, real, *, remote: bool, labels: dict[str, float]) -> None:  # type: ignore[no-untyped-def]
        self.real = real
        self.model_id = real.model_id
        self.remote = remote
        self.labels = labels
        self.calls = 0

    def classify(self, email: EmailForClassifier) -> ClassificationResult:
        self.calls += 1
        answer = self.real.classify(email)
        scores = tuple(LabelScore(label, score) for label, score in self.labels.items())
        return dataclasses.replace(answer, labels=scores)


def answering(res: Resources, *, remote: bool, labels: dict[str, float]) -> Resources:
    set_model_calls(res, True)
    return Resources(res.settings).with_standins(
        classifier=Answers(res.classifier, remote=remote, labels=labels)
    )


def delivered_again(raw: bytes, mx: str) -> bytes:
    """The same email as another mailbox's server received it: the same fingerprint."""
    return f"Received: from {mx}\r\n".encode() + raw


def labels_of(res: Resources, email_id: int) -> set[tuple[str, str, float | None]]:
    with res.db.session() as session:
        rows = session.execute(
            select(EmailLabel.label, EmailLabel.source, EmailLabel.confidence).where(
                EmailLabel.email_id == email_id
            )
        )
        return {tuple(row) for row in rows}  # type: ignore[misc]


def status_of(res: Resources, email_id: int) -> RunStatus:
    with res.db.session() as session:
        return session.scalars(
            select(PipelineRun.status).where(PipelineRun.email_id == email_id)
        ).one()


def test_a_copy_in_another_mailbox_shows_the_labels_its_origin_has_already(res) -> None:  # type: ignore[no-untyped-def]
    model = answering(res, remote=True, labels={"invoice": 0.8})
    [origin] = store_emails(res, [INVOICE], mailbox="acme")
    assert job.process_email(model, origin).kind is Kind.HANDED_OFF
    assert job.classify_email(model, origin).kind is Kind.SUCCEEDED
    [copy] = store_emails(res, [delivered_again(INVOICE, "mx.other")], mailbox="other")

    assert job.process_email(model, copy).kind is Kind.DUPLICATE

    assert model.classifier.calls == 1  # the origin's call, and none for the copy
    assert status_of(res, copy) is RunStatus.DUPLICATE
    assert labels_of(res, origin) == {("invoice", "model", 0.8)}
    assert labels_of(res, copy) == {("invoice", "origin", 0.8)}
    # The console's email page and the search by label show it with no change of theirs.
    with res.db.session() as session:
        shown = status.email_detail(session, copy)
        found = find(session, EmailFilter(label="invoice"))
    assert shown is not None and shown["labels"] == [
        {"label": "invoice", "source": "origin", "confidence": 0.8}
    ]
    assert {row["email_id"] for row in found.rows} == {origin, copy}
    # Its job again changes nothing: the run is closed.
    assert job.process_email(model, copy).kind is Kind.CLOSED
    assert labels_of(res, copy) == {("invoice", "origin", 0.8)}


def test_a_copy_that_arrives_while_its_origin_is_open_takes_the_labels_when_it_is_classified(  # type: ignore[no-untyped-def]
    res,
) -> None:
    model = answering(res, remote=True, labels={"invoice": 0.8, "urgent": 0.6})
    [origin] = store_emails(res, [INVOICE], mailbox="acme")
    assert job.process_email(model, origin).kind is Kind.HANDED_OFF
    copies = [
        store_emails(res, [delivered_again(INVOICE, box)], mailbox=box)[0]
        for box in ("north", "south")
    ]
    assert [job.process_email(model, c).kind for c in copies] == [Kind.DUPLICATE] * 2
    assert [labels_of(res, c) for c in copies] == [set(), set()]
    # A person's label on one copy, which the origin's answer names too: it stays the person's.
    with res.db.transaction() as session:
        session.add(EmailLabel(email_id=copies[0], label="urgent", source="person"))

    assert job.classify_email(model, origin).kind is Kind.SUCCEEDED

    assert model.classifier.calls == 1
    assert labels_of(res, copies[0]) == {("invoice", "origin", 0.8), ("urgent", "person", None)}
    assert labels_of(res, copies[1]) == {("invoice", "origin", 0.8), ("urgent", "origin", 0.6)}
    assert [status_of(res, c) for c in copies] == [RunStatus.DUPLICATE] * 2


def reprocessed(res: Resources, email_id: int) -> None:
    """The email's succeeded run reopened by an operator's reprocess from the CPU stage, and
    run."""
    with res.db.transaction() as session:
        reprocess = Reprocess(
            created_by=USER, from_step="documents", lane="bulk", search={}, filters=[], emails=1
        )
        session.add(reprocess)
        session.flush()
        cpu, _ = interventions.reopen_to_reprocess(
            session,
            [email_id],
            reprocess.id,
            keep_documents=False,
            leaving=interventions.reprocessing(session),
        )
    assert cpu == [email_id]
    assert job.process_email(res, email_id).kind is Kind.SUCCEEDED


@pytest.mark.parametrize("raw", [PLAIN, INVOICE], ids=["plain", "with-a-document"])
def test_a_reprocess_that_changes_the_origin_s_labels_changes_its_copies(res, raw) -> None:  # type: ignore[no-untyped-def]
    """With a local classifier, in the CPU stage: a plain email's origin is recorded in the
    transaction that classifies it, one with a document's in one before."""
    local = answering(res, remote=False, labels={"invoice": 0.8, "newsletter": 0.4})
    [origin] = store_emails(res, [raw], mailbox="acme")
    assert job.process_email(local, origin).kind is Kind.SUCCEEDED
    copies = [
        store_emails(res, [delivered_again(raw, box)], mailbox=box)[0] for box in ("north", "south")
    ]
    assert [job.process_email(local, c).kind for c in copies] == [Kind.DUPLICATE] * 2
    with res.db.transaction() as session:
        session.add(EmailLabel(email_id=copies[1], label="vip", source="person"))

    local.classifier.labels = {"invoice": 0.9, "security": 0.7}
    reprocessed(local, origin)

    assert labels_of(res, origin) == {("invoice", "model", 0.9), ("security", "model", 0.7)}
    shown = {("invoice", "origin", 0.9), ("security", "origin", 0.7)}
    assert labels_of(res, copies[0]) == shown
    assert labels_of(res, copies[1]) == shown | {("vip", "person", None)}
    assert local.classifier.calls == 2  # the origin's two answers; none for a copy
    assert [status_of(res, c) for c in copies] == [RunStatus.DUPLICATE] * 2


def test_a_copy_linked_while_its_origin_syncs_waits_and_takes_the_labels(res) -> None:  # type: ignore[no-untyped-def]
    """The origin's labels written and not committed, a copy's job finds the origin: it waits
    for the origin's lock, and then reads the labels the sync committed."""
    set_model_calls(res, True)
    [origin] = store_emails(res, [PLAIN])
    [copy] = store_emails(res, [delivered_again(PLAIN, "mx.other")], mailbox="other")
    parsed = parse_email(PLAIN, LIMITS)
    with res.db.transaction() as session:
        link_to_origin(session, origin, parsed, find_origin(session, origin, parsed))
    outcomes: list[Kind] = []
    copying = threading.Thread(
        target=lambda: outcomes.append(job.process_email(res, copy).kind), daemon=True
    )
    with res.db.transaction() as session:
        sync_model_labels(session, origin, [LabelScore("invoice", 0.8)])
        syncing = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
        copying.start()
        wait_for(lambda: _blocked_by(res, syncing), 10, "the copy's job to wait on the origin")
    copying.join(30)
    assert outcomes == [Kind.DUPLICATE]
    assert labels_of(res, copy) == {("invoice", "origin", 0.8)}


def test_an_origin_that_syncs_while_a_copy_is_linked_waits_and_takes_the_copy(res) -> None:  # type: ignore[no-untyped-def]
    """The other order: a copy linked and not committed, the origin's sync waits for it, then
    finds it among the copies."""
    set_model_calls(res, True)
    [origin] = store_emails(res, [PLAIN])
    [copy] = store_emails(res, [delivered_again(PLAIN, "mx.other")], mailbox="other")
    first, again = parse_email(PLAIN, LIMITS), parse_email(delivered_again(PLAIN, "mx"), LIMITS)
    with res.db.transaction() as session:
        link_to_origin(session, origin, first, find_origin(session, origin, first))
    syncing = threading.Thread(target=lambda: _sync(res, origin), daemon=True)
    with res.db.transaction() as session:
        found = find_origin(session, copy, again)
        assert found.duplicate_of == origin
        link_to_origin(session, copy, again, found)
        copy_labels(session, copy, origin)
        linking = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
        syncing.start()
        wait_for(lambda: _blocked_by(res, linking), 10, "the origin's sync to wait on the copy")
    syncing.join(30)
    assert not syncing.is_alive()
    assert labels_of(res, copy) == {("invoice", "origin", 0.8)}


def _sync(res: Resources, email_id: int) -> None:
    with res.db.transaction() as session:
        sync_model_labels(session, email_id, [LabelScore("invoice", 0.8)])


def _blocked_by(res: Resources, pid: int) -> bool:
    with res.db.session() as session:
        return bool(
            session.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"
                ),
                {"pid": pid},
            ).scalar()
        )


def test_forgetting_copies_and_their_origin_leaves_each_remaining_copy_its_labels(res) -> None:  # type: ignore[no-untyped-def]
    """A copy forgotten takes only its own rows. The origin forgotten passes to its next copy,
    which shows the same labels, now as its own answer's until it is classified; the copy
    after it goes on showing them, and follows the new first email's answer."""
    local = answering(res, remote=False, labels={"invoice": 0.8})
    [origin] = store_emails(res, [INVOICE], mailbox="acme")
    assert job.process_email(local, origin).kind is Kind.SUCCEEDED
    copies = [
        store_emails(res, [delivered_again(INVOICE, box)], mailbox=box)[0]
        for box in ("north", "south", "west")
    ]
    assert [job.process_email(local, c).kind for c in copies] == [Kind.DUPLICATE] * 3

    actions.forget(res, [copies[0]], enqueue=sender(res), user=USER)
    assert labels_of(res, copies[0]) == set()
    assert labels_of(res, origin) == {("invoice", "model", 0.8)}
    assert labels_of(res, copies[1]) == labels_of(res, copies[2]) == {("invoice", "origin", 0.8)}

    done = actions.forget(res, [origin], enqueue=sender(res), user=USER)
    heir, other = copies[1], copies[2]
    assert done.completed == [heir]
    assert labels_of(res, heir) == {("invoice", "model", 0.8)}
    assert labels_of(res, other) == {("invoice", "origin", 0.8)}

    local.classifier.labels = {"security": 0.6}
    assert job.process_email(local, heir).kind is Kind.SUCCEEDED
    assert labels_of(res, heir) == {("security", "model", 0.6)}
    assert labels_of(res, other) == {("security", "origin", 0.6)}
    assert status_of(res, other) is RunStatus.DUPLICATE
