"""The fleet through PgBouncer in transaction mode, the pooler docs/scaling.md recommends once the
fleet's connections pass what PostgreSQL admits ("PostgreSQL connections").

PgBouncer runs as a process of the test's own, in front of a database of the test's own, with a
server pool of 2 connections: a real prefork worker, beat (its sweeps and reports), the CLI and
this process all reach PostgreSQL through those two. Migrations run against PostgreSQL itself,
as the release role's do. `MAILPIPE_DB_TRANSACTION_POOLING=true` is what makes the fleet work
there: PgBouncer refuses the statement timeout given at connect, and a prepared statement would
outlive the transaction that made it.

The test needs Debian's pgbouncer (`apt-get install -y pgbouncer`; the test command,
`.ci/test`, installs it as root), and fails, never skips, without it.
"""

from __future__ import annotations

import email.message
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from mailpipe.cli.demo.servers import free_port, terminate, wait_for_port
from mailpipe.cli.ingest import store_emails
from mailpipe.resources import Resources
from mailpipe.settings import Settings
from mailpipe.storage.migrate import upgrade
from mailpipe.storage.models import (
    Document,
    EmailMessage,
    PipelineRun,
    QueueSample,
    SweepReport,
)
from tests.support.document_samples import docx_bytes, pdf_with_pages
from tests.support.fleet import Fleet
from tests.support.services import Database
from tests.support.waits import wait_until_closed

pytestmark = [pytest.mark.slow, pytest.mark.services]  # Redis, PostgreSQL and the S3 server

# PostgreSQL connections PgBouncer opens for the fleet's database, however many clients it has.
SERVER_POOL = 2


class PgBouncer:
    """PgBouncer in transaction mode on a free loopback port, in front of `server_url`'s
    PostgreSQL, trusting the one user it names; its log is `log_path`."""

    def __init__(self, folder: Path, server_url: str) -> None:
        self.folder = folder
        self.server = make_url(server_url)
        self.port = free_port()
        self.log_path = folder / "pgbouncer.log"
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, database: str) -> str:
        return self.server.set(
            host="127.0.0.1", port=self.port, database=database
        ).render_as_string(hide_password=False)

    def start(self) -> None:
        config = self.folder / "pgbouncer.ini"
        users = self.folder / "users.txt"
        user = self.server.username or "postgres"
        users.write_text(f'"{user}" ""\n')
        config.write_text(
            "[databases]\n"
            f"* = host={self.server.host} port={self.server.port or 5432}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            f"admin_users = {user}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {SERVER_POOL}\n"
            # A client that waits this long for one of the two server connections fails its
            # transaction: a process holding one while it waits for another shows as an error.
            "query_wait_timeout = 30\n"
        )
        # PgBouncer refuses to run as root; it reads its files before it changes user.
        as_user = ["-u", "postgres"] if os.geteuid() == 0 else []
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [pgbouncer(), *as_user, str(config)], stdout=log, stderr=subprocess.STDOUT
            )
        wait_for_port(self.port, self.process, "pgbouncer")

    def stop(self) -> None:
        terminate(self.process)

    def pool(self, database: str) -> dict[str, int]:
        """PgBouncer's figures of the pool of `database` (SHOW POOLS): clients and servers."""
        admin = self.url("pgbouncer")
        # The admin console speaks the simple query protocol only: client-side binding.
        with psycopg.connect(admin, autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
            cursor = conn.execute("SHOW POOLS")
            names = [column.name for column in cursor.description or []]
            [row] = [dict(zip(names, r, strict=True)) for r in cursor if r[0] == database]
        return row


def pgbouncer() -> str:
    """The pgbouncer program (Debian's is in /usr/sbin, which may be off a user's PATH)."""
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
    if found is None:
        pytest.fail(
            "pgbouncer is not installed; this test runs the fleet through it: "
            "apt-get install -y pgbouncer",
            pytrace=False,
        )
    return found


@pytest.fixture(scope="module")
def database(services: None) -> Iterator[Database]:
    """A database of the module's own, migrated on PostgreSQL itself, not through PgBouncer."""
    admin = make_url(os.environ["MAILPIPE_DATABASE_URL"]).set(database="postgres")
    own = Database(admin.render_as_string(hide_password=False), f"mailpipe_pgb_{os.getpid()}")
    own.create()
    upgrade(own.url)
    yield own
    own.drop()


@pytest.fixture(scope="module")
def bouncer(database: Database, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgBouncer]:
    pgbouncer()  # fails the test with how to install it, before anything starts
    bouncer = PgBouncer(tmp_path_factory.mktemp("pgbouncer"), database.url)
    bouncer.start()
    yield bouncer
    bouncer.stop()


def pooled(res: Resources, url: str, **settings: object) -> Resources:
    """Resources like `res`'s on `url`, through the transaction pooler."""
    values = {**res.settings.model_dump(), "database_url": url, "db_transaction_pooling": True}
    return Resources(Settings(**{**values, **settings}))


def invoice(n: int) -> bytes:
    """An email with a PDF or a DOCX attached, so that documents are written too."""
    message = email.message.EmailMessage()
    message["From"] = "billing@example.org"
    message["To"] = "ops@example.org"
    message["Subject"] = f"Invoice {n}"
    message["Message-ID"] = f"<pgbouncer-{n}@example.org>"
    message.set_content(f"Invoice {n}: amount due 12.{n:02d} EUR.")
    if n % 2:
        message.add_attachment(pdf_with_pages(2), "application", "pdf", filename=f"inv-{n}.pdf")
    else:
        message.add_attachment(
            docx_bytes([f"Invoice {n}"]),
            "application",
            "vnd.openxmlformats-officedocument.wordprocessingml.document",
            filename=f"inv-{n}.docx",
        )
    return message.as_bytes()


def test_without_transaction_pooling_pgbouncer_refuses_the_connection(
    res, bouncer, database
) -> None:  # type: ignore[no-untyped-def]
    """Why the setting exists: the statement timeout given at connect is refused."""
    direct = pooled(res, bouncer.url(database.name), db_transaction_pooling=False)
    try:
        with pytest.raises(OperationalError, match="unsupported startup parameter"):
            with direct.db.session() as session:
                session.execute(text("SELECT 1"))
    finally:
        direct.close()


def test_transactions_leave_nothing_on_the_server_connections_they_share(
    res, bouncer, database
) -> None:  # type: ignore[no-untyped-def]
    """Two processes' connections take turns on PgBouncer's server connections, each with the
    same statement more often than psycopg's threshold for preparing it (5): neither meets a
    statement the other prepared, and each transaction has the statement timeout and commit mode
    of its own process, set in it. A job process commits without waiting for the disk, any other
    process waits."""
    url = bouncer.url(database.name)
    cli = pooled(res, url)
    jobs = Resources.for_jobs(cli.settings)
    timeout = f"{res.settings.db_statement_timeout}s"
    try:
        for _ in range(10):
            for resources, commit in ((cli, "on"), (jobs, "off")):
                with resources.db.transaction() as session:
                    settings = session.execute(
                        text(
                            "SELECT current_setting('statement_timeout'), "
                            "current_setting('synchronous_commit')"
                        )
                    ).one()
                assert tuple(settings) == (timeout, commit)
    finally:
        cli.close()
        jobs.close()


def test_the_fleet_processes_every_email_through_pgbouncer(
    res, bouncer, database, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """A prefork worker, beat, the CLI and upstream storage, all through PgBouncer's two server
    connections: every email's run succeeds at its first attempt."""
    url = bouncer.url(database.name)
    through = pooled(res, url)
    fleet = Fleet(
        through,
        tmp_path,
        MAILPIPE_DATABASE_URL=url,
        MAILPIPE_DB_TRANSACTION_POOLING="true",
        MAILPIPE_SWEEP_INTERVAL="2",
        MAILPIPE_METRICS_INTERVAL="1",
    )
    try:
        # Stored upstream without a job: the sweeps find these.
        store_emails(through, [invoice(n) for n in range(10)])
        inbox = tmp_path / "inbox"
        inbox.mkdir()
        for n in range(10, 30):
            (inbox / f"{n}.eml").write_bytes(invoice(n))
        fleet.worker("pooled")  # prefork, 2 children
        fleet.beat()
        fleet.cli("ingest", str(inbox))  # stored and enqueued by the CLI
        with through.db.session() as session:
            ids = list(session.scalars(select(EmailMessage.id)))
        assert len(ids) == 30
        wait_until_closed(through, ids, timeout=120)
        with through.db.session() as session:
            runs = session.execute(select(PipelineRun.status, PipelineRun.attempts)).all()
            documents = session.scalar(select(func.count()).select_from(Document))
            sweeps = session.scalar(select(func.count()).select_from(SweepReport))
            samples = session.scalar(select(func.count()).select_from(QueueSample))
        # Every run succeeded at its first attempt: no transaction failed through the pooler.
        assert (
            sorted((status.value, attempts) for status, attempts in runs) == [("succeeded", 1)] * 30
        )
        assert documents == 30
        assert sweeps >= 1 and samples >= 1  # beat's sweeps and reports wrote too
        pool = bouncer.pool(database.name)
        # More clients than PostgreSQL connections: the two children, beat, and this process.
        assert pool["cl_active"] + pool["cl_waiting"] > SERVER_POOL, pool
        assert pool["sv_active"] + pool["sv_idle"] + pool["sv_used"] <= SERVER_POOL, pool
    finally:
        fleet.stop()
        through.close()
