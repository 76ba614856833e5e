"""Job markers: the enqueue dedup.

A Redis key per email (`mailpipe:job:<id>`, holding the unix time it was last set) is set with
SET NX before a job is sent: a second enqueue while the job waits or runs sends nothing. The job
stamps it when it takes its lease and deletes it when it ends (`mailpipe.coordination.leases`),
and sweeps refresh the markers of jobs they find waiting. A marker only keeps enqueues from
sending copies: whether a job was lost is decided by what the broker holds
(`mailpipe.broker.layout`), so a marker that expired, was evicted or was deleted
never gets a waiting job re-added, and one left behind by a lost message never keeps its email
from being re-added.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from redis import Redis

from mailpipe.coordination import redis_keys

# A job is published within milliseconds of its marker being stamped (enqueue, retry, deferral):
# a marker this young stands for a job that a read of the broker may have missed. A job truly
# lost that young is taken for lost by the next look.
IN_FLIGHT_GRACE_S = 10.0

_REFRESH = """
for _, key in ipairs(KEYS) do
  if not redis.call('set', key, ARGV[1], 'NX', 'EX', ARGV[2]) then
    redis.call('expire', key, ARGV[2])
  end
end
"""
_DELETE_IF_UNCHANGED = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def stamp() -> str:
    """A marker's value: now."""
    return f"{time.time():.3f}"


def claim(redis: Redis, email_ids: Sequence[int], ttl: int) -> list[bool]:
    """Set each email's marker unless it has one: True where this call set it (send the job)."""
    pipe = redis.pipeline(transaction=False)
    now = stamp()
    for email_id in email_ids:
        pipe.set(redis_keys.job_marker(email_id), now, nx=True, ex=ttl)
    return [bool(ok) for ok in pipe.execute()]


def release(redis: Redis, email_ids: Sequence[int]) -> None:
    """Delete markers set for jobs that were then not sent."""
    if email_ids:
        redis.delete(*(redis_keys.job_marker(email_id) for email_id in email_ids))


def read(redis: Redis, email_ids: Sequence[int]) -> list[bytes | None]:
    """Each email's marker as stored, None where it has none."""
    pipe = redis.pipeline(transaction=False)
    for email_id in email_ids:
        pipe.get(redis_keys.job_marker(email_id))
    return list(pipe.execute())


def just_sent(value: bytes, now: float | None = None) -> bool:
    """A marker stamped within the in-flight grace of `now`."""
    return set_at(value) > (time.time() if now is None else now) - IN_FLIGHT_GRACE_S


def set_at(value: bytes) -> float:
    """When a marker was set."""
    try:
        return float(value)
    except ValueError:  # a marker that holds no time: as old as can be
        return 0.0


def refresh(redis: Redis, email_ids: Sequence[int], ttl: int) -> None:
    """Keep the markers of jobs found waiting in the broker: set where missing, TTL renewed. One
    script call for the batch: a sweep over a million waiting jobs makes a thousand calls, not
    two million commands."""
    if email_ids:
        keys = [redis_keys.job_marker(email_id) for email_id in email_ids]
        redis.eval(_REFRESH, len(keys), *keys, stamp(), ttl)


def drop_stale(redis: Redis, stale: dict[int, bytes]) -> None:
    """Delete markers whose message is lost, each only if nothing stamped it anew meanwhile."""
    pipe = redis.pipeline(transaction=False)
    for email_id, value in stale.items():
        pipe.eval(_DELETE_IF_UNCHANGED, 1, redis_keys.job_marker(email_id), value)
    pipe.execute()
