"""Waiting for what real workers do: a condition with a generous deadline, never a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy import select


def wait_for(
    predicate: Callable[[], bool],
    timeout: float = 60.0,
    what: str = "condition",
    every: float = 0.1,
) -> None:
    """Ask `predicate` every `every` seconds until it is true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def holds_for(predicate: Callable[[], bool], seconds: float, what: str = "condition") -> None:
    """Check that `predicate` stays true for `seconds`: what must not happen, watched for as
    long as it would take to happen."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            raise AssertionError(f"{what} stopped holding")
        time.sleep(0.1)


def run_statuses(res, email_ids: list[int]) -> dict[int, str]:  # type: ignore[no-untyped-def]
    from mailpipe.storage.models import PipelineRun

    with res.db.session() as session:
        rows = session.execute(
            select(PipelineRun.email_id, PipelineRun.status).where(
                PipelineRun.email_id.in_(email_ids)
            )
        ).all()
    return {email_id: status.value for email_id, status in rows}


def wait_until_closed(res, email_ids: list[int], timeout: float = 90.0) -> dict[int, str]:  # type: ignore[no-untyped-def]
    """Wait until every email has a run that is not open; returns email id -> status."""

    def closed() -> bool:
        statuses = run_statuses(res, email_ids)
        return len(statuses) == len(email_ids) and "open" not in statuses.values()

    wait_for(closed, timeout, f"{len(email_ids)} runs to close")
    return run_statuses(res, email_ids)
