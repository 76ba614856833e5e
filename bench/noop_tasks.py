"""A no-op task on mailpipe's own Celery app, for the bare-Celery baseline of bench/throughput.py.

Loaded into a benchmark worker with `celery -A mailpipe worker -I bench.noop_tasks`, so every
celeryconfig setting applies to it as to `mailpipe.process_email` (acks late, prefetch, JSON,
task events, the same queue). Its only work is one Redis round trip that counts it and stamps
when it finished (and, for the first one, when it started), so the benchmark knows when the first
and the last one ran.
"""

from __future__ import annotations

import os
import time

from redis import Redis

from mailpipe.celery import app
from mailpipe.coordination.redis_keys import key

NAME = "bench.noop"
_client: tuple[int, Redis] | None = None


def done_key() -> str:
    return key("bench:noop:done")


def first_key() -> str:
    return key("bench:noop:first")


def last_key() -> str:
    return key("bench:noop:last")


def _redis() -> Redis:
    # One client per process: a client inherited through fork would share its socket.
    global _client
    if _client is None or _client[0] != os.getpid():
        _client = (os.getpid(), Redis.from_url(app.conf.broker_url))
    return _client[1]


@app.task(name=NAME)
def noop(email_id: int) -> int:
    pipe = _redis().pipeline(transaction=False)
    now = repr(time.time())
    pipe.incr(done_key())
    pipe.set(first_key(), now, nx=True)
    pipe.set(last_key(), now)
    pipe.execute()
    return email_id
