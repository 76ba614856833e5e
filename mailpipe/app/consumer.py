"""The worker's consumer: Celery's own, with task events sent in batches.

Celery buffers a worker's task events (received, started, succeeded, ...) and publishes the
buffer as one ``task.multi`` message, but it flushes at the next turn of the event loop, so with
jobs of tens of milliseconds nearly every event still costs its own PUBLISH round trip from the
main process: three per job. Flushing at most every `EVENT_BATCH_S` seconds (or at Celery's
`buffer_limit` of 24 events, whichever comes first) sends the same events in a fraction of the
round trips; Flower sees them at most that much later. The buffer is flushed before the consumer
shuts down, so a stopping worker's last events still go out.

This is the one place mailpipe reaches into Celery's internals: it overrides the consumer's
`on_send_event_buffered` hook and calls its private `_flush_events`. Checked against Celery 5.7;
`tests/unit/app/test_consumer.py` fails if either moves. It stays because it pays on mailpipe's
own workload: a third of the worker main process's CPU per job (docs/benchmarks.md, "Task events
in batches").
"""

from __future__ import annotations

import time

from celery.worker.consumer import Consumer as CeleryConsumer

EVENT_BATCH_S = 0.2


class Consumer(CeleryConsumer):
    # When the pending flush is due; None when none is pending.
    _event_flush_due: float | None = None

    def on_send_event_buffered(self) -> None:
        if not self.hub:
            super().on_send_event_buffered()
            return
        now = time.monotonic()
        # A flush long overdue was lost with its timer (a reset event loop): schedule another.
        if self._event_flush_due is None or now > self._event_flush_due + EVENT_BATCH_S:
            self._event_flush_due = now + EVENT_BATCH_S
            self.hub.call_later(EVENT_BATCH_S, self._flush_event_batch)

    def _flush_event_batch(self) -> None:
        self._event_flush_due = None
        self._flush_events()

    def shutdown(self) -> None:
        self._flush_events()
        super().shutdown()
