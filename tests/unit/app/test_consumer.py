"""The hooks of Celery's consumer that `mailpipe.app.consumer` relies on: this fails loudly when an
upgrade of Celery moves them, rather than letting task events go unbatched (or unsent)."""

from __future__ import annotations

import inspect

import celery
from celery.worker.consumer import Consumer as CeleryConsumer

from mailpipe.app.consumer import Consumer


def test_the_consumer_hooks_it_overrides_and_calls_are_still_there() -> None:
    assert celery.VERSION[:2] == (5, 7), "re-check mailpipe.app.consumer against this Celery"
    assert list(inspect.signature(CeleryConsumer.on_send_event_buffered).parameters) == ["self"]
    assert list(inspect.signature(CeleryConsumer._flush_events).parameters) == ["self"]
    assert "on_send_event_buffered" in inspect.getsource(CeleryConsumer)
    assert issubclass(Consumer, CeleryConsumer)


def test_the_app_runs_this_consumer() -> None:
    from mailpipe.celery import app

    assert app.conf.worker_consumer == "mailpipe.app.consumer:Consumer"
