"""What the benchmarks share beyond the tests' services (docs/benchmarks.md).

The services of a run (its own PostgreSQL database, Redis key prefix, S3 server) come from
`tests.support.services`; this module adds where they are on this machine, the environment of a
run's processes, the `mailpipe` command of another checkout, and the accounting: CPU meters,
medians, the machine's description. Nothing here imports a mailpipe module that reads settings at
import time, so a benchmark can set `os.environ` first.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.services import Database

if TYPE_CHECKING:
    import psutil
    from redis import Redis

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

# The summary line `mailpipe ingest` prints, the same in every version so far.
_INGESTED = re.compile(r"^stored (\d+), enqueued (\d+)", re.MULTILINE)


def database(name: str) -> Database:
    """A database of the run's own on the machine's PostgreSQL (not created yet)."""
    return Database(PG_ADMIN_URL, name)


def truncate(url: str) -> None:
    """Empty every data table and restart the ids, so each repetition stores the same rows."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"TRUNCATE {', '.join(DATA_TABLES)} RESTART IDENTITY CASCADE")


def env_without_settings() -> dict[str, str]:
    """This process's environment less every MAILPIPE_ setting: a child started with it reads
    the settings' defaults, or only what it is given on top, whatever the shell has set."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MAILPIPE_")}


def base_env(*, database_url: str, prefix: str, blob_url: str, **extra: str) -> dict[str, str]:
    """The environment of every process of one benchmark run (this one and its workers)."""
    env = {
        "MAILPIPE_DATABASE_URL": database_url,
        "MAILPIPE_BROKER_URL": REDIS_URL,
        "MAILPIPE_BLOB_URL": blob_url,
        "MAILPIPE_REDIS_PREFIX": prefix,
        "MAILPIPE_MODEL_BACKEND": "rules",
        # Fake credentials for the local S3 server; never a real account.
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        # Workers load bench modules (`-I bench.noop_tasks`) whatever folder they start in.
        "PYTHONPATH": str(REPO),
    }
    env.update(extra)
    return env


def mailpipe_command(src: Path) -> list[str]:
    """The `mailpipe` command of the checkout at `src`, from the entry point its pyproject.toml
    declares: the installed script may belong to another checkout, and the module behind the
    command moves between layouts."""
    scripts = tomllib.loads((src / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["mailpipe"].split(":")
    return [sys.executable, "-c", f"from {module} import {function}; {function}()"]


def run_mailpipe(src: Path, env: dict[str, str], *args: str) -> str:
    """Run `mailpipe ARGS` with the code of the checkout at `src`; returns what it printed."""
    done = subprocess.run(
        [*mailpipe_command(src), *args],
        env={**env, "PYTHONPATH": str(src)},
        cwd=src,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"mailpipe {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def ingest(src: Path, env: dict[str, str], folder: Path, expected: int, *options: str) -> None:
    """`mailpipe ingest [OPTIONS] FOLDER` with the checkout at `src`: every email stored and
    enqueued."""
    output = run_mailpipe(src, env, "ingest", *options, str(folder))
    found = _INGESTED.search(output)
    if found is None or (int(found[1]), int(found[2])) != (expected, expected):
        raise RuntimeError(f"ingest of {expected} emails from {src}: {output.strip()}")


def write_emails(folder: Path, emails: list[bytes]) -> Path:
    """One .eml file per email, named so that `mailpipe ingest` reads them in this order."""
    folder.mkdir(parents=True, exist_ok=True)
    for number, data in enumerate(emails):
        (folder / f"{number:06d}.eml").write_bytes(data)
    return folder


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


def write_report(path: Path, args: object, results: object) -> None:
    """A benchmark's figures as JSON, with the machine and the arguments they were made with."""
    report = {"machine": machine(), "args": vars(args), "results": results}
    path.write_text(json.dumps(report, indent=2, default=str))


def percentile(values: Iterable[float], share: float) -> float:
    """The value at `share` of the sorted values (0.5 the median's rank, 0.99 the p99's)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def rotated(variants: list[str], repetition: int) -> list[str]:
    """Each repetition starts with a different variant, so none always runs first (or last)."""
    k = repetition % len(variants)
    return variants[k:] + variants[:k]


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


def local_redis_server(client: Redis) -> psutil.Process | None:
    """The Redis server that `client` talks to, when it runs on this machine (its CPU can then be
    measured); None, said on stderr, when it does not."""
    import psutil

    try:
        server = psutil.Process(int(client.info("server")["process_id"]))
        if "redis-server" in server.name():
            return server
    except (psutil.Error, KeyError, ValueError):
        pass
    print("Redis server not found on this machine: its CPU is not measured", file=sys.stderr)
    return None


def postgres_backends(conn, database: str) -> list[int]:  # type: ignore[no-untyped-def]
    """PIDs of the server processes serving connections to `database` (ours and the workers')."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'",
        (database,),
    ).fetchall()
    return [pid for (pid,) in rows]


def publish(args: Any, figures: dict[str, Any]) -> int:
    """Print a benchmark's report as JSON (the machine, the arguments, then `figures`) and write
    it to `args.json` when given. Returns the exit status."""
    given = {
        name: str(value) if isinstance(value, Path) else value for name, value in vars(args).items()
    }
    text = json.dumps({"machine": machine(), "args": given, **figures}, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0
