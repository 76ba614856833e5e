"""The model rate limit serves live calls first, against the real Redis (docs/model-calls.md).

Threads stand in for the model role's threads; each limiter call is one Redis round trip, so the
GIL does not serialize them more than a fleet's hosts are. Grant times are the Redis times the
limiter yields, so the rate bound is checked exactly (tests/support/grants.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
from redis import Redis

from mailpipe.broker.queues import Lane
from mailpipe.coordination import redis_keys
from mailpipe.coordination.ratelimit import FleetRateLimiter, RateLimited
from tests.support.grants import assert_within_rate

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server


def limiter(res, name: str, **limits: float) -> FleetRateLimiter:  # type: ignore[no-untyped-def]
    settings = {"rate_per_s": 100.0, "burst": 1, "max_in_flight": 100, "bulk_share": 0.2}
    settings.update(limits)
    return FleetRateLimiter(
        res.redis,
        rate_per_s=settings["rate_per_s"],
        burst=int(settings["burst"]),
        max_in_flight=int(settings["max_in_flight"]),
        bulk_share=settings["bulk_share"],
        name=name,
    )


@dataclass
class Grants:
    """What the callers were granted, by lane, and the most calls held at once."""

    times: dict[Lane, list[float]] = field(default_factory=lambda: {lane: [] for lane in Lane})
    held: int = 0
    peak: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def all(self) -> list[float]:
        return sorted(t for times in self.times.values() for t in times)


def ask(limits: FleetRateLimiter, lane: Lane, until: float, hold: float, grants: Grants) -> None:
    """Ask for slots in `lane` until `until` (monotonic), each held `hold` seconds."""
    while time.monotonic() < until:
        try:
            with limits.slot(wait=0.5, lane=lane) as granted_at:
                with grants.lock:
                    grants.held += 1
                    grants.peak = max(grants.peak, grants.held)
                time.sleep(hold)
                with grants.lock:
                    grants.held -= 1
        except RateLimited:
            continue
        # Only grants while every caller was still asking count: a lane that stopped early
        # would leave the other one alone.
        if time.monotonic() < until:
            with grants.lock:
                grants.times[lane].append(granted_at)


def run(limits: FleetRateLimiter, callers: dict[Lane, int], seconds: float, hold: float) -> Grants:
    grants = Grants()
    until = time.monotonic() + seconds
    threads = [
        threading.Thread(target=ask, args=(limits, lane, until, hold, grants))
        for lane, n in callers.items()
        for _ in range(n)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 30)
        assert not thread.is_alive()
    return grants


def test_while_live_calls_wait_bulk_gets_its_share_of_the_rate_and_the_rate_holds(res) -> None:  # type: ignore[no-untyped-def]
    rate, burst, share = 40.0, 1, 0.2
    limits = limiter(res, "share", rate_per_s=rate, burst=burst, bulk_share=share)

    grants = run(limits, {Lane.LIVE: 4, Lane.BULK: 4}, seconds=4.0, hold=0.0)

    total, bulk = len(grants.all()), len(grants.times[Lane.BULK])
    assert total > 4 * rate / 2, "the callers should have had most of the run's tokens"
    assert_within_rate(grants.all(), rate, burst)  # over both lanes together
    # The credit bounds bulk exactly: share of every grant, plus the one it may hold at the
    # start, plus the burst taken before any live call had been refused.
    assert bulk <= share * total + 1 + burst
    # And bulk is not starved: with credit, a bulk call races the live calls for the next token
    # and, four against four, wins it about every other time, so it gets about
    # 1 / (1/share + 1) = 0.17 of the grants; half the share leaves room for a busy machine.
    assert bulk >= share / 2 * total, f"bulk got {bulk} of {total}"


def test_the_in_flight_cap_holds_over_both_lanes_and_bulk_keeps_to_its_share(res) -> None:  # type: ignore[no-untyped-def]
    cap, share = 3, 0.2
    limits = limiter(res, "cap", rate_per_s=1000.0, burst=100, max_in_flight=cap, bulk_share=share)

    grants = run(limits, {Lane.LIVE: 4, Lane.BULK: 4}, seconds=2.0, hold=0.02)

    # Eight callers contend for three slots: the cap is reached, and never passed. Live calls
    # refused for a slot wait as much as those refused for a token: bulk keeps to its share.
    assert grants.peak == cap
    total, bulk = len(grants.all()), len(grants.times[Lane.BULK])
    assert total > 0 and bulk <= share * total + 1 + cap


def test_with_no_live_call_waiting_bulk_takes_every_token(res) -> None:  # type: ignore[no-untyped-def]
    burst = 5
    limits = limiter(res, "alone", rate_per_s=0.5, burst=burst, bulk_share=0.0)

    # Even with no share at all, bulk takes the whole burst back to back, and is then refused
    # for the rate only.
    for _ in range(burst):
        with limits.slot(lane=Lane.BULK):
            pass
    with pytest.raises(RateLimited) as refused, limits.slot(lane=Lane.BULK):
        pass
    assert "give way" not in str(refused.value)


def test_a_live_caller_that_stops_asking_holds_bulk_back_only_until_its_registration_ends(
    res,  # type: ignore[no-untyped-def]
) -> None:
    # One token per 2 s: a refused live call registers until past its next try, 2 s away.
    limits = limiter(res, "gone", rate_per_s=0.5, burst=1, bulk_share=0.2)
    with limits.slot(lane=Lane.LIVE):
        pass
    with pytest.raises(RateLimited):
        with limits.slot(lane=Lane.LIVE):  # refused, and never asks again
            pass
    [(_, registered_until_us)] = live_waiters(res.redis, "gone")

    # The next token comes due while the live call is still registered: bulk gives it way.
    with pytest.raises(RateLimited) as refused, limits.slot(wait=2.5, lane=Lane.BULK):
        pass
    assert "give way" in str(refused.value)
    # Once the registration ends, bulk takes the token.
    with limits.slot(wait=10.0, lane=Lane.BULK) as granted_at:
        assert granted_at >= registered_until_us / 1_000_000
    assert live_waiters(res.redis, "gone") == []


def test_a_live_call_granted_is_no_longer_waiting(res) -> None:  # type: ignore[no-untyped-def]
    limits = limiter(res, "granted", rate_per_s=0.5, burst=1)
    with limits.slot(lane=Lane.LIVE):
        pass
    with limits.slot(wait=5.0, lane=Lane.LIVE):  # refused first, then granted
        pass
    assert live_waiters(res.redis, "granted") == []


def live_waiters(redis: Redis, name: str) -> list[tuple[bytes, float]]:
    return redis.zrange(redis_keys.key(f"ratelimit:{{{name}}}:live"), 0, -1, withscores=True)


def test_bulk_banks_at_most_one_turn_of_credit_while_it_runs_alone(res) -> None:  # type: ignore[no-untyped-def]
    """Twenty bulk grants with no live call waiting earn bulk no more than one turn: when live
    calls come, bulk does not take several grants in a row on credit it banked alone."""
    limits = limiter(res, "credit-cap", rate_per_s=1000.0, burst=50, bulk_share=0.25)
    for _ in range(20):
        with limits.slot(wait=1.0, lane=Lane.BULK):
            pass
    bucket = redis_keys.key("ratelimit:{credit-cap}:bucket")
    assert float(res.redis.hget(bucket, "bulk_credit")) == 1.0
