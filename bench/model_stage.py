"""The model stage: the fleet as the Procfile starts it (the `worker` and `model` roles) against a
local Converse server, measured for throughput against the fleet limit, memory per model call in
flight, and the CPU per email when model calls are switched on over a backlog.

    .venv/bin/python -m bench.model_stage [--emails 400] [--rate 20] [--delay 1] \\
        [--backlog 5000] [--json results.json]

Both roles start from their Procfile lines verbatim (`sh -c`), with an environment of this run's
own: a PostgreSQL database, a blob folder, a Redis key prefix, the `bedrock` backend pointed at
the local server (tests/support/bedrock_server.py), which answers every call after `--delay`
seconds.

- Throughput: `--emails` emails stored and enqueued with model calls on and the limit at
  `--rate` calls/s (burst = rate); emails/s from the first enqueue to the last run closed,
  against R. The fleet's memory is sampled meanwhile: the sum of PSS over every process of both
  roles (shared pages once), divided by the most calls in flight at the server.
- CPU per email: `--backlog` emails processed twice over, in two fresh databases: once with
  model calls on from the start, and once stored with model calls off, every run left waiting
  after its CPU stage, then model calls switched on (`mailpipe model-calls on`). CPU is every
  process of both roles, user + system, per email; a fast model (0.02 s, a high limit) so that the
  CPU, not the model, is what is timed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
from sqlalchemy import ColumnElement, func, select

from bench import harness
from tests.support.bedrock_server import TimedBedrockServer, invoices
from tests.support.services import Database, delete_prefix

REPO = Path(__file__).resolve().parents[1]


def procfile() -> dict[str, str]:
    lines = (REPO / "Procfile").read_text().splitlines()
    return dict(line.split(": ", 1) for line in lines if ": " in line)


class Fleet:
    """The `worker` and `model` roles started from the Procfile, on an environment of their own."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> Fleet:
        lines = procfile()
        for role in ("worker", "model"):
            with (self.logs / f"{role}.log").open("ab") as log:
                self.processes.append(
                    subprocess.Popen(
                        ["sh", "-c", lines[role]],
                        env=self.env,
                        cwd=REPO,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + 60
        while not all(
            "ready." in (self.logs / f"{r}.log").read_text() for r in ("worker", "model")
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("the roles did not start: see " + str(self.logs))
            time.sleep(0.2)
        return self

    def pids(self) -> list[int]:
        found = []
        for process in self.processes:
            try:
                parent = psutil.Process(process.pid)
                found += [parent.pid, *(child.pid for child in parent.children(recursive=True))]
            except psutil.NoSuchProcess:
                continue
        return found

    def pss_mb(self) -> float:
        total = 0
        for pid in self.pids():
            try:
                total += psutil.Process(pid).memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return total / 2**20

    def stop(self) -> None:
        # Each line runs in a shell of its own session: the signal goes to the whole group.
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def environment(
    database: Database, prefix: str, blobs: Path, server: TimedBedrockServer, rate: float
) -> dict[str, str]:
    env = harness.env_without_settings()
    # The Procfile's `celery` is this environment's.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        harness.base_env(database_url=database.url, prefix=prefix, blob_url=f"file://{blobs}"),
        MAILPIPE_MODEL_BACKEND="bedrock",
        MAILPIPE_MODEL_RATE_PER_S=str(rate),
        MAILPIPE_MODEL_BURST=str(max(1, int(rate))),
        MAILPIPE_MODEL_MAX_IN_FLIGHT="1000",
        AWS_ENDPOINT_URL_BEDROCK_RUNTIME=server.url,
    )
    return env


def mailpipe(env: dict[str, str], *args: str) -> str:
    return harness.run_mailpipe(REPO, env, *args)


def store_and_enqueue(env: dict[str, str], emails: list[bytes], folder: Path) -> None:
    harness.ingest(REPO, env, harness.write_emails(folder, emails), len(emails))


def count_runs(database: Database, condition: ColumnElement[bool]) -> int:
    """Runs of `database` that meet `condition`, on a connection of this call's own."""
    import sqlalchemy

    from mailpipe.storage.models import PipelineRun

    engine = sqlalchemy.create_engine(
        database.url.replace("postgresql://", "postgresql+psycopg://")
    )
    with engine.connect() as conn:
        count = conn.execute(
            select(func.count()).select_from(PipelineRun).where(condition)
        ).scalar()
    engine.dispose()
    return int(count or 0)


def closed(database: Database) -> int:
    from mailpipe.storage.models import PipelineRun, RunStatus

    return count_runs(database, PipelineRun.status != RunStatus.OPEN)


def converted(database: Database) -> int:
    from mailpipe.storage.models import PipelineRun

    return count_runs(database, PipelineRun.converted_at.is_not(None))


def wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


class Setup:
    """A database, a Redis prefix, a blob folder and a model server of one measurement's own."""

    def __init__(self, name: str, delay: float, rate: float) -> None:
        self.database = harness.database(f"mailpipe_bench_stage_{name}_{uuid.uuid4().hex[:6]}")
        self.database.create()
        self.prefix = f"benchstage{uuid.uuid4().hex[:8]}:"
        self.work = Path(tempfile.mkdtemp(prefix="mailpipe-bench-stage-"))
        self.server = TimedBedrockServer(delay=delay).start()
        self.env = environment(self.database, self.prefix, self.work / "blobs", self.server, rate)
        mailpipe(self.env, "db", "upgrade")

    def close(self) -> None:
        self.server.stop()
        delete_prefix(harness.REDIS_URL, self.prefix)
        self.database.drop()


def throughput(emails: int, rate: float, delay: float) -> dict[str, object]:
    setup = Setup("tp", delay, rate)
    fleet = Fleet(setup.env, setup.work).start()
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(fleet.pss_mb())
            time.sleep(1)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        mailpipe(setup.env, "model-calls", "on")
        sampler.start()
        started = time.monotonic()
        store_and_enqueue(setup.env, invoices(emails), setup.work / "inbox")
        wait(lambda: closed(setup.database) == emails, 3600, "the emails to close")
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        fleet.stop()
        setup.close()
    peak = setup.server.peak_in_flight
    arrivals = setup.server.arrivals()
    # The rate the calls held once they flowed: calls after the first over the span of arrivals
    # (the end-to-end figure also holds the ingest before the first call and one latency after).
    steady = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else 0.0
    return {
        "emails": emails,
        "rate": rate,
        "delay_s": delay,
        "seconds": round(elapsed, 1),
        "emails_per_s": round(emails / elapsed, 2),
        "share_of_rate": round(emails / elapsed / rate, 3),
        "calls_per_s_steady": round(steady, 2),
        "steady_share_of_rate": round(steady / rate, 3),
        "peak_in_flight": peak,
        "fleet_pss_mb_median": round(statistics.median(samples), 1) if samples else None,
        "fleet_pss_mb_per_call_in_flight": round(max(samples) / max(1, peak), 1)
        if samples
        else None,
    }


def cpu_per_email(emails: int, switched_on: bool) -> dict[str, object]:
    setup = Setup("cpu", 0.02, 1000.0)
    fleet = Fleet(setup.env, setup.work).start()
    meter = harness.CpuMeter()
    try:
        mailpipe(setup.env, "model-calls", "off" if switched_on else "on")
        meter.poll(fleet.pids())
        store_and_enqueue(setup.env, invoices(emails), setup.work / "inbox")
        if switched_on:
            wait(lambda: converted(setup.database) == emails, 3600, "every CPU stage")
            meter.poll(fleet.pids())
            mailpipe(setup.env, "model-calls", "on")
        wait(lambda: closed(setup.database) == emails, 3600, "the emails to close")
        meter.poll(fleet.pids())
        calls = len(setup.server.arrivals())
    finally:
        fleet.stop()
        setup.close()
    return {
        "emails": emails,
        "model_calls_switched_on_over_the_backlog": switched_on,
        "cpu_ms_per_email": round(1000 * meter.seconds() / emails, 2),
        "model_calls": calls,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emails", type=int, default=400)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--backlog", type=int, default=5000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print("Procfile:", {role: shlex.split(line)[:6] for role, line in procfile().items()})
    report = {
        "machine": harness.machine(),
        "throughput": throughput(args.emails, args.rate, args.delay),
        "cpu": [cpu_per_email(args.backlog, False), cpu_per_email(args.backlog, True)],
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
