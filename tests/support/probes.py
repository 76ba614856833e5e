"""A task that reports what a real worker's job process runs with, for tests that must see the
worker's own connections rather than the test process's.

Loaded with ``celery -A mailpipe worker -I tests.support.probes``. Each call answers under a
Redis key the test names, since the app keeps no task results; `ask_a_job_process` starts such a
worker and asks.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import text

from mailpipe.celery import app
from mailpipe.cli.demo import fleet
from mailpipe.resources import Resources, get_resources
from tests.support.waits import wait_for

SYNCHRONOUS_COMMIT = "tests.probe.synchronous_commit"


@app.task(name=SYNCHRONOUS_COMMIT)
def synchronous_commit(reply_key: str) -> None:
    """The `synchronous_commit` of the database sessions this process's jobs use."""
    res = get_resources()
    with res.db.session() as session:
        value = session.scalar(text("SHOW synchronous_commit"))
    res.redis.set(reply_key, str(value), ex=300)


def ask_a_job_process(
    res: Resources, log_dir: Path, pool: str = "prefork", answers: Any = None, **env: str
) -> str:
    """Start a real worker with `pool` and `env`, ask one of its job processes for its
    `synchronous_commit`, stop it. The answer is read from `answers` (a Redis client), by default
    this process's Redis."""
    answers = answers if answers is not None else res.redis
    worker = fleet.worker(
        {**os.environ, **env}, log_dir, pool=pool, extra_args=("-I", "tests.support.probes")
    ).start()
    try:
        worker.wait_ready()
        reply = f"{res.settings.redis_prefix}test:probe:{uuid.uuid4().hex}"
        with fleet.control_app(worker.env) as control:
            control.send_task(SYNCHRONOUS_COMMIT, args=(reply,), queue=res.settings.queue)
        wait_for(lambda: answers.exists(reply) == 1, 60, "the probe's answer")
        return str(answers.get(reply).decode())
    finally:
        worker.stop()
