"""The services a run of the tests or a benchmark sets up for itself, beside the `redis-server`
of its own that the demo starts too (`mailpipe.cli.demo.servers.PrivateRedis`).

- `Database`: a PostgreSQL database of the run's own on a shared server, created and dropped;
- `PrivatePostgres`: a PostgreSQL server of the run's own, on a free port, that it may stop and
  start (the machine's server is shared, and a restart would hit every other user of it);
- `S3Server`: moto's S3-compatible server on loopback, as a subprocess;
- `delete_prefix`: the run's keys on a shared Redis, and only those (never FLUSHDB).

Nothing here imports a mailpipe module that reads settings, so a caller can set the environment
first. moto is a test dependency: it is only ever started as a subprocess.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mailpipe.cli.demo.servers import free_port, terminate, wait_for_port


@dataclass
class Database:
    """A database of its own on the PostgreSQL server that `admin_url` reaches."""

    admin_url: str
    name: str

    @property
    def url(self) -> str:
        return self.admin_url.rsplit("/", 1)[0] + "/" + self.name

    def create(self) -> Database:
        self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        self._admin(f'CREATE DATABASE "{self.name}"')
        return self

    def drop(self) -> None:
        self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql)


def delete_prefix(redis_url: str, prefix: str) -> int:
    """Delete the keys under `prefix` from a shared Redis; returns how many."""
    import redis

    if not prefix:
        raise ValueError("refusing to delete keys without a prefix")
    client = redis.Redis.from_url(redis_url)
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            deleted += client.unlink(*batch)
            batch = []
    if batch:
        deleted += client.unlink(*batch)
    client.close()
    return deleted


@dataclass
class S3Server:
    """moto's S3-compatible server on loopback, as a subprocess, with one bucket."""

    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, bucket: str) -> S3Server:
        import boto3

        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_for_port(self.port, self.process, "the S3 server")
        except RuntimeError as exc:
            raise RuntimeError(
                f"{exc}; its log: {self.log_path.read_text(errors='replace')}"
            ) from None
        boto3.session.Session(
            aws_access_key_id="local", aws_secret_access_key="local", region_name="us-east-1"
        ).client("s3", endpoint_url=self.url).create_bucket(Bucket=bucket)
        return self

    def stop(self) -> None:
        terminate(self.process)


class PrivatePostgres:
    """A PostgreSQL server of its own on a free port, in a temporary folder. It runs as the
    `postgres` user when the caller is root, as PostgreSQL refuses to run as root."""

    def __init__(self) -> None:
        self.bindir = _postgres_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="mailpipe-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.root / "log")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", log, "-w", "start")

    def stop(self) -> None:
        """Fast shutdown: every connection is cut, as in a restart or a failover."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        # A server that is not running has nothing to stop: that exit code is not an error here.
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def _run(self, tool: str, *args: str, check: bool = True) -> None:
        command = [str(self.bindir / tool), *args]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=check, capture_output=True, timeout=60)


def _postgres_bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb is None:
        raise RuntimeError("PostgreSQL's initdb was not found (install the postgresql package)")
    return Path(initdb).parent
