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
errors, a few poison jobs that segfault their child on every delivery, and a few model stages
that die once their answer is stored. Each stopped worker is replaced, so two keep running. The
workers load `tests.support.faults`, which counts per email the deliveries that reached the
job's steps; the model stage calls a local Bedrock stand-in, which counts the calls per email.
The run records which emails each fault cut, and checks that work was repeated only for them.

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
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from mailpipe.cli.demo import fleet as localfleet
from mailpipe.cli.demo.servers import PrivateRedis
from tests.support.bedrock_server import CountingBedrockServer, bedrock_env, email_key
from tests.support.flaky_proxy import FlakyProxy
from tests.support.paths import CORPUS, REPO
from tests.support.services import Database, PrivatePostgres, S3Server

TERMINAL = ("succeeded", "duplicate", "failed")
BUCKET = "chaos"
WORKER_ARGS = ("-I", "tests.support.faults")
# The one-off faults, each once this fraction of the emails is closed (so that each lands while
# work remains, however fast the machine), at least ONE_OFF_GAP_S apart. Worker children are
# SIGKILLed every CHILD_SIGKILL_EVERY_S from 2 s after the fleet is ready until the last of them.
# S3 comes first: only the CPU stage reads and writes blobs, and with the model stage on, its
# work can be done by the time half the runs are closed.
SCHEDULE = (
    (0.05, "s3_errors"),
    (0.10, "worker_sigkill"),
    (0.20, "worker_sigterm"),
    (0.30, "redis_flush"),
    (0.40, "postgres_restart"),
)
# The faults whose cut can spend the attempt it cuts: a process that dies mid-attempt, and an
# error of PostgreSQL or S3 whose check passes by the time it is judged. A worker's SIGTERM gives
# back the attempts it cuts off, and a flushed lease leaves its attempt running.
SPENDS_AN_ATTEMPT = frozenset({"child_sigkill", "worker_sigkill", "postgres_restart", "s3_errors"})
ONE_OFF_GAP_S = 2.0
CHILD_SIGKILL_EVERY_S = 3.0
S3_ERRORS_S = 4.0
DEPTH_SAMPLE_EVERY_S = 0.1
# Emails whose model stage dies once the model's answer is stored (tests.support.faults), so that
# the run sees the next delivery take the stored answer instead of paying for a second call.
ANSWER_FAULTS = 5
# How often the leases are read while a fault that lasts (the PostgreSQL restart) is under way.
LEASE_SAMPLE_EVERY_S = 0.01
# How long the leases are still read after a SIGKILL: the kernel ends the process meanwhile, so a
# job it took between the first read and the signal is seen.
KILL_SETTLES_S = 0.05
EXAMPLES = 10  # ids listed per figure in the report

# FLUSHDB in one atomic script that carries the test's own keys over (`mailpipe:test:*`: the
# fault settings and the counters of tests.support.faults). Everything mailpipe and kombu keep
# goes, as in a real flush; what the report counts stays. Returns the queue's depth and the
# unacked messages just before the flush, how many test keys were kept, and the emails' leases
# the flush took (their jobs, still running, were cut off from the fleet's coordination).
FLUSH_KEEPING_TEST_KEYS = """
local depth = 0
for _, name in ipairs(KEYS) do depth = depth + redis.call('LLEN', name) end
local unacked = redis.call('HLEN', ARGV[2])
local leases = redis.call('KEYS', ARGV[3])
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
return {depth, unacked, #kept, leases}
"""

# In the run's own database: every row written to `classification` or `email_label` (inserted,
# updated, deleted) is logged with its transaction, in that transaction, so the log holds the
# committed writes only. An email whose answer or labels were written by two transactions was
# classified or labelled twice.
RECORD_WRITES = """
CREATE TABLE chaos_write (
    table_name text NOT NULL, email_id bigint NOT NULL, txid bigint NOT NULL DEFAULT txid_current()
);
CREATE FUNCTION chaos_record_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO chaos_write (table_name, email_id) VALUES (TG_TABLE_NAME, OLD.email_id);
    ELSE
        INSERT INTO chaos_write (table_name, email_id) VALUES (TG_TABLE_NAME, NEW.email_id);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_write AFTER INSERT OR UPDATE OR DELETE ON classification
    FOR EACH ROW EXECUTE FUNCTION chaos_record_write();
CREATE TRIGGER chaos_write AFTER INSERT OR UPDATE OR DELETE ON email_label
    FOR EACH ROW EXECUTE FUNCTION chaos_record_write();
"""
WRITTEN_MORE_THAN_ONCE = """
SELECT email_id, count(DISTINCT txid) FROM chaos_write WHERE table_name = :table_name
GROUP BY email_id HAVING count(DISTINCT txid) > 1 ORDER BY email_id
"""


def chaos_env(
    database_url: str, redis_url: str, s3_url: str, model: CountingBedrockServer, workdir: Path
) -> dict[str, str]:
    """The environment of the run and of every process it starts: nothing MAILPIPE_ is inherited
    (a test run's settings point at the machine's services), windows are shortened, the model
    stage calls the stand-in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAILPIPE_")}
    env.update(
        {
            "MAILPIPE_DATABASE_URL": database_url,
            "MAILPIPE_BROKER_URL": redis_url,
            "MAILPIPE_REDIS_PREFIX": "",
            "MAILPIPE_QUEUE": "mailpipe",
            "MAILPIPE_BLOB_URL": f"s3://{BUCKET}/blobs",
            "MAILPIPE_S3_ENDPOINT_URL": s3_url,
            # The stand-in answers at once: at the default fleet limit (5 calls/s) the limiter,
            # not the faults, would set the model stage's pace.
            "MAILPIPE_MODEL_RATE_PER_S": "1000",
            "MAILPIPE_MODEL_BURST": "1000",
            "MAILPIPE_VISIBILITY_TIMEOUT": "30",
            "MAILPIPE_TASK_SOFT_TIME_LIMIT": "15",
            "MAILPIPE_TASK_TIME_LIMIT": "20",
            "MAILPIPE_RETRY_BACKOFF_BASE": "1",
            "MAILPIPE_RETRY_BACKOFF_MAX": "6",
            # A job that waits out an outage comes back within seconds, as the retries do.
            "MAILPIPE_DEFER_BASE": "1",
            "MAILPIPE_DEFER_MAX": "6",
            "MAILPIPE_HEALTH_CACHE_SECONDS": "1",
            "MAILPIPE_LEASE_TTL": "6",
            # Sweeps every few seconds; markers lapse after twice that (the least the settings
            # accept), so a job waits in the queue far longer than its marker lives.
            "MAILPIPE_SWEEP_INTERVAL": "3",
            "MAILPIPE_DEDUP_TTL": "6",
            # A job that dies once its answer is stored, its message already lost (the flush took
            # it from a worker's reserved messages), is re-added this long after the answer.
            "MAILPIPE_STALL_AFTER": "10",
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
            **bedrock_env(model, workdir),
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


def answer_fault_positions(raws: list[bytes], rng: random.Random) -> list[int]:
    """ANSWER_FAULTS generated emails with no copy in the run: each of them is classified."""
    seen = Counter(raws)
    eligible = [p for p, raw in enumerate(raws) if seen[raw] == 1 and b"Message-ID: <chaos-" in raw]
    return sorted(rng.sample(eligible, ANSWER_FAULTS))


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
        self.answer_fault_ids: list[int] = []
        # The emails whose delivery a fault cut, and the faults that cut them: any work of the
        # delivery may have to be done again, and only that work.
        self.cut: defaultdict[int, set[str]] = defaultdict(set)
        # How many cuts that spend an attempt each email took: one that every attempt of its run
        # lost to such a cut fails by design (MAILPIPE_MAX_RETRIES), and is no healthy email
        # failing.
        self.cuts: Counter[int] = Counter()
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
            self.model = CountingBedrockServer().start()
            stack.callback(self.model.stop)
            self.env = chaos_env(
                database_url, self.redis_server.url, self.proxy.url, self.model, self.workdir
            )
            # Before any mailpipe module reads its settings (they are read once per process).
            for name in [name for name in os.environ if name.startswith("MAILPIPE_")]:
                del os.environ[name]
            os.environ.update(self.env)
            stack.callback(self._close_resources)
            stack.callback(self._stop_processes)
            return self._run()

    def _run(self) -> dict[str, Any]:
        from sqlalchemy import text

        from mailpipe.broker import layout
        from mailpipe.cli.ingest import store_emails
        from mailpipe.enqueue import enqueue_emails
        from mailpipe.resources import get_resources
        from mailpipe.storage import flags
        from mailpipe.storage.db import once_more_if_disconnected
        from mailpipe.storage.migrate import upgrade
        from tests.support.faults import set_answer_fault, set_fault

        res = get_resources()
        upgrade(res.settings.database_url)
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
            session.execute(text(RECORD_WRITES))
        raws, poison_positions = build_emails(self.n, self.poison, self.seed)
        for start in range(0, len(raws), 500):
            self.ids.extend(store_emails(res, raws[start : start + 500]))
        self.poison_ids = [self.ids[p] for p in poison_positions]
        for email_id in self.poison_ids:
            set_fault(res.redis, email_id, "segfault")
        self.answer_fault_ids = [self.ids[p] for p in answer_fault_positions(raws, self.rng)]
        for email_id in self.answer_fault_ids:
            set_answer_fault(res.redis, email_id)
        lists = layout.family_lists(res.settings.queue)

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
                with self._leased_meanwhile() as leased:
                    os.kill(pid, signal.SIGKILL)
                    time.sleep(KILL_SETTLES_S)
            except ProcessLookupError:
                return
            cut = self._record_cut("child_sigkill", _held_by(leased, {pid}))
            self.log("child_sigkill", worker=target.nodename, pid=pid, cut=cut)

    def _worker_sigkill(self) -> None:
        victim = self.workers.pop(0)
        with self._leased_meanwhile() as leased:
            pids = {victim.pid, *victim.child_pids()}
            victim.kill()
        cut = self._record_cut("worker_sigkill", _held_by(leased, pids))
        self.log("worker_sigkill", worker=victim.nodename, cut=cut)
        self.workers.append(self._worker("chaos-c"))

    def _worker_sigterm(self) -> None:
        # Its children finish their jobs within the soft shutdown, or are cut off at its end;
        # they take no new one, so the jobs it may cut are those they hold now.
        victim = self.workers.pop(0)
        with self._leased_meanwhile() as leased:
            pids = set(victim.child_pids())
            victim.signal(signal.SIGTERM)
        cut = self._record_cut("worker_sigterm", _held_by(leased, pids))
        self.log("worker_sigterm", worker=victim.nodename, cut=cut)
        self.workers.append(self._worker("chaos-d"))

    def _redis_flush(self) -> None:
        from mailpipe.broker import layout
        from mailpipe.coordination import redis_keys
        from mailpipe.resources import get_resources
        from mailpipe.storage.models import utcnow

        res = get_resources()
        lists = layout.family_lists(res.settings.queue)
        self.flushed_at, self.flushed_at_utc = time.monotonic(), utcnow()
        depth, unacked, kept, leases = res.redis.eval(
            FLUSH_KEEPING_TEST_KEYS,
            len(lists),
            *lists,
            redis_keys.key("test:*"),
            layout.unacked_key(),
            redis_keys.key("lease:*"),
        )
        cut = self._record_cut("redis_flush", {_email_of(key) for key in leases})
        self.log(
            "redis_flush",
            queue_before=depth,
            unacked_before=unacked,
            test_keys_kept=kept,
            cut=cut,
        )

    def _postgres_restart(self) -> None:
        # Every job that held a lease while the server was down may have lost a transaction.
        began = time.monotonic()
        with self._leased_meanwhile() as leased:
            self.postgres.stop()
            self.postgres.start()
        cut = self._record_cut("postgres_restart", _held_by(leased))
        self.log("postgres_restart", down_s=round(time.monotonic() - began, 2), cut=cut)

    def _s3_errors(self) -> None:
        self.proxy.fail_for(S3_ERRORS_S)
        self.log("s3_errors", seconds=S3_ERRORS_S)

    def _leases(self) -> set[tuple[int, int]]:
        """The leases held now, as (pid of the holder, email): a lease holds `host:pid:token`
        (mailpipe.coordination.leases)."""
        from mailpipe.coordination import redis_keys
        from mailpipe.resources import get_resources

        redis = get_resources().redis
        keys = list(redis.scan_iter(match=redis_keys.key("lease:*"), count=1000))
        values = redis.mget(keys) if keys else []
        return {
            (int(value.split(b":")[1]), _email_of(key))
            for key, value in zip(keys, values, strict=True)
            if value is not None
        }

    @contextlib.contextmanager
    def _leased_meanwhile(self) -> Iterator[set[tuple[int, int]]]:
        """Every lease held at some moment of the block: read as it begins and ends, and every
        LEASE_SAMPLE_EVERY_S between."""
        leased = self._leases()
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(LEASE_SAMPLE_EVERY_S):
                leased.update(self._leases())

        sampler = threading.Thread(target=sample, name="lease-sampler", daemon=True)
        sampler.start()
        try:
            yield leased
        finally:
            stop.set()
            sampler.join()
            leased.update(self._leases())

    def _record_cut(self, fault: str, emails: set[int]) -> list[int]:
        for email_id in emails:
            self.cut[email_id].add(fault)
            if fault in SPENDS_AN_ATTEMPT:
                self.cuts[email_id] += 1
        return sorted(emails)

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
        from tests.support.faults import answer_fault_key, runs_key

        ids, poison = self.ids, set(self.poison_ids)
        pipe = res.redis.pipeline(transaction=False)
        for email_id in ids:
            pipe.get(runs_key(email_id))
        for email_id in self.answer_fault_ids:
            pipe.get(answer_fault_key(email_id))
        counts = [int(value or 0) for value in pipe.execute()]
        step_runs = dict(zip(ids, counts[: len(ids)], strict=True))
        answer_faults_left = counts[len(ids) :]
        rerun = {i: r for i, r in step_runs.items() if r > 1 and i not in poison}

        with res.db.session() as session:
            self._record_cut("s3_errors", self._refused_by_s3(session))
            prompts, unmatched_calls = self._model_calls(session, res.settings)
            classified = set(session.scalars(select(Classification.email_id)))
            classified_again, labelled_again = (
                dict(session.execute(text(WRITTEN_MORE_THAN_ONCE), {"table_name": name}).all())
                for name in ("classification", "email_label")
            )
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
            failed = [
                {"email": row.email_id, "attempts": row.attempts, "error": row.error}
                for row in session.scalars(
                    select(PipelineRun).where(
                        PipelineRun.status == "failed", PipelineRun.email_id.not_in(self.poison_ids)
                    )
                )
            ]
            every_attempt_cut = [
                run for run in failed if self.cuts[run["email"]] >= res.settings.max_attempts
            ]
            failed_other = [run for run in failed if run not in every_attempt_cut]
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
        calls = {email_id: n for emails, n in prompts for email_id in emails}
        called_again = [(emails, n) for emails, n in prompts if n > len(emails)]
        by_fault = Counter(fault for faults in self.cut.values() for fault in faults)
        report: dict[str, Any] = {
            "scenario": self.scenario,
            "emails": len(ids),
            "terminal": {s: terminal.get(s, 0) for s in TERMINAL},
            "lost": len(ids) - sum(terminal.get(s, 0) for s in TERMINAL),
            "cut": {"emails": len(self.cut), "by_fault": dict(sorted(by_fault.items()))},
            "reruns": {
                "emails": len(rerun),
                "extra_runs": sum(r - 1 for r in rerun.values()),
                "examples": dict(sorted(rerun.items())[:EXAMPLES]),
                "outside_cuts": sorted(set(rerun) - set(self.cut)),
            },
            "model_calls": {
                "calls": sum(n for _, n in prompts) + unmatched_calls,
                "prompts": len(prompts),
                "prompts_of_several_emails": [emails for emails, _ in prompts if len(emails) > 1],
                "called_more_than_once": sum(len(emails) for emails, _ in called_again),
                "extra_calls": sum(n - len(emails) for emails, n in called_again),
                "examples": called_again[:EXAMPLES],
                "outside_cuts": sorted(
                    email_id
                    for emails, _ in called_again
                    if not self.cut.keys() & set(emails)
                    for email_id in emails
                ),
                "unmatched": unmatched_calls,
                "classified_without_a_call": sorted(
                    email_id
                    for emails, n in prompts
                    if n < len(classified & set(emails))
                    for email_id in emails
                ),
            },
            "answer_faults": {
                "emails": self.answer_fault_ids,
                "fired": sum(1 for left in answer_faults_left if left <= 0),
                # Not fired, the email cut by another fault: that fault can end the delivery
                # between the answer's commit and the answer fault's kill (a worker's shutdown
                # terminating its child), and the next delivery takes the stored answer.
                "unfired_but_cut": sorted(
                    i
                    for i, left in zip(self.answer_fault_ids, answer_faults_left, strict=True)
                    if left > 0 and i in self.cut
                ),
                "calls": {i: calls.get(i, 0) for i in self.answer_fault_ids},
            },
            "classified_more_than_once": {
                "emails": len(classified_again),
                "examples": dict(list(classified_again.items())[:EXAMPLES]),
            },
            "labels_written_more_than_once": {
                "emails": len(labelled_again),
                "examples": dict(list(labelled_again.items())[:EXAMPLES]),
            },
            "classifications": classifications,
            "artifacts_on_copies": artifacts_on_copies,
            "succeeded_without_one_classification": succeeded_without_one_classification,
            "needs_review": needs_review,
            "poison_expected": self.poison,
            "poison": poison_runs,
            "failed_other": failed_other,
            "failed_every_attempt_cut": every_attempt_cut,
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

    def _refused_by_s3(self, session: Any) -> set[int]:
        """The emails whose blobs S3 refused during its errors: a raw email (kept once for an
        email and its copies) or a document's text."""
        from sqlalchemy import select

        from mailpipe.storage.models import EmailMessage

        by_blob: defaultdict[str, set[int]] = defaultdict(set)
        for email_id, blob_key in session.execute(select(EmailMessage.id, EmailMessage.blob_key)):
            by_blob[blob_key].add(email_id)
        emails: set[int] = set()
        for path in self.proxy.failed_paths:
            key = path.partition("?")[0].removeprefix(f"/{BUCKET}/blobs/")
            if key.startswith("text/"):
                emails.add(int(key.split("/")[1]))
            else:
                emails |= by_blob.get(key, set())
        return emails

    def _model_calls(self, session: Any, settings: Any) -> tuple[list[tuple[list[int], int]], int]:
        """The calls the stand-in counted for each prompt, rebuilt from what the emails' model
        stage read, with those emails (one, unless two emails that are not copies read alike:
        their calls are counted together); and the calls about no email of the run."""
        from sqlalchemy import select

        from mailpipe.classifiers import input_from_json
        from mailpipe.classifiers.prompt import build_prompt
        from mailpipe.storage.models import ModelInput

        emails: defaultdict[str, list[int]] = defaultdict(list)
        rows = session.execute(
            select(ModelInput.email_id, ModelInput.input).execution_options(yield_per=500)
        )
        for email_id, stored in rows:
            prompt = build_prompt(
                input_from_json(stored), settings.labels, settings.classifier_text_budget
            )
            emails[email_key(prompt.user)].append(email_id)
        left = self.model.calls
        prompts = [(sorted(ids), left.pop(key, 0)) for key, ids in emails.items()]
        return sorted(prompts), sum(left.values())

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


def _email_of(lease_key: bytes) -> int:
    return int(lease_key.rsplit(b":", 1)[1])


def _held_by(leased: set[tuple[int, int]], pids: set[int] | None = None) -> set[int]:
    """The emails of `leased` whose lease a process of `pids` (any, when None) held."""
    return {email_id for pid, email_id in leased if pids is None or pid in pids}


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
    if report["reruns"]["outside_cuts"]:
        found.append(f"steps run again for emails no fault cut: {report['reruns']['outside_cuts']}")
    calls = report["model_calls"]
    if calls["outside_cuts"]:
        found.append(f"model called again for emails no fault cut: {calls['outside_cuts']}")
    if calls["unmatched"] or calls["classified_without_a_call"]:
        found.append(
            f"model calls not told apart by email: {calls['unmatched']} about no email, "
            f"classified without a call: {calls['classified_without_a_call']}"
        )
    answers = report["answer_faults"]
    if not 0 < answers["fired"] + len(answers["unfired_but_cut"]) == len(answers["emails"]):
        found.append(f"answer faults that did not fire: {answers}")
    for what in ("classified_more_than_once", "labels_written_more_than_once"):
        if report[what]["emails"]:
            found.append(f"{what.replace('_', ' ')}: {report[what]['examples']}")
    depth = report["queue_depth"]
    if depth["peak_before_flush"] is not None and depth["peak_before_flush"] > report["emails"]:
        found.append(
            f"queue depth peaked at {depth['peak_before_flush']} before the flush, above "
            f"{report['emails']}"
        )
    if depth["peak"] is not None and depth["peak"] > depth["bound"]:
        found.append(f"queue depth peaked at {depth['peak']}, above {depth['bound']}")
    return found


def print_table(report: dict[str, Any]) -> None:
    depth, sweeps = report["queue_depth"], report["sweeps"]
    calls, answers = report["model_calls"], report["answer_faults"]
    rows: list[tuple[str, object]] = [
        ("scenario", report["scenario"]),
        ("emails", report["emails"]),
        *((f"  {status}", count) for status, count in report["terminal"].items()),
        ("lost", report["lost"]),
        ("emails a fault cut", report["cut"]["emails"]),
        (
            "steps run more than once (outside cuts)",
            f"{report['reruns']['emails']} emails, {report['reruns']['extra_runs']} extra runs "
            f"({len(report['reruns']['outside_cuts'])})",
        ),
        ("model calls", calls["calls"]),
        (
            "  more than once per email (outside cuts)",
            f"{calls['called_more_than_once']} emails, {calls['extra_calls']} extra calls "
            f"({len(calls['outside_cuts'])})",
        ),
        (
            "  answer faults fired (their calls)",
            f"{answers['fired']} ({sorted(answers['calls'].values())})",
        ),
        ("classified more than once", report["classified_more_than_once"]["emails"]),
        ("labels written more than once", report["labels_written_more_than_once"]["emails"]),
        ("artifacts on copies", report["artifacts_on_copies"]),
        ("succeeded without one classification", report["succeeded_without_one_classification"]),
        ("marked for review", report["needs_review"]),
        ("poison jobs", len(report["poison"])),
        ("  their attempts", sorted({p["attempts"] for p in report["poison"]})),
        ("failed, every attempt cut by a fault", len(report["failed_every_attempt_cut"])),
        ("other failed runs", len(report["failed_other"])),
        (
            "sweeps (re-adds before / after the flush)",
            f"{sweeps['count']} ({sweeps['readded_before_flush']} / "
            f"{sweeps['readded_after_flush']})",
        ),
        (
            "peak queue depth before the flush (bound)",
            f"{depth['peak_before_flush']} ({report['emails']})",
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
