"""Alembic environment: the URL comes from mailpipe's settings (or the caller's config)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, event

from mailpipe.settings import get_settings
from mailpipe.storage.db import make_engine
from mailpipe.storage.models import Base

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().database_url


def run_migrations_offline() -> None:
    context.configure(
        url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(url)
    sqlite = engine.dialect.name == "sqlite"
    if sqlite:
        # A batch migration builds a table again, dropping the old one, which SQLite's foreign
        # keys refuse while other tables refer to it; the pragma takes effect only outside a
        # transaction, so it is set as each connection opens. Every key is checked at the end.
        event.listen(engine, "connect", _sqlite_foreign_keys_off)
    with engine.connect() as connection:
        # Batch mode lets later migrations alter columns on SQLite, which has no ALTER COLUMN.
        context.configure(
            connection=connection, target_metadata=Base.metadata, render_as_batch=True
        )
        with context.begin_transaction():
            context.run_migrations()
            if sqlite:
                _check_foreign_keys(connection)
    engine.dispose()


def _sqlite_foreign_keys_off(dbapi_connection, _record) -> None:
    dbapi_connection.execute("PRAGMA foreign_keys=OFF")


def _check_foreign_keys(connection: Connection) -> None:
    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if broken:
        raise RuntimeError(f"the migrations leave {len(broken)} rows with a broken foreign key")


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
