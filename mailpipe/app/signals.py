"""Every Celery signal handler of mailpipe, each explained in a line.

Loaded by the processes that run Celery's loops (the configuration's `imports`), never by one
that merely publishes jobs.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import uuid
from typing import Any

from billiard.util import get_logger as _multiprocessing_logger
from celery.apps import worker
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    celeryd_after_setup,
    task_received,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from redis import Redis, RedisError

from mailpipe import __version__, resources
from mailpipe.app import logs
from mailpipe.app.pausing import PauseStep
from mailpipe.app.tasks import sweep
from mailpipe.broker.queues import family, job_queues
from mailpipe.celery import app
from mailpipe.coordination import heartbeat, redis_keys
from mailpipe.settings import Settings, get_settings

log = logging.getLogger(__name__)

# Workers stop consuming a paused stage's queues and probe it (mailpipe.app.pausing).
app.steps["consumer"].add(PauseStep)

# The worker main process's threads, between worker_ready and worker_shutdown.
_heartbeat: heartbeat.WorkerHeartbeat | None = None


@after_setup_logger.connect
def _log_format(logger: logging.Logger | None = None, **_: Any) -> None:
    """Celery's handlers write tracebacks in describe()'s words, and JSON lines with
    MAILPIPE_LOG_FORMAT=json (mailpipe.app.logs), in the worker (its children inherit them) and
    in beat."""
    log_format = get_settings().log_format
    logs.set_up(logger, log_format)
    logs.set_up(_multiprocessing_logger(), log_format)


@after_setup_task_logger.connect
def _task_log_format(logger: logging.Logger | None = None, **_: Any) -> None:
    """The same for Celery's task logger, which has handlers of its own."""
    logs.set_up(logger, get_settings().log_format)


@celeryd_after_setup.connect
def _consume_the_mailboxes_shards(instance: Any = None, **_: Any) -> None:
    """A worker given a lane queue (`-Q`, or every queue) consumes its mailboxes' shard queues
    with it, so that the Procfile, the task definitions and an operator name lane queues only
    (mailpipe.broker.mailboxes). Celery's documented way to add queues after -Q is applied."""
    settings = get_settings()
    queues = instance.app.amqp.queues
    consumed = set(queues.consume_from)
    for queue in job_queues(settings):
        if queue in consumed:
            for shard in family(queue, settings)[1:]:
                queues.select_add(shard)


@worker_init.connect
def _json_notices(**_: Any) -> None:
    """MAILPIPE_LOG_FORMAT=json: the worker's shutdown notices, which Celery writes itself, are
    JSON lines too."""
    if get_settings().log_format == "json":
        logs.use_json_for_celery_notices()


@worker_init.connect
def _build_the_classifier(**_: Any) -> None:
    """Build the classifier once at start, so that a missing rules file, a rule naming a label
    outside MAILPIPE_LABELS or a bad regex stops the worker with the reason, instead of failing
    every job once model calls are on (each child builds its own again, lazily)."""
    from mailpipe.classifiers import make_classifier

    settings = get_settings()
    try:
        make_classifier(settings)
    except Exception as exc:
        raise SystemExit(f"mailpipe worker: {_classifier_problem(settings, exc)}") from None


@worker_init.connect
def _warn_of_settings_that_defeat_a_mechanism(**_: Any) -> None:
    """Windows that defeat one another, a database reached without TLS: warned of, not refused."""
    settings = get_settings()
    for warning in [*settings.window_warnings(), *settings.database_tls_warnings()]:
        log.warning("settings: %s", warning)


@worker_init.connect
def _refuse_an_evicting_redis(**_: Any) -> None:
    """A Redis that may evict keys loses them silently: allkeys-* the queued jobs, volatile-* the
    coordination keys, which all have a TTL. Refuse to start on anything but noeviction."""
    policy = _maxmemory_policy(get_settings().broker_url)
    if policy is not None and policy != "noeviction":
        raise SystemExit(
            f"Redis maxmemory-policy is {policy}: it may evict keys mailpipe needs (allkeys-* "
            "evicts queued jobs; volatile-* evicts leases, dedup markers and heartbeats first, "
            "as they have a TTL). Set it to noeviction before starting workers (on ElastiCache, "
            "in a custom parameter group: the default one uses volatile-lru)."
        )


@worker_init.connect
def _commit_like_a_job_process(**_: Any) -> None:
    """The worker runs jobs, in its children or on its threads (mailpipe.resources.runs_jobs)."""
    resources.runs_jobs()


@worker_init.connect
def _freeze_heap_before_fork(**_: Any) -> None:
    """Objects the main process built so far stay shared with the children: the cyclic GC would
    otherwise touch them in every child and copy their pages (docs/decisions/gc-freeze.md)."""
    gc.collect()
    gc.freeze()


@worker_process_init.connect
def _fresh_resources_in_child(**_: Any) -> None:
    """Connections do not survive fork: each worker child builds its own."""
    resources.reset()


@worker_process_shutdown.connect
def _close_resources_in_child(**_: Any) -> None:
    """Close the child's pools cleanly when it is recycled (max tasks per child)."""
    resources.get_resources().close()


@task_received.connect
def _hold_delivery(request: Any = None, **_: Any) -> None:
    """The heartbeat reports every message this worker holds, so that none is taken from it."""
    if _heartbeat is not None and request is not None:
        _heartbeat.received(request.message.delivery_tag)


@worker_ready.connect
def _say_the_release(sender: Any = None, **_: Any) -> None:
    """Every worker's start names its release, so that a half-rolled fleet can be read in logs."""
    log.info("mailpipe %s: worker %s ready", __version__, getattr(sender, "hostname", "?"))


@worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    """Liveness and held messages every few seconds, from a thread of the main process; a dead
    worker's messages go back to the queue within about MAILPIPE_WORKER_DEAD_AFTER, put back by
    a second thread so that a long recovery never delays a beat."""
    global _heartbeat
    settings = get_settings()
    if _heartbeat is not None:
        return
    nodename = getattr(sender, "hostname", None) or "worker"
    worker_id = f"{nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    # A broker connection of the recovery thread's own, never one from the app's pool: children
    # forked later close the pool's connections, and would block on one this thread is using.
    connection = app.connection_for_write()

    def restore(tag: str) -> None:
        connection.default_channel.qos.restore_by_tag(tag)

    _heartbeat = heartbeat.WorkerHeartbeat(
        _redis(settings.broker_url),
        worker_id,
        version=__version__,
        interval=settings.worker_heartbeat_interval,
        dead_after=settings.worker_dead_after,
        restore=restore,
        queues=lambda: _consumed_queues(sender),
        # The ECS health check tests this file's age: fresh while heartbeats reach Redis, which
        # is also what keeps this worker's messages its own (deploy/README.md, Health checks).
        health_file=settings.worker_health_file,
    )
    _heartbeat.start()


@worker_ready.connect
def _sweep_once_per_fleet_start(**_: Any) -> None:
    """Runs that waited (for model calls, or through an outage) are picked up at once, not at
    the next scheduled sweep; the first worker of a fleet start sends it, the others see its key."""
    settings = get_settings()
    try:
        first = _redis(settings.broker_url).set(
            redis_keys.startup_sweep(),
            os.getpid(),
            nx=True,
            ex=max(1, int(settings.sweep_interval)),
        )
    except RedisError:
        log.warning("could not send the start-up sweep; the schedule covers it", exc_info=True)
        return
    if first:
        sweep.apply_async()


@worker_shutting_down.connect
def _say_what_a_normal_stop_did(sig: str = "", how: str = "", **_: Any) -> None:
    """Sent in the signal handler, after the stop's wait. The roles remap SIGTERM to SIGQUIT so
    that a stop gives running jobs a bounded wait (Celery's soft shutdown), and Celery then
    says "Cold shutdown" at every deploy: say what the stop was, with Celery's own signal-safe
    write (a JSON line in JSON mode, `logs.use_json_for_celery_notices`)."""
    if (sig, how) == ("SIGTERM", "Cold"):
        worker.safe_say(
            "worker: warm shutdown at SIGTERM: no new jobs, and running ones had up to "
            f"{get_settings().soft_shutdown_timeout:g} s to finish; any still running went back "
            "to their queue (Celery names this stop cold: its soft shutdown, with "
            "REMAP_SIGTERM=SIGQUIT)",
            sys.__stdout__,
        )


@worker_shutdown.connect
def _stop_threads(**_: Any) -> None:
    """Sent once the pool has stopped: the heartbeat leaves the registry (a beat or a recovery in
    flight gets a second, then is left to die with the process: the threads are daemons)."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop(timeout=1.0)
        _heartbeat = None


def _consumed_queues(consumer: Any) -> list[str]:
    """The queues the worker consumes now (`-Q`, and any added or cancelled since)."""
    task_consumer = getattr(consumer, "task_consumer", None)
    return [queue.name for queue in list(task_consumer.queues)] if task_consumer else []


def _classifier_problem(settings: Settings, exc: Exception) -> str:
    """What is wrong with the classifier's configuration, naming the setting to fix."""
    if settings.model_backend == "rules":
        source = (
            f"MAILPIPE_RULES_FILE ({settings.rules_file})"
            if settings.rules_file is not None
            else "the bundled rules"
        )
        if isinstance(exc, OSError):
            return f"{source} cannot be read: {exc.strerror or exc}"
        if isinstance(exc, re.error):
            return f"{source} has a bad regex {exc.pattern!r}: {exc.msg}"
        if isinstance(exc, KeyError):
            return f"{source} has a rule without {exc}"
        return f"{source} is not valid: {exc}"
    return f"the {settings.model_backend} classifier cannot be built: {type(exc).__name__}: {exc}"


def _redis(url: str) -> Redis:
    return Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def _maxmemory_policy(url: str) -> str | None:
    """The server's eviction policy (INFO tells it where managed services hide CONFIG); None,
    with a warning, when Redis cannot be asked (down at start: kombu's own retries handle that)
    or does not say."""
    try:
        policy = _redis(url).info("memory").get("maxmemory_policy")
    except RedisError:
        log.warning("could not read Redis's maxmemory-policy", exc_info=True)
        return None
    if policy is None:
        log.warning("Redis does not tell its maxmemory-policy; it must be noeviction")
        return None
    return str(policy)
