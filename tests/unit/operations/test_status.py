"""The console's read side on real PostgreSQL and Redis: the failed and review lists, an email's
detail, the job state and the fleet's status."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from sqlalchemy import update

from mailpipe.broker.queues import Lane, Stage, stage_queue
from mailpipe.coordination import pauses, redis_keys
from mailpipe.coordination.heartbeat import redis_time
from mailpipe.enqueue import enqueue_emails, send_job
from mailpipe.operations.status import (
    EXACT_UP_TO,
    FailedFilter,
    email_detail,
    error_classes,
    failed_page,
    fleet_status,
    history,
    job_state,
    review_page,
)
from mailpipe.operations.waiting import top_mailboxes
from mailpipe.pipeline import emails, interventions
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.models import EmailLabel, PipelineRun, RunStatus, utcnow
from tests.support.failed_runs import T0, add_attempts, add_emails, add_failed, add_run, attempt

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def listed(res: Resources, filt: FailedFilter | None = None, **paging: int) -> list[int]:
    with res.db.session() as session:
        return [row["email_id"] for row in failed_page(session, filt, **paging).rows]


def test_the_failed_list_is_the_latest_first_without_dismissed_runs(res) -> None:  # type: ignore[no-untyped-def]
    old = add_failed(res, 1, review=True)
    new = add_failed(res, 3, "InputRejected", model_stage=True)
    add_failed(res, 2, dismissed=True)
    add_run(res, add_emails(res, 1)[0], RunStatus.SUCCEEDED)
    with res.db.transaction() as session:
        emails.move(session, [old], Lane.BULK)
    with res.db.session() as session:
        page = failed_page(session, FailedFilter())
    assert (page.page, page.pages, page.total) == (1, 1, 2)
    assert page.rows == [
        {
            "email_id": new,
            "attempts": 4,
            "failed_at": (T0 + timedelta(minutes=3)).isoformat() + "Z",
            "stage": "model",
            "error_class": "InputRejected",
            "error": "InputRejected: failed",
            "needs_review": False,
            "lane": "live",
            "mailbox": "default",
            "dismissed_at": None,
        },
        {
            "email_id": old,
            "attempts": 4,
            "failed_at": (T0 + timedelta(minutes=1)).isoformat() + "Z",
            "stage": "cpu",
            "error_class": "BlobMissing",
            "error": "BlobMissing: failed",
            "needs_review": True,
            "lane": "bulk",
            "mailbox": "default",
            "dismissed_at": None,
        },
    ]


def test_each_filter_of_the_failed_list(res) -> None:  # type: ignore[no-untyped-def]
    a = add_failed(res, 1, "BlobMissing")
    b = add_failed(res, 2, "Stalled", model_stage=True)
    c = add_failed(res, 3, "BlobMissing", model_stage=True)
    d = add_failed(res, 4, "Stalled")
    add_failed(res, 5, "Stalled", dismissed=True)
    at = T0 + timedelta(minutes=2)
    assert listed(res, FailedFilter(error_class="BlobMissing")) == [c, a]
    assert listed(res, FailedFilter(error_class="Nothing")) == []
    assert listed(res, FailedFilter(stage=Stage.CPU)) == [d, a]
    assert listed(res, FailedFilter(stage=Stage.MODEL)) == [c, b]
    assert listed(res, FailedFilter(since=at)) == [d, c, b]  # since: inclusive
    assert listed(res, FailedFilter(until=at)) == [a]  # until: exclusive
    both = FailedFilter(error_class="Stalled", stage=Stage.CPU, since=at)
    assert listed(res, both) == [d]
    with res.db.session() as session:
        assert error_classes(session) == [("BlobMissing", 2), ("Stalled", 2)]


def test_pages_of_the_failed_list_cover_it_once_with_the_total(res) -> None:  # type: ignore[no-untyped-def]
    ids = [add_failed(res, minutes) for minutes in range(7)]
    # Two runs failed in one statement share their time: the id keeps their order fixed.
    with res.db.transaction() as session:
        session.execute(
            update(PipelineRun)
            .where(PipelineRun.email_id.in_(ids[:2]))
            .values(closed_at=T0 + timedelta(minutes=9))
        )
    pages = []
    with res.db.session() as session:
        for number in (1, 2, 3, 4):
            page = failed_page(session, None, number, 3)
            assert (page.page, page.pages, page.total) == (number, 3, 7)
            pages.append([row["email_id"] for row in page.rows])
        assert failed_page(session, FailedFilter(error_class="None")).pages == 1
        with pytest.raises(ValueError):
            failed_page(session, None, 0)
    assert pages == [[ids[1], ids[0], ids[6]], [ids[5], ids[4], ids[3]], [ids[2]], []]


def test_the_review_list_pages_with_the_run_s_status(res) -> None:  # type: ignore[no-untyped-def]
    marked = [add_failed(res, minutes, review=True) for minutes in range(3)]
    [no_run, unmarked] = add_emails(res, 2)
    with res.db.transaction() as session:
        emails.mark_for_review(session, [no_run], "looked odd")
    with res.db.session() as session:
        first = review_page(session, 1, 3)
        second = review_page(session, 2, 3)
    assert (first.total, first.pages, second.page) == (4, 2, 2)
    assert [row["email_id"] for row in first.rows + second.rows] == [*marked, no_run]
    assert second.rows == [
        {
            "email_id": no_run,
            "subject": None,
            "reason": "looked odd",
            "mailbox": "default",
            "status": None,
        }
    ]
    assert first.rows[0]["status"] == "failed"
    assert unmarked not in [row["email_id"] for row in first.rows + second.rows]


def test_an_email_s_detail_carries_its_history_in_order_and_its_dismissal(res) -> None:  # type: ignore[no-untyped-def]
    email_id = add_failed(res, 1, "AttemptsUsedUp", dismissed=True)
    failure = {"error_class": "OperationalError", "error": "e", "host": "w1"}
    tries = ((1, "retrying"), (2, "lost"), (3, "failed"))
    add_attempts(
        res,
        email_id,
        [
            {**attempt("cpu", outcome, T0 + timedelta(seconds=n), ran=n, number=n), **failure}
            for n, outcome in tries
        ],
    )
    with res.db.session() as session:
        detail = email_detail(session, email_id)
        assert email_detail(session, email_id + 1000) is None
    assert detail is not None
    assert [(h["attempt"], h["outcome"]) for h in detail["history"]] == [
        (1, "retrying"),
        (2, "lost"),
        (3, "failed"),
    ]
    assert detail["history"][0] == {
        "id": detail["history"][0]["id"],
        "stage": "cpu",
        "attempt": 1,
        "started_at": T0.isoformat() + "Z",
        "ended_at": (T0 + timedelta(seconds=1)).isoformat() + "Z",
        "outcome": "retrying",
        "deferrals": None,
        "run_again": False,
        "error_class": "OperationalError",
        "error": "e",
        "host": "w1",
    }
    assert detail["older_history"] is None
    assert detail["dismissed_at"] == (T0 + timedelta(minutes=1)).isoformat() + "Z"
    assert detail["run"]["error_class"] == "AttemptsUsedUp"
    assert (detail["origin"], detail["duplicate_of"]) == (None, None)


def test_the_history_marks_where_the_run_was_opened_again(res) -> None:  # type: ignore[no-untyped-def]
    # The first run, a reprocess, and a retry after it failed: the run counts each from 1.
    email_id = add_failed(res, 1, "AttemptsUsedUp")
    passes = [(1, "succeeded"), (1, "succeeded"), (1, "retrying"), (2, "failed"), (1, "succeeded")]
    add_attempts(
        res,
        email_id,
        [
            attempt("cpu", outcome, T0 + timedelta(seconds=n), number=number)
            for n, (number, outcome) in enumerate(passes)
        ],
    )
    marks = [False, True, True, False, True]
    with res.db.session() as session:
        whole = history(session, email_id)["history"]
        assert [row["run_again"] for row in whole] == marks
        # A page's first row is told by the row before the page.
        last = history(session, email_id, limit=2)
        older = history(session, email_id, before=last["older_history"], limit=2)
    assert [row["run_again"] for row in older["history"] + last["history"]] == marks[1:]


def state(res: Resources, email_id: int) -> tuple[str, str | None]:
    with res.db.session() as session:
        found = job_state(res, session, email_id)
    assert found is not None
    return found["state"], found["waiting_for"]


def test_job_state_for_every_state(res) -> None:  # type: ignore[no-untyped-def]
    never, marked, fresh, running, retrying, lost = add_emails(res, 6)
    assert state(res, never) == ("not_enqueued", None)
    assert enqueue_emails([marked, fresh, retrying], res).sent == [marked, fresh, retrying]
    assert state(res, marked) == ("queued", None)  # no run yet, a job waiting
    add_run(res, fresh, RunStatus.OPEN)
    assert state(res, fresh) == ("queued", None)
    add_run(res, running, RunStatus.OPEN, attempts=1, attempt_started_at=utcnow())
    res.redis.set(redis_keys.lease(running), "host:1:holder", px=60_000)
    assert state(res, running) == ("running", None)
    add_run(res, retrying, RunStatus.OPEN, attempts=1, error="OperationalError: e")
    assert state(res, retrying) == ("retrying", None)
    add_run(res, lost, RunStatus.OPEN)  # open, no marker, no lease: in no queue
    assert state(res, lost) == ("lost", None)
    for status in (RunStatus.SUCCEEDED, RunStatus.DUPLICATE, RunStatus.FAILED):
        [closed] = add_emails(res, 1)
        add_run(res, closed, status, closed_at=utcnow())
        assert state(res, closed) == (status.value, None)
    dismissed = add_failed(res, 1, dismissed=True)
    assert state(res, dismissed) == ("dismissed", None)
    with res.db.session() as session:
        assert job_state(res, session, 424242) is None


def test_a_waiting_job_says_what_it_waits_for(res) -> None:  # type: ignore[no-untyped-def]
    paused, deferred, limited, switched_off = add_emails(res, 4)
    enqueue_emails([paused, deferred, limited, switched_off], res)
    for email_id in (paused, deferred, limited):
        add_run(res, email_id, RunStatus.OPEN)
    add_run(res, switched_off, RunStatus.OPEN, converted_at=utcnow())
    with res.db.transaction() as session:
        flags.set_model_calls(session, False)
    assert state(res, switched_off) == ("waiting", "model_calls")

    later = time.time() + 60
    queue = stage_queue(Stage.CPU, res.settings, Lane.LIVE)
    res.redis.zadd(redis_keys.deferred(queue), {str(deferred): later, str(limited): later})
    add_attempts(
        res, limited, [{**attempt("cpu", "deferred", utcnow()), "error_class": "RateLimited"}]
    )
    assert state(res, deferred) == ("waiting", "deferral")
    assert state(res, limited) == ("waiting", "rate_limit")
    assert state(res, paused) == ("queued", None)

    pauses.pause(res.redis, Stage.CPU, "maintenance")
    assert state(res, paused) == ("waiting", "paused_stage")
    assert state(res, switched_off) == ("waiting", "model_calls")  # its stage is not paused


def test_job_state_carries_the_run_s_figures_and_labels(res) -> None:  # type: ignore[no-untyped-def]
    email_id = add_failed(res, 1, "InputRejected", review=True)
    with res.db.transaction() as session:
        session.add(EmailLabel(email_id=email_id, label="invoice", source="rules"))
    with res.db.session() as session:
        found = job_state(res, session, email_id)
    assert found is not None
    assert {k: found[k] for k in ("attempts", "error_class", "error", "needs_review")} == {
        "attempts": 4,
        "error_class": "InputRejected",
        "error": "InputRejected: failed",
        "needs_review": True,
    }
    assert (found["labels"], found["history"]) == (["invoice"], [])
    assert found["updated_at"].endswith("Z")


def test_fleet_status_shows_each_queue_and_the_live_workers(res) -> None:  # type: ignore[no-untyped-def]
    ids = add_emails(res, 2)
    enqueue_emails(ids, res)
    now = redis_time(res.redis)
    settings = res.settings
    res.redis.zadd(redis_keys.workers(), {"celery@a:1:x": now - 1, "celery@gone:2:y": now - 600})
    res.redis.zadd(redis_keys.workers_on(f"{settings.queue}.model"), {"celery@a:1:x": now - 1})
    status = fleet_status(res)
    assert status["queue"]["depth"] == 2
    email = status["queues"]["email"]
    assert (email["name"], email["depth"], email["deferred"]) == (settings.queue, 2, 0)
    assert email["oldest_age_s"] >= 0
    assert status["queues"]["model"] == {
        "name": f"{settings.queue}.model",
        "depth": 0,
        "oldest_age_s": None,
        "deferred": 0,
        "workers": 1,
    }
    assert status["queues"]["control"]["name"] == f"{settings.queue}.control"
    assert list(status["queues"]) == ["email", "email.bulk", "model", "model.bulk", "control"]
    [worker] = status["workers"]
    assert (worker["id"], worker["hostname"], worker["queues"]) == (
        "celery@a:1:x",
        "celery@a",
        [f"{settings.queue}.model"],
    )
    assert 1.0 <= worker["last_seen_s"] < 30  # seen a second before now, by Redis's clock


def test_fleet_status_shows_each_stage_s_bulk_lane(res) -> None:  # type: ignore[no-untyped-def]
    settings = res.settings
    ids = add_emails(res, 3)
    for email_id in ids:
        send_job(email_id, lane=Lane.BULK)
    now = redis_time(res.redis)
    res.redis.zadd(redis_keys.workers_on(f"{settings.queue}.bulk"), {"celery@a:1:x": now - 1})
    queues = fleet_status(res)["queues"]
    bulk = queues["email.bulk"]
    assert (bulk["name"], bulk["depth"], bulk["deferred"], bulk["workers"]) == (
        f"{settings.queue}.bulk",
        3,
        0,
        1,
    )
    assert bulk["oldest_age_s"] >= 0
    assert (queues["email"]["depth"], queues["model.bulk"]["depth"]) == (0, 0)
    assert queues["model.bulk"]["name"] == f"{settings.queue}.model.bulk"


def test_fleet_status_counts_every_figure_and_the_overview_estimates_the_totals(res) -> None:  # type: ignore[no-untyped-def]
    add_emails(res, 1)  # no run yet
    add_failed(res, 1, review=True)
    for status in (RunStatus.OPEN, RunStatus.DUPLICATE, RunStatus.SUCCEEDED):
        add_run(res, add_emails(res, 1)[0], status)
    counts = ("emails", "no_run", "runs", "needs_review", "estimated")
    small = fleet_status(res)
    assert {key: small[key] for key in counts} == {
        "emails": 5,
        "no_run": 1,
        "runs": {"open": 1, "succeeded": 1, "duplicate": 1, "failed": 1},
        "needs_review": 1,
        "estimated": [],
    }
    with res.db.transaction() as session:
        session.connection().exec_driver_sql(
            "WITH e AS (INSERT INTO email_message (blob_key, size, sha256, created_at, has_run) "
            "SELECT 'blobs/none', 1, '', now(), true FROM generate_series(1, %(n)s) RETURNING id) "
            "INSERT INTO pipeline_run (email_id, status, attempts, sweep_count, created_at, "
            "updated_at) SELECT id, 'succeeded', 1, 0, now(), now() FROM e",
            {"n": EXACT_UP_TO},
        )
        session.connection().exec_driver_sql("ANALYZE email_message, pipeline_run")
    # What a script reads is counted, however large: it can wait on a figure to reach a total.
    exact = fleet_status(res)
    assert exact["estimated"] == []
    assert (exact["emails"], exact["runs"]["succeeded"]) == (EXACT_UP_TO + 5, EXACT_UP_TO + 1)
    large = fleet_status(res, estimates=True)
    # The console's overview: past the bound, the planner's estimates of the totals; what
    # operators act on still counted.
    assert large["estimated"] == ["emails", "runs.succeeded"]
    assert abs(large["emails"] - (EXACT_UP_TO + 5)) <= EXACT_UP_TO // 10
    assert abs(large["runs"]["succeeded"] - (EXACT_UP_TO + 1)) <= EXACT_UP_TO // 10
    assert (large["no_run"], large["needs_review"]) == (1, 1)
    assert {name: n for name, n in large["runs"].items() if name != "succeeded"} == {
        "open": 1,
        "duplicate": 1,
        "failed": 1,
    }


def waiting_emails(res: Resources, n: int, mailbox: str | None, stored_ago: float) -> list[int]:
    """`n` emails of `mailbox`, stored `stored_ago` seconds ago, with no run yet."""
    created_at = utcnow() - timedelta(seconds=stored_ago)
    return add_emails(res, n, mailbox=mailbox, created_at=created_at)


def test_fleet_status_lists_the_mailboxes_with_the_most_waiting_work(res) -> None:  # type: ignore[no-untyped-def]
    """Counted over the open runs and the emails with no run; each aged from when it began to
    wait at its stage: stored, handed on to the model stage, or opened again."""
    now = utcnow()
    flood = waiting_emails(res, 5, "flood", 60)
    add_run(res, flood[0], RunStatus.OPEN)  # stored 60 s ago, its CPU stage under way
    waiting_emails(res, 3, "tied", 200)
    default = waiting_emails(res, 3, None, 100)
    # Stored long ago, handed on to the model stage 30 s ago: it waits from then.
    [handed_on] = waiting_emails(res, 1, None, 900)
    add_run(res, handed_on, RunStatus.OPEN, converted_at=now - timedelta(seconds=30))
    add_run(res, default[0], RunStatus.SUCCEEDED)  # done: no longer waiting
    # Failed long ago and retried now: it waits from its retry, not from when it was stored.
    [retried] = waiting_emails(res, 1, "retried", 5000)
    add_run(res, retried, RunStatus.FAILED, closed_at=now - timedelta(seconds=4000))
    with res.db.transaction() as session:
        assert interventions.reopen(session, retried)
    add_run(res, waiting_emails(res, 1, "done", 10)[0], RunStatus.SUCCEEDED)

    found = fleet_status(res)["mailboxes"]
    assert found["waiting"] == 4
    assert [(m["mailbox"], m["waiting"]) for m in found["top"]] == [
        ("flood", 5),
        ("tied", 3),  # as many as the default mailbox's, waiting longer
        ("default", 3),
        ("retried", 1),
    ]
    ages = [m["oldest_age_s"] for m in found["top"]]
    assert ages == pytest.approx([60, 200, 100, 0], abs=5)
    with res.db.session() as session:
        two = top_mailboxes(session, utcnow(), limit=2)
    assert (two.mailboxes, [m.mailbox for m in two.top]) == (4, ["flood", "tied"])
