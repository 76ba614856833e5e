"""Benchmark of model calls through one real prefork worker: the call rate achieved against the
fleet limit, emails/s at each worker concurrency, and the memory of every worker child.

    .venv/bin/python -m bench.model_calls [--emails 80] [--rate 4] [--delay 2] \\
        [--concurrency 2 8 16] [--repeat 3] [--json results.json]

Each run starts one `celery -A mailpipe worker -P prefork -c N` subprocess with the `bedrock`
backend pointed at the local `converse` server (tests/support/bedrock_server.py, in this process,
on loopback) that answers every call after `--delay` seconds, as a model would. The bench process
stores `--emails` emails, switches model calls on and enqueues them (`t0`); the run ends when the
last run closes (its `closed_at`). Two limits per concurrency:

- `rate R`: `MAILPIPE_MODEL_RATE_PER_S=R`, `MAILPIPE_MODEL_BURST=R` (the production defaults keep
  burst = rate), a generous `MAILPIPE_MODEL_MAX_IN_FLIGHT`;
- `unlimited`: rate and burst far above what one worker can reach; the limiter still runs (one
  Redis round trip per call) but never refuses, so concurrency / latency is the only bound.

Reported per run: emails/s end to end (emails / (last close - t0)) against the prediction
min(R, concurrency / delay); the time from t0 to the first call (each child's first job also
builds its database, Redis and boto3 clients); model calls / s, as calls / time between the
first and last call's arrival at the server, and as the slope of call number against arrival
time (which neither the initial burst nor the waves of a short run at high concurrency inflate);
the most calls that arrived in any 1 s window, against the limiter's bound B + R; the most calls
in flight at the server; jobs deferred by the limiter (from the worker log); CPU per email
(worker main process and children, cold starts included); and the memory of the worker's main
process and each child, sampled every `--sample` seconds during the run (median and max per
process): RSS, which counts pages shared with the parent in full; USS, the pages only that
process holds (what one more child adds); and the sum of PSS over the main process and children
(shared pages counted once), the memory of the whole worker, as its container's limit must
allow for.

Its own environment, torn down at the end: a PostgreSQL database of its own (migrated with
`mailpipe.storage.migrate.upgrade`), a blob folder in a temp dir, the local Redis under a key
prefix of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil
import sqlalchemy
from sqlalchemy import func, select

from bench import harness
from bench.report import table
from mailpipe.cli.demo import fleet
from mailpipe.cli.ingest import store_emails
from mailpipe.enqueue import enqueue_emails
from mailpipe.resources import Resources, get_resources
from mailpipe.storage import flags
from mailpipe.storage.migrate import upgrade
from mailpipe.storage.models import PipelineRun, RunStatus

# The server that records when each call arrived: the same one the worker-level test reads.
from tests.support.bedrock_server import TimedBedrockServer, invoices
from tests.support.grants import most_in_window
from tests.support.services import delete_prefix

RUN = uuid.uuid4().hex[:8]
DATABASE = harness.database(f"mailpipe_bench_models_{RUN}")
PREFIX = f"benchmodels{RUN}:"
WORK_DIR = Path(tempfile.mkdtemp(prefix="mailpipe-bench-models-"))
# Before any mailpipe settings are read: the settings and the Celery app read the environment once.
os.environ.update(
    harness.base_env(
        database_url=DATABASE.url,
        prefix=PREFIX,
        blob_url=f"file://{WORK_DIR / 'blobs'}",
        MAILPIPE_SOFT_SHUTDOWN_TIMEOUT="5",
        # No profile or credentials of the machine's user reach the fake Bedrock endpoint.
        AWS_CONFIG_FILE=str(WORK_DIR / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(WORK_DIR / "no-aws-credentials"),
    )
)
os.environ.pop("AWS_PROFILE", None)

MIB = 1024 * 1024
UNLIMITED_RATE = 1000.0

_SUMMARY_COLUMNS = [
    "limit",
    "c",
    "runs",
    "emails_per_s",
    "predicted",
    "first_call_s",
    "calls_per_s",
    "calls_per_s_fit",
    "max_calls_1s",
    "bound_1s",
    "peak_in_flight",
    "deferred",
    "cpu_ms_per_email",
    "child_rss_mib",
    "child_rss_max_mib",
    "child_uss_mib",
    "main_rss_mib",
    "task_pss_max_mib",
]


@dataclass(frozen=True)
class Config:
    label: str
    concurrency: int
    rate_per_s: float
    burst: int
    max_in_flight: int


@dataclass
class MemorySampler:
    """RSS, USS and PSS of a worker's main process and its children, every `interval` seconds.

    Each sample is one round over the processes, so that their PSS can be summed per round: the
    sum is the memory the whole worker (one ECS task's container) holds, shared pages once.
    """

    pid: int
    interval: float
    rounds: list[dict[int, tuple[int, int, int]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        main = psutil.Process(self.pid)
        found = {}
        for process in [main, *main.children()]:
            try:
                info = process.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # a child recycled between the listing and the read
            found[process.pid] = (info.rss, info.uss, info.pss)
        self.rounds.append(found)

    def summary(self) -> dict[str, object]:
        def stats(values: list[int]) -> dict[str, float]:
            return {
                "median_mib": round(statistics.median(values) / MIB, 1),
                "max_mib": round(max(values) / MIB, 1),
            }

        def process(pid: int) -> dict[str, object]:
            seen = [found[pid] for found in self.rounds if pid in found]
            return {
                kind: stats([sample[index] for sample in seen])
                for index, kind in enumerate(("rss", "uss", "pss"))
            }

        pids = dict.fromkeys(pid for found in self.rounds for pid in found)
        return {
            "main": process(self.pid),
            "children": {pid: process(pid) for pid in pids if pid != self.pid},
            "task_pss": stats([sum(pss for _, _, pss in found.values()) for found in self.rounds]),
        }


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and its live children, user and system."""
    total = 0.0
    main = psutil.Process(pid)
    for process in [main, *main.children()]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def reset_state(res: Resources) -> None:
    """Empty tables, model calls off and none of this bench's Redis keys: each run starts cold."""
    harness.truncate(DATABASE.url)
    with res.db.transaction() as session:
        flags.set_model_calls(session, False)
    delete_prefix(harness.REDIS_URL, PREFIX)


def closed_runs(res: Resources) -> int | None:
    """Runs closed so far; None when the database did not answer (the run is then marked)."""
    try:
        with res.db.session() as session:
            closed = select(func.count()).where(PipelineRun.status != RunStatus.OPEN)
            return session.scalar(closed) or 0
    except sqlalchemy.exc.OperationalError:
        return None


def run_once(
    res: Resources, config: Config, args: argparse.Namespace, repetition: int
) -> dict[str, object]:
    reset_state(res)
    load_before = os.getloadavg()[0]
    server = TimedBedrockServer(delay=args.delay).start()
    env = dict(os.environ)
    env.update(
        {
            "MAILPIPE_MODEL_BACKEND": "bedrock",
            "AWS_ENDPOINT_URL_BEDROCK_RUNTIME": server.url,
            "MAILPIPE_MODEL_RATE_PER_S": str(config.rate_per_s),
            "MAILPIPE_MODEL_BURST": str(config.burst),
            "MAILPIPE_MODEL_MAX_IN_FLIGHT": str(config.max_in_flight),
        }
    )
    name = f"{config.label.replace(' ', '')}-c{config.concurrency}-r{repetition}"
    worker = fleet.worker(env, WORK_DIR / "logs", concurrency=config.concurrency, name=name)
    worker.start()
    try:
        worker.wait_ready()
        ids = store_emails(res, invoices(args.emails))
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
        sampler = MemorySampler(worker.pid, args.sample)
        sampler.sample()
        sampler.start()
        cpu_before = cpu_seconds(worker.pid)
        t0 = datetime.now(UTC).replace(tzinfo=None)
        t0_monotonic = time.monotonic()
        enqueue_emails(ids, res)
        predicted = min(config.rate_per_s, config.concurrency / args.delay)
        deadline = time.monotonic() + args.emails / predicted * 3 + 60
        # A database outage during a run (another process restarting PostgreSQL on a shared
        # machine) makes the jobs retry: the run finishes, but its numbers are marked.
        db_outages = 0
        while (closed := closed_runs(res)) is None or closed < len(ids):
            db_outages += closed is None
            if time.monotonic() > deadline or not worker.alive():
                raise RuntimeError(f"run {name} did not finish; worker log:\n{worker.log_tail()}")
            time.sleep(0.2)
        cpu_used = cpu_seconds(worker.pid) - cpu_before
        sampler.stop()
    finally:
        worker.stop()
        server.stop()

    with res.db.session() as session:
        last_close = session.scalar(select(func.max(PipelineRun.closed_at)))
        statuses = dict(
            session.execute(
                select(PipelineRun.status, func.count()).group_by(PipelineRun.status)
            ).all()
        )
        max_attempts = session.scalar(select(func.max(PipelineRun.attempts)))
    wall = (last_close - t0).total_seconds()
    arrivals = server.arrivals()
    span = arrivals[-1] - arrivals[0]
    memory = sampler.summary()
    children = memory["children"]

    def children_median(kind: str) -> float:
        return round(statistics.median(c[kind]["median_mib"] for c in children.values()), 1)

    return {
        "limit": config.label,
        "concurrency": config.concurrency,
        "rate_per_s": config.rate_per_s,
        "burst": config.burst,
        "max_in_flight": config.max_in_flight,
        "repetition": repetition,
        "emails": len(ids),
        "statuses": {status.value: count for status, count in statuses.items()},
        "max_attempts": max_attempts,
        "db_outage_polls": db_outages,
        "wall_s": round(wall, 2),
        "emails_per_s": round(len(ids) / wall, 3),
        "predicted_emails_per_s": round(predicted, 3),
        "calls": len(arrivals),
        # From the enqueue to the first call: every child's first job also builds its clients.
        "first_call_s": round(arrivals[0] - t0_monotonic, 2),
        "call_span_s": round(span, 2),
        "calls_per_s": round(len(arrivals) / span, 3),
        # calls / span overstates a short run: n calls span n - 1 gaps, and at high concurrency
        # they come in waves of c every model latency. The slope of call number against arrival
        # time is the rate the run held, burst and waves included.
        "calls_per_s_fit": round(
            statistics.linear_regression(arrivals, range(len(arrivals))).slope, 3
        ),
        "max_calls_1s": most_in_window(arrivals, 1.0),
        "bound_1s": round(config.burst + config.rate_per_s),
        "peak_in_flight": server.peak_in_flight,
        "deferred": worker.log_path.read_text(errors="replace").count(" deferred "),
        "cpu_ms_per_email": round(cpu_used * 1000 / len(ids), 1),
        # Other work on the machine skews CPU-bound numbers: say how busy it was.
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "arrivals_s": [round(t - t0_monotonic, 4) for t in arrivals],
        "memory": memory,
        "child_rss_median_mib": children_median("rss"),
        "child_rss_max_mib": max(c["rss"]["max_mib"] for c in children.values()),
        "child_uss_median_mib": children_median("uss"),
        "child_pss_median_mib": children_median("pss"),
        "main_rss_median_mib": memory["main"]["rss"]["median_mib"],
        "task_pss_max_mib": memory["task_pss"]["max_mib"],
    }


def _median(group: list[dict[str, object]], key: str) -> float:
    return round(statistics.median(float(r[key]) for r in group), 2)


def summarise(runs: list[dict[str, object]]) -> list[dict[str, object]]:
    """One row per configuration: medians over its repetitions (emails/s also min-max)."""
    rows = []
    keys = list(dict.fromkeys((run["limit"], run["concurrency"]) for run in runs))
    for limit, concurrency in keys:
        group = [r for r in runs if (r["limit"], r["concurrency"]) == (limit, concurrency)]

        rates = [float(r["emails_per_s"]) for r in group]
        rows.append(
            {
                "limit": limit,
                "c": concurrency,
                "runs": len(group),
                "emails_per_s": f"{_median(group, 'emails_per_s')} ({min(rates):.2f}-{max(rates):.2f})",
                "predicted": group[0]["predicted_emails_per_s"],
                "first_call_s": _median(group, "first_call_s"),
                "calls_per_s": _median(group, "calls_per_s"),
                "calls_per_s_fit": _median(group, "calls_per_s_fit"),
                "max_calls_1s": max(int(r["max_calls_1s"]) for r in group),
                "bound_1s": group[0]["bound_1s"],
                "peak_in_flight": max(int(r["peak_in_flight"]) for r in group),
                "deferred": _median(group, "deferred"),
                "cpu_ms_per_email": _median(group, "cpu_ms_per_email"),
                "child_rss_mib": _median(group, "child_rss_median_mib"),
                "child_rss_max_mib": max(float(r["child_rss_max_mib"]) for r in group),
                "child_uss_mib": _median(group, "child_uss_median_mib"),
                "main_rss_mib": _median(group, "main_rss_median_mib"),
                "task_pss_max_mib": max(float(r["task_pss_max_mib"]) for r in group),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 80: three repetitions of the six configurations stay near 15 minutes at a 2 s delay; the
    # -c 2 runs (1 email/s at most) take two thirds of it.
    parser.add_argument("--emails", type=int, default=80, help="emails per run")
    parser.add_argument("--rate", type=float, default=4.0, help="the limit R, calls per second")
    parser.add_argument("--delay", type=float, default=2.0, help="the model's answer time, seconds")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--max-in-flight", type=int, default=64, help="generous: not a bound")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of every configuration")
    # Reading a process's PSS and USS costs about 3 ms of CPU: at 1 s, ~5 % of a core at -c 16.
    parser.add_argument("--sample", type=float, default=1.0, help="memory sampling interval (s)")
    parser.add_argument("--json", type=Path, help="also write every run to this file")
    args = parser.parse_args()

    configs = [
        Config(label, c, rate, max(1, round(rate)), args.max_in_flight)
        for c in args.concurrency
        for label, rate in ((f"rate {args.rate:g}", args.rate), ("unlimited", UNLIMITED_RATE))
    ]
    machine = {
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 1024**3, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "emails": args.emails,
        "delay_s": args.delay,
        "repeat": args.repeat,
    }
    print("machine:", ", ".join(f"{key} {value}" for key, value in machine.items()), flush=True)
    upgrade(DATABASE.create().url)
    res = get_resources()
    runs: list[dict[str, object]] = []
    started = time.monotonic()
    try:
        # Repetitions outermost: drift in the machine over the bench hits every configuration alike.
        for repetition in range(1, args.repeat + 1):
            for config in configs:
                run = run_once(res, config, args, repetition)
                runs.append(run)
                print(
                    f"[{time.monotonic() - started:6.0f} s] {config.label:>10}"
                    f" c={config.concurrency:<2}"
                    f" #{repetition}: {run['emails_per_s']} emails/s, {run['calls_per_s']} calls/s,"
                    f" {run['deferred']} deferred, statuses {run['statuses']}, max attempts"
                    f" {run['max_attempts']}, load {run['load_avg_1m']}",
                    flush=True,
                )
                if args.json:  # after every run: a bench cut short keeps what it measured
                    write_json(args.json, machine, runs)
    finally:
        res.close()
        delete_prefix(harness.REDIS_URL, PREFIX)
        DATABASE.drop()
    print(
        f"\n{args.emails} emails per run, model delay {args.delay:g} s, medians of"
        f" {args.repeat} runs ({time.monotonic() - started:.0f} s in all)"
    )
    print(table(summarise(runs), _SUMMARY_COLUMNS))
    if args.json:
        write_json(args.json, machine, runs)
    shutil.rmtree(WORK_DIR, ignore_errors=True)


def write_json(path: Path, machine: dict[str, object], runs: list[dict[str, object]]) -> None:
    document = {"machine": machine, "summary": summarise(runs), "runs": runs}
    path.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
