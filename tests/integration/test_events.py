"""Task events from a real worker: every job's events reach a monitor (Flower's feed), the last
ones included when the worker stops right after its last job."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path

import pytest
from celery.events.receiver import EventReceiver

from mailpipe.celery import app
from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import enqueue_emails
from mailpipe.storage import flags
from tests.support.emails import raw_email
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

JOBS = 30


class JobEvents(EventReceiver):
    """process_email's events by task id."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, handlers={"*": self._record}, **kwargs)
        self.names: dict[str, str] = {}
        self.by_task: dict[str, list[str]] = defaultdict(list)

    def jobs(self) -> dict[str, list[str]]:
        return {
            task: events
            for task, events in list(self.by_task.items())
            if self.names.get(task) == "mailpipe.process_email"
        }

    def _record(self, event: dict) -> None:  # type: ignore[type-arg]
        if "uuid" in event:
            if event.get("name"):  # task-sent and task-received carry it
                self.names[event["uuid"]] = event["name"]
            self.by_task[event["uuid"]].append(event["type"])


def test_every_jobs_events_arrive_and_the_last_ones_at_shutdown(res, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    ids = store_emails(
        res,
        [raw_email(f"e{i}", body=f"body {i}") for i in range(JOBS)],
    )
    with app.connection_for_read() as connection:
        receiver = JobEvents(connection, app=app)
        # Subscribed long before the worker is ready (a fanout message nobody listens to is gone).
        listening = threading.Thread(target=receiver.capture, kwargs={"wakeup": False}, daemon=True)
        listening.start()
        # Enqueued first, so that the sweep a worker runs at start finds every job queued.
        enqueue_emails(ids, res)
        worker = localfleet.worker(dict(os.environ), tmp_path, concurrency=2)
        worker.start()
        try:
            assert set(wait_until_closed(res, ids).values()) == {"succeeded"}
        finally:
            # The worker stops at once after its last job: whatever it still buffered must be
            # flushed on the way out.
            assert worker.stop() == 0, worker.log_tail()

        def all_succeeded_seen() -> bool:
            return sum("task-succeeded" in e for e in receiver.jobs().values()) == JOBS

        wait_for(all_succeeded_seen, 10, "every job's task-succeeded event")
        receiver.should_stop = True
        listening.join(5)

    jobs = receiver.jobs()
    assert len(jobs) == JOBS
    for events in jobs.values():
        assert {"task-received", "task-started", "task-succeeded"} <= set(events)
