"""OldestMailboxWaitSeconds on real PostgreSQL and Redis: the worst-off mailbox's oldest wait in
each stage and lane, the mailbox with the most waiting work left out, as the report sends it."""

from __future__ import annotations

from datetime import timedelta

import pytest

from mailpipe.broker.queues import Lane, Stage
from mailpipe.coordination import pauses
from mailpipe.operations.metrics import collect
from mailpipe.operations.sinks import metric_data
from mailpipe.resources import Resources
from mailpipe.storage.models import RunStatus, utcnow
from tests.support.failed_runs import add_emails, add_run

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def stored(res: Resources, n: int, mailbox: str | None, ago: float, lane: Lane) -> list[int]:
    """`n` emails of `mailbox` in `lane`, stored `ago` seconds ago, with no run yet."""
    at = utcnow() - timedelta(seconds=ago)
    return add_emails(res, n, mailbox=mailbox, created_at=at, lane=lane.value)


def at_model_stage(res: Resources, email_ids: list[int], ago: float, **values: object) -> None:
    """Open runs past their CPU stage, handed on `ago` seconds ago."""
    for email_id in email_ids:
        converted_at = utcnow() - timedelta(seconds=ago)
        add_run(res, email_id, RunStatus.OPEN, converted_at=converted_at, **values)


def sent_waits(res: Resources) -> dict[tuple[str, ...], float]:
    """The report's OldestMailboxWaitSeconds by its dimensions' values."""
    return {
        tuple(f"{d['Name']}={d['Value']}" for d in entry["Dimensions"]): entry["Value"]
        for reading in collect(res)
        for entry in metric_data(reading)
        if entry["MetricName"] == "OldestMailboxWaitSeconds"
    }


def test_a_flood_alone_reads_0_and_a_mailbox_starved_behind_it_its_wait(res) -> None:  # type: ignore[no-untyped-def]
    # The CPU stage's live lane: a flood waiting 1000 s, the default mailbox starved 300 s.
    stored(res, 50, "flood", 1000, Lane.LIVE)
    stored(res, 2, None, 300, Lane.LIVE)
    stored(res, 1, "fresh", 10, Lane.LIVE)
    # The CPU stage's bulk lane: the flood alone.
    stored(res, 20, "flood", 2000, Lane.BULK)
    # The model stage's live lane, aged from each hand-off; a run there that waits for model
    # calls to be switched on waits for the switch, not its turn.
    at_model_stage(res, stored(res, 3, "busy", 9000, Lane.LIVE), 20)
    at_model_stage(res, stored(res, 1, "behind", 9000, Lane.LIVE), 40)
    at_model_stage(res, stored(res, 1, "switched", 9000, Lane.LIVE), 5000, waiting_since=utcnow())

    waits = sent_waits(res)
    assert set(waits) == {
        (f"Stage={stage.value}", f"Lane={lane.value}") for stage in Stage for lane in Lane
    }
    assert waits[("Stage=cpu", "Lane=live")] == pytest.approx(300, abs=5)
    assert waits[("Stage=cpu", "Lane=bulk")] == 0.0
    assert waits[("Stage=model", "Lane=live")] == pytest.approx(40, abs=5)
    assert waits[("Stage=model", "Lane=bulk")] == 0.0


def test_two_floods_as_large_leave_out_the_younger_and_a_paused_stage_reads_0(res) -> None:  # type: ignore[no-untyped-def]
    stored(res, 5, "first", 100, Lane.LIVE)
    stored(res, 5, "second", 700, Lane.LIVE)
    assert sent_waits(res)[("Stage=cpu", "Lane=live")] == pytest.approx(700, abs=5)
    pauses.pause(res.redis, Stage.CPU, "maintenance")
    assert sent_waits(res)[("Stage=cpu", "Lane=live")] == 0.0
