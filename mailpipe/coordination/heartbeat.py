"""Worker heartbeats: which workers are alive, and which delivered messages no live worker holds.

kombu's Redis transport only gives a delivered message back when it has been unacknowledged for
the whole visibility timeout (15 minutes by default), because nothing tells it that the worker
holding the message is gone. The heartbeat does, in the manner of Sidekiq's super_fetch: each
worker's main process writes, every `MAILPIPE_WORKER_HEARTBEAT_INTERVAL` seconds, its heartbeat
and the delivery tags of every message it holds (running, reserved for a busy child, or waiting
for its countdown). On a thread of its own, so that a slow pass never delays a beat, each worker
also looks, under a short lock, for delivered messages that no live worker has held for
`MAILPIPE_WORKER_DEAD_AFTER` seconds, and puts them back at the front of their queue, a bounded
number per pass. A live worker reports each message within one interval of receiving it, so one
that is held stays held; a worker killed whole (SIGKILL, OOM, a lost host) loses its messages to
another within about `dead_after` plus one interval. The visibility timeout stays as the last
line of defence.

Clocks. Every time written or compared here is Redis's (`TIME`), so that hosts whose clocks
disagree agree on who is alive. The hosts' own clocks serve only to pace their threads and to
time a pass against its budget (`time.monotonic`, never compared with another host's). kombu
scores its unacked index with the delivering host's `time.time()`, so those scores are not read:
how long a message has been held by no live worker is timed on Redis's clock instead.

Plain Python on Redis: the worker's signal handlers start the threads and hand them the received
tags and the way to restore a message (kombu's own `restore_by_tag`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from redis import Redis, RedisError
from redis.exceptions import LockError

from mailpipe.broker import layout
from mailpipe.coordination import redis_keys

log = logging.getLogger(__name__)

# Messages put back per recovery pass at most; the rest wait for the next pass, one interval on.
# A restore is a few milliseconds, so a full pass stays well inside its time budget.
MAX_RESTORED_PER_PASS = 500


@dataclass(frozen=True)
class Recovery:
    """One recovery pass: the delivery tags it put back, and how many it found due but left for
    the next pass (its bound or its time budget cut it short)."""

    restored: list[str]
    left: int


class WorkerHeartbeat:
    """The heartbeat and recovery threads of one worker process."""

    def __init__(
        self,
        redis: Redis,
        worker_id: str,
        *,
        interval: float,
        dead_after: float,
        restore: Callable[[str], None],
        queues: Callable[[], Sequence[str]] = tuple,
        health_file: Path | None = None,
        max_restored: int = MAX_RESTORED_PER_PASS,
        version: str = "",
    ) -> None:
        self.redis = redis
        self.worker_id = worker_id
        # Its release: a fleet half rolled to the next one shows as two (`live_versions`).
        self.version = version
        # What it consumes now (a worker can be told to add a queue): RunningTasks is per queue.
        self._queues = queues
        self._registered: set[str] = set()
        self.interval = interval
        self.dead_after = dead_after
        self._restore = restore
        self._max_restored = max_restored
        self._health_file = health_file
        self._health_file_failed = False
        self._held: set[str] = set()
        self._held_lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._every, args=(act,), name=name, daemon=True)
            for name, act in (
                ("mailpipe-heartbeat", self.beat),
                ("mailpipe-recovery", self.recover),
            )
        ]

    def received(self, delivery_tag: str) -> None:
        """A message was delivered to this worker (called from its event loop)."""
        with self._held_lock:
            self._held.add(delivery_tag)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float) -> None:
        """Stop beating and leave the registry: this worker's messages are acknowledged or were
        put back by kombu as it closed, so nothing of it is left to recover."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
        try:
            pipe = self.redis.pipeline(transaction=False)
            for registry in (
                redis_keys.workers(),
                redis_keys.workers_of(self.version),
                *map(redis_keys.workers_on, self._registered),
            ):
                pipe.zrem(registry, self.worker_id)
            pipe.delete(redis_keys.worker_held(self.worker_id))
            pipe.execute()
        except RedisError:
            log.warning("heartbeat: could not leave the registry; the entry lapses", exc_info=True)

    def beat(self) -> None:
        """Write the heartbeat and the messages still held (those acknowledged are dropped)."""
        with self._held_lock:
            tags = sorted(self._held)
        if tags:
            gone = {
                t
                for t, held in zip(tags, layout.still_unacked(self.redis, tags), strict=True)
                if not held
            }
            if gone:
                with self._held_lock:
                    self._held -= gone
                tags = [t for t in tags if t not in gone]
        key = redis_keys.worker_held(self.worker_id)
        # Scored by Redis's clock, which every reader compares with: a host's skew is no matter.
        # Read a round trip before the write, the score is at most that much early: the safe side.
        now = redis_time(self.redis)
        pipe = self.redis.pipeline(transaction=True)
        queues = set(self._queues())
        for registry in (
            redis_keys.workers(),
            redis_keys.workers_of(self.version),
            *map(redis_keys.workers_on, queues),
        ):
            pipe.zadd(registry, {self.worker_id: now})
        pipe.sadd(redis_keys.worker_versions(), self.version)
        for left in self._registered - queues:
            pipe.zrem(redis_keys.workers_on(left), self.worker_id)
        self._registered = queues
        pipe.delete(key)
        if tags:
            pipe.sadd(key, *tags)
        pipe.expire(key, math.ceil(self.dead_after * 2))
        pipe.execute()
        if self._health_file is not None:
            self._touch_health_file(self._health_file)

    def _touch_health_file(self, path: Path) -> None:
        """Touched only once the heartbeat reached Redis: the file's age is the health check's
        (deploy/README.md). A file that cannot be touched fails the check, not the heartbeat."""
        try:
            path.touch()
        except OSError as exc:
            if not self._health_file_failed:
                log.warning("heartbeat: cannot touch the health file %s: %s", path, exc)
            self._health_file_failed = True
        else:
            self._health_file_failed = False

    def recover(self) -> Recovery | None:
        """If no other worker is at it, put back the messages no live worker holds; None when
        another worker holds the lock."""
        # The lock outlasts the pass's budget with room for the restore under way when it ends.
        lock = self.redis.lock(
            redis_keys.reaper_lock(), timeout=recovery_budget(self.dead_after) * 2, blocking=False
        )
        if not lock.acquire():
            return None
        try:
            recovery = recover_orphans(
                self.redis, self.dead_after, self._restore, max_restored=self._max_restored
            )
        finally:
            try:
                lock.release()
            except LockError:
                log.warning("heartbeat: the recovery outlived its lock", exc_info=True)
        if recovery.restored or recovery.left:
            log.warning(
                "heartbeat: put back %d message(s) that no live worker holds%s: %s",
                len(recovery.restored),
                f"; pass cut short, {recovery.left} left for the next" if recovery.left else "",
                ", ".join(recovery.restored[:10]),
            )
        return recovery

    def _every(self, act: Callable[[], object]) -> None:
        """Run `act` every interval until stopped; a late run (a slow Redis) is followed at once
        by the next, not by the runs it missed."""
        due = time.monotonic()
        while not self._stopping.is_set():
            try:
                act()
            except Exception:
                log.warning("heartbeat: %s failed", act.__name__, exc_info=True)
            due = max(due + self.interval, time.monotonic())
            self._stopping.wait(due - time.monotonic())


def recovery_budget(dead_after: float) -> float:
    """Seconds a recovery pass may spend putting messages back: well below `dead_after`, so that a
    pass ends long before its lock does."""
    return dead_after / 4


def recover_orphans(
    redis: Redis,
    dead_after: float,
    restore: Callable[[str], None],
    *,
    max_restored: int = MAX_RESTORED_PER_PASS,
    clock: Callable[[], float] = time.monotonic,
) -> Recovery:
    """Put back the messages no live worker has held for `dead_after` seconds, oldest first, at
    most `max_restored` of them and for at most `recovery_budget` seconds; forget the workers
    that stopped beating.

    Since when each delivered message has been held by no live worker is kept, on Redis's clock,
    in the `unheld` sorted set: a dead worker's messages from its last heartbeat, a message no
    worker ever named from the first pass that saw it. Each pass rewrites the set with what is
    still delivered and unheld, so a message held, acknowledged or put back leaves it, and one
    delivered again after being put back starts afresh.
    """
    started = clock()
    # Everything compared with `cutoff` was written with Redis's clock (heartbeats, the unheld
    # times); the only local clock is `clock`, which times this pass and nothing else.
    now = redis_time(redis)
    cutoff = now - dead_after
    workers = redis_keys.workers()
    dead: list[tuple[bytes, float]] = redis.zrangebyscore(  # type: ignore[assignment]
        workers, "-inf", f"({cutoff}", withscores=True
    )
    live = [_text(w) for w in redis.zrangebyscore(workers, cutoff, "+inf")]
    held = (
        {_text(t) for t in redis.sunion([redis_keys.worker_held(w) for w in live])}
        if live
        else set()
    )
    recorded: list[tuple[bytes, float]] = redis.zrange(  # type: ignore[assignment]
        redis_keys.unheld(), 0, -1, withscores=True
    )
    since = {_text(tag): at for tag, at in recorded}
    for worker, last_beat in dead:
        for tag in map(_text, redis.smembers(redis_keys.worker_held(_text(worker)))):
            since[tag] = min(since.get(tag, last_beat), last_beat)
    unheld = {tag: since.get(tag, now) for tag in layout.delivered(redis) if tag not in held}
    due = sorted((tag for tag, s in unheld.items() if s <= cutoff), key=unheld.__getitem__)
    restored: list[str] = []
    try:
        for tag in due[:max_restored]:
            if clock() - started >= recovery_budget(dead_after):
                break
            restore(tag)
            restored.append(tag)
    finally:
        for tag in restored:
            del unheld[tag]
        pipe = redis.pipeline(transaction=True)
        pipe.delete(redis_keys.unheld())
        if unheld:
            pipe.zadd(redis_keys.unheld(), unheld)
            # Passes come every interval. Times that no pass refreshed for long (the whole fleet
            # was down) lapse rather than cut short the time of a holder that has not beaten
            # yet; those messages are then timed afresh, later but never lost.
            pipe.pexpire(redis_keys.unheld(), math.ceil(dead_after * 2000))
        if dead:
            # Their messages' times are in the unheld set now, so a pass cut short loses none.
            pipe.zrem(workers, *(w for w, _ in dead))
            pipe.delete(*(redis_keys.worker_held(_text(w)) for w, _ in dead))
        pipe.execute()
    return Recovery(restored, len(due) - len(restored))


def live_workers(redis: Redis, dead_after: float, *queues: str) -> int:
    """Worker processes (ECS tasks) whose heartbeat is fresh; with `queues`, those consuming any
    of them, each counted once (the entries of workers gone for good are dropped on the way)."""
    cutoff = redis_time(redis) - dead_after
    if not queues:
        return int(redis.zcount(redis_keys.workers(), cutoff, "+inf"))
    pipe = redis.pipeline(transaction=False)
    for registry in map(redis_keys.workers_on, queues):
        pipe.zremrangebyscore(registry, "-inf", cutoff - dead_after)
        pipe.zrangebyscore(registry, cutoff, "+inf")
    return len(set().union(*pipe.execute()[1::2]))


def live_versions(redis: Redis, dead_after: float) -> dict[str, int]:
    """Worker processes with a fresh heartbeat per release; a release none of whose workers is
    left is forgotten."""
    cutoff = redis_time(redis) - dead_after
    versions = sorted(_text(v) for v in redis.smembers(redis_keys.worker_versions()))
    pipe = redis.pipeline(transaction=False)
    for version in versions:
        pipe.zremrangebyscore(redis_keys.workers_of(version), "-inf", cutoff - dead_after)
        pipe.zcount(redis_keys.workers_of(version), cutoff, "+inf")
    counts = dict(zip(versions, pipe.execute()[1::2], strict=True))
    gone = [version for version, count in counts.items() if not count]
    if gone:
        redis.srem(redis_keys.worker_versions(), *gone)
    return {version: int(count) for version, count in counts.items() if count}


@dataclass(frozen=True)
class LiveWorker:
    """A worker process with a fresh heartbeat, as the console lists it."""

    worker_id: str  # the Celery node name, the process id and a random suffix
    last_seen_s: float  # since its last heartbeat, on Redis's clock
    queues: list[str]  # those of `queues` (asked about) that it consumes

    @property
    def hostname(self) -> str:
        return self.worker_id.rsplit(":", 2)[0]


def live_worker_list(redis: Redis, dead_after: float, queues: Sequence[str]) -> list[LiveWorker]:
    """The worker processes whose heartbeat is fresh, the most recently seen first, each with the
    queues among `queues` it consumes."""
    now = redis_time(redis)
    cutoff = now - dead_after
    pipe = redis.pipeline(transaction=False)
    pipe.zrangebyscore(redis_keys.workers(), cutoff, "+inf", withscores=True)
    for queue in queues:
        pipe.zrangebyscore(redis_keys.workers_on(queue), cutoff, "+inf")
    beats, *consumers = pipe.execute()
    on = [{_text(w) for w in members} for members in consumers]
    workers = [
        LiveWorker(
            _text(worker),
            max(0.0, now - at),
            [queue for queue, members in zip(queues, on, strict=True) if _text(worker) in members],
        )
        for worker, at in beats
    ]
    return sorted(workers, key=lambda w: w.last_seen_s)


def redis_time(redis: Redis) -> float:
    """Redis's clock, in unix seconds: the one every host agrees on."""
    seconds, microseconds = redis.time()
    return seconds + microseconds / 1e6


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
