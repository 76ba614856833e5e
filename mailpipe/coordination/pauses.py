"""Stage pauses: a fleet-wide fault stops a stage's work instead of failing its backlog.

A fleet-wide fault (`mailpipe.errors.FleetFault`) says the fleet, not the email, is wrong. A job
that hits one records it here and defers without using an attempt. Once
`MAILPIPE_PAUSE_AFTER_EMAILS` distinct emails hit faults at a stage within
`MAILPIPE_PAUSE_WINDOW` seconds, the stage is paused: a hash with the error, since when, and who
paused it (`auto`, or `operator` for `mailpipe pause`). Workers stop consuming a paused stage's
queues (mailpipe.app.pausing); one probe per interval ends an automatic pause when it succeeds.
An operator's pause ends only with `mailpipe resume`.

Times are Redis's own clock (`TIME`), so that hosts with skewed clocks agree on them. The keys
have no TTL: a pause must outlive any quiet period, which is also why the broker's Redis must
not evict (mailpipe.app.signals).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis import Redis
from redis.commands.core import Script

from mailpipe.broker.queues import Stage
from mailpipe.coordination import redis_keys

AUTO = "auto"
OPERATOR = "operator"


@dataclass(frozen=True)
class Pause:
    stage: Stage
    error: str
    since: float  # unix time (Redis's clock)
    by: str  # AUTO or OPERATOR

    def holds(self, max_pause: float, now: float | None = None) -> bool:
        """Whether the stage's jobs are held: an operator's pause until it is resumed, a fault's
        for `max_pause` seconds (from then on the jobs run, and fail with the fault)."""
        now = time.time() if now is None else now
        return self.by == OPERATOR or now - self.since <= max_pause


def _script(source: bytes) -> Script:
    return Script(None, source)  # type: ignore[arg-type]


# KEYS: faults, pause. ARGV: email id, window s, threshold, error.
# Returns the pause's fields when the stage is paused (now or before), else an empty list.
_RECORD_FAULT = _script(b"""
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('zadd', KEYS[1], now, ARGV[1])
redis.call('zremrangebyscore', KEYS[1], '-inf', now - tonumber(ARGV[2]))
if redis.call('exists', KEYS[2]) == 0 and redis.call('zcard', KEYS[1]) >= tonumber(ARGV[3]) then
  redis.call('hset', KEYS[2], 'error', ARGV[4], 'since', tostring(now), 'by', 'auto')
end
return redis.call('hgetall', KEYS[2])
""")
# KEYS: pause. ARGV: error, by. Pauses unless paused already (an operator takes over a fault's
# pause, keeping its error and start); returns the pause's fields.
_PAUSE = _script(b"""
if redis.call('exists', KEYS[1]) == 0 then
  local t = redis.call('time')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  redis.call('hset', KEYS[1], 'error', ARGV[1], 'since', tostring(now), 'by', ARGV[2])
elseif ARGV[2] == 'operator' then
  redis.call('hset', KEYS[1], 'by', 'operator')
end
return redis.call('hgetall', KEYS[1])
""")


def record_fault(
    redis: Redis, stage: Stage, email_id: int, error: str, *, threshold: int, window: float
) -> Pause | None:
    """Count a fleet-wide fault of `email_id` at `stage`; the stage's pause, if it is paused
    (by this fault or before it)."""
    fields = _RECORD_FAULT(
        keys=[redis_keys.faults(stage), redis_keys.pause(stage)],
        args=[email_id, window, threshold, error],
        client=redis,
    )
    return _from_fields(stage, fields)


def pause(redis: Redis, stage: Stage, error: str, by: str = OPERATOR) -> Pause:
    """Pause `stage` unless it is paused already; the pause in force. An operator's pause of a
    stage a fault paused makes it the operator's: no probe ends it, only `mailpipe resume`."""
    fields = _PAUSE(keys=[redis_keys.pause(stage)], args=[error, by], client=redis)
    result = _from_fields(stage, fields)
    assert result is not None
    return result


def resume(redis: Redis, stage: Stage) -> bool:
    """End the stage's pause and forget its recent faults; False if it was not paused."""
    pipe = redis.pipeline()
    pipe.delete(redis_keys.pause(stage))
    pipe.delete(redis_keys.faults(stage))
    deleted, _ = pipe.execute()
    return bool(deleted)


def paused(redis: Redis) -> dict[Stage, Pause]:
    """Every paused stage, in one round trip."""
    pipe = redis.pipeline(transaction=False)
    for stage in Stage:
        pipe.hgetall(redis_keys.pause(stage))
    found = {
        stage: _from_fields(stage, fields)
        for stage, fields in zip(Stage, pipe.execute(), strict=True)
    }
    return {stage: pause for stage, pause in found.items() if pause is not None}


def faulted_emails(redis: Redis, stage: Stage, count: int = 1) -> list[int]:
    """The emails that hit a fault at `stage` most lately: what a probe tries."""
    found: list[bytes] = redis.zrevrange(redis_keys.faults(stage), 0, count - 1)  # type: ignore[assignment]
    return [int(i) for i in found]


def take_probe(redis: Redis, stage: Stage, interval: float) -> bool:
    """True for the one caller per `interval` that is to probe the stage."""
    return bool(redis.set(redis_keys.probe_lock(stage), 1, nx=True, px=int(interval * 1000)))


class CachedPauses:
    """The paused stages, read at most every `max_age` seconds: a job checks them at its start
    without a round trip of its own."""

    def __init__(self, max_age: float = 1.0) -> None:
        self._max_age = max_age
        self._read_at = -float("inf")
        self._paused: dict[Stage, Pause] = {}

    def __call__(self, redis: Redis) -> dict[Stage, Pause]:
        now = time.monotonic()
        if now - self._read_at >= self._max_age:
            self._paused = paused(redis)
            self._read_at = now
        return self._paused


def _from_fields(stage: Stage, fields: object) -> Pause | None:
    if not fields:
        return None
    # HGETALL answers a dict; the same reply from a script is a flat list of fields and values.
    if isinstance(fields, dict):
        items = list(fields.items())
    else:
        values = list(fields)  # type: ignore[call-overload]
        items = list(zip(values[::2], values[1::2], strict=True))
    text = {_str(k): _str(v) for k, v in items}
    return Pause(stage, text.get("error", ""), float(text.get("since", "0")), text.get("by", AUTO))


def _str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
