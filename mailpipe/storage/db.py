"""Engines and sessions, one engine per process.

Engines hold sockets and threads that do not survive fork, so each process builds its own the first
time it asks (`worker_process_init` resets the inherited one in worker children).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, Table, create_engine, event
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

from mailpipe.storage.models import Base, table

log = logging.getLogger(__name__)

# How long a SQLite writer waits for another one before "database is locked" (milliseconds).
SQLITE_BUSY_TIMEOUT_MS = 30_000
# A pooled connection idle for longer than this is pinged before use (seconds). Busy processes
# never pay the round trip; a job that meets a connection the server closed under load retries
# its transaction instead (`once_more_if_disconnected`).
PING_AFTER_IDLE_S = 10.0

T = TypeVar("T")


def normalise_url(url: str) -> str:
    """Pick the psycopg 3 driver for plain PostgreSQL URLs; leave every other URL alone."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a PostgreSQL connection may take to open, a statement to run, and a silent peer
    to be believed alive (seconds). A server that restarts or a network that drops packets then
    fails the job's statement in seconds, as a transient error that is retried, instead of hanging
    the job until its hard time limit kills it."""

    connect_timeout: int = 5
    statement_timeout: int = 30
    keepalives_idle: int = 30
    pool_size: int = 2  # connections kept per process
    burst: int | None = None  # opened past them while all are busy; None: as many again

    def connect_args(self) -> dict[str, Any]:
        return {
            "connect_timeout": self.connect_timeout,
            "keepalives": 1,
            "keepalives_idle": self.keepalives_idle,
            "keepalives_interval": max(1, self.keepalives_idle // 3),
            "keepalives_count": 3,
            # Data sent and never acknowledged (a peer gone mid-query) fails the socket too.
            "tcp_user_timeout": (self.keepalives_idle + self.statement_timeout) * 1000,
        }


def make_engine(
    url: str,
    limits: ConnectionLimits | None = None,
    *,
    synchronous_commit: bool = True,
    transaction_pooling: bool = False,
) -> Engine:
    """`synchronous_commit=False`: PostgreSQL answers a COMMIT before the commit is on disk
    (its `synchronous_commit = off`). A crash of the server, not of this process, can then undo
    the last fraction of a second of commits, never part of one; SQLite ignores it.

    `transaction_pooling=True`: the URL reaches PostgreSQL through a pooler in transaction mode
    (PgBouncer, RDS Proxy), which may run each transaction on another server connection. The
    connections then keep no state of their own: no server-side prepared statements, and the
    statement timeout and commit mode are set in each transaction (SET LOCAL, one round trip
    more) instead of at connect, where PgBouncer refuses them.

    Statement parameters are left out of every error's message (`hide_parameters`): they hold
    the emails' subjects, senders and texts, and errors end up in logs and on runs."""
    url = normalise_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        limits = limits or ConnectionLimits()
        settings = {"statement_timeout": str(limits.statement_timeout * 1000)}
        if not synchronous_commit:
            settings["synchronous_commit"] = "off"
        connect_args = limits.connect_args()
        if transaction_pooling:
            connect_args["prepare_threshold"] = None
        else:
            connect_args["options"] = " ".join(f"-c {k}={v}" for k, v in settings.items())
        engine = create_engine(
            url,
            hide_parameters=True,
            pool_size=limits.pool_size,
            max_overflow=limits.pool_size if limits.burst is None else limits.burst,
            connect_args=connect_args,
        )
        if transaction_pooling:
            statement = "; ".join(f"SET LOCAL {k} = {v}" for k, v in settings.items())
            event.listen(engine, "begin", partial(_set_local, statement))
        event.listen(engine, "checkin", _on_checkin)
        event.listen(engine, "checkout", partial(_ping_if_idle, engine.dialect))
        return engine
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url, hide_parameters=True, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
    )
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _set_local(statement: str, connection) -> None:
    connection.exec_driver_sql(statement)


def _read_timeout(statement: str, _session, _transaction, connection) -> None:
    connection.exec_driver_sql(statement)


def _on_checkin(_dbapi_connection, record) -> None:
    record.info["idle_since"] = time.monotonic()


def _ping_if_idle(dialect: Dialect, dbapi_connection, record, _proxy) -> None:
    idle_since = record.info.get("idle_since")
    if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_S:
        return
    try:
        dialect.do_ping(dbapi_connection)
    except Exception as exc:
        # The pool drops this connection and checks out another (SQLAlchemy retries the checkout).
        raise DisconnectionError(f"pooled connection is dead: {exc}") from exc


def once_more_if_disconnected(work: Callable[[], T]) -> T:
    """Run `work`, and once more if it failed on a connection the server had closed (a database
    restart under load): the pool then drops every connection as old as that one, so the second
    run opens a fresh connection. `work` must be a whole transaction."""
    try:
        return work()
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        log.info("database connection was closed by the server; running the transaction again")
        return work()


def _sqlite_on_connect(dbapi_connection, _record) -> None:
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


def _sqlite_on_begin(connection) -> None:
    # IMMEDIATE takes the write lock up front: a deferred transaction that later writes can fail
    # with SQLITE_BUSY without waiting when another process committed in between.
    connection.exec_driver_sql("BEGIN IMMEDIATE")


class Database:
    """The process's engine and session factories, rebuilt after a fork.

    `read_timeout_ms`: the statement timeout of the sessions `reading` opens, set in each of
    their transactions (SET LOCAL, one round trip more) on PostgreSQL; its other sessions keep
    the connection's (`ConnectionLimits.statement_timeout`)."""

    def __init__(
        self,
        url: str,
        limits: ConnectionLimits | None = None,
        *,
        synchronous_commit: bool = True,
        transaction_pooling: bool = False,
        read_timeout_ms: int | None = None,
    ) -> None:
        self.url = url
        self.limits = limits
        self.synchronous_commit = synchronous_commit
        self.transaction_pooling = transaction_pooling
        self.read_timeout_ms = read_timeout_ms
        self._pid: int | None = None
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._reads: sessionmaker[Session] | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None or self._pid != os.getpid():
            if self._engine is not None:
                # Inherited from the parent: drop its pooled connections without closing the
                # parent's sockets.
                self._engine.dispose(close=False)
            self._engine = make_engine(
                self.url,
                self.limits,
                synchronous_commit=self.synchronous_commit,
                transaction_pooling=self.transaction_pooling,
            )
            self._sessions = sessionmaker(self._engine, expire_on_commit=False)
            self._reads = self._sessions
            if self.read_timeout_ms is not None and self._engine.dialect.name == "postgresql":
                self._reads = sessionmaker(self._engine, expire_on_commit=False)
                statement = f"SET LOCAL statement_timeout = {int(self.read_timeout_ms)}"
                event.listen(self._reads, "after_begin", partial(_read_timeout, statement))
            self._pid = os.getpid()
        return self._engine

    def session(self) -> Session:
        self.engine  # noqa: B018 - builds the factory for this process
        assert self._sessions is not None
        return self._sessions()

    def reading(self) -> Session:
        """A session for reads, whose statements are given up past `read_timeout_ms` (an
        OperationalError that `errors.is_statement_timeout` names); a plain session without
        one."""
        self.engine  # noqa: B018 - builds the factories for this process
        assert self._reads is not None
        return self._reads()

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
    model: type[Base],
    rows: list[dict],
    conflict: list[str],
    returning: Any = None,
) -> list[Any]:
    """INSERT ... ON CONFLICT DO NOTHING on PostgreSQL and SQLite alike; with `returning`, the
    values of that column for the rows actually inserted."""
    if not rows:
        return []
    statement = _insert_ignore(_dialect(session), table(model), tuple(conflict), returning)
    if returning is None:
        session.execute(statement, rows)
        return []
    return list(session.scalars(statement, rows))


def upsert(session: Session, model: type[Base], rows: list[dict], conflict: list[str]) -> None:
    """INSERT ... ON CONFLICT DO UPDATE of every non-key column given."""
    if not rows:
        return
    statement = _upsert(_dialect(session), table(model), tuple(conflict), tuple(rows[0]))
    session.execute(statement, rows)


# The statements are built once per process and shape, and their rows go as parameters: a job
# then pays neither for building them (the ORM's bulk-insert path, the `excluded` alias and its
# columns) nor for compiling them (taken from SQLAlchemy's cache). On the table, not the ORM
# class: the ORM's bulk path costs more than the insert itself, for nothing here.
@cache
def _insert_ignore(dialect: str, table: Table, conflict: tuple[str, ...], returning: Any) -> Any:
    statement = dialect_insert(dialect)(table).on_conflict_do_nothing(index_elements=conflict)
    return statement if returning is None else statement.returning(returning)


@cache
def _upsert(dialect: str, table: Table, conflict: tuple[str, ...], columns: tuple[str, ...]) -> Any:
    statement = dialect_insert(dialect)(table)
    update = {name: statement.excluded[name] for name in columns if name not in conflict}
    return statement.on_conflict_do_update(index_elements=conflict, set_=update)


def _dialect(session: Session) -> str:
    return session.get_bind().dialect.name


def dialect_insert(dialect: str) -> Any:
    """The dialect's INSERT, which has ON CONFLICT (PostgreSQL's and SQLite's alike)."""
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as postgresql_insert

        return postgresql_insert
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert
