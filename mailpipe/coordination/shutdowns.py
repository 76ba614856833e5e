"""Jobs cut off by their worker's shutdown window, told apart from jobs whose process died.

When a worker's soft-shutdown window ends (a deploy, a scale-in), Celery cancels the jobs whose
results it has not yet taken and the broker puts their messages back. The worker's main process
marks each such email here first, with the time; the next claim of the email that finds its last
attempt unfinished, started before the mark, gives the attempt back instead of counting a crash
(mailpipe.pipeline.runs.claim). Celery also cancels jobs that ended inside the window a
moment before: their marks are older than the email's next attempt, and count for nothing.
"""

from __future__ import annotations

import time

from redis import Redis

from mailpipe.coordination import redis_keys

# Long enough for the requeued message to come back behind any backlog; a mark that lapses
# first only counts the cut-off as an attempt.
CUT_OFF_MARK_TTL_S = 7 * 24 * 3600


def mark_cut_off(redis: Redis, email_ids: list[int]) -> None:
    """Mark the emails as cut off now. The time is the host's that ran the jobs, the clock their
    attempts' start was read from."""
    now = time.time()
    pipe = redis.pipeline(transaction=False)
    for email_id in email_ids:
        pipe.set(redis_keys.cut_off(email_id), repr(now), ex=CUT_OFF_MARK_TTL_S)
    pipe.execute()


def cut_off_at(redis: Redis, email_id: int) -> float | None:
    """When the email's job was last cut off by its worker's shutdown (unix time), if it was.
    Read, not taken: a mark older than the attempt it is held against counts for nothing, so a
    claim whose transaction is rolled back and run again reads it again."""
    value = redis.get(redis_keys.cut_off(email_id))
    return None if value is None else float(value)
