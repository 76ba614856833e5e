"""Alembic environment: the URL comes from mailpipe's settings (or the caller's config)."""

from __future__ import annotations

from alembic import context

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
    with engine.connect() as connection:
        # Batch mode lets later migrations alter columns on SQLite, which has no ALTER COLUMN.
        context.configure(
            connection=connection, target_metadata=Base.metadata, render_as_batch=True
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
