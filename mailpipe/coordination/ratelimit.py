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

Live first (docs/model-calls.md, "Lanes and the limit"): a live call that is refused registers
itself as waiting until a little after its next try (`_WAITER_MARGIN_S`), or until it is granted.
While any live call is registered, a bulk call is granted only on credit: the bucket keeps
`bulk_credit`, which every grant raises by `bulk_share` and every bulk grant lowers by 1, kept
in [0, 1]. So over any stretch of time in which a live call is registered throughout, bulk calls
get at most `bulk_share` of the grants, plus one; bulk calls that keep asking get about that
share (a bulk call with credit still races the live calls for the next token). With no live call
waiting, bulk takes tokens freely. The lane decides who gets a token, never how many there are:
the bounds above hold over both lanes together.

A mailbox's ceiling (docs/mailboxes.md, "A mailbox's ceiling on model calls"): a call may name
its mailbox's ceiling, r_m calls per second, and is then checked against it first, in the same
script, so that it takes a fleet token only when its mailbox allows it. The ceiling is a generic
cell rate algorithm with two clocks in one hash per mailbox: `tat`, the next slot it hands out,
and `granted`, the earliest the next grant may be, each advanced by 1/r_m and allowed to run
`_CEILING_TOLERANCE_S` (tau) ahead of now. A call refused by its mailbox takes nothing of the
fleet's: it is handed its own slot (`tat` - tau, and `tat` moves on), and comes back at or after
it holding the slot, when it passes without taking another. The grants, whether held slots or
not, keep to `granted`, so that in any window of t seconds a mailbox has at most
1 + r_m*(tau + t) grants however late its slots are used; a call that comes back before its slot,
or finds the grants ahead of now by more than tau, is refused with what it holds.

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

from mailpipe.broker.queues import Lane
from mailpipe.coordination import redis_keys
from mailpipe.errors import Throttled
from mailpipe.settings import Settings

log = logging.getLogger(__name__)

# KEYS: bucket hash, in-flight sorted set, live waiters sorted set, and with a ceiling the
# mailbox's hash.
# ARGV: rate (tokens/s), burst, max in flight, slot id, slot TTL (µs), lane, bulk share,
# waiter margin (µs), the mailbox's ceiling (calls/s, 0: none), its tolerance (µs), the slot the
# call holds (µs, 0: none).
# Returns {granted 0|1, Redis time (µs), µs until a token is due (or the mailbox's slot), 1 if all
# slots are taken, 1 if a bulk call gave way to live ones, 1 if the mailbox's ceiling refused the
# call, the mailbox slot the call holds (µs, 0: none)}.
# Times are integer microseconds: exact in Lua's doubles (2**53 µs is 285 years), and Redis turns
# returned Lua numbers into integers, which would cut fractional seconds.
_ACQUIRE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local max_in_flight = tonumber(ARGV[3])
local ttl_us = tonumber(ARGV[5])
local live = ARGV[6] == 'live'
local bulk_share = tonumber(ARGV[7])
local margin_us = tonumber(ARGV[8])
local m_rate = tonumber(ARGV[9])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])

-- The mailbox's ceiling first: a call it refuses takes nothing of the fleet's, and registers as
-- no live waiter (it defers until its slot).
local m_tat, m_granted, m_interval, m_tau
local m_held = tonumber(ARGV[11])
if m_rate > 0 then
  m_interval = 1000000 / m_rate
  m_tau = tonumber(ARGV[10])
  local m_state = redis.call('HMGET', KEYS[4], 'tat', 'granted')
  m_tat = math.max(tonumber(m_state[1]) or now, now)
  m_granted = math.max(tonumber(m_state[2]) or now, now)
  local grant_due = m_granted - m_tau
  local slot = m_held
  if m_held == 0 then
    slot = math.max(now, m_tat - m_tau)
  end
  if slot > now or grant_due > now then
    if m_held == 0 then
      -- Refused without a slot: this one is the call's own, and the next call's comes after it.
      m_tat = m_tat + m_interval
      redis.call('HSET', KEYS[4], 'tat', m_tat, 'granted', m_granted)
      redis.call('PEXPIRE', KEYS[4], math.ceil((m_tat - now + m_tau) / 1000) + 1000)
    end
    return {0, now, math.max(slot, grant_due) - now, 0, 0, 1, slot}
  end
end

redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local slots_full = redis.call('ZCARD', KEYS[2]) >= max_in_flight
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local live_waiting = redis.call('ZCARD', KEYS[3]) > 0

local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts', 'bulk_credit')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
local credit = tonumber(state[3]) or 0
-- A clock that went back (failover to a replica) refills nothing until it passes `ts` again.
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate / 1000000)
  ts = now
end
local token_wait = 0
if tokens < 1 then
  token_wait = math.ceil((1 - tokens) * 1000000 / rate)
end
-- A bulk call uses credit only while live calls wait; the credit gains this grant's share first,
-- so that bulk gets one grant in 1/bulk_share (the margin absorbs the sum's rounding).
local bulk_on_credit = (not live) and live_waiting
local held_for_live = bulk_on_credit and credit + bulk_share < 1 - 1e-9
-- A refusal writes nothing to the bucket: refilling is a pure function of the stored state and
-- the time. A live call registers as waiting until a little after it tries again.
if token_wait > 0 or slots_full or held_for_live then
  if live then
    -- Twice the wait: past the caller's jitter (at most 20 %) however long the wait.
    local registered_us = 2 * token_wait + margin_us
    redis.call('ZADD', KEYS[3], now + registered_us, ARGV[4])
    redis.call('PEXPIRE', KEYS[3], math.ceil(registered_us / 1000) + 1000)
  elseif held_for_live then
    -- Credit comes with grants: try again when the next token is due.
    token_wait = math.max(token_wait, math.ceil(1000000 / rate))
  end
  return {0, now, token_wait, slots_full and 1 or 0, held_for_live and 1 or 0, 0, m_held}
end

credit = math.min(1, credit + bulk_share)
if bulk_on_credit then
  credit = math.max(0, credit - 1)
end
redis.call('HSET', KEYS[1], 'tokens', tokens - 1, 'ts', ts, 'bulk_credit', credit)
-- A bucket left alone refills within burst/rate seconds; after that a missing key means the same
-- (and no credit: bulk earns it again once live calls wait).
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
redis.call('ZADD', KEYS[2], now + ttl_us, ARGV[4])
redis.call('PEXPIRE', KEYS[2], math.ceil(ttl_us / 1000) + 1000)
if live then
  redis.call('ZREM', KEYS[3], ARGV[4])
end
if m_rate > 0 then
  -- A call that held its slot took it when it was refused; one without takes the next now.
  if m_held == 0 then
    m_tat = m_tat + m_interval
  end
  m_granted = m_granted + m_interval
  redis.call('HSET', KEYS[4], 'tat', m_tat, 'granted', m_granted)
  local m_ahead = math.max(m_tat, m_granted) - now + m_tau
  redis.call('PEXPIRE', KEYS[4], math.ceil(m_ahead / 1000) + 1000)
end
return {1, now, 0, 0, 0, 0, m_held}
"""

# When only a slot is missing, the limiter cannot know when a running call ends: poll briefly
# while waiting, and suggest coming back after about one model call's length when giving up (the
# slot TTL would be a guaranteed bound, but one that only a crashed holder ever needs).
_SLOT_POLL_S = 0.05
_SLOT_RETRY_AFTER_S = 1.0
# How long past its next try a refused live call stays registered as waiting: a round trip and a
# busy host's scheduling, with room to spare. A live caller that stops asking (its job deferred,
# its process dead) holds bulk back this long at most after its last try.
_WAITER_MARGIN_S = 0.5
# How far a mailbox's grants and slots may run ahead of now (tau): the lateness of a deferred
# job's return that costs its mailbox nothing, and what lets 1 + r_m * tau of a quiet mailbox's
# calls start at once. A second covers a busy worker's timers; more would loosen the ceiling's
# bound for every mailbox.
_CEILING_TOLERANCE_S = 1.0


class RateLimited(Throttled):
    """No model call could start in time; `retry_after` says when one is likely to.
    `mailbox_slot`: the slot of its mailbox's ceiling the call holds (Redis time), to be handed
    back when it asks again; `by_ceiling`: its mailbox's ceiling refused it, and it waits for
    that slot."""

    retry_after: float

    def __init__(
        self,
        message: str,
        *,
        retry_after: float,
        mailbox_slot: float | None = None,
        by_ceiling: bool = False,
    ) -> None:
        super().__init__(message, retry_after=retry_after)
        self.mailbox_slot = mailbox_slot
        self.by_ceiling = by_ceiling


@dataclass(frozen=True)
class Ceiling:
    """A call's mailbox's ceiling: `rate_per_s` calls per second of the mailbox `mailbox` (its
    shown name, which only its key's hash is made of), and the slot the call holds (Redis time,
    from an earlier refusal), if any."""

    mailbox: str
    rate_per_s: float
    slot: float | None = None


@dataclass(frozen=True)
class _Attempt:
    granted: bool
    at: float  # Redis time, seconds since the epoch
    token_wait: float  # seconds until the bucket has a token; 0 if it has one
    slots_full: bool
    held_for_live: bool  # a bulk call without credit while live calls wait
    by_ceiling: bool  # the mailbox's ceiling refused the call
    mailbox_slot: float | None  # the mailbox slot the call holds, Redis time


class FleetRateLimiter:
    """Rate and concurrency limit shared by every process that uses the same Redis and `name`.

    Keys are `[MAILPIPE_REDIS_PREFIX]mailpipe:ratelimit:{name}:bucket`, `...:inflight` and
    `...:live` (the live calls waiting). The braces are a Redis Cluster hash tag: the keys of one
    limiter live on one shard, which a script needs. `bulk_share` is MAILPIPE_BULK_SHARE.
    """

    def __init__(
        self,
        redis: Redis,
        *,
        rate_per_s: float,
        burst: int,
        max_in_flight: int,
        bulk_share: float,
        name: str = "model",
        slot_ttl: float = 120.0,
    ) -> None:
        if rate_per_s <= 0 or burst < 1 or max_in_flight < 1 or slot_ttl <= 0:
            raise ValueError("rate_per_s and slot_ttl must be > 0, burst and max_in_flight >= 1")
        if not 0 <= bulk_share <= 1:
            raise ValueError("bulk_share must be from 0 to 1")
        self._redis = redis
        self._rate = rate_per_s
        self._burst = burst
        self._max_in_flight = max_in_flight
        self._bulk_share = bulk_share
        self._slot_ttl_us = round(slot_ttl * 1_000_000)
        self._bucket_key = redis_keys.key(f"ratelimit:{{{name}}}:bucket")
        self._inflight_key = redis_keys.key(f"ratelimit:{{{name}}}:inflight")
        self._live_key = redis_keys.key(f"ratelimit:{{{name}}}:live")
        self._name = name
        self._acquire = redis.register_script(_ACQUIRE)

    @classmethod
    def for_model_calls(cls, redis: Redis, settings: Settings) -> FleetRateLimiter:
        """The fleet's limit on model calls, as the settings give it."""
        return cls(
            redis,
            rate_per_s=settings.model_rate_per_s,
            burst=settings.model_burst,
            max_in_flight=settings.model_max_in_flight,
            bulk_share=settings.bulk_share,
        )

    @contextmanager
    def slot(
        self, wait: float = 0.0, lane: Lane = Lane.LIVE, ceiling: Ceiling | None = None
    ) -> Iterator[float]:
        """Take a token and an in-flight slot, waiting up to `wait` seconds; release on exit.
        A bulk call gives way to live ones; with a `ceiling`, its mailbox's ceiling allows the
        call first (the module's docstring).

        Raises `RateLimited` (with `retry_after`) if neither came in time, and at once, with the
        mailbox's slot the call is to come back with, when the mailbox's ceiling refuses it: a
        capped mailbox's calls wait as deferred jobs, not in threads. Yields the Redis time at
        which the call was admitted, the time the rate bound is stated in.
        """
        slot_id = uuid.uuid4().hex
        deadline = time.monotonic() + wait
        while True:
            attempt = self._try(slot_id, lane, ceiling)
            if attempt.granted:
                break
            if attempt.by_ceiling:
                raise RateLimited(
                    "model calls of this mailbox are at its ceiling (MAILPIPE_MAILBOX_MODEL_RATE)",
                    retry_after=attempt.token_wait,
                    mailbox_slot=attempt.mailbox_slot,
                    by_ceiling=True,
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RateLimited(
                    "model calls are at the fleet limit"
                    + (" of calls in flight" if attempt.slots_full else " of calls per second")
                    + (", and bulk calls give way to live ones" if attempt.held_for_live else ""),
                    retry_after=max(
                        attempt.token_wait, _SLOT_RETRY_AFTER_S if attempt.slots_full else 0.0
                    ),
                    mailbox_slot=attempt.mailbox_slot,
                )
            pause = max(attempt.token_wait, _SLOT_POLL_S if attempt.slots_full else 0.0)
            # Up to 20 % jitter so that waiters told the same time do not all retry at once.
            time.sleep(min(remaining, pause * random.uniform(1.0, 1.2)))
        try:
            yield attempt.at
        finally:
            self._release(slot_id)

    def _try(self, slot_id: str, lane: Lane, ceiling: Ceiling | None) -> _Attempt:
        keys = [self._bucket_key, self._inflight_key, self._live_key]
        rate, held = (0.0, None) if ceiling is None else (ceiling.rate_per_s, ceiling.slot)
        if ceiling is not None and rate > 0:
            keys.append(redis_keys.mailbox_ceiling(self._name, ceiling.mailbox))
        reply = self._acquire(
            keys=keys,
            args=[
                self._rate,
                self._burst,
                self._max_in_flight,
                slot_id,
                self._slot_ttl_us,
                lane.value,
                self._bulk_share,
                round(_WAITER_MARGIN_S * 1_000_000),
                rate,
                round(_CEILING_TOLERANCE_S * 1_000_000),
                0 if held is None else round(held * 1_000_000),
            ],
        )
        granted, now_us, token_wait_us, slots_full, held_for_live, by_ceiling, slot_us = reply
        return _Attempt(
            granted=bool(granted),
            at=now_us / 1_000_000,
            token_wait=token_wait_us / 1_000_000,
            slots_full=bool(slots_full),
            held_for_live=bool(held_for_live),
            by_ceiling=bool(by_ceiling),
            mailbox_slot=slot_us / 1_000_000 if slot_us else None,
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
