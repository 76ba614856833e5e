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


SHARDED = [
    "mailpipe.control",
    "mailpipe",
    *(f"mailpipe:{i:02d}" for i in range(4)),
    "mailpipe.bulk",
    *(f"mailpipe.bulk:{i:02d}" for i in range(4)),
]


def sharded_cycle(share: float, monkeypatch: pytest.MonkeyPatch) -> LiveFirst:
    settings = get_settings().model_copy(update={"bulk_share": share})
    monkeypatch.setattr(lanes, "get_settings", lambda: settings)
    cycle = LiveFirst()
    cycle.update(SHARDED)
    return cycle


def served(cycle: LiveFirst, waiting: dict[str, int], jobs: int) -> list[str]:
    """The queue of each of the next `jobs` jobs, taken as a BRPOP over `consume`'s order."""
    order = []
    for _ in range(jobs):
        queue = next(q for q in cycle.consume(len(SHARDED)) if waiting.get(q))
        waiting[queue] -= 1
        cycle.rotate(queue)
        order.append(queue)
    return order


def test_a_lane_s_shards_take_turns_so_a_quiet_shard_waits_behind_one_job_of_each_other(
    monkeypatch,
) -> None:
    cycle = sharded_cycle(0, monkeypatch)
    # A flood in two shards; then one job in a third.
    waiting = {"mailpipe:01": 500, "mailpipe:02": 500}
    served(cycle, waiting, 7)
    waiting["mailpipe:03"] = 1
    assert "mailpipe:03" in served(cycle, waiting, 3)
    # The flood alone then takes every job: nothing is held back for shards without work.
    assert len(served(cycle, waiting, 100)) == 100


def test_a_lane_s_own_queue_takes_its_turn_with_its_shards_and_live_goes_before_bulk(
    monkeypatch,
) -> None:
    """The lane's own queue is the default mailbox's: one queue among the lane's, in turn."""
    cycle = sharded_cycle(0, monkeypatch)
    order = cycle.consume(len(SHARDED))
    assert order[:2] == ["mailpipe.control", "mailpipe"]
    assert order.index("mailpipe.bulk") > max(order.index(f"mailpipe:{i:02d}") for i in range(4))
    waiting = {"mailpipe": 3, "mailpipe:00": 3, "mailpipe.bulk:00": 3}
    assert served(cycle, waiting, 9) == ["mailpipe", "mailpipe:00"] * 3 + ["mailpipe.bulk:00"] * 3


def test_bulk_keeps_its_share_across_shards(monkeypatch) -> None:
    cycle = sharded_cycle(0.25, monkeypatch)
    waiting = {f"mailpipe:{i:02d}": 300 for i in range(4)} | {
        f"mailpipe.bulk:{i:02d}": 300 for i in range(4)
    }
    order = served(cycle, waiting, 400)
    assert sum(q.startswith("mailpipe.bulk") for q in order) == 100
    # Each lane's shards get even turns.
    live = [q for q in order if not q.startswith("mailpipe.bulk")]
    assert {live.count(f"mailpipe:{i:02d}") for i in range(4)} == {75}


def test_a_queue_added_or_cancelled_keeps_the_others_turns(monkeypatch) -> None:
    cycle = sharded_cycle(0, monkeypatch)
    cycle.rotate("mailpipe:00")
    cycle.update([q for q in SHARDED if q != "mailpipe:02"])
    live = [q for q in cycle.consume(len(SHARDED)) if q.startswith("mailpipe:")]
    assert live == ["mailpipe:01", "mailpipe:03", "mailpipe:00"]
