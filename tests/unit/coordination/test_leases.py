"""The email lease and the job marker it carries, against the real Redis."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest

from mailpipe.coordination import leases, redis_keys
from mailpipe.coordination.heartbeat import redis_time
from mailpipe.coordination.leases import Lease, LeaseHeld
from tests.support.waits import holds_for, wait_for

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

EMAIL = 41


def lease(res, ttl: float = 6.0) -> Lease:  # type: ignore[no-untyped-def]
    return Lease(res.redis, EMAIL, ttl, marker_ttl=600)


def test_acquire_marks_the_job_running_and_release_clears_both_when_the_job_is_over(res) -> None:  # type: ignore[no-untyped-def]
    before = time.time()
    with leases.hold(res.redis, EMAIL, 6.0, marker_ttl=600) as held:
        assert res.redis.get(redis_keys.lease(EMAIL)).decode() == held.value
        # Stamped to the millisecond: within one of the time around the call.
        assert (
            before - 0.001
            <= float(res.redis.get(redis_keys.job_marker(EMAIL)))
            <= time.time() + 0.001
        )
        assert 0 < res.redis.pttl(redis_keys.lease(EMAIL)) <= 6000
    assert res.redis.exists(redis_keys.lease(EMAIL), redis_keys.job_marker(EMAIL)) == 0


def test_release_before_a_follow_up_keeps_the_marker_stamped_anew(res) -> None:  # type: ignore[no-untyped-def]
    with leases.hold(res.redis, EMAIL, 6.0, marker_ttl=600) as held:
        taken = float(res.redis.get(redis_keys.job_marker(EMAIL)))
        time.sleep(0.01)
        held.keep_marker = True
    assert not res.redis.exists(redis_keys.lease(EMAIL))
    marker = res.redis.get(redis_keys.job_marker(EMAIL))
    assert marker is not None, "the follow-up's marker was deleted with the lease"
    assert float(marker) > taken


def test_a_second_delivery_finds_the_lease_held_by_a_live_process(res) -> None:  # type: ignore[no-untyped-def]
    first = lease(res)
    first.acquire()
    with pytest.raises(LeaseHeld) as held:
        lease(res).acquire()
    # The lease's time to live when it was refused: no more than its TTL, no less than now.
    assert res.redis.pttl(redis_keys.lease(EMAIL)) / 1000 <= held.value.wait <= 6.0
    assert res.redis.get(redis_keys.lease(EMAIL)).decode() == first.value
    first.release()


def test_the_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(res) -> None:  # type: ignore[no-untyped-def]
    dead = subprocess.Popen(["true"])
    dead.wait()
    res.redis.set(redis_keys.lease(EMAIL), f"{socket.gethostname()}:{dead.pid}:gone", px=60_000)

    taker = lease(res)
    try:
        taker.acquire()
    except LeaseHeld as held:
        raise AssertionError(f"the dead process's lease was waited out: {held}") from None
    assert res.redis.get(redis_keys.lease(EMAIL)).decode() == taker.value
    assert taker.release()


def test_a_held_lease_outlives_its_ttl_while_it_is_renewed(res) -> None:  # type: ignore[no-untyped-def]
    # The shortest TTL the settings accept (MAILPIPE_LEASE_TTL >= 3): renewed every 1 to 1.5 s.
    ttl = 3.0
    held = lease(res, ttl=ttl)
    held.acquire()
    # On Redis's clock, which the TTL runs on: the lease as taken has lapsed by then.
    outlived_at = redis_time(res.redis) + 1.5 * ttl

    def held_past_its_ttl() -> bool:
        assert res.redis.get(redis_keys.lease(EMAIL)) == held.value.encode()
        return redis_time(res.redis) > outlived_at

    wait_for(held_past_its_ttl, 60, "the lease to outlive one and a half TTLs")
    assert 0 < res.redis.pttl(redis_keys.lease(EMAIL)) <= 3000
    assert not held.lost
    assert held.release()
    assert not held.lost
    assert not res.redis.exists(redis_keys.lease(EMAIL))


def test_a_renewal_that_finds_the_lease_taken_marks_it_lost_and_release_leaves_the_new_holder(
    res,
) -> None:  # type: ignore[no-untyped-def]
    held = lease(res, ttl=3.0)
    held.acquire()
    res.redis.set(redis_keys.lease(EMAIL), "elsewhere:1:other", px=60_000)
    res.redis.set(redis_keys.job_marker(EMAIL), "123.000")  # the new holder's marker
    wait_for(lambda: held.lost, 10, "the renewal to find the lease taken")
    assert not held.release()
    assert res.redis.get(redis_keys.lease(EMAIL)) == b"elsewhere:1:other"
    assert res.redis.get(redis_keys.job_marker(EMAIL)) == b"123.000"


def test_taking_and_giving_back_leases_never_wakes_the_renewal_thread(res) -> None:  # type: ignore[no-untyped-def]
    # A wake-up per job hands the GIL to the renewal thread in the middle of the job.
    # A TTL of ten minutes: the thread's own looks (every sixth of it) never come in the test.
    renewer = leases._Renewer()
    for n in range(100):
        held = Lease(res.redis, EMAIL + n, 600.0, marker_ttl=600)
        renewer.hold(held)
        renewer.drop(held)
    holds_for(lambda: renewer.wakeups == 0, 0.5, "no wake-up of the renewal thread")
