"""The console's write side on real PostgreSQL and Redis: retry and dismiss in batches, through
the run-state module and the deduplicated enqueue, and what a sweep makes of a dismissed run."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import select

from mailpipe.app.tasks import run_sweep
from mailpipe.broker import layout
from mailpipe.broker.queues import Lane, Stage, TaskName
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import redis_keys
from mailpipe.enqueue import sender
from mailpipe.operations import actions
from mailpipe.operations.status import FailedFilter, failed_page
from mailpipe.pipeline import job
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.models import EmailMessage, PipelineRun, RunStatus
from tests.support.failed_runs import add_emails, add_failed, add_run

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

USER = "test:operator"


def run_rows(res: Resources) -> dict[int, tuple[str, bool]]:
    """Each run's status and whether it is dismissed."""
    with res.db.session() as session:
        rows = session.execute(
            select(PipelineRun.email_id, PipelineRun.status, PipelineRun.dismissed_at)
        )
        return {e: (s.value, d is not None) for e, s, d in rows}


def queued(res: Resources) -> list[int]:
    """The email of every job waiting in the email queue, one entry a job."""
    return sorted(layout.emails_in_broker(res.redis, [res.settings.queue]))


class Counting:
    """The real enqueue, recording each call's ids: one call a batch."""

    def __init__(self, res: Resources) -> None:
        self.calls: list[list[int]] = []
        self._send = sender(res)

    def __call__(self, email_ids, task: TaskName, lane: Lane, boxes):  # type: ignore[no-untyped-def]
        self.calls.append(list(email_ids))
        return self._send(email_ids, task, lane, boxes)


def test_retry_all_reopens_in_batches_and_enqueues_each_once(res) -> None:  # type: ignore[no-untyped-def]
    ids = [add_failed(res, minutes) for minutes in range(5)]
    dismissed = add_failed(res, 9, dismissed=True)
    enqueue = Counting(res)
    done = actions.retry(res, enqueue=enqueue, user=USER, batch=2)
    assert (sorted(done.done), done.enqueued, done.refused) == (ids, 5, {})
    assert enqueue.calls == [ids[0:2], ids[2:4], ids[4:5]]
    assert queued(res) == ids
    rows = run_rows(res)
    assert all(rows[i] == ("open", False) for i in ids)
    assert rows[dismissed] == ("failed", True)
    # Again: nothing is listed any more, nothing is sent twice.
    assert actions.retry(res, enqueue=enqueue, user=USER, batch=2).done == []
    assert len(enqueue.calls) == 3


def test_retry_all_takes_only_what_the_filter_lists(res) -> None:  # type: ignore[no-untyped-def]
    blob = add_failed(res, 1, "BlobMissing")
    model = add_failed(res, 2, "BlobMissing", model_stage=True)
    other = add_failed(res, 3, "Stalled")
    filt = FailedFilter(error_class="BlobMissing", stage=Stage.CPU)
    done = actions.retry(res, filt=filt, enqueue=sender(res), user=USER)
    assert (done.done, done.enqueued) == ([blob], 1)
    assert run_rows(res) == {
        blob: ("open", False),
        model: ("failed", False),
        other: ("failed", False),
    }


def test_retry_by_id_names_each_id_it_does_not_retry(res) -> None:  # type: ignore[no-untyped-def]
    failed = add_failed(res, 1, review=True)
    dismissed = add_failed(res, 2, dismissed=True)
    [done_id, no_run] = add_emails(res, 2)
    add_run(res, done_id, RunStatus.SUCCEEDED)
    done = actions.retry(
        res, [failed, done_id, no_run, dismissed, 424242], enqueue=sender(res), user=USER
    )
    assert sorted(done.done) == sorted([failed, dismissed])  # a dismissal is undone by its id
    assert done.refused == {
        done_id: "its run is succeeded",
        no_run: "it has no run",
        424242: "it has no run",
    }
    assert run_rows(res)[dismissed] == ("open", False)
    with res.db.session() as session:
        assert session.get_one(EmailMessage, failed).needs_review is False
    with pytest.raises(ValueError):
        actions.retry(res, [failed], FailedFilter(), enqueue=sender(res), user=USER)


def test_dismiss_keeps_the_run_failed_and_takes_it_off_both_lists(res) -> None:  # type: ignore[no-untyped-def]
    marked = add_failed(res, 1, review=True)
    kept = add_failed(res, 2)
    done = actions.dismiss(res, [marked, marked], user=USER)
    assert (done.done, done.refused) == ([marked], {})
    assert run_rows(res) == {marked: ("failed", True), kept: ("failed", False)}
    with res.db.session() as session:
        assert [r["email_id"] for r in failed_page(session, FailedFilter()).rows] == [kept]
        assert session.get_one(EmailMessage, marked).needs_review is False
    again = actions.dismiss(res, [marked], user=USER)
    assert (again.done, again.refused) == ([], {marked: "its run is dismissed already"})


def test_a_dismiss_is_listed_apart_and_can_be_taken_back(res) -> None:  # type: ignore[no-untyped-def]
    dismissed, kept = add_failed(res, 1), add_failed(res, 2)
    actions.dismiss(res, [dismissed], user=USER)
    with res.db.session() as session:
        view = failed_page(session, FailedFilter(dismissed=True)).rows
    assert [row["email_id"] for row in view] == [dismissed] and view[0]["dismissed_at"]
    done = actions.undo_dismiss(res, [dismissed, kept], user=USER)
    assert (done.done, done.refused) == ([dismissed], {kept: "its run is failed"})
    assert run_rows(res) == {dismissed: ("failed", False), kept: ("failed", False)}
    with res.db.session() as session:
        assert failed_page(session, FailedFilter(dismissed=True)).rows == []
        listed = [row["email_id"] for row in failed_page(session, FailedFilter()).rows]
    assert listed == [kept, dismissed]


def test_dismiss_all_with_a_filter_in_batches(res) -> None:  # type: ignore[no-untyped-def]
    stalled = [add_failed(res, minutes, "Stalled") for minutes in range(3)]
    other = add_failed(res, 5, "InputRejected")
    done = actions.dismiss(res, filt=FailedFilter(error_class="Stalled"), user=USER, batch=2)
    assert sorted(done.done) == stalled
    assert run_rows(res)[other] == ("failed", False)


def test_a_dismissed_run_is_readded_by_neither_retry_all_nor_a_sweep(res) -> None:  # type: ignore[no-untyped-def]
    [bad] = store_emails(res, [b"\x00 not an email"])
    assert job.process_email(res, bad).kind.value == "failed"
    runs_before = run_rows(res)
    assert actions.dismiss(res, [bad], user=USER).done == [bad]
    assert actions.retry(res, enqueue=sender(res), user=USER).done == []
    result = run_sweep(res)
    assert result.ran and result.readded_ids == []
    assert queued(res) == []
    assert not res.redis.exists(redis_keys.job_marker(bad))
    assert runs_before == {bad: ("failed", False)}
    assert run_rows(res) == {bad: ("failed", True)}


def test_clear_review_takes_the_mark_off_and_leaves_the_run(res) -> None:  # type: ignore[no-untyped-def]
    marked = add_failed(res, 1, review=True)
    [plain] = add_emails(res, 1)
    done = actions.clear_review(res, [marked, plain, 424242], user=USER)
    assert done.done == [marked]
    assert done.refused == {plain: "not on the review list", 424242: "no such email"}
    assert run_rows(res)[marked] == ("failed", False)
    with res.db.session() as session:
        assert session.get_one(EmailMessage, marked).needs_review is False


def test_each_batch_acted_on_is_logged_with_the_user_and_ids_only(  # type: ignore[no-untyped-def]
    res, caplog: pytest.LogCaptureFixture
) -> None:
    ids = [add_failed(res, minutes) for minutes in range(3)]
    with caplog.at_level(logging.INFO, logger="mailpipe.operations.actions"):
        actions.dismiss(res, ids, user=USER, batch=2)
    assert (
        [(r.action, r.user, r.email_ids) for r in caplog.records]
        == [  # type: ignore[attr-defined]
            ("dismiss", USER, ids[:2]),
            ("dismiss", USER, ids[2:]),
        ]
    )


def test_a_retry_with_redis_down_changes_nothing(res) -> None:  # type: ignore[no-untyped-def]
    from redis.exceptions import ConnectionError as RedisConnectionError

    from mailpipe.cli.demo.servers import free_port

    failed = add_failed(res, 1)
    down = Resources(
        res.settings.model_copy(update={"broker_url": f"redis://127.0.0.1:{free_port()}/0"})
    ).with_standins(db=res.db)
    with pytest.raises(RedisConnectionError):
        actions.retry(down, [failed], enqueue=sender(down), user=USER)
    assert run_rows(res) == {failed: ("failed", False)}


def test_the_fleet_s_switches_are_actions_with_their_audit_line(  # type: ignore[no-untyped-def]
    res, caplog: pytest.LogCaptureFixture
) -> None:
    sweeps: list[str] = []
    with caplog.at_level(logging.INFO, logger="mailpipe.operations.actions"):
        actions.switch_model_calls(res, False, send_sweep=lambda: sweeps.append("off"), user=USER)
        actions.switch_model_calls(res, True, send_sweep=lambda: sweeps.append("on"), user=USER)
        held = actions.pause(res, Stage.MODEL, "provider maintenance", user=USER)
        assert actions.resume(res, Stage.MODEL, user=USER)
        assert not actions.resume(res, Stage.MODEL, user=USER)  # not paused: nothing to audit
    assert sweeps == ["on"]  # switched on, the waiting runs are swept at once
    with res.db.session() as session:
        assert flags.model_calls_enabled(session)
    assert (held.by, held.error) == ("operator", "provider maintenance")
    assert [(r.action, r.user) for r in caplog.records] == [  # type: ignore[attr-defined]
        ("model_calls_off", USER),
        ("model_calls_on", USER),
        ("pause_model", USER),
        ("resume_model", USER),
    ]


def test_an_action_on_all_the_filter_lists_takes_the_count_confirmed_and_no_more(res) -> None:  # type: ignore[no-untyped-def]
    """Retry all and dismiss all act only while the filter lists the count the operator
    confirmed, and on that many at most: a run failed while they work waits for the next."""
    rejected = [add_failed(res, minutes, "InputRejected") for minutes in (1, 2)]
    stalled = add_failed(res, 3, "Stalled")
    assert actions.count_failed(res, FailedFilter()) == actions.Counted(3, 2)
    assert actions.count_failed(res, FailedFilter(error_class="Stalled")) == actions.Counted(1, 0)
    with pytest.raises(actions.Changed) as changed:
        actions.retry(res, enqueue=sender(res), user=USER, expect=2)
    assert changed.value.plan == actions.Counted(3, 2)
    with pytest.raises(actions.Changed):
        actions.dismiss(res, user=USER, expect=4)
    assert {status for status, _ in run_rows(res).values()} == {"failed"}

    late: list[int] = []

    def failing_another(email_ids, task: TaskName, lane: Lane, boxes):  # type: ignore[no-untyped-def]
        if not late:
            late.append(add_failed(res, 9, "Stalled"))
        return sender(res)(email_ids, task, lane, boxes)

    done = actions.retry(res, enqueue=failing_another, user=USER, expect=3, batch=1)
    assert sorted(done.done) == sorted([*rejected, stalled])
    assert run_rows(res)[late[0]] == ("failed", False)


def test_the_review_list_s_all_is_the_marked_emails_and_their_rejected_runs(res) -> None:  # type: ignore[no-untyped-def]
    rejected = add_failed(res, 1, "InputRejected", review=True)
    marked = add_failed(res, 2, "Stalled", review=True)
    add_failed(res, 3, "InputRejected")
    assert actions.marked(res) == [rejected, marked]
    assert actions.count_of(res, actions.marked(res)) == actions.Counted(2, 1)
    with pytest.raises(actions.Changed):
        actions.clear_review(res, actions.marked(res), user=USER, expect=3)
    assert actions.clear_review(res, actions.marked(res), user=USER, expect=2).done == [
        rejected,
        marked,
    ]
    assert actions.marked(res) == []
