"""Reprocess on real PostgreSQL and Redis: succeeded emails a filter finds run again from the
step asked for, in the bulk lane, their answer kept until the new one replaces it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import pytest
from sqlalchemy import select

from mailpipe.broker.queues import Lane, TaskName
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import sender
from mailpipe.operations import actions
from mailpipe.operations.actions import Step
from mailpipe.operations.search import EmailFilter
from mailpipe.operations.status import reprocesses
from mailpipe.pipeline import emails, interventions, job, runs
from mailpipe.pipeline.policy import Kind
from mailpipe.resources import Resources
from mailpipe.storage.models import EmailLabel, PipelineRun, RunStatus
from tests.support.emails import raw_email
from tests.support.switches import set_model_calls
from tests.unit.pipeline.test_job import INVOICE, PLAIN, remote_model

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

USER = "test:operator"
OTHER = raw_email("lunch", sender="someone@else.example", message_id="l1@else", body="Noon?")


class Sent:
    """An enqueue that records what it was asked to send."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], TaskName, Lane]] = []

    def __call__(
        self, ids: Sequence[int], task: TaskName, lane: Lane, boxes: object = None
    ) -> list[int]:
        self.calls.append((list(ids), task, lane))
        return list(ids)


def labels(res: Resources, email_id: int) -> set[str]:
    with res.db.session() as session:
        return set(session.scalars(select(EmailLabel.label).where(EmailLabel.email_id == email_id)))


def status_of(res: Resources, email_id: int) -> RunStatus:
    with res.db.session() as session:
        return session.scalars(
            select(PipelineRun.status).where(PipelineRun.email_id == email_id)
        ).one()


def test_a_plan_counts_the_emails_and_the_model_calls_and_changes_nothing(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    invoices = store_emails(res, [INVOICE, PLAIN])
    [other] = store_emails(res, [OTHER])
    assert {job.process_email(res, i).kind for i in [*invoices, other]} == {Kind.SUCCEEDED}
    sent = Sent()
    by_label = EmailFilter(label="invoice")
    planned = actions.plan_reprocess(res, by_label)
    assert (planned.emails, planned.model_calls, planned.reprocess_id) == (2, 0, None)  # rules
    remote = remote_model(res)
    paid = actions.plan_reprocess(remote, by_label)
    assert (paid.emails, paid.model_calls) == (2, 2)
    assert sent.calls == [] and reprocesses_of(res) == []
    assert {status_of(res, i) for i in [*invoices, other]} == {RunStatus.SUCCEEDED}


def reprocesses_of(res: Resources) -> list[dict[str, object]]:
    with res.db.session() as session:
        return reprocesses(session)


def test_reprocess_from_classify_runs_the_model_stage_again_in_the_bulk_lane(res) -> None:  # type: ignore[no-untyped-def]
    remote = remote_model(res)
    set_model_calls(res, True)
    invoices = store_emails(res, [INVOICE, PLAIN])
    [other] = store_emails(res, [OTHER])
    for email_id in [*invoices, other]:
        assert job.process_email(remote, email_id).kind is Kind.HANDED_OFF
        assert job.classify_email(remote, email_id).kind is Kind.SUCCEEDED
    sent = Sent()

    done = actions.reprocess(
        remote, EmailFilter(label="invoice"), Step.CLASSIFY, enqueue=sent, user=USER
    )

    assert (done.emails, done.model_calls, done.enqueued) == (2, 2, 2)
    # Their documents and the model's input are stored: the model stage alone, in bulk.
    assert sent.calls == [(sorted(invoices), TaskName.CLASSIFY_EMAIL, Lane.BULK)]
    assert [status_of(res, i) for i in invoices] == [RunStatus.OPEN] * 2
    assert status_of(res, other) is RunStatus.SUCCEEDED
    # The answer stays until the new one replaces it.
    assert all(labels(res, i) == {"invoice"} for i in invoices)
    [progress] = reprocesses_of(res)
    assert {k: progress[k] for k in ("id", "from", "lane", "emails", "done", "failed", "left")} == {
        "id": done.reprocess_id,
        "from": "classify",
        "lane": "bulk",
        "emails": 2,
        "done": 0,
        "failed": 0,
        "left": 2,
    }
    # The same filter again finds nothing to take: the runs are open already.
    again = actions.reprocess(
        remote, EmailFilter(label="invoice"), Step.CLASSIFY, enqueue=sent, user=USER
    )
    assert (again.emails, again.reprocess_id, len(sent.calls)) == (0, None, 1)

    calls = remote.classifier.calls
    assert [job.classify_email(remote, i).kind for i in invoices] == [Kind.SUCCEEDED] * 2
    assert remote.classifier.calls == calls + 2
    assert all(labels(res, i) == {"invoice"} for i in invoices)
    [progress] = reprocesses_of(res)
    assert (progress["done"], progress["left"]) == (2, 0)


def test_reprocess_from_parse_runs_the_cpu_stage_and_enqueues_each_job_once(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    invoices = store_emails(res, [INVOICE, PLAIN])
    [other] = store_emails(res, [OTHER])
    assert [job.process_email(res, i).kind for i in [*invoices, other]] == [Kind.SUCCEEDED] * 3

    done = actions.reprocess(
        res, EmailFilter(label="invoice"), Step.PARSE, enqueue=sender(res), user=USER, batch=1
    )

    assert (done.emails, done.enqueued) == (2, 2)
    with res.db.session() as session:
        converted = session.scalars(
            select(PipelineRun.converted_at).where(PipelineRun.email_id.in_(invoices))
        ).all()
    assert converted == [None, None]
    assert [job.process_email(res, i, lane=Lane.BULK).kind for i in invoices] == [
        Kind.SUCCEEDED
    ] * 2
    assert all(labels(res, i) == {"invoice"} for i in invoices)


def test_only_a_succeeded_run_is_reopened_whatever_ids_it_is_handed(res) -> None:  # type: ignore[no-untyped-def]
    """The batch is read before its transaction locks the runs: one that changed meanwhile (a
    retry reopened it, a sweep failed it) is passed over."""
    set_model_calls(res, True)
    succeeded, still_open = store_emails(res, [INVOICE, PLAIN])
    assert job.process_email(res, succeeded).kind is Kind.SUCCEEDED
    with res.db.transaction() as session:
        runs.ensure_runs(session, [still_open])
        reopened = interventions.reopen_to_reprocess(
            session,
            [succeeded, still_open],
            1,
            keep_documents=True,
            leaving=interventions.reprocessing(session),
        )
    assert reopened == ([succeeded], [])  # rules answered in the CPU stage: it runs again
    assert status_of(res, still_open) is RunStatus.OPEN


def test_a_run_another_reprocess_took_since_it_was_read_is_not_reopened(res) -> None:  # type: ignore[no-untyped-def]
    """Read before its batch locks them, a run may have been taken, and done, by a reprocess
    counted after this one: locked, it is passed over."""
    set_model_calls(res, True)
    ids = store_emails(res, [INVOICE, PLAIN])
    assert [job.process_email(res, i).kind for i in ids] == [Kind.SUCCEEDED] * 2
    with res.db.session() as session:
        leaving = interventions.reprocessing(session)
    later = actions.reprocess(
        res, EmailFilter(email_id=ids[0]), Step.PARSE, enqueue=Sent(), user=USER
    )
    assert job.process_email(res, ids[0], lane=Lane.BULK).kind is Kind.SUCCEEDED
    with res.db.transaction() as session:
        reopened = interventions.reopen_to_reprocess(
            session, ids, 99, keep_documents=False, leaving=leaving
        )
    assert reopened == ([ids[1]], [])
    with res.db.session() as session:
        taken = dict(session.execute(select(PipelineRun.email_id, PipelineRun.reprocess_id)).all())
    assert taken == {ids[0]: later.reprocess_id, ids[1]: 99}


def test_a_reprocess_takes_the_emails_the_search_finds(res) -> None:  # type: ignore[no-untyped-def]
    """On PostgreSQL the search matches whole words, through the full-text indexes: `invoice`
    finds no "invoices". A reprocess by the same filter takes what the search showed, no more."""
    from mailpipe.operations.search import find

    set_model_calls(res, True)
    raws = [
        raw_email("invoice 7", sender="a@acme.example", message_id="w1@acme", body="Due"),
        raw_email("invoices for May", sender="a@acme.example", message_id="w2@acme", body="Due"),
    ]
    ids = store_emails(res, raws)
    assert {job.process_email(res, i).kind for i in ids} == {Kind.SUCCEEDED}
    by_word = EmailFilter(subject=("invoice",))
    with res.db.session() as session:
        shown = [row["email_id"] for row in find(session, by_word).rows]
    assert shown == [ids[0]]
    sent = Sent()
    planned = actions.plan_reprocess(res, by_word)
    assert planned.emails == 1
    done = actions.reprocess(res, by_word, Step.PARSE, enqueue=sent, user=USER)
    assert sent.calls == [([ids[0]], TaskName.PROCESS_EMAIL, Lane.BULK)]
    assert (done.emails, status_of(res, ids[1])) == (1, RunStatus.SUCCEEDED)


def succeeded_again(res: Resources, email_ids: list[int]) -> None:
    """What the workers do with a reprocess's jobs: each run closes again."""
    for email_id in email_ids:
        assert job.process_email(res, email_id, lane=Lane.BULK).kind is Kind.SUCCEEDED


def test_the_same_reprocess_again_takes_nothing_while_the_first_is_under_way(res) -> None:  # type: ignore[no-untyped-def]
    """Sent again once most of the first's emails are done, it takes none of them; so does a
    plan counted before the first, confirmed after the first has ended. Once the first has
    ended, the same request counted anew takes them again, and the first's progress says so."""
    set_model_calls(res, True)
    invoices = store_emails(res, [INVOICE, PLAIN, INVOICE.replace(b"j12@", b"j14@")])
    [other] = store_emails(res, [OTHER])
    succeeded_again(res, [*invoices, other])
    by_label = EmailFilter(label="invoice")
    before = actions.plan_reprocess(res, by_label)
    first = actions.reprocess(res, by_label, Step.PARSE, enqueue=Sent(), user=USER)
    assert (first.emails, first.taken) == (3, 3)
    succeeded_again(res, invoices[:2])

    sent = Sent()
    again = actions.reprocess(res, by_label, Step.PARSE, enqueue=sent, user=USER)
    assert (again.emails, again.reprocess_id, sent.calls) == (0, None, [])
    succeeded_again(res, invoices[2:])
    late = actions.reprocess(res, by_label, Step.PARSE, enqueue=sent, user=USER, as_of=before.as_of)
    assert (late.emails, late.reprocess_id, sent.calls) == (0, None, [])
    with pytest.raises(actions.Changed) as changed:
        actions.reprocess(
            res, by_label, Step.PARSE, enqueue=sent, user=USER, expect=3, as_of=before.as_of
        )
    assert changed.value.plan.emails == 0
    [progress] = reprocesses_of(res)
    assert {k: progress[k] for k in ("emails", "taken", "done", "left", "retaken")} == {
        "emails": 3,
        "taken": 3,
        "done": 3,
        "left": 0,
        "retaken": 0,
    }

    anew = actions.reprocess(res, by_label, Step.CLASSIFY, enqueue=sent, user=USER)
    assert anew.taken == 3
    latest, earlier = reprocesses_of(res)
    assert (latest["id"], latest["taken"], latest["left"]) == (anew.reprocess_id, 3, 3)
    assert (earlier["done"], earlier["retaken"]) == (0, 3)


@pytest.mark.parametrize(
    "everything",
    [
        EmailFilter(),
        EmailFilter(state="succeeded"),
        EmailFilter(review=False),
        EmailFilter(since=datetime(1970, 1, 1)),
        EmailFilter(since=datetime(1970, 1, 1), state="succeeded", review=False),
    ],
)
def test_a_filter_that_leaves_out_no_succeeded_email_is_not_a_filter(res, everything) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    ids = store_emails(res, [INVOICE, PLAIN])
    with res.db.transaction() as session:
        runs.ensure_runs(session, [store_emails(res, [OTHER])[0]])  # open: not one to take
    succeeded_again(res, ids)
    sent = Sent()
    with pytest.raises(actions.NotAFilter) as refused:
        actions.plan_reprocess(res, everything)
    assert refused.value.plan.emails == 2
    with pytest.raises(actions.NotAFilter):
        actions.reprocess(res, everything, Step.PARSE, enqueue=sent, user=USER, expect=2)
    assert sent.calls == [] and reprocesses_of(res) == []
    [marked] = store_emails(res, [OTHER.replace(b"l1@", b"l2@")])
    succeeded_again(res, [marked])
    with res.db.transaction() as session:
        emails.mark_for_review(session, [marked], "looked odd")
    # One succeeded email left out: the filter narrows, and the plan says by how much.
    narrowed = EmailFilter(since=datetime(1970, 1, 1), review=False)
    plan = actions.plan_reprocess(res, narrowed)
    assert plan.emails == 2


def test_a_reprocess_takes_the_count_confirmed_and_no_more_than_the_most_unless_told(res) -> None:  # type: ignore[no-untyped-def]
    set_model_calls(res, True)
    invoices = store_emails(res, [INVOICE, PLAIN])
    [other] = store_emails(res, [OTHER])
    succeeded_again(res, [*invoices, other])
    by_label = EmailFilter(label="invoice")
    sent = Sent()
    with pytest.raises(actions.Changed) as changed:
        actions.reprocess(res, by_label, Step.PARSE, enqueue=sent, user=USER, expect=3)
    assert (changed.value.plan.emails, changed.value.plan.most) == (2, 10_000)
    small = Resources(res.settings.model_copy(update={"reprocess_max": 1}))
    with pytest.raises(actions.OverMax):
        actions.reprocess(small, by_label, Step.PARSE, enqueue=sent, user=USER, expect=2)
    assert sent.calls == [] and {status_of(res, i) for i in invoices} == {RunStatus.SUCCEEDED}
    late: list[int] = []

    def storing_another(ids: Sequence[int], task: TaskName, lane: Lane, boxes: object) -> list[int]:
        """An invoice that succeeds while the reprocess works: its plan did not count it."""
        if not late:
            late.extend(store_emails(res, [INVOICE.replace(b"j12@", b"late@")]))
            succeeded_again(res, late)
        return sent(ids, task, lane, boxes)

    done = actions.reprocess(
        small,
        by_label,
        Step.PARSE,
        enqueue=storing_another,
        user=USER,
        expect=2,
        over_max=True,
        batch=1,
    )
    assert (done.taken, done.enqueued) == (2, 2)
    assert status_of(res, late[0]) is RunStatus.SUCCEEDED
    [progress] = reprocesses_of(res)
    assert (progress["emails"], progress["taken"], progress["left"]) == (2, 2, 2)
