"""Every Celery signal handler of mailpipe, each explained in a line."""

from __future__ import annotations

import gc
import logging
import time
from functools import partial
from typing import Any

from celery.signals import (
    beat_init,
    before_task_publish,
    worker_process_init,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)

from mailpipe import flags, metrics, resources
from mailpipe.queuestats import ENQUEUED_AT_HEADER
from mailpipe.settings import get_settings

log = logging.getLogger(__name__)

# The worker main process's metrics thread, between worker_ready and worker_shutdown.
_metrics_reporter: metrics.MetricsReporter | None = None


@worker_init.connect
def _freeze_heap_before_fork(**_: Any) -> None:
    """Objects the main process built so far stay shared with the children: the cyclic GC would
    otherwise touch them in every child and copy their pages (measured: a child's private memory
    from 85 to 51 MiB after jobs, docs/model-calls.md)."""
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


@before_task_publish.connect
def _stamp_enqueue_time(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """The oldest waiting job's age is read from this stamp (OldestJobAgeSeconds)."""
    if headers is not None:
        headers.setdefault(ENQUEUED_AT_HEADER, time.time())


@worker_ready.connect
@beat_init.connect
def _sweep_at_start_when_model_calls_are_on(sender: Any = None, **_: Any) -> None:
    """Runs that waited for model calls are picked up at once, not at the next scheduled sweep."""
    from mailpipe.tasks import sweep

    res = resources.get_resources()
    try:
        with res.db.session() as session:
            enabled = flags.model_calls_enabled(session)
    except Exception:  # noqa: BLE001 - no schema yet or database down: the schedule covers it
        log.warning("could not read the model-calls switch at start", exc_info=True)
        return
    if enabled:
        sweep.apply_async()
    # The main process must not keep connections that its forked children would inherit.
    resources.get_resources().close()
    resources.reset()


@worker_ready.connect
def _start_metrics_reporter(**_: Any) -> None:
    """Backlog metrics from the main process, on a daemon thread so that a slow CloudWatch never
    stalls job intake (mailpipe.metrics.MetricsReporter)."""
    global _metrics_reporter
    from mailpipe.celery import app
    from mailpipe.tasks import count_live_workers

    settings = get_settings()
    if not settings.worker_metrics or _metrics_reporter is not None:
        return
    # The ping gets a broker connection of its own, never one from the app's pool: a pooled
    # connection released with its reply BRPOP still pending is force-closed by every child the
    # pool forks later, and that close blocks on the parent's socket until the child is killed
    # for not coming up ("Timed out waiting for UP message").
    connection = app.connection_for_write()
    _metrics_reporter = metrics.MetricsReporter(
        resources.Resources(settings),
        count_workers=partial(count_live_workers, connection=connection),
        sink=metrics.make_sink(settings),
        interval=settings.metrics_interval,
    )
    _metrics_reporter.start()


@worker_shutdown.connect
def _stop_metrics_reporter(**_: Any) -> None:
    """No report after shutdown starts; one in flight gets a second, then is left to die with
    the process (its thread is a daemon)."""
    global _metrics_reporter
    if _metrics_reporter is not None:
        _metrics_reporter.stop(timeout=1.0)
        _metrics_reporter = None
