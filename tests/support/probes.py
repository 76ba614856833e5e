"""A task that reports what a real worker's job process runs with, for tests that must see the
worker's own connections rather than the test process's.

Loaded with ``celery -A mailpipe worker -I tests.support.probes``. Each call answers under a
Redis key the test names, since the app keeps no task results.
"""

from __future__ import annotations

from sqlalchemy import text

from mailpipe.celery import app
from mailpipe.resources import get_resources

SYNCHRONOUS_COMMIT = "tests.probe.synchronous_commit"


@app.task(name=SYNCHRONOUS_COMMIT)
def synchronous_commit(reply_key: str) -> None:
    """The `synchronous_commit` of the database sessions this process's jobs use."""
    res = get_resources()
    with res.db.session() as session:
        value = session.scalar(text("SHOW synchronous_commit"))
    res.redis.set(reply_key, str(value), ex=300)
