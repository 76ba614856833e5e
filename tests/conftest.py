"""Real services for every test: the local Redis and PostgreSQL, and an S3 server on loopback.

The environment below is set before any mailpipe module reads its settings. A service that is not
there fails the run with a message that says how to start it; nothing is skipped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

RUN_ID = f"{os.getpid()}"
PG_ADMIN_URL = os.environ.get("MAILPIPE_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
PG_DATABASE = f"mailpipe_test_{RUN_ID}"
REDIS_URL = os.environ.get("MAILPIPE_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


S3_PORT = _free_port()
S3_ENDPOINT = f"http://127.0.0.1:{S3_PORT}"
S3_BUCKET = "mailpipe-test"

TEST_ENV = {
    "MAILPIPE_DATABASE_URL": PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + PG_DATABASE,
    "MAILPIPE_BROKER_URL": REDIS_URL,
    "MAILPIPE_BLOB_URL": f"s3://{S3_BUCKET}/blobs",
    "MAILPIPE_S3_ENDPOINT_URL": S3_ENDPOINT,
    "MAILPIPE_QUEUE": "mailpipe",
    # Every key of this run, kombu's included, lives under this prefix: test runs sharing the
    # machine's Redis never see each other's jobs.
    "MAILPIPE_REDIS_PREFIX": f"test{RUN_ID}:",
    # Short windows so that retries, leases and redeliveries happen within a test.
    "MAILPIPE_TASK_SOFT_TIME_LIMIT": "20",
    "MAILPIPE_TASK_TIME_LIMIT": "25",
    "MAILPIPE_RETRY_BACKOFF_BASE": "0.5",
    "MAILPIPE_RETRY_BACKOFF_MAX": "4",
    "MAILPIPE_VISIBILITY_TIMEOUT": "40",
    "MAILPIPE_LEASE_TTL": "6",
    "MAILPIPE_SOFT_SHUTDOWN_TIMEOUT": "5",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
os.environ.update(TEST_ENV)

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO.parent / "shared" / "corpus"


def _require(condition: bool, message: str) -> None:
    if not condition:
        pytest.exit(message, returncode=3)


@pytest.fixture(scope="session", autouse=True)
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Check Redis and PostgreSQL, create and migrate this run's database, start the S3 server."""
    import redis
    import sqlalchemy

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.RedisError as exc:
        _require(False, f"Redis is not reachable at {REDIS_URL} ({exc}). Start it: redis-server "
                 "--daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save '' --appendonly no")
    clear_redis(client)

    admin = sqlalchemy.create_engine(
        PG_ADMIN_URL.replace("postgresql://", "postgresql+psycopg://"),
        isolation_level="AUTOCOMMIT",
        pool_pre_ping=True,  # the chaos test restarts PostgreSQL
    )
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{PG_DATABASE}"')
            conn.exec_driver_sql(f'CREATE DATABASE "{PG_DATABASE}"')
    except sqlalchemy.exc.OperationalError as exc:
        _require(False, f"PostgreSQL is not reachable at {PG_ADMIN_URL} ({exc}). Start it: "
                 "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start")

    from mailpipe.migrate import upgrade

    upgrade(TEST_ENV["MAILPIPE_DATABASE_URL"])

    s3_log = tmp_path_factory.mktemp("s3") / "moto.log"
    s3 = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(S3_PORT)],
        stdout=s3_log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    _wait_for_port(S3_PORT, s3, s3_log)
    import boto3

    boto3.client("s3", endpoint_url=S3_ENDPOINT).create_bucket(Bucket=S3_BUCKET)
    try:
        yield
    finally:
        s3.terminate()
        s3.wait(10)
        from mailpipe.resources import get_resources

        get_resources().close()
        clear_redis(client)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{PG_DATABASE}" WITH (FORCE)')
        admin.dispose()


def _wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            _require(False, f"the S3 server exited: {log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    _require(False, f"the S3 server did not listen on {port}: {log.read_text()}")


@pytest.fixture
def res(services: None):  # type: ignore[no-untyped-def]
    """This process's Resources on clean tables and a clean Redis database."""
    from mailpipe.resources import get_resources

    res = get_resources()
    clean(res)
    return res


def clean(res) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import text

    from mailpipe.models import Base

    tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
    with res.db.transaction() as session:
        session.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    clear_redis(res.redis)


def clear_redis(client) -> None:  # type: ignore[no-untyped-def]
    """Delete this run's keys (and only those)."""
    for found in client.scan_iter(match=TEST_ENV["MAILPIPE_REDIS_PREFIX"] + "*", count=1000):
        client.delete(found)
