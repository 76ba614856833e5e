"""Which shard queue a mailbox's jobs take (mailpipe.broker.mailboxes), with no services."""

from __future__ import annotations

import itertools

import pytest

from mailpipe.broker import mailboxes


def test_a_mailbox_has_two_distinct_shards_the_same_in_every_process() -> None:
    pairs = {name: mailboxes.shards_of(name, 16) for name in (f"customer-{i}" for i in range(500))}
    assert all(a != b and 0 <= a < 16 and 0 <= b < 16 for a, b in pairs.values())
    # A stable hash, not Python's salted one: these two are fixed for every release.
    assert mailboxes.shards_of("customer-1", 16) == pairs["customer-1"]
    assert mailboxes.shards_of(None, 16) == mailboxes.shards_of("", 16)
    # Pairs spread over the C(16, 2) there are.
    assert len({frozenset(p) for p in pairs.values()}) > 100
    assert mailboxes.shards_of("x", 1) == (0, 0)


def test_jobs_go_to_the_shorter_of_the_two_and_a_batch_fills_both_evenly() -> None:
    first, second = (f"mailpipe:{i:02d}" for i in mailboxes.shards_of("flood", 16))
    placed = mailboxes.assign([(i, "flood") for i in range(10)], "mailpipe", 16, {})
    assert sorted(placed.values()).count(first) == 5 and list(placed.values()).count(second) == 5
    # A shard already long is avoided until the other catches up.
    placed = mailboxes.assign([(i, "flood") for i in range(4)], "mailpipe", 16, {first: 10})
    assert set(placed.values()) == {second}


def test_a_quiet_mailbox_beside_a_flood_goes_to_its_shard_the_flood_does_not_hold() -> None:
    flood = set(mailboxes.shards_of("flood", 16))
    lengths = {f"mailpipe:{i:02d}": 1000 for i in flood}
    names = (f"quiet-{i}" for i in itertools.count())
    quiet = next(n for n in names if len(flood & set(mailboxes.shards_of(n, 16))) == 1)
    [(_, queue)] = mailboxes.assign([(1, quiet)], "mailpipe", 16, lengths).items()
    assert int(queue.rsplit(":", 1)[1]) not in flood


def test_the_default_mailbox_and_no_shards_are_the_lane_s_own_queue() -> None:
    """Where the previous release takes every job of an email without a mailbox."""
    assert mailboxes.assign([(1, None), (2, "a")], "mailpipe", 16, {})[1] == "mailpipe"
    assert mailboxes.candidates([None], "mailpipe", 16) == set()
    assert mailboxes.assign([(1, "a"), (2, None)], "mailpipe.bulk", 0, {}) == {
        1: "mailpipe.bulk",
        2: "mailpipe.bulk",
    }
    assert mailboxes.candidates(["a"], "mailpipe", 0) == set()


@pytest.mark.parametrize("name", ["", "   ", "a\nb", "x" * 201])
def test_a_name_that_cannot_be_a_mailbox_s_is_refused_without_quoting_it(name) -> None:
    with pytest.raises(ValueError) as refused:
        mailboxes.checked(name)
    assert name.strip() == "" or name not in str(refused.value)


def test_the_default_mailbox_is_null_on_the_row_and_default_when_shown() -> None:
    assert mailboxes.stored("default") is None and mailboxes.stored(None) is None
    assert mailboxes.shown(None) == "default" and mailboxes.stored("acme") == "acme"
