"""Emails being forgotten (`mailpipe forget`, docs/decisions/erasure.md): the fence their jobs
check, and what Redis keeps by email id, deleted.

The fence is a key per email, set before anything of the email is deleted and kept for longer
than a delivery of its job can still come and run (`fence_ttl`). The database fences a job's
rows (its run is closed, then deleted); its blobs are written outside any transaction, so a job
checks the fence before it writes one, and deletes what it wrote when its rows were fenced off
and the fence is there.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis import Redis

from mailpipe.broker.queues import Stage
from mailpipe.coordination import redis_keys
from mailpipe.settings import Settings


def fence_ttl(settings: Settings) -> int:
    """Seconds a fence is kept: a message of the job comes back within the visibility timeout,
    and runs for at most the hard time limit."""
    return settings.visibility_timeout + settings.task_time_limit


def fence(redis: Redis, email_ids: Sequence[int], ttl: int) -> None:
    pipe = redis.pipeline(transaction=False)
    for email_id in email_ids:
        pipe.set(redis_keys.forgotten(email_id), 1, ex=ttl)
    pipe.execute()


def fenced(redis: Redis, email_id: int) -> bool:
    """Whether the email is being, or was lately, forgotten."""
    return bool(redis.exists(redis_keys.forgotten(email_id)))


def _sorted_sets() -> list[str]:
    """The sorted sets whose members are email ids: deferred jobs, and faults met in an outage."""
    return [*redis_keys.deferred_sets(), *(redis_keys.faults(stage) for stage in Stage)]


def _keys(email_ids: Sequence[int]) -> list[str]:
    return [
        key
        for email_id in email_ids
        for key in (redis_keys.job_marker(email_id), redis_keys.cut_off(email_id))
    ]


def count(redis: Redis, email_ids: Sequence[int]) -> int:
    """How many keys and set members Redis keeps of the emails (`clear` deletes them)."""
    if not email_ids:
        return 0
    pipe = redis.pipeline(transaction=False)
    pipe.exists(*_keys(email_ids))
    for sorted_set in _sorted_sets():
        pipe.zmscore(sorted_set, [str(email_id) for email_id in email_ids])
    existing, *scores = pipe.execute()
    return int(existing) + sum(score is not None for found in scores for score in found)


def clear(redis: Redis, email_ids: Sequence[int]) -> int:
    """Delete what Redis keeps of the emails: their job markers, shutdown marks, deferrals and
    outage faults; returns how many. Their fence stays, and so does a lease, which is its
    holder's: a live delivery gives it back as it ends (fenced off, at its next write), a dead
    one's lapses within MAILPIPE_LEASE_TTL."""
    if not email_ids:
        return 0
    pipe = redis.pipeline(transaction=False)
    pipe.delete(*_keys(email_ids))
    for sorted_set in _sorted_sets():
        pipe.zrem(sorted_set, *(str(email_id) for email_id in email_ids))
    return sum(int(n) for n in pipe.execute())
