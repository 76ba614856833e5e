"""The tasks through Celery's in-process test worker, against the real Redis and PostgreSQL.

pytest-celery's plugin provides the worker (`celery_session_worker`: Celery's `start_worker`, a
solo pool in a thread of this process); the fixtures below hand it mailpipe's own app and a
queue of its own. These tests are fast checks of what the task shells do with a real broker and
database: the job's outcome mapped to Celery's, a sweep's re-adds. What a crash, a kill or a
shutdown does is tested on real prefork workers (test_crashes, test_recovery, test_roles).

The worker lives for the whole session, so it consumes only `IN_PROCESS_QUEUE`, which nothing
but this module sends to: the prefork workers of the other tests keep every job of theirs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import setup_logging, task_failure, task_success
from sqlalchemy import select

from mailpipe.broker import layout
from mailpipe.broker.queues import Lane, Stage, TaskName, stage_queue
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import pauses, redis_keys
from mailpipe.errors import RunFailed
from mailpipe.pipeline import policy, runs
from mailpipe.resources import Resources
from mailpipe.storage import flags
from mailpipe.storage.models import EmailLabel, SweepReport
from tests.support.emails import raw_email
from tests.support.waits import run_statuses, wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

IN_PROCESS_QUEUE = "in-process"
# Exported by Celery's logging set-up for the children a worker forks later.
CELERY_FORK_VARIABLES = ("_MP_FORK_LOGLEVEL_", "_MP_FORK_LOGFILE_", "_MP_FORK_LOGFORMAT_")


@pytest.fixture(scope="session")
def celery_session_app() -> Iterator[Celery]:
    from mailpipe.celery import app

    yield app


@pytest.fixture(scope="session")
def celery_worker_parameters() -> dict[str, Any]:
    return {
        "queues": [IN_PROCESS_QUEUE],
        "hostname": "in-process@localhost",
        # The ping check needs a result backend; mailpipe keeps none (the runs are the results).
        "perform_ping_check": False,
    }


def _leave_logging_alone(**_: Any) -> None:
    """A `setup_logging` receiver: while one answers, Celery configures no logger."""


@pytest.fixture(scope="session")
def in_process_worker(request: pytest.FixtureRequest) -> Any:
    """pytest-celery's session worker, leaving this process as it found it: starting a worker
    sets up Celery's logging (the root logger's level and handlers) and exports variables that
    the children forked later read, and the tests after this module must inherit neither."""
    before = {name: os.environ.get(name) for name in CELERY_FORK_VARIABLES}
    setup_logging.connect(_leave_logging_alone)
    try:
        return request.getfixturevalue("celery_session_worker")
    finally:
        setup_logging.disconnect(_leave_logging_alone)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Outcomes:
    """Each task's end as the worker signals it: the task's return value, or its exception."""

    def __init__(self) -> None:
        self.by_id: dict[str, object] = {}
        self._lock = threading.Lock()

    def success(self, sender: Any = None, result: object = None, **_: Any) -> None:
        with self._lock:
            self.by_id[sender.request.id] = result

    def failure(self, task_id: str = "", exception: BaseException | None = None, **_: Any) -> None:
        with self._lock:
            self.by_id[task_id] = exception

    def wait(self, task_id: str) -> object:
        wait_for(lambda: task_id in self.by_id, 30, f"task {task_id} to end")
        return self.by_id[task_id]


@pytest.fixture
def outcomes() -> Iterator[Outcomes]:
    seen = Outcomes()
    task_success.connect(seen.success, weak=False)
    task_failure.connect(seen.failure, weak=False)
    try:
        yield seen
    finally:
        task_success.disconnect(seen.success)
        task_failure.disconnect(seen.failure)


@pytest.fixture
def worker(res: Resources, in_process_worker: Any) -> Any:
    """The in-process worker, on clean tables and Redis keys (`res` runs first)."""
    return in_process_worker


def send(app: Celery, name: TaskName, *args: object) -> str:
    return app.send_task(name.value, args=args, queue=IN_PROCESS_QUEUE).id


def email(tag: str) -> bytes:
    return raw_email(
        f"Invoice {tag}",
        sender="billing@example.org",
        message_id=f"{tag}@x",
        body="Amount due: 40 EUR",
    )


def test_a_job_ends_succeeded_with_its_labels(
    res: Resources, worker: Any, outcomes: Outcomes
) -> None:
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    [email_id] = store_emails(res, [email("in-process")])
    task_id = send(worker.app, TaskName.PROCESS_EMAIL, email_id)
    assert outcomes.wait(task_id) == "succeeded"
    assert wait_until_closed(res, [email_id], timeout=30) == {email_id: "succeeded"}
    with res.db.session() as session:
        labels = set(
            session.scalars(select(EmailLabel.label).where(EmailLabel.email_id == email_id))
        )
    assert "invoice" in labels


def test_an_unknown_id_fails_its_task_and_the_next_job_runs(
    res: Resources, worker: Any, outcomes: Outcomes
) -> None:
    [email_id] = store_emails(res, [email("after-unknown")])
    unknown = send(worker.app, TaskName.PROCESS_EMAIL, email_id + 10_000)
    known = send(worker.app, TaskName.PROCESS_EMAIL, email_id)
    failure = outcomes.wait(unknown)
    assert isinstance(failure, RunFailed)
    assert f"no email_message row with id {email_id + 10_000}" in str(failure)
    assert outcomes.wait(known) in ("succeeded", "waiting")
    assert run_statuses(res, [email_id + 10_000]) == {}


def test_a_sweep_task_re_adds_an_email_that_has_no_job(
    res: Resources, worker: Any, outcomes: Outcomes
) -> None:
    [email_id] = store_emails(res, [email("no-job")])  # stored, never enqueued
    task_id = send(worker.app, TaskName.SWEEP)
    summary = outcomes.wait(task_id)
    assert isinstance(summary, dict)
    assert summary["readded_no_run"] == 1, summary
    with res.db.session() as session:
        report = session.scalars(select(SweepReport)).one()
    assert report.readded_no_run == 1
    # The job waits in the email queue, for the workers that consume it (none in this test).
    assert layout.queue_stats(res.redis, res.settings.queue).depth == 1
    assert layout.emails_in_broker(res.redis, [res.settings.queue]) == {email_id}


def test_a_job_sent_with_arguments_of_a_newer_release_runs(
    res: Resources, worker: Any, outcomes: Outcomes
) -> None:
    """A later release may add a field to the job's message: this one runs the job as it
    knows it, where a task without `**unknown` would raise TypeError before the job starts."""
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    [email_id] = store_emails(res, [email("newer-release")])
    task_id = worker.app.send_task(
        TaskName.PROCESS_EMAIL.value,
        args=(email_id,),
        kwargs={"lane": "live", "priority_hint": 3, "trace": {"origin": "ingest"}},
        queue=IN_PROCESS_QUEUE,
    ).id
    assert outcomes.wait(task_id) == "succeeded"
    sweep_id = worker.app.send_task(
        TaskName.SWEEP.value, kwargs={"reason": "newer"}, queue=IN_PROCESS_QUEUE
    ).id
    assert isinstance(outcomes.wait(sweep_id), dict)


@pytest.mark.parametrize("follow_up", ["retry", "deferral", "pause"])
def test_a_bulk_job_s_follow_up_stays_in_the_bulk_lane(
    res: Resources, worker: Any, follow_up: str
) -> None:
    """A retry (after an attempt that died), a deferral (the lease held elsewhere) and a pause's
    re-send each go back to the queue of the delivery's lane, never to the live one."""
    [email_id] = store_emails(res, [email(f"bulk-{follow_up}")])
    if follow_up == "retry":
        with res.db.transaction() as session:
            runs.claim(session, email_id, policy.Limits.of(res.settings))
    elif follow_up == "deferral":
        res.redis.set(redis_keys.lease(email_id), "elsewhere:1:holder", px=60_000)
    else:
        pauses.pause(res.redis, Stage.CPU, "held for the test")
        # The in-process worker shares this process's resources: its cached read of the pauses
        # (a second old at most) is dropped, so that its next job reads the pause.
        res.pauses.forget()
    worker.app.send_task(
        TaskName.PROCESS_EMAIL.value,
        args=(email_id,),
        kwargs={"lane": Lane.BULK.value},
        queue=IN_PROCESS_QUEUE,
    )
    bulk = stage_queue(Stage.CPU, res.settings, Lane.BULK)
    live = stage_queue(Stage.CPU, res.settings, Lane.LIVE)
    wait_for(
        lambda: layout.emails_in_broker(res.redis, [bulk]) == {email_id},
        30,
        f"the {follow_up} in the bulk lane",
    )
    assert layout.emails_in_broker(res.redis, [live]) == set()
