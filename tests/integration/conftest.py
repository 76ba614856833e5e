"""A real prefork worker, shared by the tests of one module that only need one to be running.

Module scope, not session: a module that asserts what waits in the queue (the sweeper's tests)
must not have a worker from an earlier module consuming it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import select

from mailpipe import localfleet
from mailpipe.localfleet import CeleryProcess


@pytest.fixture(scope="module")
def worker(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CeleryProcess]:
    process = localfleet.worker(
        dict(os.environ), tmp_path_factory.mktemp("worker-logs"), concurrency=2, name="shared"
    ).start()
    process.wait_ready()
    yield process
    process.stop()


@pytest.fixture
def live_worker(worker: CeleryProcess) -> CeleryProcess:
    """The shared worker, checked alive before and after the test."""
    assert worker.alive(), worker.log_tail()
    yield worker
    assert worker.alive(), f"the worker died during the test:\n{worker.log_tail()}"


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def run_statuses(res, email_ids: list[int]) -> dict[int, str]:  # type: ignore[no-untyped-def]
    from mailpipe.models import PipelineRun

    with res.db.session() as session:
        rows = session.execute(
            select(PipelineRun.email_id, PipelineRun.status).where(PipelineRun.email_id.in_(email_ids))
        ).all()
    return {email_id: status.value for email_id, status in rows}


def wait_until_closed(res, email_ids: list[int], timeout: float = 90.0) -> dict[int, str]:  # type: ignore[no-untyped-def]
    """Wait until every email has a run that is not open; returns email id -> status."""
    def closed() -> bool:
        statuses = run_statuses(res, email_ids)
        return len(statuses) == len(email_ids) and "open" not in statuses.values()

    wait_for(closed, timeout, f"{len(email_ids)} runs to close")
    return run_statuses(res, email_ids)
