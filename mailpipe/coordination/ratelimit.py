"""A fleet-wide limit on model calls, kept in Redis: a rate (token bucket) and a cap on concurrency.

Every worker process on every host asks the same Redis before a model call, so the limits hold
for the fleet however many tasks the service scales to. One Lua script checks and takes both a
token and an in-flight slot atomically, so two processes can never both take the last one, and
it reads the clock with Redis `TIME`, so the hosts' clocks do not matter.

Bounds (r = rate per second, B = burst, C = max in flight, T = slot TTL):

- In any time window of length t (Redis time), at most B + r*t calls are admitted: the bucket
  holds at most B tokens when the window opens, gains at most r*t during it, never goes below
  zero, and each call takes one token.
- At most C calls hold a slot at once. A holder that dies without releasing (SIGKILL, OOM, lost
  host) keeps its slot until T after it took it; a call that runs longer than T loses its slot,
  so T must exceed the longest call (the Bedrock classifier's worst case is about 110 s).

Waiting is polling, not a queue: a waiter sleeps until a token is due (or briefly, when only a
slot is missing) and tries again. That is not fair among waiters, which is acceptable for jobs
that retry anyway; it costs one Redis round trip per try.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from redis import Redis, RedisError

from mailpipe.coordination import redis_keys
from mailpipe.errors import Throttled

log = logging.getLogger(__name__)

# KEYS: bucket hash, in-flight sorted set.
# ARGV: rate (tokens/s), burst, max in flight, slot id, slot TTL (µs).
# Returns {granted 0|1, Redis time (µs), µs until a token is due, 1 if all slots are taken}.
# Times are integer microseconds: exact in Lua's doubles (2**53 µs is 285 years), and Redis turns
# returned Lua numbers into integers, which would cut fractional seconds.
_ACQUIRE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local max_in_flight = tonumber(ARGV[3])
local ttl_us = tonumber(ARGV[5])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])

redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local slots_full = redis.call('ZCARD', KEYS[2]) >= max_in_flight

local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
-- A clock that went back (failover to a replica) refills nothing until it passes `ts` again.
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate / 1000000)
  ts = now
end
local token_wait = 0
if tokens < 1 then
  token_wait = math.ceil((1 - tokens) * 1000000 / rate)
end
-- A refusal writes nothing: refilling is a pure function of the stored state and the time.
if token_wait > 0 or slots_full then
  return {0, now, token_wait, slots_full and 1 or 0}
end

redis.call('HSET', KEYS[1], 'tokens', tokens - 1, 'ts', ts)
-- A bucket left alone refills within burst/rate seconds; after that a missing key means the same.
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
redis.call('ZADD', KEYS[2], now + ttl_us, ARGV[4])
redis.call('PEXPIRE', KEYS[2], math.ceil(ttl_us / 1000) + 1000)
return {1, now, 0, 0}
"""

# When only a slot is missing, the limiter cannot know when a running call ends: poll briefly
# while waiting, and suggest coming back after about one model call's length when giving up (the
# slot TTL would be a guaranteed bound, but one that only a crashed holder ever needs).
_SLOT_POLL_S = 0.05
_SLOT_RETRY_AFTER_S = 1.0


class RateLimited(Throttled):
    """No model call could start in time; `retry_after` says when one is likely to."""

    retry_after: float

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message, retry_after=retry_after)


@dataclass(frozen=True)
class _Attempt:
    granted: bool
    at: float  # Redis time, seconds since the epoch
    token_wait: float  # seconds until the bucket has a token; 0 if it has one
    slots_full: bool


class FleetRateLimiter:
    """Rate and concurrency limit shared by every process that uses the same Redis and `name`.

    Keys are `[MAILPIPE_REDIS_PREFIX]mailpipe:ratelimit:{name}:bucket` and `...:inflight`. The braces are a Redis
    Cluster hash tag: both keys of one limiter live on one shard, which a script needs.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        rate_per_s: float,
        burst: int,
        max_in_flight: int,
        name: str = "model",
        slot_ttl: float = 120.0,
    ) -> None:
        if rate_per_s <= 0 or burst < 1 or max_in_flight < 1 or slot_ttl <= 0:
            raise ValueError("rate_per_s and slot_ttl must be > 0, burst and max_in_flight >= 1")
        self._redis = redis
        self._rate = rate_per_s
        self._burst = burst
        self._max_in_flight = max_in_flight
        self._slot_ttl_us = round(slot_ttl * 1_000_000)
        self._bucket_key = redis_keys.key(f"ratelimit:{{{name}}}:bucket")
        self._inflight_key = redis_keys.key(f"ratelimit:{{{name}}}:inflight")
        self._acquire = redis.register_script(_ACQUIRE)

    @contextmanager
    def slot(self, wait: float = 0.0) -> Iterator[float]:
        """Take a token and an in-flight slot, waiting up to `wait` seconds; release on exit.

        Raises `RateLimited` (with `retry_after`) if neither came in time. Yields the Redis time
        at which the call was admitted, the time the rate bound is stated in.
        """
        slot_id = uuid.uuid4().hex
        deadline = time.monotonic() + wait
        while True:
            attempt = self._try(slot_id)
            if attempt.granted:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RateLimited(
                    "model calls are at the fleet limit"
                    + (" of calls in flight" if attempt.slots_full else " of calls per second"),
                    retry_after=max(
                        attempt.token_wait, _SLOT_RETRY_AFTER_S if attempt.slots_full else 0.0
                    ),
                )
            pause = max(attempt.token_wait, _SLOT_POLL_S if attempt.slots_full else 0.0)
            # Up to 20 % jitter so that waiters told the same time do not all retry at once.
            time.sleep(min(remaining, pause * random.uniform(1.0, 1.2)))
        try:
            yield attempt.at
        finally:
            self._release(slot_id)

    def _try(self, slot_id: str) -> _Attempt:
        granted, now_us, token_wait_us, slots_full = self._acquire(
            keys=[self._bucket_key, self._inflight_key],
            args=[self._rate, self._burst, self._max_in_flight, slot_id, self._slot_ttl_us],
        )
        return _Attempt(
            granted=bool(granted),
            at=now_us / 1_000_000,
            token_wait=token_wait_us / 1_000_000,
            slots_full=bool(slots_full),
        )

    def _release(self, slot_id: str) -> None:
        """Give the slot back. Failing to is logged, not raised: the call itself is done, and the
        slot frees itself at its TTL, so failing the job (and paying for the call again) would be
        the worse outcome."""
        try:
            removed = self._redis.zrem(self._inflight_key, slot_id)
        except RedisError:
            log.warning(
                "could not release a model call slot; it frees itself at its TTL", exc_info=True
            )
            return
        if not removed:
            log.warning(
                "a model call outlived its slot TTL (%.0f s); the in-flight cap may have been "
                "exceeded meanwhile: raise slot_ttl above the longest call",
                self._slot_ttl_us / 1_000_000,
            )
