"""Stage pauses: an outage stops a stage's work instead of failing its backlog.

A job whose dependency fails its own check too (mailpipe.pipeline.health) records the fault here
and defers without using an attempt. Once `MAILPIPE_PAUSE_AFTER_EMAILS` distinct emails hit
faults at a stage within `MAILPIPE_PAUSE_WINDOW` seconds, the stage is paused: a hash with the
error, the dependency, since when, who paused it (`auto`, or `operator` for `mailpipe pause`) and
a token. Workers stop consuming a paused stage's queues (mailpipe.app.pausing); the dependency's
check, once per probe interval, ends an automatic pause when it passes. An operator's pause ends
only with `mailpipe resume`.

An operator's pause is also kept in the database (mailpipe.storage.flags), and a key with no TTL
says that Redis holds every pause so kept. A flushed or restarted Redis loses that key with the
pauses: a reader that finds it missing (`paused_if_known` answers None) puts the kept pauses
back (`restore`) before it trusts what Redis says.

Ending a pause compares its token, so a pause set or taken over while a probe's check ran
survives the probe. `since` is when the outage began: a pause that starts within a pause window
of the last one's end counts from the first, so that an outage that flaps keeps one start for its
alarm.

A mailbox's pause (`mailpipe pause --mailbox`) is an operator's only, kept the same way: a
field per mailbox in one hash, and a key of its own saying that Redis holds every one the
database keeps (`paused_mailboxes_if_known`, `restore_mailboxes`). Its jobs are not left in the
broker: each delivery ends without claiming anything and its resume sends them again
(docs/mailboxes.md, "Pausing a mailbox").

Times are Redis's own clock (`TIME`), so that hosts with skewed clocks agree on them. The pause
keys have no TTL: a pause must outlive any quiet period, which is also why the broker's Redis
must not evict (mailpipe.app.signals).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

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
    since: float  # unix time (Redis's clock): when the outage or the operator's pause began
    by: str  # AUTO or OPERATOR
    token: str = ""  # changes whenever the pause is set or taken over
    dependency: str = ""  # the dependency whose check ends an automatic pause

    def alarming(self, alarm_after: float, now: float | None = None) -> bool:
        """An automatic pause that has lasted past `alarm_after` seconds."""
        now = time.time() if now is None else now
        return self.by == AUTO and now - self.since > alarm_after


def _script(source: bytes) -> Script:
    return Script(None, source)  # type: ignore[arg-type]


# Sets the pause hash (KEYS[1]) with a new token, since the outage's start (KEYS[2]) when one is
# remembered, else now. ARGV: error, by, dependency, now.
_SET_PAUSE = b"""
local function set_pause(error, by, dependency, now)
  local since = redis.call('get', KEYS[2]) or tostring(now)
  redis.call('set', KEYS[2], since)
  redis.call('hset', KEYS[1], 'error', error, 'since', since, 'by', by,
    'token', string.format('%.6f', now) .. ':' .. by, 'dependency', dependency)
end
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
"""
# KEYS: pause, outage, faults. ARGV: email id, window s, threshold, error, dependency.
# Returns the pause's fields when the stage is paused (now or before), else an empty list.
_RECORD_FAULT = _script(
    _SET_PAUSE
    + b"""
redis.call('zadd', KEYS[3], now, ARGV[1])
redis.call('zremrangebyscore', KEYS[3], '-inf', now - tonumber(ARGV[2]))
if redis.call('exists', KEYS[1]) == 0 and redis.call('zcard', KEYS[3]) >= tonumber(ARGV[3]) then
  set_pause(ARGV[4], 'auto', ARGV[5], now)
end
return redis.call('hgetall', KEYS[1])
"""
)
# KEYS: pause, outage. ARGV: reason, since (empty: now). An operator's pause: a new one, or one
# that takes over an automatic pause with the operator's reason and keeps its start; returns the
# pause's fields.
_PAUSE = _script(
    _SET_PAUSE
    + b"""
if redis.call('hget', KEYS[1], 'by') ~= 'operator' then
  if redis.call('exists', KEYS[1]) == 0 then
    redis.call('del', KEYS[2])
    if ARGV[2] ~= '' then redis.call('set', KEYS[2], ARGV[2]) end
  end
  set_pause(ARGV[1], 'operator', redis.call('hget', KEYS[1], 'dependency') or '', now)
end
return redis.call('hgetall', KEYS[1])
"""
)
# KEYS: pause, outage, faults. ARGV: token, remember s. Ends the pause if it still holds
# `token`; the outage's start is remembered for `remember` seconds. Returns 1 if it ended.
_END_IF = _script(b"""
if redis.call('hget', KEYS[1], 'token') ~= ARGV[1] then return 0 end
redis.call('del', KEYS[1], KEYS[3])
redis.call('expire', KEYS[2], math.max(1, math.ceil(tonumber(ARGV[2]))))
return 1
""")


def _keys(stage: Stage) -> list[str]:
    return [redis_keys.pause(stage), redis_keys.outage(stage), redis_keys.faults(stage)]


def record_fault(
    redis: Redis,
    stage: Stage,
    email_id: int,
    error: str,
    *,
    dependency: str,
    threshold: int,
    window: float,
) -> Pause | None:
    """Count an outage's fault of `email_id` at `stage`; the stage's pause, if it is paused
    (by this fault or before it)."""
    fields = _RECORD_FAULT(
        keys=_keys(stage), args=[email_id, window, threshold, error, dependency], client=redis
    )
    return _from_fields(stage, fields)


def pause(redis: Redis, stage: Stage, reason: str) -> Pause:
    """An operator's pause of `stage`, with `reason`; the pause in force. It takes over an
    automatic pause (no probe ends it then, only `resume`), and leaves an operator's as it is."""
    return _pause(redis, stage, reason, "")


def _pause(redis: Redis, stage: Stage, reason: str, since: str) -> Pause:
    fields = _PAUSE(keys=_keys(stage)[:2], args=[reason, since], client=redis)
    result = _from_fields(stage, fields)
    assert result is not None
    return result


def end_if(redis: Redis, stage: Stage, token: str, remember: float) -> bool:
    """End the stage's pause if it is still the pause of `token` (a probe's check passed);
    False when it has ended or changed meanwhile. The outage's start is kept `remember`
    seconds, for a pause that follows."""
    return bool(_END_IF(keys=_keys(stage), args=[token, remember], client=redis))


def resume(redis: Redis, stage: Stage) -> bool:
    """An operator ends the stage's pause, its recent faults and its outage's start; False if it
    was not paused."""
    pipe = redis.pipeline()
    for name in _keys(stage):
        pipe.delete(name)
    deleted, _, _ = pipe.execute()
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


def paused_if_known(redis: Redis) -> dict[Stage, Pause] | None:
    """Every paused stage, as `paused`; None when Redis lost the operator's pauses the database
    keeps (it was flushed or restarted since they were last put back): `restore` them first."""
    pipe = redis.pipeline(transaction=False)
    pipe.exists(redis_keys.pauses_restored())
    for stage in Stage:
        pipe.hgetall(redis_keys.pause(stage))
    known, *replies = pipe.execute()
    if not known:
        return None
    found = {
        stage: _from_fields(stage, fields) for stage, fields in zip(Stage, replies, strict=True)
    }
    return {stage: pause for stage, pause in found.items() if pause is not None}


def restore(redis: Redis, kept: dict[Stage, tuple[str, float]]) -> dict[Stage, Pause]:
    """Put back the operator's pauses the database keeps (`kept`: each stage's reason and start),
    as `pause` sets them, each with its own start; every paused stage after it."""
    for stage, (reason, since) in kept.items():
        _pause(redis, stage, reason, repr(since))
    redis.set(redis_keys.pauses_restored(), 1)
    return paused(redis)


@dataclass(frozen=True)
class MailboxPause:
    mailbox: str  # the name shown ("default" for the default mailbox)
    reason: str
    since: float  # unix time


def pause_mailbox(redis: Redis, pause: MailboxPause) -> None:
    """Mirror a kept mailbox pause in Redis, for the workers' reads."""
    redis.hset(redis_keys.mailbox_pauses(), pause.mailbox, _mailbox_fields(pause))


def resume_mailbox(redis: Redis, mailbox: str) -> bool:
    """End the mailbox's pause in Redis; False if Redis held none."""
    return bool(redis.hdel(redis_keys.mailbox_pauses(), mailbox))


def paused_mailboxes_if_known(redis: Redis) -> dict[str, MailboxPause] | None:
    """Every paused mailbox, by the name shown, in one round trip; None when Redis lost the
    pauses the database keeps: `restore_mailboxes` them first."""
    pipe = redis.pipeline(transaction=False)
    pipe.exists(redis_keys.mailbox_pauses_restored())
    pipe.hgetall(redis_keys.mailbox_pauses())
    known, fields = pipe.execute()
    if not known:
        return None
    found = {}
    for name, value in fields.items():
        mailbox, held = _str(name), json.loads(value)
        found[mailbox] = MailboxPause(mailbox, held["reason"], float(held["since"]))
    return found


def restore_mailboxes(redis: Redis, kept: dict[str, tuple[str, float]]) -> dict[str, MailboxPause]:
    """Put back the mailbox pauses the database keeps (`kept`: each one's reason and start);
    every paused mailbox after it."""
    back = {name: MailboxPause(name, reason, since) for name, (reason, since) in kept.items()}
    pipe = redis.pipeline()
    pipe.delete(redis_keys.mailbox_pauses())
    if back:
        pipe.hset(
            redis_keys.mailbox_pauses(),
            mapping={name: _mailbox_fields(pause) for name, pause in back.items()},
        )
    pipe.set(redis_keys.mailbox_pauses_restored(), 1)
    pipe.execute()
    return back


def _mailbox_fields(pause: MailboxPause) -> str:
    return json.dumps({"reason": pause.reason, "since": pause.since})


def take_probe(redis: Redis, stage: Stage, interval: float) -> bool:
    """True for the one caller per `interval` that is to probe the stage."""
    return bool(redis.set(redis_keys.probe_lock(stage), 1, nx=True, px=int(interval * 1000)))


T = TypeVar("T")


class CachedPauses(Generic[T]):
    """The paused stages (or mailboxes), read at most every `max_age` seconds: a job checks them
    at its start without a round trip of its own. `read` reads them (and puts back what Redis
    lost)."""

    def __init__(self, nothing: T, max_age: float = 1.0) -> None:
        self._max_age = max_age
        self._read_at = -float("inf")
        self._paused = nothing

    def __call__(self, read: Callable[[], T]) -> T:
        now = time.monotonic()
        if now - self._read_at >= self._max_age:
            self._paused = read()
            self._read_at = now
        return self._paused

    def forget(self) -> None:
        """Drop the cached read: the next call reads the pauses again, whatever its age."""
        self._read_at = -float("inf")


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
    return Pause(
        stage,
        text.get("error", ""),
        float(text.get("since", "0")),
        text.get("by", AUTO),
        text.get("token", ""),
        text.get("dependency", ""),
    )


def _str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
