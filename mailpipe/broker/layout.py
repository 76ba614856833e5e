"""What the broker holds, read from kombu's Redis keys: the one module that knows their layout.

kombu's Redis transport keeps a queue as Redis lists (one per priority step; LPUSH to publish,
BRPOP to consume), and every delivered, not yet acknowledged message in the ``unacked`` hash
(delivery tag -> the message) with its delivery time in the ``unacked_index`` sorted set (the
delivering host's clock, which mailpipe does not read: hosts' clocks disagree), filed by a MULTI
a round trip after the BRPOP that took it. A message waiting for its countdown is delivered early
and held by a worker, so it is in the hash too. What is in neither is not in the broker.

mailpipe reads those keys for three things: the backlog figures (queue depth, the oldest job's
age), whether an email's job is still in the broker (the sweeper), and which delivered messages
no live worker holds (the worker heartbeat). Checked against kombu 5.7 and redis-py 8
(`tests/unit/broker/test_layout.py` fails if the layout moves).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kombu.transport.redis import PRIORITY_STEPS, Channel
from redis import Redis

from mailpipe.broker.queues import family
from mailpipe.settings import get_settings

# Set on every published job by the before_task_publish handler (mailpipe.app.signals): when it was
# sent, and which email it is for.
ENQUEUED_AT_HEADER = "mailpipe_enqueued_at"
EMAIL_ID_HEADER = "mailpipe_email_id"


def queue_list(queue: str) -> str:
    """The Redis list kombu keeps a queue's messages in."""
    return f"{get_settings().redis_prefix}{queue}"


# Messages read per script call: each call blocks Redis for about a millisecond per 1,000.
SCAN_CHUNK = 2000

# Reads the email id header out of each message server-side, so a scan moves ids over the
# network, not whole messages. In the unacked hash the message is JSON inside JSON, so the
# header's quotes come escaped: the pattern skips backslashes and quotes before the colon.
_IDS_FROM_MESSAGES = """
local function ids_of(items, first, step, out)
  for i = first, #items, step do
    local _, stop = string.find(items[i], ARGV[1], 1, true)
    if stop then
      local id = string.match(items[i], '^[\\\\"]*:%s*(%d+)', stop + 1)
      if id then out[#out + 1] = id end
    end
  end
  return out
end
if ARGV[2] == 'list' then
  local items = redis.call('LRANGE', KEYS[1], ARGV[3], ARGV[4])
  return {#items, ids_of(items, 1, 1, {})}
end
local reply = redis.call('HSCAN', KEYS[1], ARGV[3], 'COUNT', ARGV[4])
return {reply[1], ids_of(reply[2], 2, 2, {})}
"""


def job_headers(email_id: int) -> dict[str, float | int]:
    """The headers every job message carries: its email, and when it was sent (the backlog's
    age, OldestJobAgeSeconds, is read from the oldest waiting job's)."""
    return {EMAIL_ID_HEADER: email_id, ENQUEUED_AT_HEADER: time.time()}


def unacked_key() -> str:
    return f"{get_settings().redis_prefix}{Channel.unacked_key}"


def priority_lists(queue: str) -> list[str]:
    base = queue_list(queue)
    return [base if step == 0 else f"{base}{Channel.sep}{step}" for step in PRIORITY_STEPS]


@dataclass(frozen=True)
class QueueStats:
    depth: int
    oldest_age_s: float | None


def family_lists(queue: str) -> list[str]:
    """Every list the jobs of a lane queue can wait in: its own and its shards', each priority's."""
    return [name for member in family(queue, get_settings()) for name in priority_lists(member)]


def queue_stats(redis: Redis, queue: str) -> QueueStats:
    """Jobs waiting in the lane queue `queue` (its shards and every priority list) and how long
    the oldest has waited."""
    names = family_lists(queue)
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


def emails_in_broker(redis: Redis, queues: Iterable[str]) -> set[int]:
    """The ids of every email with a job in the broker: waiting in one of the lane queues
    `queues` or their shards, delivered to a worker and not acknowledged, or held for its
    countdown.

    The lists and the hash are read in chunks while workers go on, so the read is ordered to miss
    nothing that stays in the broker throughout: the hash, then each list from its newest end
    (a consumer takes from the oldest end, so positions counted from the newest never skip an
    element), then the hash again for whatever a worker took from a list meanwhile. A job that
    was sent after the read began may be missing; the caller allows for that. So may one that a
    worker took between its BRPOP and the MULTI that files it in the hash, a round trip later:
    the caller re-adds it, and its copy finds the lease held or the run closed.
    """
    found: set[int] = set()
    found.update(_ids_in_hash(redis, unacked_key()))
    for queue in queues:
        for name in family_lists(queue):
            found.update(_ids_in_list(redis, name))
    found.update(_ids_in_hash(redis, unacked_key()))
    return found


def delivered(redis: Redis) -> list[str]:
    """Delivery tags of every message delivered to a worker and not yet acknowledged.

    kombu scores the ``unacked_index`` with the delivering host's ``time.time()``, so when a
    message was delivered is not read here: another host's clock may be off by any amount.
    """
    tags: list[bytes] = redis.hkeys(unacked_key())  # type: ignore[assignment]
    return [tag.decode() for tag in tags]


def still_unacked(redis: Redis, tags: list[str]) -> list[bool]:
    pipe = redis.pipeline(transaction=False)
    for tag in tags:
        pipe.hexists(unacked_key(), tag)
    return [bool(found) for found in pipe.execute()]


def _ids_in_list(redis: Redis, name: str) -> Iterator[int]:
    start = 0
    while True:
        count, ids = _scan(redis, name, "list", start, start + SCAN_CHUNK - 1)
        yield from ids
        if count < SCAN_CHUNK:
            return
        start += SCAN_CHUNK


def _ids_in_hash(redis: Redis, name: str) -> Iterator[int]:
    cursor: int | bytes = 0
    while True:
        cursor, ids = _scan(redis, name, "hash", cursor, SCAN_CHUNK)
        yield from ids
        if int(cursor) == 0:
            return


def _scan(redis: Redis, key: str, kind: str, a: int | bytes, b: int) -> tuple[int, list[int]]:
    head, ids = redis.eval(_IDS_FROM_MESSAGES, 1, key, EMAIL_ID_HEADER, kind, a, b)
    return int(head), [int(i) for i in ids]


def _enqueued_at(raw: bytes | None) -> float | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)["headers"].get(ENQUEUED_AT_HEADER)
        return float(value) if value is not None else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def lengths(redis: Redis, queues: Iterable[str]) -> dict[str, int]:
    """How many jobs wait in each of `queues` (the list kombu publishes to), in one round trip."""
    names = list(queues)
    if not names:
        return {}
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.llen(queue_list(name))
    return dict(zip(names, pipe.execute(), strict=True))
