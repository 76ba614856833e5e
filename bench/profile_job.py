"""Where a job's time goes, and how many SQL statements and Redis commands it sends.

    .venv/bin/python -m bench.profile_job [--jobs 1100] [--workload mixed|plain] [--no-pyspy]
                                          [--out DIR]

Same workloads and services as bench/throughput.py (`mixed_workload`, or `plain_workload` with
`--workload plain`; PostgreSQL, local blobs,
model calls on with the `rules` classifier), except Redis: a private `redis-server` started here on
a free port, so that its `INFO commandstats` counts this run and nothing else (the shared Redis
serves other processes; its commandstats are server-wide). Three parts:

1. The limit path in this process: `process_email(res, email_id)` over every email, under
   pyinstrument, with SQLAlchemy's `before_cursor_execute` and redis-py counted
   (bench/counters.py). Prints statements per job by verb and table, split by outcome, and the
   inclusive time of each pipeline step.
2. A real `celery worker -P prefork -c 2`: the no-op task, then mailpipe over the same emails.
   Redis commands per job from the server's commandstats (reset once the worker is ready); the
   worker loads bench/counters.py (`-I bench.counters`) to count its children's SQL and Redis
   commands client-side too.
3. py-spy (`record --subprocesses --format raw`) on the mailpipe worker of part 2: self time per
   function, split between the worker's main process and its children.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

from bench import harness
from mailpipe.harness.services import free_port

RUN = uuid.uuid4().hex[:8]
DATABASE = harness.database(f"mailpipe_bench_prof_{RUN}")
PREFIX = f"benchprof{RUN}:"
WORK = Path(tempfile.mkdtemp(prefix="mailpipe-profile-"))
ENV = harness.base_env(
    database_url=DATABASE.url, prefix=PREFIX, blob_url=f"file://{WORK / 'blobs'}"
)
os.environ.update(ENV)

# Inclusive time of these steps (function names in mailpipe and the libraries under them).
STEPS = (
    ("process_email", "mailpipe/pipeline/job.py"),
    ("claim_attempt", "mailpipe/pipeline/runs.py"),
    ("_run_steps", "mailpipe/pipeline/job.py"),
    ("get", "mailpipe/storage/blobs.py"),
    ("parse_email", "mailpipe/mail/parse.py"),
    ("find_origin", "mailpipe/pipeline/origin.py"),
    ("convert_documents", "mailpipe/pipeline/documents.py"),
    ("document_rows", "mailpipe/pipeline/documents.py"),
    ("store_documents", "mailpipe/pipeline/documents.py"),
    ("model_calls_enabled", "mailpipe/storage/flags.py"),
    ("__init__", "mailpipe/coordination/ratelimit.py"),
    ("classify", "mailpipe/pipeline/classify.py"),
    ("close", "mailpipe/pipeline/runs.py"),
    ("store_classification", "mailpipe/pipeline/classify.py"),
    ("sync_model_labels", "mailpipe/pipeline/labels.py"),
    ("commit", "sqlalchemy/orm/session.py"),
    ("_do_ping_w_event", "sqlalchemy/engine/default.py"),
    ("do_ping", "sqlalchemy/engine/default.py"),
    ("_checkout", "sqlalchemy/pool/base.py"),
    ("_compiler", "sqlalchemy/sql/elements.py"),
    ("_execute_context", "sqlalchemy/engine/base.py"),
    ("_exec_single_context", "sqlalchemy/engine/base.py"),
    ("_emit_insert_statements", "sqlalchemy/orm/persistence.py"),
    ("execute", "psycopg/cursor.py"),
)


def limit_path(res, ids: list[int], out: Path) -> dict[str, object]:  # type: ignore[no-untyped-def]
    from pyinstrument import Profiler

    from bench import counters
    from mailpipe.pipeline.job import process_email

    counters.install()
    counters.reset()
    per_outcome: dict[str, Counter[str]] = defaultdict(Counter)
    redis_per_outcome: dict[str, Counter[str]] = defaultdict(Counter)
    jobs_per_outcome: Counter[str] = Counter()
    profiler = Profiler(interval=0.0005)
    started = time.perf_counter()
    profiler.start()
    for email_id in ids:
        sql_before, redis_before = Counter(counters.SQL), Counter(counters.REDIS)
        outcome = process_email(res, email_id).kind.value
        jobs_per_outcome[outcome] += 1
        per_outcome[outcome].update(Counter(counters.SQL) - sql_before)
        redis_per_outcome[outcome].update(Counter(counters.REDIS) - redis_before)
    profiler.stop()
    elapsed = time.perf_counter() - started
    (out / "limit-pyinstrument.html").write_text(profiler.output_html())
    (out / "limit-pyinstrument.txt").write_text(profiler.output_text(unicode=False, color=False))
    root = profiler.last_session.root_frame()
    steps = _inclusive_times(root)
    return {
        "jobs": len(ids),
        "seconds_under_profiler": elapsed,
        "outcomes": dict(jobs_per_outcome),
        "sql_per_job": {
            outcome: {k: v / jobs_per_outcome[outcome] for k, v in sorted(c.items())}
            for outcome, c in per_outcome.items()
        },
        "sql_total_per_job": {
            outcome: sum(c.values()) / jobs_per_outcome[outcome]
            for outcome, c in per_outcome.items()
        },
        "redis_per_job": {
            outcome: {k: v / jobs_per_outcome[outcome] for k, v in c.items()}
            for outcome, c in redis_per_outcome.items()
        },
        "step_ms_per_job": {name: t / len(ids) * 1000 for name, t in steps.items()},
        "top_self_ms_per_job": _top_self(root, len(ids)),
    }


def _inclusive_times(root) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Inclusive seconds of each STEP, counting only its outermost frames (no recursion twice)."""
    totals: dict[str, float] = Counter()

    def walk(frame, inside: frozenset[str]) -> None:  # type: ignore[no-untyped-def]
        name = None
        for function, path in STEPS:
            if frame.function == function and (frame.file_path or "").endswith(path):
                name = f"{path.rsplit('/', 1)[-1][:-3]}.{function}"
                break
        if name is not None and name not in inside:
            totals[name] += frame.time
            inside = inside | {name}
        for child in frame.children:
            walk(child, inside)

    walk(root, frozenset())
    return dict(totals)


def _top_self(  # type: ignore[no-untyped-def]
    root, jobs: int, limit: int = 25
) -> list[tuple[str, float]]:
    self_times: Counter[str] = Counter()

    def walk(frame) -> None:  # type: ignore[no-untyped-def]
        path = frame.file_path_short or frame.file_path or "?"
        self_times[f"{frame.function} ({path}:{frame.line_no})"] += frame.total_self_time
        for child in frame.children:
            walk(child)

    walk(root)
    return [(name, t / jobs * 1000) for name, t in self_times.most_common(limit)]


class PrivateRedis:
    """A redis-server of our own on loopback: its commandstats count our worker and nothing else."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ],
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        import redis

        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def commandstats(self) -> dict[str, int]:
        return {
            k.removeprefix("cmdstat_"): v["calls"]
            for k, v in self.client.info("commandstats").items()
        }

    def reset(self) -> None:
        self.client.config_resetstat()

    def stop(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(10)


def worker_counts(
    res,
    url: str,
    ids: list[int],
    redis_server: PrivateRedis,
    noop: bool,  # type: ignore[no-untyped-def]
    pyspy: bool,
    out: Path,
) -> dict[str, object]:
    import psycopg

    from mailpipe.enqueue import enqueue_emails
    from mailpipe.harness import fleet
    from mailpipe.storage import flags

    counts_dir = WORK / ("counts-noop" if noop else "counts-mailpipe")
    harness.clean_dir(counts_dir)
    env = {**os.environ, "MAILPIPE_BENCH_COUNTS_DIR": str(counts_dir)}
    extra = ("-I", "bench.noop_tasks,bench.counters") if noop else ("-I", "bench.counters")
    with res.db.transaction() as session:
        flags.set_model_calls(session, False)  # no start-up sweep (see bench/throughput.py)
    worker = fleet.worker(env, WORK / "logs", concurrency=2, extra_args=extra).start()
    spy = None
    try:
        worker.wait_ready(timeout=120)
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
        time.sleep(1.5)  # let the metrics reporter's first report pass
        redis_server.reset()
        if pyspy and not noop:
            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "--pid",
                    str(worker.pid),
                    "--subprocesses",
                    "--rate",
                    "250",
                    "--format",
                    "raw",
                    "--full-filenames",
                    "--output",
                    str(out / "worker-pyspy.txt"),
                    "--nonblocking",
                ],
                stdout=(out / "py-spy.log").open("wb"),
                stderr=subprocess.STDOUT,
            )
            time.sleep(1.0)
        started = time.time()
        if noop:
            from bench import noop_tasks

            client = redis_server.client
            app = noop_tasks.noop.app
            with app.producer_or_acquire() as producer, producer.batch():
                for email_id in ids:
                    noop_tasks.noop.apply_async((email_id,), producer=producer)
            while int(client.get(noop_tasks.done_key()) or 0) < len(ids):
                time.sleep(0.02)
        else:
            result = enqueue_emails(ids, res)
            assert len(result.sent) == len(ids), "stale dedup markers"
            with psycopg.connect(url, autocommit=True) as db:
                while db.execute(
                    "SELECT count(*) FROM pipeline_run WHERE status <> 'open'"
                ).fetchone()[0] < len(ids):
                    if not worker.alive():
                        raise RuntimeError(worker.log_tail())
                    time.sleep(0.1)
        elapsed = time.time() - started
        time.sleep(0.5)
        stats = redis_server.commandstats()
    finally:
        if spy is not None:
            spy.send_signal(2)
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
        worker.stop()
    children = [json.loads(p.read_text()) for p in counts_dir.glob("*.json")]
    child_sql: Counter[str] = Counter()
    child_redis: Counter[str] = Counter()
    for child in children:
        child_sql.update(child["sql"])
        child_redis.update(child["redis"])
    n = len(ids)
    return {
        "jobs": n,
        "seconds": elapsed,
        "worker_pid": worker.pid,
        "server_commands_per_job": {
            k: v / n for k, v in sorted(stats.items(), key=lambda kv: -kv[1])
        },
        "server_total_per_job": sum(
            v for k, v in stats.items() if k not in ("info", "config|resetstat")
        )
        / n,
        "children_sql_per_job": {k: v / n for k, v in sorted(child_sql.items())},
        "children_redis_per_job": {k: v / n for k, v in sorted(child_redis.items())},
    }


def pyspy_summary(path: Path, main_pid: int, limit: int = 30) -> dict[str, object]:
    """Samples per function from py-spy's raw (collapsed) output: the worker's main process apart
    from its pool children (py-spy puts `process PID:"command line"` at the root of each stack)."""
    by_process: Counter[str] = Counter()
    self_samples: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        # A child's stack starts with its parent's process frame, then its own.
        pid = None
        while frames and (found := re.match(r"process (\d+)", frames[0])):
            pid = int(found.group(1))
            frames = frames[1:]
        role = "main" if pid == main_pid else "children"
        by_process[role] += count
        if not frames:
            continue
        self_samples[role][_short(frames[-1])] += count
        for name in {_short(f) for f in frames}:
            inclusive[role][name] += count
    return {
        "samples": dict(by_process),
        "top_self": {role: c.most_common(limit) for role, c in self_samples.items()},
        "top_inclusive": {role: c.most_common(limit * 2) for role, c in inclusive.items()},
    }


def _short(frame: str) -> str:
    # "function (path/to/file.py:123)" -> "function (file.py)"
    name, _, where = frame.partition(" (")
    file = where.rsplit("/", 1)[-1].split(":")[0]
    return f"{name} ({file})" if file else name


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=1100)
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--workload", choices=("mixed", "plain"), default="mixed")
    parser.add_argument("--no-pyspy", action="store_true")
    parser.add_argument("--out", type=Path, default=WORK / "out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    redis_server = PrivateRedis(WORK / "redis.log")
    # Every process of this run (this one, the workers) uses the private server.
    os.environ["MAILPIPE_BROKER_URL"] = redis_server.url

    from bench.workload import mixed_workload, plain_workload
    from mailpipe.cli.ingest import store_emails
    from mailpipe.resources import get_resources
    from mailpipe.storage import flags
    from mailpipe.storage.migrate import upgrade

    url = DATABASE.create().url
    result: dict[str, object] = {"machine": harness.machine()}
    try:
        upgrade(url)
        res = get_resources()
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
        workload = mixed_workload if args.workload == "mixed" else plain_workload
        emails, kinds = workload(args.jobs, seed=args.seed)
        result["workload"] = kinds

        def store() -> list[int]:
            harness.truncate(url)
            ids: list[int] = []
            for start in range(0, len(emails), 500):
                ids += store_emails(res, emails[start : start + 500])
            return ids

        print("1. limit path under pyinstrument, counting SQL and Redis ...", flush=True)
        result["limit"] = limit_path(res, store(), args.out)
        print(json.dumps(result["limit"], indent=1), flush=True)

        print("2. worker on a private redis-server: no-op task ...", flush=True)
        result["noop_worker"] = worker_counts(
            res,
            url,
            list(range(1, len(emails) + 1)),
            redis_server,
            noop=True,
            pyspy=False,
            out=args.out,
        )
        print(json.dumps(result["noop_worker"], indent=1), flush=True)
        print(
            "2. worker on a private redis-server: mailpipe"
            + ("" if args.no_pyspy else " under py-spy")
            + " ...",
            flush=True,
        )
        result["mailpipe_worker"] = worker_counts(
            res, url, store(), redis_server, noop=False, pyspy=not args.no_pyspy, out=args.out
        )
        print(json.dumps(result["mailpipe_worker"], indent=1), flush=True)
        raw = args.out / "worker-pyspy.txt"
        if raw.exists():
            result["pyspy"] = pyspy_summary(raw, result["mailpipe_worker"]["worker_pid"])
            print(json.dumps(result["pyspy"], indent=1), flush=True)
    finally:
        redis_server.stop()
        DATABASE.drop()
        shutil.rmtree(WORK / "blobs", ignore_errors=True)
    (args.out / "profile.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
