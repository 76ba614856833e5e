"""The lease that keeps two deliveries of one email from running at once.

A lease is a Redis key holding ``host:pid:token`` with a TTL. Taking it also marks the email's
job as running (the enqueue dedup marker, stamped with the time) in the same round trip. While it
is held, one thread per process renews every lease the process holds. A delivery that finds a
lease held by a live job defers itself; one whose holder died in a child process of this same host
takes the lease over at once instead of waiting out the TTL.

Only the holder gives a lease back, and only the holder touches the marker as it does: a
delivery whose lease lapsed and was taken by another leaves both to the new holder.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from redis import Redis, RedisError
from redis.commands.core import Script

from mailpipe.coordination import redis_keys

log = logging.getLogger(__name__)


def _script(source: bytes) -> Script:
    # redis-py types the client as required; a script whose every call names one needs none.
    return Script(None, source)  # type: ignore[arg-type]


# Scripts as bytes need no client to compute their SHA; each call names the client it runs on.
# KEYS: lease, marker, then the deferred sets. ARGV: holder value, lease TTL ms, marker TTL s,
# now, email id.
# The marker is stamped whether or not the lease is free: the job is queued or running either
# way. Returns 1, or the current holder and its remaining TTL.
_ACQUIRE = _script(b"""
redis.call('set', KEYS[2], ARGV[4], 'EX', ARGV[3])
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  for i = 3, #KEYS do redis.call('zrem', KEYS[i], ARGV[5]) end
  return 1
end
return {redis.call('get', KEYS[1]) or '', redis.call('pttl', KEYS[1])}
""")
# Compare-and-set scripts: only the holder renews or releases.
_RENEW = _script(b"""
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  redis.call('expire', KEYS[2], ARGV[3])
  return 1
end
return 0
""")
# ARGV[2] == '1': a follow-up message (a retry, a deferral) was or is about to be sent, so the
# marker stays, stamped anew; otherwise the job is over and the marker goes with the lease.
_RELEASE = _script(b"""
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('del', KEYS[1])
if ARGV[2] == '1' then
  redis.call('set', KEYS[2], ARGV[3], 'EX', ARGV[4])
else
  redis.call('del', KEYS[2])
end
return 1
""")
_TAKE_OVER = _script(b"""
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
""")


class LeaseHeld(Exception):
    """Another live delivery holds the lease; `wait` is how long before it may be free."""

    def __init__(self, email_id: int, holder: str, wait: float) -> None:
        super().__init__(f"email {email_id} is being processed by {holder}")
        self.wait = wait


class Lease:
    """One delivery's claim on an email: `acquire()`, run the job, `release()`; or `hold()`.

    `lost` turns true if a renewal found the lease gone or taken (the job goes on: its writes are
    fenced by its attempt number in the database, so a second runner cannot corrupt anything).
    """

    def __init__(self, redis: Redis, email_id: int, ttl: float, marker_ttl: int) -> None:
        self.redis = redis
        self.email_id = email_id
        self.keys = [redis_keys.lease(email_id), redis_keys.job_marker(email_id)]
        self.ttl_ms = int(ttl * 1000)
        self.marker_ttl = marker_ttl
        self.value = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        self.renew_at = 0.0
        self.lost = False
        self.released = False
        # Set by the job when it sends (or is about to send) a follow-up message for the email.
        self.keep_marker = False

    def acquire(self) -> None:
        """Take the lease and mark the job running, or raise LeaseHeld."""
        answer = _ACQUIRE(
            keys=[*self.keys, *redis_keys.deferred_sets()],
            args=[self.value, self.ttl_ms, self.marker_ttl, _now(), self.email_id],
            client=self.redis,
        )
        if answer != 1:
            holder, pttl = answer[0].decode(), answer[1]
            if not (holder and _holder_is_dead(holder) and self._take_over(holder)):
                wait = pttl / 1000 if pttl > 0 else 1.0
                raise LeaseHeld(self.email_id, holder or "?", wait)
        _renewer().hold(self)

    def release(self) -> bool:
        """Give the lease back, if this delivery still holds it, with the marker kept (stamped
        now) or deleted as `keep_marker` says. False when the lease was no longer this one's."""
        self.released = True
        _renewer().drop(self)
        try:
            return bool(
                _RELEASE(
                    keys=self.keys,
                    args=[self.value, "1" if self.keep_marker else "0", _now(), self.marker_ttl],
                    client=self.redis,
                )
            )
        except RedisError:
            # The job's outcome stands; the lease and the marker lapse at their TTLs.
            log.warning("email %s: could not give the lease back", self.email_id, exc_info=True)
            return False

    def renew(self) -> None:
        try:
            renewed = _RENEW(
                keys=self.keys, args=[self.value, self.ttl_ms, self.marker_ttl], client=self.redis
            )
        except Exception:
            log.warning("email %s: lease renewal failed", self.email_id, exc_info=True)
            return
        if not renewed and not self.released:
            # Gone for good: the job goes on, fenced by its attempt, and renewing stops.
            self.lost = True
            _renewer().drop(self)
            log.error("email %s: lease lost while the job was running", self.email_id)

    def _take_over(self, holder: str) -> bool:
        taken = _TAKE_OVER(
            keys=self.keys[:1], args=[holder, self.value, self.ttl_ms], client=self.redis
        )
        if taken:
            log.warning("email %s: took over the lease of dead process %s", self.email_id, holder)
        return bool(taken)


@contextmanager
def hold(redis: Redis, email_id: int, ttl: float, marker_ttl: int) -> Iterator[Lease]:
    """The lease for the length of a `with` block; raises LeaseHeld when another live delivery
    holds it. Given back however the block ends."""
    lease = Lease(redis, email_id, ttl, marker_ttl)
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()


def _now() -> str:
    return f"{time.time():.3f}"


class _Renewer:
    """The process's one renewal thread. It looks at the held leases every sixth of the shortest
    TTL it has been given and renews each lease a third of its TTL after it was taken or last
    renewed, so a lease is renewed before half its TTL has passed.

    Taking or giving back a lease never wakes the thread: a wake-up per job would hand the GIL to
    this thread in the middle of the job, and on a machine whose CPUs are all busy the job then
    waits for the thread to be scheduled."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._tick: float | None = None
        self.wakeups = 0

    def hold(self, lease: Lease) -> None:
        tick = lease.ttl_ms / 6000
        with self._changed:
            lease.renew_at = time.monotonic() + lease.ttl_ms / 3000
            self._leases[id(lease)] = lease
            if self._tick is None or tick < self._tick:
                # A shorter TTL than any before (or the first): the thread's next look must
                # come sooner than it planned.
                self._tick = tick
                self._changed.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)
                self._thread.start()

    def drop(self, lease: Lease) -> None:
        with self._changed:
            self._leases.pop(id(lease), None)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait(self._tick)
                self.wakeups += 1
                now = time.monotonic()
                due = [lease for lease in self._leases.values() if lease.renew_at <= now]
                for lease in due:
                    lease.renew_at = now + lease.ttl_ms / 3000
            for lease in due:
                lease.renew()


_process_renewer: _Renewer | None = None


def _renewer() -> _Renewer:
    global _process_renewer
    if _process_renewer is None:
        _process_renewer = _Renewer()
    return _process_renewer


def _forget_renewer_after_fork() -> None:
    # The thread does not exist in a forked child, and its lock may have been held at the fork.
    global _process_renewer
    _process_renewer = None


os.register_at_fork(after_in_child=_forget_renewer_after_fork)


def _holder_is_dead(holder: str) -> bool:
    host, _, rest = holder.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False
