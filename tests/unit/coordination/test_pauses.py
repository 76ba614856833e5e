"""Stage pauses: what a pause holds, who holds it, and what ends it."""

from __future__ import annotations

import pytest

from mailpipe.broker.queues import Stage
from mailpipe.coordination import pauses
from mailpipe.coordination.pauses import AUTO, OPERATOR, Pause

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def outage(res, email_id: int = 1, error: str = "BlobUnavailable: S3 down") -> Pause | None:  # type: ignore[no-untyped-def]
    """A fault of an outage that pauses the stage at once (a threshold of one email)."""
    return pauses.record_fault(
        res.redis, Stage.CPU, email_id, error, dependency="blobs", threshold=1, window=60
    )


def test_an_outages_pause_alarms_past_its_bound_and_an_operators_never() -> None:
    fault = Pause(Stage.CPU, "BlobUnavailable: S3 down", since=100.0, by=AUTO)
    operator = Pause(Stage.CPU, "paused by an operator", since=100.0, by=OPERATOR)
    assert not fault.alarming(50, now=150.0)
    assert fault.alarming(50, now=150.5)
    assert not operator.alarming(50, now=100_000.0)


def test_pauses_below_the_threshold_wait_and_name_their_dependency(res) -> None:  # type: ignore[no-untyped-def]
    def fault(email_id: int) -> Pause | None:
        return pauses.record_fault(
            res.redis, Stage.MODEL, email_id, "down", dependency="model", threshold=2, window=60
        )

    assert fault(1) is None
    assert fault(1) is None  # the same email twice is one email
    paused = fault(2)
    assert paused is not None
    assert (paused.by, paused.dependency, paused.error) == (AUTO, "model", "down")


def test_an_operator_takes_over_an_outages_pause_with_their_reason(res) -> None:  # type: ignore[no-untyped-def]
    fault = outage(res)
    assert fault is not None
    held = pauses.pause(res.redis, Stage.CPU, "checking the bucket policy")
    # The operator's now, with their reason, so no probe ends it; since when and what caused it
    # stay.
    assert (held.by, held.error, held.since, held.dependency) == (
        OPERATOR,
        "checking the bucket policy",
        fault.since,
        "blobs",
    )
    assert held.token != fault.token
    assert outage(res, 2, "BlobUnavailable: again") == held
    assert pauses.pause(res.redis, Stage.CPU, "another reason") == held
    assert pauses.paused(res.redis) == {Stage.CPU: held}


def test_a_probe_ends_only_the_pause_it_checked(res) -> None:  # type: ignore[no-untyped-def]
    """An operator who pauses while a probe's check runs keeps the pause when it passes."""
    checked = outage(res)
    assert checked is not None
    held = pauses.pause(res.redis, Stage.CPU, "paused by an operator")  # during the check
    assert not pauses.end_if(res.redis, Stage.CPU, checked.token, remember=60)
    assert pauses.paused(res.redis) == {Stage.CPU: held}
    assert pauses.resume(res.redis, Stage.CPU)
    assert pauses.paused(res.redis) == {}


def test_a_pause_soon_after_the_last_counts_from_the_outages_start(res) -> None:  # type: ignore[no-untyped-def]
    first = outage(res)
    assert first is not None
    assert pauses.end_if(res.redis, Stage.CPU, first.token, remember=60)
    assert pauses.paused(res.redis) == {}
    again = outage(res, 2)
    assert again is not None
    assert again.since == first.since
    assert again.token != first.token
    # An operator's resume forgets the outage: the next pause starts anew.
    assert pauses.resume(res.redis, Stage.CPU)
    later = outage(res, 3)
    assert later is not None
    assert later.since > first.since
