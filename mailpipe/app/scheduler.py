"""A beat scheduler that fires only while it holds the fleet's beat lock in Redis.

Two `celery beat` processes may run (a deploy overlap, a standby): the one holding the lock fires
the schedule, the other checks the lock every third of its timeout and takes over when the holder
stops renewing it, so within `MAILPIPE_BEAT_LOCK_TIMEOUT` (default 60 s) plus one check of a
holder being killed. The lock is redis-py's `Lock`, a key with a TTL, so a Redis flush only means the next
beat to ask holds it. celery-redbeat was the alternative; it keeps the schedule itself in Redis,
which this Redis (no persistence, flushed in chaos tests) would lose.

The lock holder also reports the fleet's metrics every `MAILPIPE_METRICS_INTERVAL` seconds, and
prunes what only grows every `MAILPIPE_HOUSEKEEPING_INTERVAL` (mailpipe.operations.housekeeping),
from this process, which runs no jobs, each on a thread of its own
(`mailpipe.app.periodic.Periodic`): a report never waits behind busy workers, and a slow
CloudWatch or a long pass never delays a tick. A standby does neither, so the fleet has one report
per interval and one housekeeper. With model batches on, it also forms, submits, follows and
applies the bulk lane's model batches every `MAILPIPE_MODEL_BATCH_INTERVAL`
(mailpipe.pipeline.batches), the one leader of the batches.

Each tick whose lock check reached Redis, holding the lock or standing by, touches
`MAILPIPE_BEAT_HEALTH_FILE`: the ECS health check tests that file's age (deploy/README.md). A tick
comes at least every third of the lock timeout (20 s by default).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery.beat import PersistentScheduler
from redis import Redis, RedisError
from redis.exceptions import LockError, LockNotOwnedError

from mailpipe.app.periodic import Periodic
from mailpipe.broker.queues import control_queue, job_queues
from mailpipe.classifiers.batch import BatchModel
from mailpipe.coordination import redis_keys
from mailpipe.enqueue import declare_queue, sender
from mailpipe.operations import housekeeping, metrics, sinks
from mailpipe.pipeline import batches
from mailpipe.resources import Resources, get_resources
from mailpipe.settings import get_settings

log = logging.getLogger(__name__)


class LockedScheduler(PersistentScheduler):
    """`PersistentScheduler` that fires, and reports the fleet's metrics, only while it holds
    the beat lock."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = self._settings = get_settings()
        problem = settings.model_batch_leader_problem()
        if problem is not None:
            # The bulk lane's runs would wait for batches no leader forms.
            raise ValueError(f"beat: {problem}")
        self._redis = Redis.from_url(
            settings.broker_url, socket_timeout=5, socket_connect_timeout=5
        )
        self._lock_timeout = settings.beat_lock_timeout
        # Not thread-local: beat may close the scheduler from another thread than the ticks'.
        self._lock = self._redis.lock(
            redis_keys.beat_lock(), timeout=self._lock_timeout, blocking=False, thread_local=False
        )
        self._active = False
        self._health_file: Path = settings.beat_health_file
        self._health_file_failed = False
        res, sink = get_resources(), sinks.make_sink(settings)
        self._reporter = Periodic(
            "metrics report", lambda: metrics.report(res, sink), settings.metrics_interval
        )
        self._housekeeper = Periodic(
            "housekeeping", lambda: housekeeping.prune(res), settings.housekeeping_interval
        )
        self._batches = Periodic("model batches", _batch_leader(res), settings.model_batch_interval)
        super().__init__(*args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        check_every = self._lock_timeout / 3
        if not self._hold_lock():
            return check_every
        self._declare_queues()
        next_report = self._reporter.tick()
        next_pass = self._housekeeper.tick()
        # With batches switched off, the pass sends the emails still waiting through real-time.
        bedrock = self._settings.model_backend == "bedrock"
        next_batches = self._batches.tick() if bedrock else check_every
        return min(super().tick(*args, **kwargs), check_every, next_report, next_pass, next_batches)

    def close(self) -> None:
        try:
            if self._active:
                # Beat closes its scheduler twice at exit (on stop, and again as it syncs).
                self._active = False
                self._lock.release()
        except (RedisError, LockError):
            log.warning("beat: could not release the lock; it expires by itself", exc_info=True)
        super().close()

    def _declare_queues(self) -> None:
        # A flushed Redis forgets kombu's queue bindings, and a sweep sent to an unbound queue is
        # dropped silently: the recovery would be lost with what it recovers from.
        try:
            with self.app.producer_or_acquire() as producer:
                for name in (*job_queues(self._settings), control_queue(self._settings)):
                    declare_queue(self.app, producer, name)
        except Exception:
            log.warning("beat: could not declare the queues", exc_info=True)

    def _hold_lock(self) -> bool:
        try:
            # Renew while held (the TTL starts again), take when free.
            held = self._lock.reacquire() if self._active else self._lock.acquire()
        except LockNotOwnedError:
            held = False  # it lapsed and another beat took it
        except RedisError:
            # Redis down: the broker is down too, nothing could be sent anyway.
            log.warning("beat: Redis unreachable; not firing", exc_info=True)
            return self._set_active(False)
        self._touch_health_file()
        return self._set_active(held)

    def _set_active(self, held: bool) -> bool:
        if held != self._active:
            log.warning("beat: %s the scheduler lock", "holding" if held else "lost")
            self._active = held
        return held

    def _touch_health_file(self) -> None:
        try:
            self._health_file.touch()
        except OSError as exc:
            if not self._health_file_failed:
                log.warning("beat: cannot touch the health file %s: %s", self._health_file, exc)
            self._health_file_failed = True
        else:
            self._health_file_failed = False


def _batch_leader(res: Resources) -> Callable[[], object]:
    """The batches' pass, with the `bedrock` control-plane client built on its first run (on
    the pass's thread, after beat has started)."""
    model: list[BatchModel] = []

    def run() -> object:
        if not model:
            model.append(BatchModel.from_settings(res.settings))
        return batches.tick(res, sender(res), model[0])

    return run
