"""What a pause holds, without a broker."""

from __future__ import annotations

from mailpipe.coordination.pauses import AUTO, OPERATOR, Pause
from mailpipe.coordination.queues import Stage


def test_a_faults_pause_holds_for_its_bound_and_an_operators_until_resumed() -> None:
    fault = Pause(Stage.CPU, "FleetFault: S3 refused", since=100.0, by=AUTO)
    operator = Pause(Stage.CPU, "paused by an operator", since=100.0, by=OPERATOR)
    assert fault.holds(50, now=150.0)
    assert not fault.holds(50, now=150.5)
    assert operator.holds(50, now=100_000.0)
