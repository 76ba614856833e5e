"""The backlog as Redis holds it: queue depth and the age of the oldest waiting job.

Read straight from kombu's lists (one per priority step), so the figures need no worker to answer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from kombu.transport.redis import PRIORITY_STEPS, Channel
from redis import Redis

from mailpipe.redis_keys import queue_list

# Set on every published job by the before_task_publish handler (mailpipe.signals).
ENQUEUED_AT_HEADER = "mailpipe_enqueued_at"


@dataclass(frozen=True)
class QueueStats:
    depth: int
    oldest_age_s: float | None


def priority_lists(queue: str) -> list[str]:
    base = queue_list(queue)
    return [base if step == 0 else f"{base}{Channel.sep}{step}" for step in PRIORITY_STEPS]


def queue_stats(redis: Redis, queue: str) -> QueueStats:
    names = priority_lists(queue)
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.llen(name)
    for name in names:
        pipe.lindex(name, -1)  # kombu LPUSHes and BRPOPs: the oldest message is the last
    replies = pipe.execute()
    depth = sum(replies[: len(names)])
    now = time.time()
    ages = [now - t for t in (_enqueued_at(raw) for raw in replies[len(names) :]) if t is not None]
    return QueueStats(depth, max(ages) if ages else None)


def _enqueued_at(raw: bytes | None) -> float | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)["headers"].get(ENQUEUED_AT_HEADER)
        return float(value) if value is not None else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
