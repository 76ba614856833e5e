"""End-to-end throughput: the pipeline alone, mailpipe's Celery worker, and a no-op Celery task;
optionally another mailpipe checkout's worker beside them.

    .venv/bin/python -m bench.throughput [--workload mixed|plain] [--jobs 1100] [--repeat 3]
                                         [--concurrency 2] [--no-s3] [--baseline-src DIR]
                                         [--mailbox NAME]
                                         [--json FILE]

One run, every measurement interleaved (each repetition starts with a different one), on a fresh
PostgreSQL database, the local Redis under a key prefix of this run, model calls on with the
`rules` classifier. The emails are `bench.workload.mixed_workload(--jobs)`: the shared corpus
emails, generated emails with PDF and DOCX attachments from the shared corpus, ~10 % copies; with
`--workload plain`, `bench.workload.plain_workload(--jobs)`: short plain-text emails and nothing
else, the job at its cheapest.

Variants, each over the same emails (tables truncated and the emails stored again before each):

- limit: `mailpipe.pipeline.job.process_email(res, email_id)` in N plain processes (fork, no
  Celery), each with its own `Resources` committing as a worker's children do, taking the next
  email id from a shared counter;
- mailpipe: the emails enqueued with `mailpipe.enqueue.enqueue_emails`, each with its mailbox (the
  default one, or `--mailbox NAME`'s: one mailbox's flood, in its two shard queues) as ingest
  and the sweeper send them, and processed by one
  `celery -A mailpipe worker -P prefork -c N` (started fresh for the measurement). The jobs are
  published while the worker's consumer is stopped (a remote control command), then it is
  restarted: the worker drains a full queue, as the limit's processes start with every email id
  at hand;
- noop: the same number of `bench.noop` tasks (bench/noop_tasks.py, on mailpipe's app, so every
  celeryconfig setting applies) through the same kind of worker;
- baseline, with `--baseline-src DIR`: the mailpipe variant with the code of the checkout in DIR
  (another commit, made with `git worktree add DIR <commit>`), at the main concurrency with local
  blobs. That checkout is only ever run, never imported here, so it may have another layout: its
  `celery -A mailpipe worker` starts in DIR with DIR first on PYTHONPATH, and its own
  `mailpipe ingest` stores the emails (written once as files) and enqueues them into the paused
  consumer. It has a database of its own, made by its own `mailpipe db upgrade`, and a Redis key
  prefix of its own. Reported: its jobs/s and its ratio to mailpipe's, paired per repetition.

Blob storage is a local folder, and for limit and mailpipe at the main concurrency also S3 (moto's
server on loopback, started here). Times run from the start signal (limit) or the first job's
start (mailpipe: from the worker log's first "succeeded in" line; noop: the first task's own time
stamp) to the last run closed (`max(pipeline_run.closed_at)`) or the last no-op task's own time
stamp.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path

import psutil
import psycopg

from bench import harness
from mailpipe.cli.demo import fleet
from tests.support.services import S3Server, delete_prefix

RUN = uuid.uuid4().hex[:8]
DATABASE = harness.database(f"mailpipe_bench_tp_{RUN}")
PREFIX = f"benchtp{RUN}:"
BASELINE_DATABASE = harness.database(f"mailpipe_bench_tp_{RUN}_baseline")
BASELINE_PREFIX = f"benchtpbase{RUN}:"
WORK = Path(tempfile.mkdtemp(prefix="mailpipe-throughput-"))
BUCKET = "mailpipe-bench"
ENV = harness.base_env(
    database_url=DATABASE.url, prefix=PREFIX, blob_url=f"file://{WORK / 'blobs'}"
)
os.environ.update(ENV)

POLL_S = 0.1
TIMEOUT_S = 900.0


@dataclass
class Measurement:
    variant: str  # limit | mailpipe | noop | baseline
    blobs: str  # local | s3
    concurrency: int
    repetition: int
    jobs: int
    seconds: float
    outcomes: dict[str, int] = field(default_factory=dict)
    worker_main_cpu_s: float | None = None  # CPU of the worker's main process during the run
    load_avg: float = 0.0
    # CPU seconds during the run: the job processes (limit children; worker main + children),
    # the PostgreSQL backends serving this run's database and the Redis server (which serves this
    # run alone). Less sensitive than wall time to what else runs on the machine; all of it
    # shares the same cores.
    cpu_jobs_s: float | None = None
    cpu_postgres_s: float | None = None
    cpu_redis_s: float | None = None
    # mailpipe: the share of c x the run's wall time that the children spent inside jobs (from
    # the worker log's "succeeded in" lines); the rest they waited for the main process.
    child_busy: float | None = None
    # mailpipe: median ms a child waited between two of its jobs (handover_ms)
    handover_ms: float | None = None
    # mailpipe, noop: how long publishing the jobs took (the run's first seconds; the worker is
    # already taking them and shares the CPUs with this publisher meanwhile)
    enqueue_s: float | None = None

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.variant, self.blobs, self.concurrency)


def _limit_child(overrides, ids, counter, barrier, results) -> None:  # type: ignore[no-untyped-def]
    from mailpipe.pipeline import job
    from mailpipe.resources import Resources
    from mailpipe.settings import Settings

    res = Resources.for_jobs(Settings(**overrides))  # committing as a worker's children do
    outcomes: Counter[str] = Counter()
    barrier.wait()
    cpu_start = sum(os.times()[:2])
    while True:
        with counter.get_lock():
            index = counter.value
            counter.value += 1
        if index >= len(ids):
            break
        try:
            outcomes[job.process_email(res, ids[index]).kind.value] += 1
        except Exception as exc:
            outcomes[f"raised {type(exc).__name__}"] += 1
    res.close()
    results.put((dict(outcomes), sum(os.times()[:2]) - cpu_start))


class Baseline:
    """The mailpipe checkout of `--baseline-src`, only ever run (its `mailpipe` command, its
    `celery` workers), never imported: it may have another layout. It has a database of its own,
    with the schema of its own migrations, and a Redis key prefix of its own; it stores the same
    emails, written once as files for its `mailpipe ingest`."""

    def __init__(self, src: Path, emails: list[bytes]) -> None:
        self.src = src
        self.commit = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        self.jobs = len(emails)
        self.folder = harness.write_emails(WORK / "emails", emails)
        self.env = {
            **os.environ,
            **harness.base_env(
                database_url=BASELINE_DATABASE.create().url,
                prefix=BASELINE_PREFIX,
                blob_url=f"file://{WORK / 'baseline-blobs'}",
                PYTHONPATH=str(src),
            ),
        }
        self.mailpipe("db", "upgrade")
        self.db = psycopg.connect(BASELINE_DATABASE.url, autocommit=True)

    def mailpipe(self, *args: str) -> str:
        return harness.run_mailpipe(self.src, self.env, *args)

    def set_model_calls(self, enabled: bool) -> None:
        self.mailpipe("model-calls", "on" if enabled else "off")

    def ingest(self) -> None:
        harness.ingest(self.src, self.env, self.folder, self.jobs)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from bench.workload import mixed_workload, plain_workload
        from mailpipe.resources import Resources, get_resources
        from mailpipe.settings import Settings
        from mailpipe.storage import flags
        from mailpipe.storage.migrate import upgrade

        self.args = args
        self.busy: float | None = None
        self.enqueue_s: float | None = None
        self.handover: float | None = None
        self.url = DATABASE.create().url
        upgrade(self.url)
        self.res = {"local": get_resources()}
        self.redis_server = harness.local_redis_server(self.res["local"].redis)
        self.overrides: dict[str, dict[str, str]] = {"local": {}}
        self.env = {"local": dict(os.environ)}
        self.s3: S3Server | None = None
        if not args.no_s3:
            self.s3 = S3Server(WORK / "moto.log").start(BUCKET)
            s3 = {"blob_url": f"s3://{BUCKET}/{RUN}", "s3_endpoint_url": self.s3.url}
            self.overrides["s3"] = s3
            self.res["s3"] = Resources(Settings(**s3))
            self.env["s3"] = {
                **os.environ,
                "MAILPIPE_BLOB_URL": s3["blob_url"],
                "MAILPIPE_S3_ENDPOINT_URL": s3["s3_endpoint_url"],
            }
        workload = mixed_workload if args.workload == "mixed" else plain_workload
        self.emails, self.kinds = workload(args.jobs, seed=args.seed)
        self.flags = flags
        self.db = psycopg.connect(self.url, autocommit=True)
        self._set_model_calls(True)
        self.base: Baseline | None = None
        if args.baseline_src:
            self.base = Baseline(args.baseline_src, self.emails)

    def _set_model_calls(self, enabled: bool) -> None:
        with self.res["local"].db.transaction() as session:
            self.flags.set_model_calls(session, enabled)

    def _store(self, blobs: str) -> list[int]:
        from mailpipe.cli.ingest import store_emails

        harness.truncate(self.url)
        ids: list[int] = []
        for start in range(0, len(self.emails), 500):
            ids += store_emails(
                self.res[blobs], self.emails[start : start + 500], mailbox=self.args.mailbox
            )
        return ids

    def limit(self, blobs: str, concurrency: int) -> tuple[float, dict[str, int], None]:
        ids = self._store(blobs)
        ctx = multiprocessing.get_context("fork")
        counter = ctx.Value("i", 0)
        barrier = ctx.Barrier(concurrency + 1)
        results = ctx.Queue()
        children = [
            ctx.Process(
                target=_limit_child,
                args=(self.overrides[blobs], ids, counter, barrier, results),
            )
            for _ in range(concurrency)
        ]
        for child in children:
            child.start()
        pg = harness.CpuMeter()
        pg.poll(harness.postgres_backends(self.db, DATABASE.name))
        redis_before = self._redis_cpu_s()
        barrier.wait(timeout=60)
        started = time.time()
        outcomes: Counter[str] = Counter()
        cpu = 0.0
        deadline = time.monotonic() + TIMEOUT_S
        received = 0
        while received < len(children):
            try:
                found, used = results.get(timeout=POLL_S)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError("limit children did not finish") from None
                pg.poll(harness.postgres_backends(self.db, DATABASE.name))
                continue
            outcomes.update(found)
            cpu += used
            received += 1
        pg.poll(harness.postgres_backends(self.db, DATABASE.name))
        for child in children:
            child.join(30)
        seconds = _last_closed(self.db) - started
        if any(k.startswith("raised") for k in outcomes):
            print(f"  limit outcomes: {dict(outcomes)}", file=sys.stderr)
        self.cpu = (cpu, pg.seconds(), self._redis_since(redis_before))
        return seconds, _outcomes(self.db), None

    def _worker(  # type: ignore[no-untyped-def]
        self, env, concurrency: int, set_model_calls, extra: tuple[str, ...] = (), cwd=None
    ) -> fleet.CeleryProcess:
        # Off while the worker starts: with model calls on, worker_ready fires a sweep that would
        # busy a child (and re-add stored emails) while the measurement runs.
        set_model_calls(False)
        worker = fleet.worker(env, WORK / "logs", concurrency=concurrency, extra_args=extra)
        # `python -m celery` puts its working folder first on the path: the checkout it runs.
        worker.cwd = cwd
        worker.start()
        worker.wait_ready(timeout=120)
        set_model_calls(True)
        return worker

    def _consume(self, worker: fleet.CeleryProcess, on: bool) -> None:
        """Stop or restart the worker's consumer of the email queue (a remote control command,
        answered once the worker has done it): the jobs are published while it is stopped, so
        the measurement is the worker draining a full queue, without the publisher's CPU."""
        from mailpipe.broker.queues import email_queue, family

        settings = self.res["local"].settings
        with fleet.control_app(worker.env) as app:
            command = app.control.add_consumer if on else app.control.cancel_consumer
            # The email queue and its mailboxes' shards.
            for queue in family(email_queue(settings), settings):
                replies = command(queue, destination=[worker.nodename], reply=True, timeout=10)
                if not replies or any(
                    "ok" not in answer for reply in replies for answer in reply.values()
                ):
                    state = "resume" if on else "pause"
                    raise RuntimeError(f"worker did not {state} {queue}: {replies}")

    def _drain(  # type: ignore[no-untyped-def]
        self, worker: fleet.CeleryProcess, concurrency: int, publish, db, database: str
    ) -> tuple[float, dict[str, int], float]:
        """Publish the jobs and time the worker until every run in `database` is closed."""
        main = psutil.Process(worker.pid)
        jobs_cpu, pg = harness.CpuMeter(), harness.CpuMeter()
        self._consume(worker, False)
        publish()
        jobs_cpu.poll([worker.pid, *worker.child_pids()])
        pg.poll(harness.postgres_backends(db, database))
        cpu_before = sum(main.cpu_times()[:2])
        redis_before = self._redis_cpu_s()
        started = time.time()
        self._consume(worker, True)
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            (closed,) = db.execute(
                "SELECT count(*) FROM pipeline_run WHERE status <> 'open'"
            ).fetchone()
            jobs_cpu.poll([worker.pid, *worker.child_pids()])
            pg.poll(harness.postgres_backends(db, database))
            if closed >= len(self.emails):
                break
            if time.monotonic() > deadline or not worker.alive():
                raise RuntimeError(
                    f"{closed}/{len(self.emails)} closed; worker log:\n{worker.log_tail()}"
                )
            time.sleep(POLL_S)
        cpu = sum(main.cpu_times()[:2]) - cpu_before
        self.cpu = (jobs_cpu.seconds(), pg.seconds(), self._redis_since(redis_before))
        # The worker's next BRPOP (up to a second later), not the control command's answer,
        # starts the consumption.
        started = first_job_start(worker.log_path)
        seconds = _last_closed(db) - started
        self.busy = busy_share(worker.log_path, concurrency, seconds)
        self.handover = handover_ms(worker.log_path)
        return seconds, _outcomes(db), cpu

    def mailpipe(self, blobs: str, concurrency: int) -> tuple[float, dict[str, int], float]:
        from mailpipe.enqueue import enqueue_emails

        worker = self._worker(self.env[blobs], concurrency, self._set_model_calls)
        try:
            ids = self._store(blobs)

            def publish() -> None:
                published = time.time()
                # With their mailbox, as ingest and the sweeper send them.
                boxes = dict.fromkeys(ids, self.args.mailbox)
                result = enqueue_emails(ids, self.res[blobs], mailboxes=boxes)
                self.enqueue_s = time.time() - published
                if len(result.sent) != len(ids):
                    raise RuntimeError(
                        f"only {len(result.sent)} of {len(ids)} enqueued: stale markers?"
                    )

            return self._drain(worker, concurrency, publish, self.db, DATABASE.name)
        finally:
            worker.stop()

    def baseline(self, blobs: str, concurrency: int) -> tuple[float, dict[str, int], float]:
        """The mailpipe variant with the baseline checkout's worker, and its `mailpipe ingest`
        storing and enqueueing the emails into the paused consumer (`blobs` is always local)."""
        assert self.base is not None
        harness.truncate(BASELINE_DATABASE.url)
        worker = self._worker(
            self.base.env, concurrency, self.base.set_model_calls, cwd=self.base.src
        )
        try:
            return self._drain(
                worker, concurrency, self.base.ingest, self.base.db, BASELINE_DATABASE.name
            )
        finally:
            worker.stop()

    def noop(self, blobs: str, concurrency: int) -> tuple[float, dict[str, int], float]:
        from bench import noop_tasks

        redis = self.res["local"].redis
        worker = self._worker(
            self.env[blobs], concurrency, self._set_model_calls, ("-I", "bench.noop_tasks")
        )
        try:
            redis.delete(noop_tasks.done_key(), noop_tasks.first_key(), noop_tasks.last_key())
            jobs = len(self.emails)
            main = psutil.Process(worker.pid)
            jobs_cpu = harness.CpuMeter()

            def publish() -> None:
                published = time.time()
                app = noop_tasks.noop.app
                with app.producer_or_acquire() as producer, producer.batch():
                    for email_id in range(1, jobs + 1):
                        noop_tasks.noop.apply_async((email_id,), producer=producer)
                self.enqueue_s = time.time() - published

            self._consume(worker, False)
            publish()
            jobs_cpu.poll([worker.pid, *worker.child_pids()])
            cpu_before = sum(main.cpu_times()[:2])
            redis_before = self._redis_cpu_s()
            started = time.time()
            self._consume(worker, True)
            deadline = time.monotonic() + TIMEOUT_S
            while int(redis.get(noop_tasks.done_key()) or 0) < jobs:
                jobs_cpu.poll([worker.pid, *worker.child_pids()])
                if time.monotonic() > deadline or not worker.alive():
                    raise RuntimeError(f"no-op tasks not done; worker log:\n{worker.log_tail()}")
                time.sleep(POLL_S / 5)
            jobs_cpu.poll([worker.pid, *worker.child_pids()])
            cpu = sum(main.cpu_times()[:2]) - cpu_before
            self.cpu = (jobs_cpu.seconds(), None, self._redis_since(redis_before))
            started = float(redis.get(noop_tasks.first_key()))
            seconds = float(redis.get(noop_tasks.last_key())) - started
        finally:
            worker.stop()
        return seconds, {"noop": jobs}, cpu

    def _redis_cpu_s(self) -> float | None:
        return sum(self.redis_server.cpu_times()[:2]) if self.redis_server else None

    def _redis_since(self, before: float | None) -> float | None:
        now = self._redis_cpu_s()
        return None if now is None or before is None else now - before

    def close(self) -> None:
        self.db.close()
        for res in self.res.values():
            res.close()
        if self.base is not None:
            self.base.db.close()
        if self.s3 is not None:
            self.s3.stop()


def _outcomes(db) -> dict[str, int]:  # type: ignore[no-untyped-def]
    rows = db.execute("SELECT status::text, count(*) FROM pipeline_run GROUP BY 1").fetchall()
    retried = db.execute("SELECT count(*) FROM pipeline_run WHERE attempts > 1").fetchone()
    found = {status: count for status, count in rows}
    if retried and retried[0]:
        found["retried"] = retried[0]
    return found


def _last_closed(db) -> float:  # type: ignore[no-untyped-def]
    (last,) = db.execute("SELECT max(closed_at) FROM pipeline_run").fetchone()
    return last.replace(tzinfo=UTC).timestamp()


def plan(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    main = [
        ("limit", "local", args.concurrency),
        ("mailpipe", "local", args.concurrency),
        ("noop", "local", args.concurrency),
    ]
    if args.baseline_src:
        main.append(("baseline", "local", args.concurrency))
    if not args.no_s3:
        main += [("limit", "s3", args.concurrency), ("mailpipe", "s3", args.concurrency)]
    return main


Key = tuple[str, str, int]  # variant, blobs, concurrency


def _by_key(measurements: list[Measurement]) -> dict[Key, list[Measurement]]:
    groups: dict[Key, list[Measurement]] = {}
    for m in measurements:
        groups.setdefault(m.key, []).append(m)
    return groups


def _paired(groups: dict[Key, list[Measurement]], over: Key, under: Key) -> list[float]:
    """One rate over the other in each repetition: both ran in the same round, so a drift of the
    machine over the run hits them alike."""
    under_rates = {m.repetition: m.rate for m in groups[under]}
    return [m.rate / under_rates[m.repetition] for m in groups[over] if m.repetition in under_rates]


def summarise(measurements: list[Measurement]) -> dict[str, object]:
    groups = _by_key(measurements)
    rates = {k: harness.median(m.rate for m in ms) for k, ms in groups.items()}
    summary: dict[str, object] = {"rates": {f"{v}/{b}/c{c}": r for (v, b, c), r in rates.items()}}
    comparisons = []
    baseline = []
    for blobs in ("local", "s3"):
        for c in sorted({k[2] for k in rates}):
            limit, mailpipe = rates.get(("limit", blobs, c)), rates.get(("mailpipe", blobs, c))
            if not limit or not mailpipe:
                continue
            paired = _paired(groups, ("mailpipe", blobs, c), ("limit", blobs, c))
            noop = rates.get(("noop", blobs, c))
            comparisons.append(
                {
                    "blobs": blobs,
                    "concurrency": c,
                    "limit_per_s": limit,
                    "mailpipe_per_s": mailpipe,
                    "noop_per_s": noop,
                    "ratio": mailpipe / limit,
                    "ratio_paired_median": harness.median(paired) if paired else None,
                    "overhead_ms": (1 / mailpipe - 1 / limit) * c * 1000,
                    "noop_ms": (c / noop * 1000) if noop else None,
                    "limit_job_ms": c / limit * 1000,
                }
            )
            before = rates.get(("baseline", blobs, c))
            if not before:
                continue
            paired = _paired(groups, ("baseline", blobs, c), ("mailpipe", blobs, c))
            baseline.append(
                {
                    "blobs": blobs,
                    "concurrency": c,
                    "baseline_per_s": before,
                    "mailpipe_per_s": mailpipe,
                    "ratio": before / mailpipe,
                    "ratio_paired_median": harness.median(paired) if paired else None,
                    "ms_per_job_saved": (1 / before - 1 / mailpipe) * c * 1000,
                }
            )
    summary["comparisons"] = comparisons
    summary["baseline"] = baseline
    return summary


def print_tables(measurements: list[Measurement], summary: dict[str, object]) -> None:
    print(
        "\n| variant | blobs | -c | runs (jobs/s) | median jobs/s | worker main CPU ms/job | "
        "CPU ms/job: job processes + PostgreSQL + Redis | children busy | hand-over ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    groups = _by_key(measurements)
    for (variant, blobs, c), ms in sorted(
        groups.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])
    ):
        cpu = [m.worker_main_cpu_s / m.jobs * 1000 for m in ms if m.worker_main_cpu_s is not None]
        print(
            f"| {variant} | {blobs} | {c} | {', '.join(f'{m.rate:.1f}' for m in ms)} | "
            f"{harness.median(m.rate for m in ms):.1f} | "
            + (f"{harness.median(cpu):.2f} |" if cpu else "- |")
            + _cpu_cell(ms)
            + _busy_cell(ms)
            + _handover_cell(ms)
        )
    print(
        "\n| blobs | -c | limit jobs/s | mailpipe jobs/s | mailpipe/limit (paired) | "
        "overhead ms/job | "
        "limit ms/job | no-op jobs/s | no-op ms/job |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in summary["comparisons"]:  # type: ignore[union-attr]
        noop = f"{c['noop_per_s']:.0f} | {c['noop_ms']:.2f}" if c["noop_per_s"] else "- | -"
        print(
            f"| {c['blobs']} | {c['concurrency']} | {c['limit_per_s']:.1f} | "
            f"{c['mailpipe_per_s']:.1f} | "
            f"{c['ratio']:.3f} ({c['ratio_paired_median']:.3f}) | {c['overhead_ms']:.2f} | "
            f"{c['limit_job_ms']:.1f} | {noop} |"
        )


# One line per finished job: its end time (local, to the millisecond), child, and run time.
_SUCCEEDED = re.compile(
    r"^\[([0-9-]+ [0-9:,]+): INFO/(ForkPoolWorker-\d+)\] Task mailpipe\.process_email\[[^]]+\] "
    r"succeeded in ([0-9.e-]+)s",
    re.MULTILINE,
)


def _jobs_by_child(log_path: Path) -> dict[str, list[tuple[float, float]]]:
    """(start, end) of every job in the worker log, per child, in order."""
    jobs: dict[str, list[tuple[float, float]]] = {}
    for stamp, child, runtime in _SUCCEEDED.findall(log_path.read_text(errors="replace")):
        end = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        jobs.setdefault(child, []).append((end - float(runtime), end))
    return {child: sorted(runs) for child, runs in jobs.items()}


def handover_ms(log_path: Path) -> float | None:
    """The median time a child spent between the end of one job and the start of its next, in ms:
    the main process taking the result, acking, fetching and handing over the next message."""
    gaps = [
        (after[0] - before[1]) * 1000
        for runs in _jobs_by_child(log_path).values()
        for before, after in pairwise(runs)
    ]
    return harness.median(gaps) if gaps else None


def first_job_start(log_path: Path) -> float:
    """When the first job in the worker log began."""
    starts = [runs[0][0] for runs in _jobs_by_child(log_path).values()]
    if not starts:
        raise RuntimeError(f"no finished job in {log_path}")
    return min(starts)


def busy_share(log_path: Path, concurrency: int, seconds: float) -> float | None:
    """Job time the children logged over the time they had (concurrency x the run's wall
    time)."""
    busy = sum(end - start for runs in _jobs_by_child(log_path).values() for start, end in runs)
    return busy / (concurrency * seconds) if busy else None


def _busy_cell(ms: list[Measurement]) -> str:
    busy = [m.child_busy for m in ms if m.child_busy is not None]
    return f" {harness.median(busy):.0%} |" if busy else " - |"


def _handover_cell(ms: list[Measurement]) -> str:
    gaps = [m.handover_ms for m in ms if m.handover_ms is not None]
    return f" {harness.median(gaps):.1f} |" if gaps else " - |"


def _ms_per_job(ms: list[Measurement], name: str) -> float | None:
    """Median CPU ms per job of one of the Measurement's cpu_*_s fields, None if never measured."""
    values = [used / m.jobs * 1000 for m in ms if (used := getattr(m, name)) is not None]
    return harness.median(values) if values else None


def _cpu_cell(ms: list[Measurement]) -> str:
    jobs = _ms_per_job(ms, "cpu_jobs_s")
    if jobs is None:
        return " - |"
    services = (_ms_per_job(ms, name) for name in ("cpu_postgres_s", "cpu_redis_s"))
    return (
        f" {jobs:.1f}"
        + "".join(f" + {v:.1f}" if v is not None else " + -" for v in services)
        + " |"
    )


def print_baseline(summary: dict[str, object]) -> None:
    if not summary["baseline"]:
        return
    print(
        "\n| blobs | -c | baseline jobs/s | mailpipe jobs/s | baseline/mailpipe (paired) | "
        "ms/job saved since the baseline (x c) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for b in summary["baseline"]:  # type: ignore[union-attr]
        print(
            f"| {b['blobs']} | {b['concurrency']} | {b['baseline_per_s']:.1f} | "
            f"{b['mailpipe_per_s']:.1f} | {b['ratio']:.3f} ({b['ratio_paired_median']:.3f}) | "
            f"{b['ms_per_job_saved']:.2f} |"
        )


def measure(bench: Bench, args: argparse.Namespace) -> list[Measurement]:
    """Every step of the plan, each repetition starting at another step."""
    measurements = []
    steps = plan(args)
    for rep in range(args.repeat):
        shift = rep * max(1, len(steps) // args.repeat)
        for variant, blobs, c in steps[shift:] + steps[:shift]:
            load = os.getloadavg()[0]
            seconds, outcomes, cpu = getattr(bench, variant)(blobs, c)
            m = Measurement(
                variant,
                blobs,
                c,
                rep,
                len(bench.emails),
                seconds,
                outcomes,
                cpu,
                load,
                *bench.cpu,
                bench.busy,
                bench.handover,
                bench.enqueue_s,
            )
            measurements.append(m)
            bench.busy = bench.handover = bench.enqueue_s = None
            print_measurement(m)
    return measurements


def print_measurement(m: Measurement) -> None:
    services = "".join(
        f" + {name} {used / m.jobs * 1000:.1f}"
        for name, used in (("postgres", m.cpu_postgres_s), ("redis", m.cpu_redis_s))
        if used is not None
    )
    print(
        f"rep {m.repetition} {m.variant:8s} {m.blobs:5s} -c {m.concurrency}: {m.rate:7.1f} jobs/s "
        f"({m.seconds:6.2f} s, load {m.load_avg:.2f}, "
        f"CPU ms/job {m.cpu_jobs_s / m.jobs * 1000:.1f}{services}"
        + (f", children busy {m.child_busy:.0%}" if m.child_busy else "")
        + (f", hand-over {m.handover_ms:.1f} ms" if m.handover_ms else "")
        + (f", enqueue {m.enqueue_s:.2f} s" if m.enqueue_s else "")
        + f") {m.outcomes}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=1100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="a checkout of another mailpipe (git worktree add DIR <commit>), measured as the "
        "variant 'baseline'",
    )
    parser.add_argument(
        "--workload",
        choices=("mixed", "plain"),
        default="mixed",
        help="mixed: corpus, documents and copies; plain: short plain-text emails only",
    )
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument(
        "--mailbox",
        help="store and enqueue every email in this mailbox (a flood in its shard queues); "
        "default: the default mailbox, in the lane's own queue",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.baseline_src:
        args.baseline_src = args.baseline_src.resolve()
        if not (args.baseline_src / "pyproject.toml").is_file():
            parser.error(f"--baseline-src {args.baseline_src}: not a mailpipe checkout")

    print(f"machine: {harness.machine()}")
    print(f"run {RUN}: database {DATABASE.name}, Redis prefix {PREFIX}, work dir {WORK}")
    bench: Bench | None = None
    measurements: list[Measurement] = []
    try:
        bench = Bench(args)
        print(
            f"workload: {len(bench.emails)} emails {bench.kinds}, "
            f"{sum(map(len, bench.emails)) / 1e6:.1f} MB raw"
        )
        if bench.base is not None:
            print(f"baseline: {bench.base.src} (commit {bench.base.commit or 'unknown'})")
        measurements = measure(bench, args)
    finally:
        if bench is not None:
            bench.close()
        for database, prefix in ((DATABASE, PREFIX), (BASELINE_DATABASE, BASELINE_PREFIX)):
            database.drop()
            delete_prefix(harness.REDIS_URL, prefix)
        # The blobs are big; the worker logs stay for a look after a failure.
        for folder in ("blobs", "baseline-blobs", "emails"):
            shutil.rmtree(WORK / folder, ignore_errors=True)
        print(f"worker logs: {WORK / 'logs'}")
    summary = summarise(measurements)
    print_tables(measurements, summary)
    print_baseline(summary)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": harness.machine(),
                    "workload": bench.kinds,
                    "jobs": len(bench.emails),
                    "baseline_src": {"path": str(bench.base.src), "commit": bench.base.commit}
                    if bench.base
                    else None,
                    "measurements": [asdict(m) | {"rate": m.rate} for m in measurements],
                    **summary,
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
