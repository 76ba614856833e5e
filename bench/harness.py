"""Shared set-up of the throughput, ingest, profile and memory benchmarks (docs/benchmarks.md).

Every benchmark run gets its own PostgreSQL database (created here, dropped at the end), its own
Redis key prefix on the shared Redis (its keys are deleted by prefix at the end: never FLUSHDB,
others use the same server) and its own temporary blob folder. Nothing here imports a mailpipe
module that reads settings at import time, so a benchmark can set `os.environ` first.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PG_ADMIN_URL = os.environ.get(
    "MAILPIPE_BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("MAILPIPE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
REPO = Path(__file__).resolve().parent.parent

# Every table a measurement fills; runtime_flag (the model-calls switch) and alembic_version stay.
DATA_TABLES = (
    "classification",
    "email_label",
    "document",
    "pipeline_run",
    "email_origin",
    "email_message",
    "sweep_report",
)


def database_url(name: str) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name


def create_database(name: str) -> str:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return database_url(name)


def drop_database(name: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def truncate(url: str) -> None:
    """Empty every data table and restart the ids, so each repetition stores the same rows."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {', '.join(DATA_TABLES)} RESTART IDENTITY CASCADE")


def delete_prefix(redis_url: str, prefix: str) -> int:
    """Delete this run's keys (and only those) from the shared Redis."""
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_env(*, database: str, prefix: str, blob_url: str, **extra: str) -> dict[str, str]:
    """The environment of every process of one benchmark run (this one and its workers)."""
    env = {
        "MAILPIPE_DATABASE_URL": database_url(database),
        "MAILPIPE_BROKER_URL": REDIS_URL,
        "MAILPIPE_BLOB_URL": blob_url,
        "MAILPIPE_REDIS_PREFIX": prefix,
        "MAILPIPE_MODEL_BACKEND": "rules",
        # Fake credentials for the local S3 server; never a real account.
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "PYTHONPATH": str(REPO),
    }
    env.update(extra)
    return env


@dataclass
class MotoServer:
    """moto's S3-compatible server on loopback, as a subprocess."""

    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, bucket: str) -> MotoServer:
        import boto3

        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"moto server did not start; see {self.log_path}") from None
                time.sleep(0.1)
        boto3.session.Session(
            aws_access_key_id="bench", aws_secret_access_key="bench", region_name="us-east-1"
        ).client("s3", endpoint_url=self.url).create_bucket(Bucket=bucket)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def machine() -> dict[str, object]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "load_avg_at_start": os.getloadavg(),
    }


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def rotated(variants: list[str], repetition: int) -> list[str]:
    """Each repetition starts with a different variant, so none always runs first (or last)."""
    k = repetition % len(variants)
    return variants[k:] + variants[:k]


def clean_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


class CpuMeter:
    """CPU seconds (user + system) that a changing set of processes uses during a measurement.

    `poll(pids)` records each process's CPU time so far; a process seen at the first poll counts
    from there, one that appears later from zero (it started during the measurement). A process
    that exits between two polls loses what it used since the last one, so poll often.
    """

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self._polled = False

    def poll(self, pids: Iterable[int]) -> None:
        import psutil

        for pid in pids:
            try:
                used = sum(psutil.Process(pid).cpu_times()[:2])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            self.first.setdefault(pid, used if not self._polled else 0.0)
            self.last[pid] = used
        self._polled = True

    def seconds(self) -> float:
        return sum(self.last[pid] - self.first[pid] for pid in self.last)


def postgres_backends(conn, database: str) -> list[int]:  # type: ignore[no-untyped-def]
    """PIDs of the server processes serving connections to `database` (ours and the workers')."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'",
        (database,),
    ).fetchall()
    return [pid for (pid,) in rows]
