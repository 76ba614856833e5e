"""The test database and Redis keys of this run, emptied between tests."""

from __future__ import annotations

import os

from tests.support.services import delete_prefix


def clean(res) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import text

    from mailpipe.storage.models import Base

    tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
    with res.db.transaction() as session:
        session.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    delete_prefix(os.environ["MAILPIPE_BROKER_URL"], os.environ["MAILPIPE_REDIS_PREFIX"])
