"""Chaos run: N emails through two prefork workers while faults are injected on a schedule.

    python -m tests.chaos.run --n 10000 --json chaos.json

Run it from the repository's root. Every service is the run's own, so nothing on the machine's
PostgreSQL or Redis is touched: a PostgreSQL server (`PrivatePostgres`, which the run restarts),
a Redis server (`PrivateRedis`, which it flushes) and moto's S3 server (`S3Server`) behind a proxy
that can answer 503 (`tests/support/flaky_proxy.py`).

Scenarios (`--scenario`):

- `backlog` (the default, and the CI run): a backlog older than the TTLs. Every email is stored
  and enqueued before any worker or beat starts, and the fleet starts only once every job's
  dedup marker has lapsed (MAILPIPE_DEDUP_TTL); sweeps run every few seconds while it drains;
- `live`: the fleet is up first, then the emails are enqueued.

Faults, in both: a worker child SIGKILLed every few seconds, one worker SIGKILLed whole, one
worker sent SIGTERM (soft shutdown), one Redis flush, one PostgreSQL restart, a spell of S3
errors, and a few poison jobs that segfault their child on every delivery. Each stopped worker is
replaced, so two keep running. The workers load `tests.support.faults`, which counts per email
the deliveries that reached the job's steps and the model's answers taken.

It prints a table, writes the report as JSON (`--json`; docs/chaos.md lists its fields), and
exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.demo.servers import PrivateRedis
from tests.support.flaky_proxy import FlakyProxy
from tests.support.paths import CORPUS, REPO
from tests.support.services import Database, PrivatePostgres, S3Server

TERMINAL = ("succeeded", "duplicate", "failed")
BUCKET = "chaos"
WORKER_ARGS = ("-I", "tests.support.faults")
# The one-off faults, each once this fraction of the emails is closed (so that each lands while
# work remains, however fast the machine), at least ONE_OFF_GAP_S apart. Worker children are
# SIGKILLed every CHILD_SIGKILL_EVERY_S from 2 s after the fleet is ready until the last of them.
SCHEDULE = (
    (0.10, "worker_sigkill"),
    (0.20, "worker_sigterm"),
    (0.30, "redis_flush"),
    (0.40, "postgres_restart"),
    (0.50, "s3_errors"),
)
ONE_OFF_GAP_S = 2.0
CHILD_SIGKILL_EVERY_S = 3.0
S3_ERRORS_S = 4.0
DEPTH_SAMPLE_EVERY_S = 0.1
EXAMPLES = 10  # ids listed per figure in the report

# FLUSHDB in one atomic script that carries the test's own keys over (`mailpipe:test:*`: the
# fault settings and the counters of tests.support.faults). Everything mailpipe and kombu keep
# goes, as in a real flush; what the report counts stays. Returns the queue's depth and the
# unacked messages just before the flush, and how many test keys were kept.
FLUSH_KEEPING_TEST_KEYS = """
local depth = 0
for _, name in ipairs(KEYS) do depth = depth + redis.call('LLEN', name) end
local unacked = redis.call('HLEN', ARGV[2])
local kept = {}
for _, key in ipairs(redis.call('KEYS', ARGV[1])) do
  kept[#kept + 1] = {key, redis.call('PTTL', key), redis.call('DUMP', key)}
end
redis.call('FLUSHDB')
for _, k in ipairs(kept) do
  local ttl = k[2]
  if ttl < 0 then ttl = 0 end
  redis.call('RESTORE', k[1], ttl, k[3])
end
return {depth, unacked, #kept}
"""


def chaos_env(database_url: str, redis_url: str, s3_url: str) -> dict[str, str]:
    """The environment of the run and of every process it starts: nothing MAILPIPE_ is inherited
    (a test run's settings point at the machine's services), windows are shortened."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAILPIPE_")}
    env.update(
        {
            "MAILPIPE_DATABASE_URL": database_url,
            "MAILPIPE_BROKER_URL": redis_url,
            "MAILPIPE_REDIS_PREFIX": "",
            "MAILPIPE_QUEUE": "mailpipe",
            "MAILPIPE_BLOB_URL": f"s3://{BUCKET}/blobs",
            "MAILPIPE_S3_ENDPOINT_URL": s3_url,
            "MAILPIPE_MODEL_BACKEND": "rules",
            "MAILPIPE_VISIBILITY_TIMEOUT": "30",
            "MAILPIPE_TASK_SOFT_TIME_LIMIT": "15",
            "MAILPIPE_TASK_TIME_LIMIT": "20",
            "MAILPIPE_RETRY_BACKOFF_BASE": "1",
            "MAILPIPE_RETRY_BACKOFF_MAX": "6",
            "MAILPIPE_LEASE_TTL": "6",
            # Sweeps every few seconds; markers lapse after twice that (the least the settings
            # accept), so a job waits in the queue far longer than its marker lives.
            "MAILPIPE_SWEEP_INTERVAL": "3",
            "MAILPIPE_DEDUP_TTL": "6",
            "MAILPIPE_SOFT_SHUTDOWN_TIMEOUT": "5",
            "MAILPIPE_BEAT_LOCK_TIMEOUT": "10",
            # As deployed: SIGTERM starts the soft shutdown.
            "REMAP_SIGTERM": "SIGQUIT",
            # The workers import tests.support.faults from this checkout.
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p),
            "AWS_ACCESS_KEY_ID": "chaos",
            "AWS_SECRET_ACCESS_KEY": "chaos",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    return env


def build_emails(n: int, poison: int, seed: int) -> tuple[list[bytes], list[int]]:
    """Corpus emails (25 %), generated ones (30 % of them with a PDF or DOCX attachment from the
    corpus), ~10 % copies of emails already in the run, and `poison` poison emails at the end;
    returns the emails and the positions of the poison ones."""
    from email.message import EmailMessage

    from mailpipe.cli.ingest import RawEmail, read_sources
    from mailpipe.mail.parse import looks_like_email
    from mailpipe.settings import Settings

    rng = random.Random(seed)
    corpus = [
        i.data
        for i in read_sources([CORPUS / "emails"], max_bytes=Settings().max_email_bytes)
        if isinstance(i, RawEmail) and looks_like_email(i.data)
    ]
    documents = sorted(CORPUS.joinpath("documents").rglob("*.pdf")) + sorted(
        CORPUS.joinpath("documents").rglob("*.docx")
    )
    emails: list[bytes] = []
    while len(emails) < n - poison:
        roll = rng.random()
        if roll < 0.25:
            emails.append(corpus[rng.randrange(len(corpus))])
        elif roll < 0.35 and emails:
            emails.append(emails[rng.randrange(len(emails))])  # a copy of one already in the run
        else:
            k = len(emails)
            message = EmailMessage()
            message["From"] = f"sender{k % 97}@example.org"
            message["To"] = "team@example.org"
            message["Subject"] = (
                rng.choice(["Invoice", "Newsletter", "Support ticket", "Hello"]) + f" {k}"
            )
            message["Message-ID"] = f"<chaos-{seed}-{k}@example.org>"
            message.set_content(f"Message {k}. Amount due: {k} EUR. Unsubscribe at any time.")
            if rng.random() < 0.3:
                document = documents[rng.randrange(len(documents))]
                subtype = (
                    "pdf"
                    if document.suffix == ".pdf"
                    else "vnd.openxmlformats-officedocument.wordprocessingml.document"
                )
                message.add_attachment(
                    document.read_bytes(),
                    maintype="application",
                    subtype=subtype,
                    filename=document.name,
                )
            emails.append(message.as_bytes())
    first_poison = len(emails)
    for k in range(poison):
        emails.append(
            f"From: p@example.org\r\nSubject: poison {k}\r\nMessage-ID: <poison-{seed}-{k}@x>"
            "\r\n\r\nboom\r\n".encode()
        )
    return emails, list(range(first_poison, first_poison + poison))


class DepthSampler:
    """The email queue's depth, read every `every` seconds in a thread of its own."""

    def __init__(self, read: Callable[[], int], every: float) -> None:
        self.samples: list[tuple[float, int]] = []  # (monotonic time the read began, depth)
        self._read = read
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="depth-sampler", daemon=True)

    def start(self) -> DepthSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def peak(self, after: float | None = None, before: float | None = None) -> int | None:
        depths = [
            depth
            for t, depth in self.samples
            if (after is None or t >= after) and (before is None or t < before)
        ]
        return max(depths) if depths else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.samples.append((began, self._read()))
            except Exception:  # Redis is the run's own and never goes away; keep sampling anyway
                pass
            self._stop.wait(self._every)


class Chaos:
    def __init__(
        self, n: int, poison: int, seed: int, deadline: float, scenario: str, workdir: Path
    ) -> None:
        self.n, self.poison, self.seed, self.deadline = n, poison, seed, deadline
        self.scenario = scenario
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.events: list[dict[str, Any]] = []
        self.processes: list[localfleet.CeleryProcess] = []
        self.workers: list[localfleet.CeleryProcess] = []
        self.ids: list[int] = []
        self.closed = 0  # emails whose run is closed, as last read
        self.poison_ids: list[int] = []
        self.t0 = time.monotonic()
        self.fleet_started: float | None = None
        self.flushed_at: float | None = None  # monotonic
        self.flushed_at_utc: datetime | None = None
        self.backlog: dict[str, Any] | None = None

    def log(self, event: str, **details: Any) -> None:
        entry = {
            "t": round(time.monotonic() - self.t0, 2),
            "fault": event,
            "closed": self.closed,
            **details,
        }
        self.events.append(entry)
        print(f"[{entry['t']:7.2f}s] {event} (closed: {self.closed}) {details or ''}", flush=True)

    def run(self) -> dict[str, Any]:
        """Start the run's services, run the scenario, report; everything started is stopped."""
        with contextlib.ExitStack() as stack:
            self.postgres = PrivatePostgres()
            stack.callback(self.postgres.destroy)
            self.postgres.start()
            database_url = Database(self.postgres.url, "mailpipe_chaos").create().url
            self.redis_server = PrivateRedis(self.workdir / "redis.log")
            stack.callback(self.redis_server.stop)
            self.redis_server.start()
            s3 = S3Server(self.workdir / "moto.log")
            stack.callback(s3.stop)
            s3.start(BUCKET)
            self.proxy = FlakyProxy(s3.url).start()
            stack.callback(self.proxy.stop)
            self.env = chaos_env(database_url, self.redis_server.url, self.proxy.url)
            # Before any mailpipe module reads its settings (they are read once per process).
            for name in [name for name in os.environ if name.startswith("MAILPIPE_")]:
                del os.environ[name]
            os.environ.update(self.env)
            stack.callback(self._close_resources)
            stack.callback(self._stop_processes)
            return self._run()

    def _run(self) -> dict[str, Any]:
        from mailpipe.cli.ingest import store_emails
        from mailpipe.coordination import brokerstate
        from mailpipe.enqueue import enqueue_emails
        from mailpipe.resources import get_resources
        from mailpipe.storage import flags
        from mailpipe.storage.db import once_more_if_disconnected
        from mailpipe.storage.migrate import upgrade
        from tests.support.faults import set_fault

        res = get_resources()
        upgrade(res.settings.database_url)
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
        raws, poison_positions = build_emails(self.n, self.poison, self.seed)
        for start in range(0, len(raws), 500):
            self.ids.extend(store_emails(res, raws[start : start + 500]))
        self.poison_ids = [self.ids[p] for p in poison_positions]
        for email_id in self.poison_ids:
            set_fault(res.redis, email_id, "segfault")
        lists = brokerstate.priority_lists(res.settings.queue)

        def depth() -> int:
            pipe = res.redis.pipeline(transaction=False)
            for name in lists:
                pipe.llen(name)
            return sum(pipe.execute())

        self.depth = depth
        self.sampler = DepthSampler(depth, DEPTH_SAMPLE_EVERY_S)
        self.t0 = time.monotonic()
        if self.scenario == "backlog":
            enqueue_emails(self.ids, res)  # before any worker or beat exists
            self.log("enqueued", emails=len(self.ids))
            self.sampler.start()
            self._wait_for_markers_to_lapse(res)
            self._start_fleet()
            drain_from = self.fleet_started
        else:
            self._start_fleet()
            self.sampler.start()
            enqueue_emails(self.ids, res)
            self.log("enqueued", emails=len(self.ids))
            drain_from = time.monotonic()
        assert drain_from is not None
        faults_from = time.monotonic()

        stop = threading.Event()
        done = threading.Event()
        injector = threading.Thread(
            target=self._inject, args=(faults_from, stop, done), name="injector", daemon=True
        )
        injector.start()
        drained_at = None
        while time.monotonic() - drain_from < self.deadline:
            still_open = self._open_count(res)
            if still_open >= 0:  # -1: the database is restarting
                self.closed = len(self.ids) - still_open
            if done.is_set() and still_open == 0:
                drained_at = time.monotonic()
                break
            time.sleep(0.5)
        stop.set()
        injector.join(60)
        self.sampler.stop()
        self.log("drained" if drained_at is not None else "deadline")
        drain_seconds = None if drained_at is None else drained_at - drain_from
        # The restart fault may have closed the pooled connections just before (the injector has
        # joined, so the server is back): read again on a fresh one, as a claim would.
        return once_more_if_disconnected(lambda: self._report(res, drain_seconds))

    def _wait_for_markers_to_lapse(self, res: Any) -> None:
        """Until no email of the backlog has a dedup marker: none can lapse before the TTL."""
        from mailpipe.coordination import markers

        ttl = res.settings.dedup_ttl
        time.sleep(ttl)
        deadline = time.monotonic() + 30
        while (left := sum(m is not None for m in markers.read(res.redis, self.ids))) > 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{left} dedup markers still set {ttl + 30} s after the enqueue")
            time.sleep(0.2)
        self.backlog = {
            "dedup_ttl_s": ttl,
            "sweep_interval_s": res.settings.sweep_interval,
            "markers_left_at_fleet_start": left,
            "queue_depth_at_fleet_start": self.depth(),
            "age_at_fleet_start_s": round(time.monotonic() - self.t0, 2),
        }
        self.log("markers_lapsed", **self.backlog)

    def _worker(self, name: str) -> localfleet.CeleryProcess:
        process = localfleet.worker(self.env, self.workdir, name=name, extra_args=WORKER_ARGS)
        process.cwd = REPO
        self.processes.append(process.start())
        return process

    def _start_fleet(self) -> None:
        self.fleet_started = time.monotonic()
        self.workers = [self._worker("chaos-a"), self._worker("chaos-b")]
        beat = localfleet.beat(self.env, self.workdir, "chaos-beat")
        beat.cwd = REPO
        self.processes.append(beat.start())
        self.log("fleet_started", workers=2, beat=1)
        for process in self.workers:
            process.wait_ready()
        self.log("fleet_ready")

    def _inject(self, faults_from: float, stop: threading.Event, done: threading.Event) -> None:
        pending = list(SCHEDULE)
        next_child_kill = faults_from + 2.0
        next_one_off = faults_from
        try:
            while pending and not stop.is_set():
                now = time.monotonic()
                if now >= next_child_kill:
                    self._child_sigkill()
                    next_child_kill = now + CHILD_SIGKILL_EVERY_S
                if now >= next_one_off and self.closed >= pending[0][0] * len(self.ids):
                    _, fault = pending.pop(0)
                    next_one_off = now + ONE_OFF_GAP_S
                    try:
                        getattr(self, f"_{fault}")()
                    except Exception as exc:  # reported as a fault that did not happen
                        self.log(f"{fault}_error", error=repr(exc))
                time.sleep(0.2)
        except Exception as exc:  # the faults left are reported missing
            self.log("injector_error", error=repr(exc))
        finally:
            done.set()

    def _child_sigkill(self) -> None:
        children = [(w, [p for p in w.child_pids() if _running(p)]) for w in self.workers]
        live = [(w, pids) for w, pids in children if w.alive() and pids]
        if live:
            target, pids = self.rng.choice(live)
            pid = self.rng.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL)
                self.log("child_sigkill", worker=target.nodename, pid=pid)
            except ProcessLookupError:
                pass

    def _worker_sigkill(self) -> None:
        victim = self.workers.pop(0)
        victim.kill()
        self.log("worker_sigkill", worker=victim.nodename)
        self.workers.append(self._worker("chaos-c"))

    def _worker_sigterm(self) -> None:
        victim = self.workers.pop(0)
        victim.signal(signal.SIGTERM)
        self.log("worker_sigterm", worker=victim.nodename)
        self.workers.append(self._worker("chaos-d"))

    def _redis_flush(self) -> None:
        from mailpipe.coordination import brokerstate, redis_keys
        from mailpipe.resources import get_resources
        from mailpipe.storage.models import utcnow

        res = get_resources()
        lists = brokerstate.priority_lists(res.settings.queue)
        self.flushed_at, self.flushed_at_utc = time.monotonic(), utcnow()
        depth, unacked, kept = res.redis.eval(
            FLUSH_KEEPING_TEST_KEYS,
            len(lists),
            *lists,
            redis_keys.key("test:*"),
            brokerstate.unacked_key(),
        )
        self.log("redis_flush", queue_before=depth, unacked_before=unacked, test_keys_kept=kept)

    def _postgres_restart(self) -> None:
        began = time.monotonic()
        self.postgres.stop()
        self.postgres.start()
        self.log("postgres_restart", down_s=round(time.monotonic() - began, 2))

    def _s3_errors(self) -> None:
        self.proxy.fail_for(S3_ERRORS_S)
        self.log("s3_errors", seconds=S3_ERRORS_S)

    def _open_count(self, res: Any) -> int:
        from sqlalchemy import func, select

        from mailpipe.storage.models import EmailMessage, PipelineRun, RunStatus

        try:
            with res.db.session() as session:
                no_run = session.scalar(
                    select(func.count())
                    .select_from(EmailMessage)
                    .where(EmailMessage.has_run.is_(False))
                )
                open_runs = session.scalar(
                    select(func.count())
                    .select_from(PipelineRun)
                    .where(PipelineRun.status == RunStatus.OPEN)
                )
            return (no_run or 0) + (open_runs or 0)
        except Exception:  # the database is restarting
            return -1

    def _report(self, res: Any, drain_seconds: float | None) -> dict[str, Any]:
        from sqlalchemy import func, select, text

        from mailpipe.storage.models import Classification, EmailMessage, PipelineRun, SweepReport
        from tests.support.faults import classifications_key, runs_key

        ids, poison = self.ids, set(self.poison_ids)
        pipe = res.redis.pipeline(transaction=False)
        for email_id in ids:
            pipe.get(runs_key(email_id))
        for email_id in ids:
            pipe.get(classifications_key(email_id))
        counts = [int(value or 0) for value in pipe.execute()]
        step_runs = dict(zip(ids, counts[: len(ids)], strict=True))
        taken = dict(zip(ids, counts[len(ids) :], strict=True))
        rerun = {i: r for i, r in step_runs.items() if r > 1 and i not in poison}
        classified_again = {i: c for i, c in taken.items() if c > 1}

        with res.db.session() as session:
            statuses = dict(
                session.execute(
                    select(PipelineRun.status, func.count()).group_by(PipelineRun.status)
                ).all()
            )
            # Copies convert nothing and are never classified.
            artifacts_on_copies = session.scalar(
                text(
                    "SELECT count(*) FROM email_message e WHERE e.duplicate_of IS NOT NULL AND "
                    "(EXISTS (SELECT 1 FROM document d WHERE d.email_id = e.id) OR "
                    "EXISTS (SELECT 1 FROM classification c WHERE c.email_id = e.id))"
                )
            )
            succeeded_without_one_classification = session.scalar(
                text(
                    "SELECT count(*) FROM pipeline_run r WHERE r.status = 'succeeded' AND "
                    "(SELECT count(*) FROM classification c WHERE c.run_id = r.id) <> 1"
                )
            )
            needs_review = session.scalar(
                select(func.count())
                .select_from(EmailMessage)
                .where(EmailMessage.needs_review.is_(True))
            )
            poison_runs = [
                {
                    "email": row.email_id,
                    "status": row.status.value,
                    "attempts": row.attempts,
                    "step_runs": step_runs.get(row.email_id, 0),
                    "error": row.error,
                }
                for row in session.scalars(
                    select(PipelineRun).where(PipelineRun.email_id.in_(self.poison_ids))
                )
            ]
            failed_other = [
                {"email": row.email_id, "attempts": row.attempts, "error": row.error}
                for row in session.scalars(
                    select(PipelineRun).where(
                        PipelineRun.status == "failed", PipelineRun.email_id.not_in(self.poison_ids)
                    )
                )
            ]
            classifications = session.scalar(select(func.count()).select_from(Classification))
            sweeps = session.execute(
                select(
                    SweepReport.finished_at,
                    SweepReport.readded_no_run + SweepReport.readded_stalled,
                    SweepReport.marked_for_review,
                )
            ).all()
        terminal = {status.value: count for status, count in statuses.items()}

        def after_flush(finished_at: datetime) -> bool:
            return self.flushed_at_utc is not None and finished_at >= self.flushed_at_utc

        readded_after = sum(readded for at, readded, _ in sweeps if after_flush(at))
        readded_before = sum(readded for at, readded, _ in sweeps if not after_flush(at))
        happened = {event["fault"] for event in self.events}
        schedule = ["child_sigkill", *(fault for _, fault in SCHEDULE)]
        report: dict[str, Any] = {
            "scenario": self.scenario,
            "emails": len(ids),
            "terminal": {s: terminal.get(s, 0) for s in TERMINAL},
            "lost": len(ids) - sum(terminal.get(s, 0) for s in TERMINAL),
            "reruns": {
                "emails": len(rerun),
                "extra_runs": sum(r - 1 for r in rerun.values()),
                "examples": dict(sorted(rerun.items())[:EXAMPLES]),
            },
            "classified_more_than_once": {
                "emails": len(classified_again),
                "extra_classifications": sum(c - 1 for c in classified_again.values()),
                "examples": dict(sorted(classified_again.items())[:EXAMPLES]),
            },
            "classifications_taken": sum(taken.values()),
            "classifications": classifications,
            "artifacts_on_copies": artifacts_on_copies,
            "succeeded_without_one_classification": succeeded_without_one_classification,
            "needs_review": needs_review,
            "poison_expected": self.poison,
            "poison": poison_runs,
            "failed_other": failed_other,
            "sweeps": {
                "count": len(sweeps),
                "readded": readded_before + readded_after,
                "readded_before_flush": readded_before,
                "readded_after_flush": readded_after,
                "marked_for_review": sum(marked for _, _, marked in sweeps),
            },
            "queue_depth": {
                "peak": self.sampler.peak(),
                "peak_before_flush": self.sampler.peak(before=self.flushed_at),
                "peak_after_flush": (
                    None if self.flushed_at is None else self.sampler.peak(after=self.flushed_at)
                ),
                "bound": len(ids) + readded_after,
                "samples": len(self.sampler.samples),
            },
            "backlog": self.backlog,
            "drain_seconds": None if drain_seconds is None else round(drain_seconds, 1),
            "schedule": schedule,
            "faults_missing": [fault for fault in schedule if fault not in happened],
            "faults": self.events,
            "s3_requests_failed": self.proxy.failed_requests,
        }
        report["problems"] = problems(report)
        return report

    def _stop_processes(self) -> None:
        """SIGTERM to every process at once, then SIGKILL to any still up after 20 s."""
        for process in self.processes:
            if process.alive():
                process.signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for process in self.processes:
            assert process.process is not None
            try:
                process.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()

    def _close_resources(self) -> None:
        from mailpipe.resources import get_resources

        get_resources().close()


def _running(pid: int) -> bool:
    """The process is there and not a zombie (a child killed that its worker has not reaped
    yet is still listed among the worker's children)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def problems(report: dict[str, Any]) -> list[str]:
    """The run's checks (the same as tests/integration/test_chaos.py asserts), as what failed."""
    found = []
    if report["drain_seconds"] is None:
        found.append("not drained by the deadline")
    if report["lost"]:
        found.append(f"{report['lost']} emails lost")
    if report["failed_other"]:
        found.append(f"{len(report['failed_other'])} healthy emails failed")
    if len(report["poison"]) != report["poison_expected"] or any(
        p["status"] != "failed"
        or p["attempts"] != 4
        or "worker process died" not in (p["error"] or "")
        for p in report["poison"]
    ):
        found.append("a poison job did not fail after 4 attempts of a dying worker process")
    if report["needs_review"]:
        found.append(f"{report['needs_review']} emails marked for review")
    if report["artifacts_on_copies"]:
        found.append(f"{report['artifacts_on_copies']} copies with documents or classifications")
    if report["succeeded_without_one_classification"]:
        found.append(
            f"{report['succeeded_without_one_classification']} succeeded runs without exactly "
            "one classification"
        )
    if report["faults_missing"]:
        found.append(f"faults that did not happen: {report['faults_missing']}")
    depth = report["queue_depth"]
    if depth["peak"] is not None and depth["peak"] > depth["bound"]:
        found.append(f"queue depth peaked at {depth['peak']}, above {depth['bound']}")
    return found


def print_table(report: dict[str, Any]) -> None:
    depth, sweeps = report["queue_depth"], report["sweeps"]
    rows: list[tuple[str, object]] = [
        ("scenario", report["scenario"]),
        ("emails", report["emails"]),
        *((f"  {status}", count) for status, count in report["terminal"].items()),
        ("lost", report["lost"]),
        (
            "steps run more than once",
            f"{report['reruns']['emails']} emails, {report['reruns']['extra_runs']} extra runs",
        ),
        (
            "classification taken more than once",
            f"{report['classified_more_than_once']['emails']} emails",
        ),
        ("artifacts on copies", report["artifacts_on_copies"]),
        ("succeeded without one classification", report["succeeded_without_one_classification"]),
        ("marked for review", report["needs_review"]),
        ("poison jobs", len(report["poison"])),
        ("  their attempts", sorted({p["attempts"] for p in report["poison"]})),
        ("other failed runs", len(report["failed_other"])),
        (
            "sweeps (re-adds before / after the flush)",
            f"{sweeps['count']} ({sweeps['readded_before_flush']} / "
            f"{sweeps['readded_after_flush']})",
        ),
        ("peak queue depth (bound)", f"{depth['peak']} ({depth['bound']})"),
        ("time to drain (s)", report["drain_seconds"]),
        ("faults injected", len([e for e in report["faults"] if e["fault"] in report["schedule"]])),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for problem in report["problems"]:
        print(f"FAILED: {problem}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.run", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--n", type=int, default=10_000, help="emails, poison ones included")
    parser.add_argument("--poison", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--scenario", choices=("backlog", "live"), default="backlog")
    parser.add_argument("--deadline", type=float, default=3600, help="seconds to drain")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--workdir", type=Path, help="keep the logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    # A SIGTERM (a test's timeout) unwinds like an error, so every process started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chaos-")))
        else:
            workdir = args.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        chaos = Chaos(args.n, args.poison, args.seed, args.deadline, args.scenario, workdir)
        report = chaos.run()
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
