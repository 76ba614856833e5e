"""A deferred job's due time, and the deferral counts the metrics report takes, in one place:
the job writes them (mailpipe.pipeline.job), the report reads and resets the counts
(mailpipe.operations.metrics), and the sweeper reads the due times."""

from __future__ import annotations

from redis import Redis

from mailpipe.coordination import redis_keys


def record(redis: Redis, queue: str, email_id: int, due: float) -> None:
    """The email's job on `queue` waits for a deferred delivery at `due` (unix time): counted in
    the fleet's deferrals and its lane's, in one round trip."""
    pipe = redis.pipeline(transaction=False)
    pipe.zadd(redis_keys.deferred(queue), {str(email_id): due})
    pipe.incr(redis_keys.deferrals_counter())
    pipe.hincrby(redis_keys.lane_deferrals(), queue, 1)
    pipe.execute()


def take_total(redis: Redis) -> int | None:
    """The fleet's deferrals since the last take, taken; None when none was counted."""
    counted = redis.getdel(redis_keys.deferrals_counter())
    return None if counted is None else int(counted)


def take_by_lane(redis: Redis) -> dict[str, int]:
    """Each lane's deferrals since the last take (the queue's name -> deferrals), taken."""
    pipe = redis.pipeline(transaction=True)
    pipe.hgetall(redis_keys.lane_deferrals())
    pipe.delete(redis_keys.lane_deferrals())
    counted, _ = pipe.execute()
    return {queue.decode(): int(count) for queue, count in counted.items()}
