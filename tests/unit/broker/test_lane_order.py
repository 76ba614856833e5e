"""The order a worker takes its lanes in (mailpipe.broker.lanes.LiveFirst), with no broker: a
BRPOP over the order `consume` gives takes from the first queue that has a job, and tells the
cycle where it came from, as kombu's Redis transport does (tests/unit/broker/test_lanes.py
checks that against kombu and Redis)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from mailpipe.broker import lanes
from mailpipe.broker.lanes import LiveFirst
from mailpipe.settings import get_settings

QUEUES = ["mailpipe", "mailpipe.bulk", "mailpipe.control"]


def cycle_with(share: float, monkeypatch: pytest.MonkeyPatch) -> LiveFirst:
    settings = get_settings().model_copy(update={"bulk_share": share})
    monkeypatch.setattr(lanes, "get_settings", lambda: settings)
    cycle = LiveFirst()
    cycle.update(QUEUES)
    return cycle


def taken(cycle: LiveFirst, waiting: dict[str, int]) -> Iterator[str]:
    """The lane of each job a worker receives, until `waiting` (queue -> jobs) is empty."""
    while any(waiting.values()):
        queue = next(q for q in cycle.consume(len(QUEUES)) if waiting.get(q))
        waiting[queue] -= 1
        cycle.rotate(queue)
        yield "C" if queue.endswith(".control") else "B" if queue.endswith(".bulk") else "L"


def test_control_goes_first_then_live_until_bulk_has_earned_a_job(monkeypatch) -> None:
    cycle = cycle_with(0.25, monkeypatch)
    assert cycle.consume(3) == ["mailpipe.control", "mailpipe", "mailpipe.bulk"]
    for _ in range(3):
        cycle.rotate("mailpipe")
    assert cycle.consume(3) == ["mailpipe.control", "mailpipe.bulk", "mailpipe"]


def test_a_sweep_never_waits_behind_a_backlog_and_earns_bulk_nothing(monkeypatch) -> None:
    cycle = cycle_with(0.25, monkeypatch)
    waiting = {"mailpipe": 40, "mailpipe.bulk": 5, "mailpipe.control": 1}
    order = "".join(taken(cycle, waiting))
    assert order[0] == "C"
    assert order[1:13] == "LLLBLLLBLLLB"


@pytest.mark.parametrize("share", [0.1, 0.25, 0.3, 0.5])
def test_bulk_gets_its_share_while_both_lanes_have_work(share, monkeypatch) -> None:
    lanes_taken = list(
        taken(cycle_with(share, monkeypatch), {"mailpipe": 900, "mailpipe.bulk": 900})
    )
    first_thousand = lanes_taken[:1000]
    assert first_thousand.count("B") == round(1000 * share)
    # As even as the share allows: bulk turns never closer together than 1/share jobs.
    turns = [i for i, lane in enumerate(first_thousand) if lane == "B"]
    assert all(b - a >= int(1 / share) for a, b in itertools.pairwise(turns))


def test_bulk_gets_everything_once_live_is_empty_and_banks_nothing(monkeypatch) -> None:
    cycle = cycle_with(0.25, monkeypatch)
    assert "".join(taken(cycle, {"mailpipe": 6, "mailpipe.bulk": 10})) == "LLLBLLLBBBBBBBBB"
    # Live comes back after a stretch of bulk alone: it owes bulk nothing for that stretch.
    assert "".join(taken(cycle, {"mailpipe": 8, "mailpipe.bulk": 8})) == "LLLLBLLLBLBBBBBB"


def test_live_alone_leaves_bulk_one_turn_not_a_backlog_of_them(monkeypatch) -> None:
    cycle = cycle_with(0.25, monkeypatch)
    assert set(taken(cycle, {"mailpipe": 100})) == {"L"}
    assert "".join(taken(cycle, {"mailpipe": 6, "mailpipe.bulk": 3})) == "BLLLBLLLB"


def test_share_zero_is_strict_live_first_and_one_is_bulk_first(monkeypatch) -> None:
    waiting = {"mailpipe": 5, "mailpipe.control": 1, "mailpipe.bulk": 5}
    assert "".join(taken(cycle_with(0, monkeypatch), dict(waiting))) == "C" + "L" * 5 + "B" * 5
    assert "".join(taken(cycle_with(1, monkeypatch), dict(waiting))) == "C" + "B" * 5 + "L" * 5
