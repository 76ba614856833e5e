"""The worker's side of stage pauses (mailpipe.coordination.pauses): a consumer bootstep.

Every second, on the consumer's own timer (the event loop, where Celery's `cancel_consumer` and
`add_consumer` control commands also run), the step reads the paused stages and stops consuming
the queues of a paused stage, or starts again once its pause has ended. A paused stage's jobs
then wait in the broker instead of being fetched and deferred in a loop. While a stage is paused
by an outage, one worker of the fleet per `MAILPIPE_PAUSE_PROBE_INTERVAL` runs the dependency's
check, on a thread of its own so that a slow call never stalls the event loop
(mailpipe.app.probes). When Redis has lost the operator's pauses (a flush or a restart),
a thread puts them back from the database and the step changes nothing until it has
(mailpipe.pipeline.stage_pauses).

A bootstep rather than a `worker_ready` handler: Celery starts the consumer's steps again after
a lost broker connection, with the queues it consumed at start, so the pause is applied again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from celery import bootsteps
from redis import Redis, RedisError

from mailpipe.broker.queues import Lane, Stage, family, family_of, stage_queue
from mailpipe.coordination import pauses
from mailpipe.pipeline import stage_pauses
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
        self._restoring: threading.Thread | None = None
        self._redis: Redis | None = None

    def start(self, c: Any) -> None:
        settings = get_settings()
        self._redis = Redis.from_url(
            settings.broker_url, socket_timeout=5, socket_connect_timeout=5
        )
        consumed = {queue.name for queue in c.task_consumer.queues} | self._cancelled
        # Both lanes' queues of a stage, with their shards, stop and start together.
        self._queues = [
            (stage, queue)
            for stage in Stage
            for lane in Lane
            for queue in family(stage_queue(stage, settings, lane), settings)
            if queue in consumed
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
            paused = pauses.paused_if_known(self._redis)
        except RedisError:
            return  # nothing is fetched either; the next check tells
        if paused is None:
            # Redis lost the operator's pauses: put them back off the event loop, and change
            # nothing until a check reads them.
            self._restore_kept()
            return
        stopped: dict[Stage, list[str]] = {}
        started: dict[Stage, list[str]] = {}
        for stage, queue in self._queues:
            pause = paused.get(stage)
            if pause is not None and queue not in self._cancelled:
                c.cancel_task_queue(queue)
                self._cancelled.add(queue)
                stopped.setdefault(stage, []).append(queue)
            elif pause is None and queue in self._cancelled:
                c.add_task_queue(queue)
                self._cancelled.discard(queue)
                started.setdefault(stage, []).append(queue)
        for stage, queues in stopped.items():
            by = paused[stage].by
            log.warning("%s stage paused (%s): stop consuming %s", stage, by, _named(queues))
        for stage, queues in started.items():
            log.warning("%s stage no longer paused: consuming %s again", stage, _named(queues))
        for stage, pause in paused.items():
            if pause.by == pauses.AUTO and any(each is stage for each, _ in self._queues):
                self._maybe_probe(stage, settings.pause_probe_interval)

    def _restore_kept(self) -> None:
        if self._restoring is not None and self._restoring.is_alive():
            return
        self._restoring = threading.Thread(
            target=_on_own_resources,
            args=(stage_pauses.restore, "putting back the operator's pauses failed"),
            name="mailpipe-pauses-restore",
            daemon=True,
        )
        self._restoring.start()

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
            target=_on_own_resources,
            args=(partial(_probe, stage=stage), f"{stage} stage probe failed"),
            name=f"mailpipe-probe-{stage}",
            daemon=True,
        )
        self._probing.start()


def _named(queues: list[str]) -> str:
    """The lane queues of `queues`, for a log line: their shards go with them unnamed."""
    lane_queues = [queue for queue in queues if family_of(queue) == queue]
    shards = len(queues) - len(lane_queues)
    return ", ".join(lane_queues) + (f" (and {shards} shard queues)" if shards else "")


def _probe(res: Resources, stage: Stage) -> None:
    from mailpipe.app.probes import probe

    probe(res, stage)


def _on_own_resources(work: Callable[[Resources], object], failed: str) -> None:
    """`work` on a thread's connections of its own, closed after it: children forked later must
    not inherit any in use. A failure is logged; the next check tries again."""
    res = Resources(get_settings())
    try:
        work(res)
    except Exception:
        log.exception(failed)
    finally:
        res.close()
