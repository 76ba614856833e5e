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
    # A pause the last test left, read within the cache's second, would pause this one's jobs.
    res.pauses.forget()
    res.mailbox_pauses.forget()


def on_server(res, url: str):  # type: ignore[no-untyped-def]
    """Resources like `res` on the PostgreSQL server at `url` (a `PrivatePostgres` of the
    test's own), migrated, with model calls on."""
    from mailpipe.resources import Resources
    from mailpipe.settings import Settings
    from mailpipe.storage import flags
    from mailpipe.storage.migrate import upgrade

    upgrade(url)
    private = Resources(Settings(**{**res.settings.model_dump(), "database_url": url}))
    with private.db.transaction() as session:
        flags.set_model_calls(session, True)
    return private
