"""`mailpipe db upgrade`: Alembic migrations, run once before a rollout (the release role); and
the check every other command makes first, that the database is there and migrated."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from mailpipe.storage.db import Database, normalise_url

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
FIX = "run `mailpipe db upgrade`"


class SchemaMissing(Exception):
    """The database is not there, or not migrated to this code's schema."""


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # ConfigParser interpolation would eat a literal % in a password.
    config.set_main_option("sqlalchemy.url", normalise_url(database_url).replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def shown_url(url: str) -> str:
    """A URL (the database's, Redis's) as messages show it: the password masked."""
    return make_url(url).render_as_string(hide_password=True)


def check_schema(database: Database) -> None:
    """Raise SchemaMissing unless `database` exists at this code's schema revision or a later one.

    Only looks: SQLite would create a missing file on connect, so the file is looked for first
    and then opened read-only; nothing but `upgrade` creates or changes a database. A revision
    this code does not know is a later release's, migrated before its rollout: it is accepted.
    """
    url = make_url(normalise_url(database.url))
    if url.get_backend_name() == "sqlite":
        revision = _sqlite_revision(url.database or "", database.url)
    else:
        try:
            with database.engine.connect() as connection:
                revision = _revision(connection)
        except OperationalError:
            if not _lacks_database(url):
                raise  # the server is down or refuses the role: unavailable, not unmigrated
            raise SchemaMissing(
                f"no database {url.database} on the server at {shown_url(database.url)}: "
                f"create it (`createdb {url.database}`), then {FIX}"
            ) from None
    if revision is None:
        raise SchemaMissing(f"the database at {shown_url(database.url)} has no schema; {FIX}")
    script = ScriptDirectory(str(MIGRATIONS))
    head = script.get_current_head()
    older = {step.revision for step in script.walk_revisions()} - {head}
    if revision in older:
        raise SchemaMissing(
            f"the database at {shown_url(database.url)} is at schema revision {revision}, "
            f"this mailpipe needs {head}; {FIX}"
        )


def _lacks_database(url: URL) -> bool:
    """Whether the PostgreSQL server at `url` answers and has no database of `url`'s name: asked
    of its `postgres` database, since the driver's error carries no SQLSTATE to tell it by."""
    engine = create_engine(url.set(database="postgres"), poolclass=NullPool, hide_parameters=True)
    try:
        with engine.connect() as connection:
            found = connection.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": url.database}
            ).first()
    except OperationalError:
        return False  # the server cannot tell: the first error stands
    finally:
        engine.dispose()
    return found is None


def _sqlite_revision(path: str, database_url: str) -> str | None:
    if not Path(path).is_file():
        raise SchemaMissing(f"no database at {shown_url(database_url)} (no such file); {FIX}")
    uri = Path(path).resolve().as_uri() + "?mode=ro"
    engine = create_engine(
        "sqlite://", creator=lambda: sqlite3.connect(uri, uri=True), hide_parameters=True
    )
    try:
        with engine.connect() as connection:
            return _revision(connection)
    finally:
        engine.dispose()


def _revision(connection: Connection) -> str | None:
    """The schema revision Alembic recorded; None when the database was never migrated."""
    return MigrationContext.configure(connection).get_current_revision()
