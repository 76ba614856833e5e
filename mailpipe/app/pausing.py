"""The worker's side of stage pauses (mailpipe.coordination.pauses): a consumer bootstep.

Every second, on the consumer's own timer (the event loop, where Celery's `cancel_consumer` and
`add_consumer` control commands also run), the step reads the paused stages and stops consuming
the queues of a paused stage, or starts again once its pause has ended. A paused stage's jobs
then wait in the broker instead of being fetched and deferred in a loop. While a stage is paused
by an outage, one worker of the fleet per `MAILPIPE_PAUSE_PROBE_INTERVAL` runs the dependency's
check, on a thread of its own so that a slow call never stalls the event loop
(mailpipe.operations.probes).

A bootstep rather than a `worker_ready` handler: Celery starts the consumer's steps again after
a lost broker connection, with the queues it consumed at start, so the pause is applied again.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import bootsteps
from redis import Redis, RedisError

from mailpipe.broker.queues import Lane, Stage, stage_queue
from mailpipe.coordination import pauses
from mailpipe.resources import Resources
from mailpipe.settings import get_settings

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0


class PauseStep(bootsteps.StartStopStep):
    """Stops and restarts consuming the queues of paused stages."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer_entry: Any = None
        self._cancelled: set[str] = set()
        self._probing: threading.Thread | None = None
        self._redis: Redis | None = None

    def start(self, c: Any) -> None:
        settings = get_settings()
        self._redis = Redis.from_url(
            settings.broker_url, socket_timeout=5, socket_connect_timeout=5
        )
        consumed = {queue.name for queue in c.task_consumer.queues} | self._cancelled
        # Both lanes' queues of a stage stop and start together.
        self._queues = [
            (stage, stage_queue(stage, settings, lane))
            for stage in Stage
            for lane in Lane
            if stage_queue(stage, settings, lane) in consumed
        ]
        self._check(c)
        self._timer_entry = c.timer.call_repeatedly(CHECK_EVERY_S, self._check, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self._timer_entry is not None:
            self._timer_entry.cancel()
            self._timer_entry = None

    def _check(self, c: Any) -> None:
        settings = get_settings()
        assert self._redis is not None
        try:
            paused = pauses.paused(self._redis)
        except RedisError:
            return  # nothing is fetched either; the next check tells
        for stage, queue in self._queues:
            pause = paused.get(stage)
            if pause is not None and queue not in self._cancelled:
                log.warning("%s stage paused (%s): stop consuming %s", stage, pause.by, queue)
                c.cancel_task_queue(queue)
                self._cancelled.add(queue)
            elif pause is None and queue in self._cancelled:
                log.warning("%s stage no longer paused: consuming %s again", stage, queue)
                c.add_task_queue(queue)
                self._cancelled.discard(queue)
            if pause is not None and pause.by == pauses.AUTO:
                self._maybe_probe(stage, settings.pause_probe_interval)

    def _maybe_probe(self, stage: Stage, interval: float) -> None:
        assert self._redis is not None
        if self._probing is not None and self._probing.is_alive():
            return
        try:
            if not pauses.take_probe(self._redis, stage, interval):
                return
        except RedisError:
            return
        self._probing = threading.Thread(
            target=_probe, args=(stage,), name=f"mailpipe-probe-{stage}", daemon=True
        )
        self._probing.start()


def _probe(stage: Stage) -> None:
    from mailpipe.operations.probes import probe

    # Connections of the probe's own, closed after it: children forked later must not inherit
    # any in use.
    res = Resources(get_settings())
    try:
        probe(res, stage)
    except Exception:
        log.exception("%s stage probe failed", stage)
    finally:
        res.close()
