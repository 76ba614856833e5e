"""A beat scheduler that fires only while it holds the fleet's beat lock in Redis.

Two `celery beat` processes may run (a deploy overlap, a standby): the one holding the lock fires
the schedule, the other checks the lock every third of its timeout and takes over when the holder
stops renewing it, so within `MAILPIPE_BEAT_LOCK_TIMEOUT` (default 60 s) plus one check of a
holder being killed. The lock is a plain key with a TTL, so a Redis flush only means the next
beat to ask holds it. celery-redbeat was the alternative; it keeps the schedule itself in Redis,
which this Redis (no persistence, flushed in chaos tests) would lose.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any

from celery.beat import PersistentScheduler
from redis import Redis, RedisError

from mailpipe import redis_keys
from mailpipe.enqueue import declare_queue
from mailpipe.queues import control_queue, email_queue
from mailpipe.settings import get_settings

log = logging.getLogger(__name__)

# Renew when held, take when free; 1 when this scheduler holds the lock afterwards.
_HOLD = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  return 1
end
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class LockedScheduler(PersistentScheduler):
    """`PersistentScheduler` that fires only while it holds the beat lock."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = self._settings = get_settings()
        self._redis = Redis.from_url(settings.broker_url, socket_timeout=5, socket_connect_timeout=5)
        self._lock_key = redis_keys.beat_lock()
        self._lock_ms = settings.beat_lock_timeout * 1000
        self._token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        self._active = False
        super().__init__(*args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        check_every = self._lock_ms / 3000
        if not self._hold_lock():
            return check_every
        self._declare_queues()
        return min(super().tick(*args, **kwargs), check_every)

    def close(self) -> None:
        try:
            if self._active:
                self._redis.eval(_RELEASE, 1, self._lock_key, self._token)
        except RedisError:
            log.warning("beat: could not release the lock; it expires by itself", exc_info=True)
        super().close()

    def _declare_queues(self) -> None:
        # A flushed Redis forgets kombu's queue bindings, and a sweep sent to an unbound queue is
        # dropped silently: the recovery would be lost with what it recovers from.
        try:
            with self.app.producer_or_acquire() as producer:
                for name in (email_queue(self._settings), control_queue(self._settings)):
                    declare_queue(self.app, producer, name)
        except Exception:  # noqa: BLE001 - the next tick tries again; sends retry on their own
            log.warning("beat: could not declare the queues", exc_info=True)

    def _hold_lock(self) -> bool:
        try:
            held = bool(self._redis.eval(_HOLD, 1, self._lock_key, self._token, self._lock_ms))
        except RedisError:
            # Redis down: the broker is down too, nothing could be sent anyway.
            log.warning("beat: Redis unreachable; not firing", exc_info=True)
            held = False
        if held != self._active:
            log.warning("beat: %s the scheduler lock", "holding" if held else "lost")
            self._active = held
        return held
