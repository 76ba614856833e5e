"""Engines and sessions, one engine per process.

Engines hold sockets and threads that do not survive fork, so each process builds its own the first
time it asks (`worker_process_init` resets the inherited one in worker children).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

# How long a SQLite writer waits for another one before "database is locked" (milliseconds).
SQLITE_BUSY_TIMEOUT_MS = 30_000


def normalise_url(url: str) -> str:
    """Pick the psycopg 3 driver for plain PostgreSQL URLs; leave every other URL alone."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def make_engine(url: str) -> Engine:
    url = normalise_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        # pre_ping turns a connection killed by a database restart into a fresh one instead of an
        # error in the next job.
        return create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=2)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _sqlite_on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    # Take transaction control from the sqlite3 module so that `begin` below decides how.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    # WAL lets readers run beside the one writer; the busy timeout makes several worker
    # children queue for the write lock instead of failing at once.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_on_begin(connection) -> None:  # type: ignore[no-untyped-def]
    # IMMEDIATE takes the write lock up front: a deferred transaction that later writes can fail
    # with SQLITE_BUSY without waiting when another process committed in between.
    connection.exec_driver_sql("BEGIN IMMEDIATE")


class Database:
    """The process's engine and session factory, rebuilt after a fork."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._pid: int | None = None
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None or self._pid != os.getpid():
            if self._engine is not None:
                # Inherited from the parent: drop its pooled connections without closing the
                # parent's sockets.
                self._engine.dispose(close=False)
            self._engine = make_engine(self.url)
            self._sessions = sessionmaker(self._engine, expire_on_commit=False)
            self._pid = os.getpid()
        return self._engine

    def session(self) -> Session:
        self.engine  # noqa: B018 - builds the factory for this process
        assert self._sessions is not None
        return self._sessions()

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session whose work commits on success and rolls back on any error."""
        with self.session() as session, session.begin():
            yield session

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None


def insert_ignore(
    session: Session,
    model: type,
    rows: list[dict],
    conflict: list[str],
    returning: Any = None,
) -> list[Any]:
    """INSERT ... ON CONFLICT DO NOTHING on PostgreSQL and SQLite alike; with `returning`, the
    values of that column for the rows actually inserted."""
    if not rows:
        return []
    statement = _dialect_insert(session)(model).values(rows)
    statement = statement.on_conflict_do_nothing(index_elements=conflict)
    if returning is None:
        session.execute(statement)
        return []
    return list(session.scalars(statement.returning(returning)))


def upsert(session: Session, model: type, rows: list[dict], conflict: list[str]) -> None:
    """INSERT ... ON CONFLICT DO UPDATE of every non-key column given."""
    if not rows:
        return
    statement = _dialect_insert(session)(model).values(rows)
    update = {name: statement.excluded[name] for name in rows[0] if name not in conflict}
    session.execute(statement.on_conflict_do_update(index_elements=conflict, set_=update))


def _dialect_insert(session: Session):  # type: ignore[no-untyped-def]
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert
