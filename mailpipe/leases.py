"""Step 1: the lease that keeps two deliveries of one email from running at once.

A lease is a Redis key holding ``host:pid:token`` with a TTL, renewed by a thread while the job
runs. A delivery that finds a lease held by a live job defers itself; one whose holder died in a
child process of this same host takes the lease over at once instead of waiting out the TTL.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from types import TracebackType

from redis import Redis

from mailpipe import redis_keys

log = logging.getLogger(__name__)

# Compare-and-set scripts: only the holder renews or releases.
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  redis.call('expire', KEYS[2], ARGV[3])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
_TAKE_OVER = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""


class LeaseHeld(Exception):
    """Another live delivery holds the lease; `wait` is how long before it may be free."""

    def __init__(self, email_id: int, holder: str, wait: float) -> None:
        super().__init__(f"email {email_id} is being processed by {holder}")
        self.wait = wait


class Lease:
    """A held lease; use as a context manager to renew it while the job runs and release it after."""

    def __init__(self, redis: Redis, email_id: int, ttl: float, marker_ttl: int) -> None:
        self.redis = redis
        self.email_id = email_id
        self.key = redis_keys.lease(email_id)
        self.marker = redis_keys.job_marker(email_id)
        self.ttl_ms = int(ttl * 1000)
        self.marker_ttl = marker_ttl
        self.value = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def acquire(self) -> None:
        """Take the lease, or raise LeaseHeld."""
        if self.redis.set(self.key, self.value, nx=True, px=self.ttl_ms):
            return
        holder = self.redis.get(self.key)
        if holder is not None and _holder_is_dead(holder.decode()):
            taken = self.redis.eval(_TAKE_OVER, 1, self.key, holder, self.value, self.ttl_ms)
            if taken:
                log.warning("email %s: took over the lease of dead process %s", self.email_id, holder)
                return
        pttl = self.redis.pttl(self.key)
        wait = pttl / 1000 if pttl and pttl > 0 else 1.0
        raise LeaseHeld(self.email_id, holder.decode() if holder else "?", wait)

    def __enter__(self) -> Lease:
        self.acquire()
        self._thread = threading.Thread(target=self._renew, name=f"lease-{self.email_id}", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.redis.eval(_RELEASE, 1, self.key, self.value)

    def _renew(self) -> None:
        interval = self.ttl_ms / 3000
        while not self._stop.wait(interval):
            try:
                renewed = self.redis.eval(
                    _RENEW, 2, self.key, self.marker, self.value, self.ttl_ms, self.marker_ttl
                )
            except Exception:  # noqa: BLE001 - a missed renewal is retried on the next tick
                log.warning("email %s: lease renewal failed", self.email_id, exc_info=True)
                continue
            if not renewed:
                # The job goes on: every step is idempotent, so a second runner cannot corrupt
                # anything, it can only repeat work.
                self.lost = True
                log.error("email %s: lease lost while the job was running", self.email_id)
                return


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
