"""Jobs cut off by their worker's shutdown window, told apart from jobs whose process died.

When a worker's soft-shutdown window ends (a deploy, a scale-in), Celery cancels the jobs still
running and the broker puts their messages back. The worker's main process marks each such email
here first; the next claim of the email finds its last attempt unfinished, takes the mark, and
gives the attempt back instead of counting a crash (mailpipe.pipeline.runs.claim_attempt).
"""

from __future__ import annotations

from redis import Redis

from mailpipe.coordination import redis_keys

# Long enough for the requeued message to come back behind any backlog; a mark that lapses
# first only counts the cut-off as an attempt.
CUT_OFF_MARK_TTL_S = 7 * 24 * 3600


def mark_cut_off(redis: Redis, email_ids: list[int]) -> None:
    pipe = redis.pipeline(transaction=False)
    for email_id in email_ids:
        pipe.set(redis_keys.cut_off(email_id), 1, ex=CUT_OFF_MARK_TTL_S)
    pipe.execute()


def take_cut_off(redis: Redis, email_id: int) -> bool:
    """True once for an email its worker cut off, and forgets the mark."""
    return redis.getdel(redis_keys.cut_off(email_id)) is not None
