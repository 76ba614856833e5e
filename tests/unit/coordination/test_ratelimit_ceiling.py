"""A mailbox's ceiling on model calls, in the fleet limiter's script, against the real Redis
(docs/mailboxes.md, "A mailbox's ceiling on model calls").

Threads stand in for the model role's threads and for the deferred jobs that come back at their
slots. Grant times are the Redis times the limiter yields, so the bounds are checked exactly
(tests/support/grants.py): a mailbox with ceiling r_m has at most 1 + r_m * (tau + t) grants in
any window of t seconds, tau being the ceiling's tolerance (1 s).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import pytest

from mailpipe.coordination import redis_keys
from mailpipe.coordination.ratelimit import Ceiling, FleetRateLimiter, RateLimited
from tests.support.grants import assert_within_rate

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

TOLERANCE_S = 1.0


def limiter(res, name: str, rate_per_s: float, burst: int) -> FleetRateLimiter:  # type: ignore[no-untyped-def]
    return FleetRateLimiter(
        res.redis,
        rate_per_s=rate_per_s,
        burst=burst,
        max_in_flight=1000,
        bulk_share=0.1,
        name=name,
    )


def refused(limits: FleetRateLimiter, ceiling: Ceiling) -> RateLimited:
    with pytest.raises(RateLimited) as raised, limits.slot(ceiling=ceiling):
        pass
    return raised.value


def test_a_burst_of_refusals_is_spread_over_distinct_future_slots_and_takes_no_fleet_token(
    res,  # type: ignore[no-untyped-def]
) -> None:
    rate = 2.0
    limits = limiter(res, "spread", rate_per_s=0.01, burst=10)
    ceiling = Ceiling("flood", rate)
    # A quiet mailbox starts 1 + r_m * tau calls at once.
    for _ in range(3):
        with limits.slot(ceiling=ceiling):
            pass
    refusals = [refused(limits, ceiling) for _ in range(7)]

    assert all(r.by_ceiling and r.mailbox_slot is not None for r in refusals)
    slots = [r.mailbox_slot or 0.0 for r in refusals]
    gaps = [b - a for a, b in itertools.pairwise(slots)]
    # Each refusal has a slot of its own, one interval (1/r_m) after the one before.
    assert all(abs(gap - 1 / rate) < 2e-6 for gap in gaps), gaps
    # Told to come back at its own slot: the last one 3.5 s after the first.
    assert 0 < refusals[0].retry_after <= 1 / rate + 0.05
    assert refusals[-1].retry_after > refusals[0].retry_after + 6 / rate - 0.1
    # The refused calls took nothing of the fleet's: three tokens of ten are gone, not ten.
    tokens = float(res.redis.hget(redis_keys.key("ratelimit:{spread}:bucket"), "tokens"))
    assert 7 <= tokens < 7.1

    # A call back before its slot is refused with the slot it holds, and takes no other.
    first = slots[0]
    early = refused(limits, Ceiling("flood", rate, first))
    assert (early.by_ceiling, early.mailbox_slot) == (True, first)
    assert refused(limits, ceiling).mailbox_slot == pytest.approx(slots[-1] + 1 / rate, abs=2e-6)
    # At its slot it passes, without taking another: the next slot handed out is the one after.
    time.sleep(max(0.0, early.retry_after) + 0.01)
    with limits.slot(ceiling=Ceiling("flood", rate, first)):
        pass
    assert refused(limits, ceiling).mailbox_slot == pytest.approx(slots[-1] + 2 / rate, abs=2e-6)


@dataclass
class Tally:
    grants: dict[str, list[float]] = field(default_factory=lambda: {"flood": [], "quiet": []})
    ceiling_refusals: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def ask(limits: FleetRateLimiter, mailbox: str, rate: float, until: float, tally: Tally) -> None:
    """A mailbox's calls for `until` (monotonic): one refused by its ceiling sleeps until its
    slot, as its deferred job would, and comes back holding it."""
    held: float | None = None
    while time.monotonic() < until:
        try:
            with limits.slot(wait=0.5, ceiling=Ceiling(mailbox, rate, held)) as granted_at:
                pass
        except RateLimited as refusal:
            held = refusal.mailbox_slot
            if refusal.by_ceiling:
                with tally.lock:
                    tally.ceiling_refusals += 1
                time.sleep(max(0.0, min(refusal.retry_after, until - time.monotonic())))
            continue
        held = None
        if time.monotonic() < until:
            with tally.lock:
                tally.grants[mailbox].append(granted_at)


def test_the_ceiling_holds_other_mailboxes_are_unaffected_and_the_fleet_limit_holds(
    res,  # type: ignore[no-untyped-def]
) -> None:
    fleet_rate, fleet_burst, ceiling, seconds = 20.0, 5, 4.0, 4.0
    limits = limiter(res, "shared", rate_per_s=fleet_rate, burst=fleet_burst)
    tally = Tally()
    until = time.monotonic() + seconds
    callers = [("flood", ceiling)] * 8 + [("quiet", 0.0)] * 2
    threads = [
        threading.Thread(target=ask, args=(limits, mailbox, rate, until, tally))
        for mailbox, rate in callers
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 30)
        assert not thread.is_alive()

    flood, quiet = tally.grants["flood"], tally.grants["quiet"]
    assert_within_rate(flood, ceiling, 1 + ceiling * TOLERANCE_S)
    assert len(flood) >= ceiling * seconds * 0.6, f"the flood had {len(flood)} calls"
    # The other mailbox has the rest of the fleet's rate, not the flood's share of it.
    assert len(quiet) >= (fleet_rate - ceiling) * seconds * 0.6, f"quiet had {len(quiet)} calls"
    assert_within_rate(sorted(flood + quiet), fleet_rate, fleet_burst)
    # No busy loop: a refused call comes back at its own slot and is granted then, so the flood
    # was refused about once per call, not once per try.
    assert tally.ceiling_refusals <= len(flood) + 8 + 2, tally.ceiling_refusals


def test_slots_used_late_all_at_once_still_keep_to_the_ceiling(res) -> None:  # type: ignore[no-untyped-def]
    """Deferred jobs that come back late together (their worker was busy) hold slots that are
    all past: their grants keep to the ceiling's clock of grants, not to their slots."""
    rate = 4.0
    limits = limiter(res, "late", rate_per_s=1000.0, burst=1000)
    ceiling = Ceiling("flood", rate)
    for _ in range(5):  # 1 + r_m * tau
        with limits.slot(ceiling=ceiling):
            pass
    held = [refused(limits, ceiling).mailbox_slot for _ in range(8)]
    time.sleep(8 / rate + 0.2)  # every slot is past

    granted, again = [], []
    for slot in held:
        try:
            with limits.slot(ceiling=Ceiling("flood", rate, slot)) as granted_at:
                granted.append(granted_at)
        except RateLimited as refusal:
            again.append(refusal)
    # A second of tolerance: 1 + r_m * tau at once, and the others told to come back soon,
    # with the slots they hold.
    assert len(granted) == 5
    assert [r.mailbox_slot for r in again] == held[5:]
    assert all(r.by_ceiling and 0 < r.retry_after <= 3 / rate + 0.05 for r in again)
