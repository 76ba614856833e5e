"""Stage pauses: what a pause holds, and who holds it."""

from __future__ import annotations

from mailpipe.broker.queues import Stage
from mailpipe.coordination import pauses
from mailpipe.coordination.pauses import AUTO, OPERATOR, Pause


def test_a_faults_pause_holds_for_its_bound_and_an_operators_until_resumed() -> None:
    fault = Pause(Stage.CPU, "FleetFault: S3 refused", since=100.0, by=AUTO)
    operator = Pause(Stage.CPU, "paused by an operator", since=100.0, by=OPERATOR)
    assert fault.holds(50, now=150.0)
    assert not fault.holds(50, now=150.5)
    assert operator.holds(50, now=100_000.0)


def test_an_operator_takes_over_a_faults_pause_and_a_fault_never_an_operators(res) -> None:  # type: ignore[no-untyped-def]
    fault = pauses.pause(res.redis, Stage.CPU, "FleetFault: S3 refused", by=AUTO)
    held = pauses.pause(res.redis, Stage.CPU, "paused by an operator")
    # The operator's now, so no probe ends it; what caused it and since when stay.
    assert held == Pause(Stage.CPU, "FleetFault: S3 refused", fault.since, OPERATOR)
    assert pauses.pause(res.redis, Stage.CPU, "FleetFault: again", by=AUTO) == held
    assert pauses.paused(res.redis) == {Stage.CPU: held}
