"""The fleet rate limiter under real contention: several OS processes, one real Redis.

Each process stands in for a worker on its own host: it builds its own Redis client and limiter
and hammers `slot()`. Grant times are the Redis server times the limiter yields, the clock its
bucket runs on, so the bound below is checked exactly, not up to clock skew between processes.

The bound (tests/support/grants.py): with rate r and burst B, every window of length t holds at
most B + r*t grants. For 1 s windows that is B + r. The lanes' rule is checked in
tests/unit/coordination/test_ratelimit_lanes.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from multiprocessing.synchronize import Barrier

import pytest
from redis import Redis

from mailpipe.coordination.ratelimit import FleetRateLimiter, RateLimited
from tests.support.grants import assert_within_rate, most_in_window

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

# The run's Redis and key prefix (tests/conftest.py): the limiter's keys and these are all under
# it, so nothing here touches another run's keys, and the `res` fixture clears them per test.
REDIS_URL = os.environ["MAILPIPE_BROKER_URL"]
PREFIX = os.environ["MAILPIPE_REDIS_PREFIX"]
GRANTS = PREFIX + "test:ratelimit:grants"
IN_FLIGHT = PREFIX + "test:ratelimit:in_flight"
VICTIM = PREFIX + "test:ratelimit:victim"
PROCESSES = 8

# Spawn, not fork: each process starts clean, as a worker on another host would, and nothing of
# the parent's Redis connections or threads is inherited.
SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def redis_db(res) -> Redis:  # type: ignore[no-untyped-def]
    """The run's Redis, with none of the run's keys left from an earlier test."""
    return res.redis


def hammer(limits: dict[str, float], seconds: float, hold: float, start: Barrier) -> None:
    """Take slots for `seconds`, each held `hold` seconds; record grants and peak concurrency.

    Runs in a child process. Refusals are expected (that is the limiter working) and retried.
    """
    client = Redis.from_url(REDIS_URL)
    limiter = FleetRateLimiter(
        client,
        rate_per_s=limits["rate_per_s"],
        burst=int(limits["burst"]),
        max_in_flight=int(limits["max_in_flight"]),
        bulk_share=0.1,
        name="hammer",
    )
    grants: list[float] = []
    peak = 0
    start.wait()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with limiter.slot(wait=0.5) as granted_at:
                peak = max(peak, client.incr(IN_FLIGHT))
                time.sleep(hold)
                client.decr(IN_FLIGHT)
        except RateLimited:
            continue
        grants.append(granted_at)
    client.rpush(GRANTS, json.dumps({"grants": grants, "peak": peak}))
    client.close()


def run_fleet(limits: dict[str, float], seconds: float, hold: float) -> tuple[list[float], int]:
    """Run `hammer` in PROCESSES processes at once; all grant times, sorted, and peak in flight."""
    start = SPAWN.Barrier(PROCESSES)
    processes = [
        SPAWN.Process(target=hammer, args=(limits, seconds, hold, start)) for _ in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=seconds + 30)
        assert process.exitcode == 0, f"a hammer process ended with {process.exitcode}"
    reports = [json.loads(raw) for raw in Redis.from_url(REDIS_URL).lrange(GRANTS, 0, -1)]
    assert len(reports) == PROCESSES
    grants = sorted(t for report in reports for t in report["grants"])
    return grants, max(report["peak"] for report in reports)


def test_grants_never_exceed_rate_plus_burst_in_any_window(redis_db: Redis) -> None:
    rate, burst = 10.0, 5
    limits = {"rate_per_s": rate, "burst": burst, "max_in_flight": 100}

    grants, _ = run_fleet(limits, seconds=3.0, hold=0.0)

    # Eight processes want far more than the limit, so the bucket is the only thing holding them.
    assert len(grants) > burst + rate, "the fleet should have had more than one window's worth"
    assert most_in_window(grants, 1.0) <= burst + rate
    # The same bound for every window length at once.
    assert_within_rate(grants, rate, burst)


def test_calls_in_flight_never_exceed_the_cap(redis_db: Redis) -> None:
    max_in_flight = 3
    limits = {"rate_per_s": 1000.0, "burst": 100, "max_in_flight": max_in_flight}

    grants, peak = run_fleet(limits, seconds=2.0, hold=0.02)

    assert grants
    # Eight processes contend for three slots, so the cap is reached, and never passed.
    assert peak == max_in_flight
    assert int(redis_db.get(IN_FLIGHT)) == 0


def hold_forever(slot_ttl: float, granted: str) -> None:
    """Take the only slot, say so with its grant time, and never let go (until killed)."""
    client = Redis.from_url(REDIS_URL)
    limiter = FleetRateLimiter(
        client,
        rate_per_s=100.0,
        burst=10,
        max_in_flight=1,
        bulk_share=0.1,
        name="victim",
        slot_ttl=slot_ttl,
    )
    with limiter.slot() as granted_at:
        client.rpush(granted, granted_at)
        time.sleep(3600)


def test_slot_of_a_killed_holder_frees_itself_after_the_ttl(redis_db: Redis) -> None:
    # Long enough that the refused attempt below comes before it lapses, on a slow machine too.
    slot_ttl = 10.0
    victim = SPAWN.Process(target=hold_forever, args=(slot_ttl, VICTIM))
    victim.start()
    reply = redis_db.blpop([VICTIM], timeout=30)
    assert reply is not None, "the victim never took its slot"
    victim_granted_at = float(reply[1])
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=10)
    assert victim.exitcode == -signal.SIGKILL

    limiter = FleetRateLimiter(
        redis_db,
        rate_per_s=100.0,
        burst=10,
        max_in_flight=1,
        bulk_share=0.1,
        name="victim",
        slot_ttl=slot_ttl,
    )
    with pytest.raises(RateLimited):  # the dead process still holds the only slot
        with limiter.slot():
            pass
    with limiter.slot(wait=slot_ttl + 5) as granted_at:
        assert granted_at >= victim_granted_at + slot_ttl


def test_rate_limited_says_when_a_token_is_due(redis_db: Redis) -> None:
    limiter = FleetRateLimiter(
        redis_db, rate_per_s=0.5, burst=1, max_in_flight=10, bulk_share=0.1, name="hint"
    )
    with limiter.slot():
        pass

    with pytest.raises(RateLimited) as refused, limiter.slot():
        pass

    # The one token was just spent; the next is due 1 / 0.5 = 2 s after that, less time passed.
    assert 0 < refused.value.retry_after <= 2.0
    assert "per second" in str(refused.value)


def test_rate_limited_when_all_slots_are_held(redis_db: Redis) -> None:
    limiter = FleetRateLimiter(
        redis_db, rate_per_s=100.0, burst=10, max_in_flight=1, bulk_share=0.1, name="full"
    )

    with limiter.slot(), pytest.raises(RateLimited) as refused, limiter.slot(wait=0.1):
        pass

    assert refused.value.retry_after > 0
    assert "in flight" in str(refused.value)
    with limiter.slot():  # released on exit
        pass
