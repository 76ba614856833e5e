"""Housekeeping (mailpipe/operations/housekeeping.py) on a large database: what the tables take
before and after a pass, what a pass costs at ten million attempts and what it does to the live
lane meanwhile, and the attempt history staying flat over many jobs.

    .venv/bin/python -m bench.housekeeping [--emails 1000000] [--attempts-per-email 10] \\
        [--live-rate 10] [--window 60] [--flat-jobs 20000] [--skip-flat] [--json results.json]

One database of the run's own (bench/model_stage.py's `Setup`: a database, a Redis key prefix, a
blob folder), seeded with INSERT ... SELECT generate_series:

1. Sizes. `--emails` emails as the pipeline writes them with a remote model, every run closed
   31 to 61 days ago: the email (subject, sender), its origin, a succeeded run, its attempts (a
   CPU attempt handed off and a model attempt; 3 % retried first at the CPU stage, 3 % deferred
   first at the model stage), the model's input (JSON of 1 to 2 KB of text), the model's answer,
   two labels, and a converted document for 30 % of them; one email in a hundred failed, on the
   failed list, with three attempts; a sweep report every 5 minutes for 60 days. After
   VACUUM ANALYZE each table's size with its indexes and TOAST, and the database's; then one
   pass (`prune`, in this process, timed), and the sizes again after a plain VACUUM (the files
   keep their size: the space is free for new rows) and after VACUUM FULL (what the kept rows
   take).
2. Ten million attempts. `--attempts-per-email` more attempts for each succeeded run, all past
   the retention, VACUUM ANALYZE, and one pass timed alone. Then the same again, and the
   `worker` and `model` roles started from their Procfile lines (the `rules` classifier, which
   classifies in the CPU stage, model calls on), and live emails stored and enqueued by this
   process at `--live-rate` a second, each timed from its store to its run's close
   (bench/lanes.py's `send_live` and `live_latency`): for `--window` seconds without a pass,
   then from the start of `mailpipe housekeeping` (a subprocess) for `--window` seconds or until
   the pass ends, whichever is later. Meanwhile pg_stat_activity is read every 0.2 s for
   backends waiting on a lock.
3. Flat (unless `--skip-flat`): a fresh database, the two roles and beat, with
   MAILPIPE_HOUSEKEEPING_INTERVAL=2 and MAILPIPE_KEEP_ATTEMPTS_DAYS of 10 s; `--flat-jobs`
   small emails in waves of 1,000 (the next when the last has closed), the attempt rows counted
   every 2 s, and once more when the last pass has had its time.

The databases are dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

from bench import harness
from bench.console import vocabulary
from bench.lanes import Live, in_process, live_latency, send_live
from bench.model_stage import Fleet, Setup, mailpipe
from mailpipe.cli.demo import fleet as celery_processes
from tests.support.bedrock_server import invoices

if TYPE_CHECKING:
    from mailpipe.resources import Resources

RETENTION_DAYS = 30
PARAGRAPHS = 4096
FAILED_EVERY = 100  # one email in a hundred failed, on the failed list
SWEEPS = 60 * 24 * 12  # a sweep report every 5 minutes for 60 days
FLAT_KEEP_S = 10.0
FLAT_INTERVAL_S = 2.0
FLAT_WAVE = 1000
DRAIN_S = 300.0

_R = "(hashint4({0}) & 2147483647)"

# Per email: its random draws, the time its run closed (evenly from 61 to 31 days ago), its
# subject and sender.
SEED = [
    "CREATE TEMP TABLE seed AS SELECT g, "
    + ", ".join(f"{_R.format(f'g + {k * 300_000_000}')} AS r{k}" for k in range(1, 5))
    + ", %(end)s::timestamp - (%(emails)s - g) * %(step)s * interval '1 second' AS at, "
    "g %% %(failed_every)s = 0 AS failed FROM generate_series(1, %(emails)s) g",
    "ALTER TABLE seed ADD COLUMN has_doc boolean, ADD COLUMN subject text, ADD COLUMN sender text,"
    " ADD COLUMN l1 text, ADD COLUMN l2 text",
    "UPDATE seed SET has_doc = r2 %% 10 < 3, "
    "subject = CASE WHEN r1 %% 4 = 0 THEN 'Invoice INV-' || g || ' ' ELSE '' END "
    "|| initcap(left(p.t, 18 + r3 %% 40)), "
    "sender = 'User ' || r2 %% 100000 || ' <user' || r2 %% 100000 || '@d' || r3 %% 2000 "
    "|| '.example>', l1 = (%(labels)s::text[])[1 + r4 %% %(nlabels)s], "
    "l2 = (%(labels)s::text[])[1 + (r4 %% %(nlabels)s + 1) %% %(nlabels)s] "
    "FROM para p WHERE p.i = seed.r3 %% 4096",
    # Foreign keys unchecked while the rows go in: origins and emails point at each other.
    "SET session_replication_role = replica",
    "INSERT INTO email_message (id, blob_key, size, sha256, received_at, created_at, has_run, "
    "subject, sender, lane, origin_id) SELECT g, 'raw/' || left(h, 2) || '/' || h || '.eml', "
    "3000 + r1 %% 60000, h, at - interval '40 seconds', at - interval '39 seconds', true, "
    "subject, sender, 'live', g FROM seed, LATERAL (SELECT md5(g::text) || md5('e' || g) AS h) x",
    "INSERT INTO email_origin (id, fingerprint, message_id, first_email_id, created_at) "
    "SELECT g, md5('o' || g) || md5('f' || g), md5(g::text) || '@mail' || r2 %% 100 || "
    "'.example', g, at - interval '38 seconds' FROM seed",
    "INSERT INTO pipeline_run (id, email_id, status, attempts, claims, sweep_count, created_at, "
    "updated_at, closed_at, converted_at, classified_at, error_class, error) SELECT g, g, "
    "(CASE WHEN failed THEN 'failed' ELSE 'succeeded' END)::run_status, "
    "CASE WHEN failed THEN 3 ELSE 1 END, CASE WHEN failed THEN 3 "
    "ELSE 2 + (r1 %% 100 < 3)::int + (r1 %% 100 BETWEEN 3 AND 5)::int END, 0, "
    "at - interval '39 seconds', at, at, CASE WHEN NOT failed THEN at - interval '2 seconds' END, "
    "CASE WHEN NOT failed THEN at - interval '100 milliseconds' END, "
    "CASE WHEN failed THEN 'OperationalError' END, "
    "CASE WHEN failed THEN %(db_error)s::text END FROM seed",
    # The attempts in the order they ended, as a fleet writes them.
    "INSERT INTO run_attempt (run_id, email_id, stage, attempt, started_at, ended_at, outcome, "
    "error_class, error, host, deferrals) SELECT g, g, stage, attempt, ended_at - "
    "seconds * interval '1 second', ended_at, outcome, error_class, error, "
    "'ip-10-0-' || r2 %% 4 || '-' || 10 + r3 %% 20 || '.ec2.internal', deferrals FROM ("
    "SELECT g, r2, r3, 'cpu' AS stage, a AS attempt, at - (4 - a) * interval '20 seconds' AS "
    "ended_at, 0.3 AS seconds, CASE WHEN a = 3 THEN 'failed' ELSE 'retrying' END AS outcome, "
    "'OperationalError' AS error_class, %(db_error)s::text AS error, NULL::int AS deferrals "
    "FROM seed, generate_series(1, 3) a WHERE failed "
    "UNION ALL SELECT g, r2, r3, 'cpu', 1, at - interval '30 seconds', 0.3, 'retrying', "
    "'OperationalError', %(db_error)s::text, NULL FROM seed WHERE NOT failed AND r1 %% 100 < 3 "
    "UNION ALL SELECT g, r2, r3, 'cpu', 1 + (r1 %% 100 < 3)::int, at - interval '2 seconds', "
    "0.05 + r3 %% 400 / 1000.0, 'handed_off', NULL, NULL, NULL FROM seed WHERE NOT failed "
    "UNION ALL SELECT g, r2, r3, 'model', 1, at - interval '1 second', 0.01, 'deferred', "
    "'ThrottlingException', %(throttled)s::text, 1 + r4 %% 4 FROM seed "
    "WHERE NOT failed AND r1 %% 100 BETWEEN 3 AND 5 "
    "UNION ALL SELECT g, r2, r3, 'model', 1, at - interval '100 milliseconds', "
    "0.5 + r4 %% 2500 / 1000.0, 'succeeded', NULL, NULL, NULL FROM seed WHERE NOT failed"
    ") a ORDER BY ended_at",
    # What the model reads: the body (two paragraphs) and the start of the document's text.
    "INSERT INTO model_input (email_id, input, created_at) SELECT g, json_build_object("
    "'subject', subject, 'sender', sender, 'recipients', json_build_array('ap@company.example'), "
    "'date', to_char(at - interval '40 seconds', 'Dy, DD Mon YYYY HH24:MI:SS +0000'), "
    "'body_text', b1.t || E'\\n\\n' || b2.t, 'documents', CASE WHEN has_doc THEN "
    "json_build_array(json_build_array('invoice-' || g || '.pdf', 'application/pdf', "
    "left(d1.t || E'\\n' || d2.t, 800))) ELSE '[]'::json END, 'more_recipients', 0), "
    "at - interval '2 seconds' FROM seed JOIN para b1 ON b1.i = r1 %% 4096 "
    "JOIN para b2 ON b2.i = (r1 >> 12) %% 4096 JOIN para d1 ON d1.i = r2 %% 4096 "
    "JOIN para d2 ON d2.i = (r2 >> 12) %% 4096 WHERE NOT failed ORDER BY g",
    "INSERT INTO classification (run_id, email_id, model_id, prompt_version, output, labels, "
    "input_tokens, output_tokens, latency_ms, created_at) SELECT g, g, %(model_id)s, "
    "%(prompt_version)s, json_build_object('labels', json_build_array("
    "json_build_object('label', l1, 'confidence', c1), "
    "json_build_object('label', l2, 'confidence', c2))), "
    "json_build_array(json_build_array(l1, c1), json_build_array(l2, c2)), "
    "350 + r1 %% 700, 25 + r2 %% 40, 500 + r4 %% 2500, at - interval '100 milliseconds' "
    "FROM seed, LATERAL (SELECT 0.5 + r3 %% 50 / 100.0 AS c1, 0.3 + r4 %% 40 / 100.0 AS c2) c "
    "WHERE NOT failed ORDER BY g",
    "INSERT INTO email_label (email_id, label, source, confidence, created_at) "
    "SELECT g, label, 'model', confidence, at FROM seed, LATERAL (VALUES "
    "(1, l1, 0.5 + r3 %% 50 / 100.0), (2, l2, 0.3 + r4 %% 40 / 100.0)) AS l(k, label, confidence) "
    "WHERE NOT failed ORDER BY g, k",
    # A converted PDF's text: six paragraphs, inline (well under MAILPIPE_DOC_INLINE_TEXT_BYTES).
    "INSERT INTO document (email_id, part_index, filename, content_type, size, sha256, status, "
    "text, page_count, updated_at) SELECT g, 1, 'invoice-' || g || '.pdf', 'application/pdf', "
    "20000 + r4 %% 200000, md5('d' || g) || md5('s' || g), 'converted', concat_ws(E'\\n', "
    "d1.t, d2.t, d3.t, d4.t, d5.t, d6.t), 1 + r4 %% 4, at - interval '2 seconds' FROM seed "
    "JOIN para d1 ON d1.i = r2 %% 4096 JOIN para d2 ON d2.i = (r2 >> 12) %% 4096 "
    "JOIN para d3 ON d3.i = r4 %% 4096 JOIN para d4 ON d4.i = (r4 >> 12) %% 4096 "
    "JOIN para d5 ON d5.i = (r4 >> 6) %% 4096 JOIN para d6 ON d6.i = (r3 >> 12) %% 4096 "
    "WHERE has_doc ORDER BY g",
    "SET session_replication_role = DEFAULT",
    "INSERT INTO sweep_report (started_at, finished_at, readded_no_run, readded_stalled, "
    "skipped_queued, marked_for_review, queue_depth, backlog_per_task) "
    "SELECT %(now)s::timestamp - k * interval '5 minutes', %(now)s::timestamp - k * "
    "interval '5 minutes' + interval '200 milliseconds', 0, (k %% 7 = 0)::int, 0, 0, k %% 50, "
    "k %% 50 / 2.0 FROM generate_series(%(sweeps)s - 1, 0, -1) k",
    *(
        f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))"
        for table in ("email_message", "email_origin", "pipeline_run")
    ),
]

# `--attempts-per-email` more attempts for each succeeded run whose id is in a range: a third at
# the CPU stage, the rest at the model stage, retries and deferrals before each stage's last,
# 20 s apart and ended before the run closed.
MORE_ATTEMPTS = (
    "INSERT INTO run_attempt (run_id, email_id, stage, attempt, started_at, ended_at, outcome, "
    "error_class, error, host, deferrals) SELECT r.id, r.email_id, "
    "CASE WHEN a <= %(cpu)s THEN 'cpu' ELSE 'model' END, "
    "CASE WHEN a <= %(cpu)s THEN a ELSE a - %(cpu)s END, "
    "r.closed_at - (%(per)s - a) * interval '20 seconds' - interval '1 second', "
    "r.closed_at - (%(per)s - a) * interval '20 seconds', "
    "CASE WHEN a = %(cpu)s THEN 'handed_off' WHEN a = %(per)s THEN 'succeeded' "
    "WHEN a %% 2 = 0 THEN 'deferred' ELSE 'retrying' END, "
    "CASE WHEN a IN (%(cpu)s, %(per)s) THEN NULL WHEN a %% 2 = 0 THEN 'ThrottlingException' "
    "ELSE 'OperationalError' END, "
    "CASE WHEN a IN (%(cpu)s, %(per)s) THEN NULL WHEN a %% 2 = 0 THEN %(throttled)s::text "
    "ELSE %(db_error)s::text END, 'ip-10-0-' || r.id %% 4 || '-' || 10 + r.id %% 20 || "
    "'.ec2.internal', CASE WHEN a NOT IN (%(cpu)s, %(per)s) AND a %% 2 = 0 THEN 1 + a %% 3 END "
    "FROM pipeline_run r, generate_series(1, %(per)s) a "
    "WHERE r.status = 'succeeded' AND r.id BETWEEN %(low)s AND %(high)s"
)

DB_ERROR = (
    "OperationalError: (psycopg.OperationalError) consuming input failed: server closed the "
    "connection unexpectedly"
)
THROTTLED = "ThrottlingException: Too many requests, please wait before trying again."


def paragraphs(count: int = PARAGRAPHS) -> list[str]:
    """Text to draw bodies and document texts from: paragraphs of about 500 characters, words
    drawn as prose draws them (a few often, most rarely) with amounts and dates among them."""
    rng = random.Random(11)
    words = vocabulary()
    weights = [1 / (rank + 1) for rank in range(len(words))]
    found = []
    for _ in range(count):
        sentences, length = [], 0
        while length < 480:
            drawn = rng.choices(words, weights, k=rng.randint(6, 16))
            if rng.random() < 0.3:
                drawn.insert(
                    rng.randrange(len(drawn)), f"{rng.randint(1, 99999)}.{rng.randint(0, 99):02d}"
                )
            sentence = " ".join(drawn).capitalize() + "."
            sentences.append(sentence)
            length += len(sentence) + 1
        found.append(" ".join(sentences))
    return found


def seed(url: str, emails: int) -> float:
    """The emails of part 1, their sweep reports; returns the seconds it took."""
    from mailpipe.classifiers.prompt import PROMPT_VERSION
    from mailpipe.settings import DEFAULT_LABELS, Settings

    started = time.monotonic()
    now = datetime.now(UTC).replace(tzinfo=None)
    given = {
        "emails": emails,
        "end": now - timedelta(days=RETENTION_DAYS + 1),
        "step": RETENTION_DAYS * 86400 / emails,
        "failed_every": FAILED_EVERY,
        "labels": list(DEFAULT_LABELS),
        "nlabels": len(DEFAULT_LABELS),
        "db_error": DB_ERROR,
        "throttled": THROTTLED,
        "model_id": Settings.model_fields["bedrock_model_id"].default,
        "prompt_version": PROMPT_VERSION,
        "now": now,
        "sweeps": SWEEPS,
    }
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TEMP TABLE para (i int PRIMARY KEY, t text)")
        with conn.cursor().copy("COPY para (i, t) FROM STDIN") as copy:
            for number, text in enumerate(paragraphs()):
                copy.write_row((number, text))
        for statement in SEED:
            conn.execute(statement, given)
    vacuum(url, "VACUUM ANALYZE")
    return time.monotonic() - started


def add_attempts(url: str, per_email: int) -> float:
    """`per_email` attempts for each succeeded run, in four statements; returns the seconds."""
    started = time.monotonic()
    with psycopg.connect(url) as conn:
        top = conn.execute("SELECT max(id) FROM pipeline_run").fetchone()
        assert top is not None and top[0] is not None
        quarter = top[0] // 4 + 1
        for low in range(1, top[0] + 1, quarter):
            given = {
                "per": per_email,
                "cpu": max(1, per_email // 3),
                "low": low,
                "high": low + quarter - 1,
                "db_error": DB_ERROR,
                "throttled": THROTTLED,
            }
            conn.execute(MORE_ATTEMPTS, given)
            conn.commit()
    vacuum(url, "VACUUM ANALYZE")
    return time.monotonic() - started


def vacuum(url: str, statement: str) -> float:
    started = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement)
    return time.monotonic() - started


def sizes(url: str) -> dict[str, dict[str, int]]:
    """Each table's rows and bytes (pg_total_relation_size: its indexes and TOAST with it), and
    the whole database's bytes (pg_database_size) as `(database)`."""
    with psycopg.connect(url) as conn:
        tables = [
            name
            for (name,) in conn.execute(
                "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = 'public' AND c.relkind = 'r' ORDER BY relname"
            )
        ]
        found = {}
        for name in tables:
            row = conn.execute(
                f"SELECT count(*), pg_total_relation_size('{name}') FROM {name}"
            ).fetchone()
            assert row is not None
            found[name] = {"rows": row[0], "bytes": row[1]}
        total = conn.execute("SELECT pg_database_size(current_database())").fetchone()
        assert total is not None
        found["(database)"] = {"rows": sum(t["rows"] for t in found.values()), "bytes": total[0]}
    return found


def timed_pass(res: Resources, url: str) -> dict[str, Any]:
    """One pass in this process: its time, what it deleted, and the CPU it took here (Python)
    and in the database's backends (every one on the database but the meter's own: nothing
    else runs on it meanwhile)."""
    from mailpipe.operations.housekeeping import prune

    backends = harness.CpuMeter()
    with psycopg.connect(url, autocommit=True) as conn:

        def poll() -> None:
            backends.poll(
                pid
                for (pid,) in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()"
                )
            )

        poll()
        cpu, started = time.process_time(), time.perf_counter()
        pruned = prune(res)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        poll()
    rows = pruned.attempts + pruned.sweep_reports + pruned.model_inputs
    return {
        "seconds": round(seconds, 1),
        "attempts": pruned.attempts,
        "sweep_reports": pruned.sweep_reports,
        "model_inputs": pruned.model_inputs,
        "rows_per_s": round(rows / seconds),
        "python_cpu_s": round(cpu, 1),
        "database_cpu_s": round(backends.seconds(), 1),
        "load": os.getloadavg(),
    }


def part_sizes(setup: Setup, res: Resources, emails: int) -> dict[str, Any]:
    url = setup.database.url
    seeded_s = seed(url, emails)
    loaded = sizes(url)
    print(f"seeded {emails} emails in {seeded_s:.0f} s", flush=True)
    pruned = timed_pass(res, url)
    print(f"pass: {pruned}", flush=True)
    vacuum_s = vacuum(url, "VACUUM")
    after_vacuum = sizes(url)
    full_s = vacuum(url, "VACUUM FULL")
    after_full = sizes(url)
    return {
        "seed_s": round(seeded_s),
        "pass": pruned,
        "vacuum_s": round(vacuum_s, 1),
        "vacuum_full_s": round(full_s, 1),
        "sizes": {"loaded": loaded, "after_pass_vacuum": after_vacuum, "after_full": after_full},
    }


class LockWatch:
    """Backends of one database waiting on a lock, read from pg_stat_activity every 0.2 s."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[tuple[int, float]] = []  # (backends waiting, the longest's query, s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @contextmanager
    def watching(self) -> Iterator[LockWatch]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.wait(0.2):
                row = conn.execute(
                    "SELECT count(*), coalesce(extract(epoch FROM max(now() - query_start)), 0) "
                    "FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"
                ).fetchone()
                assert row is not None
                self.samples.append((int(row[0]), float(row[1])))

    def summary(self) -> dict[str, Any]:
        return {
            "samples": len(self.samples),
            "samples_with_a_wait": sum(1 for n, _ in self.samples if n),
            "most_waiting": max((n for n, _ in self.samples), default=0),
            "longest_wait_s": round(max((s for _, s in self.samples), default=0.0), 2),
        }


def window(res: Resources, live: Live, watch: LockWatch) -> dict[str, Any]:
    return {
        **live_latency(res, live, DRAIN_S),
        "seconds": round(live.seconds, 1),
        "lock_waits": watch.summary(),
        "load": os.getloadavg(),
    }


def live_while(res: Resources, rate: float, seconds: float, busy: Callable[[], bool]) -> Live:
    """`send_live` for `seconds`, then on a second at a time while `busy()`."""
    live = send_live(res, rate, seconds)
    while busy():
        more = send_live(res, rate, 1.0)
        live = Live({**live.started, **more.started}, live.window_start, more.window_end)
    return live


class Pass(threading.Thread):
    """`mailpipe housekeeping` in a subprocess, timed, while this process sends live emails."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.env = env
        self.seconds = 0.0
        self.output = ""
        self.error: BaseException | None = None

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.output = mailpipe(self.env, "housekeeping")
        except BaseException as exc:
            self.error = exc
        self.seconds = time.monotonic() - started


def part_live(
    setup: Setup, res: Resources, per_email: int, rate: float, seconds: float
) -> dict[str, Any]:
    url = setup.database.url
    added_s = add_attempts(url, per_email)
    attempts = sizes(url)["run_attempt"]
    print(f"added attempts in {added_s:.0f} s: {attempts}", flush=True)
    alone = timed_pass(res, url)
    print(f"pass alone: {alone}", flush=True)
    vacuum_s = vacuum(url, "VACUUM")
    added_again_s = add_attempts(url, per_email)
    before_live = sizes(url)["run_attempt"]
    fleet = Fleet(setup.env, setup.work).start()
    try:
        with LockWatch(url).watching() as quiet:
            without = window(res, send_live(res, rate, seconds), quiet)
        print(f"without a pass: {without}", flush=True)
        command = Pass(setup.env)
        command.start()
        with LockWatch(url).watching() as busy:
            during = window(res, live_while(res, rate, seconds, command.is_alive), busy)
        command.join()
        if command.error is not None:
            raise command.error
        during["pass"] = {
            "seconds": round(command.seconds, 1),
            "ended_within_window": command.seconds <= seconds,
            **json.loads(command.output.strip().splitlines()[-1]),
        }
        print(f"during a pass: {during}", flush=True)
    finally:
        fleet.stop()
    return {
        "add_attempts_s": round(added_s),
        "attempts": attempts,
        "pass_alone": alone,
        "vacuum_s": round(vacuum_s, 1),
        "add_attempts_again_s": round(added_again_s),
        "attempts_before_live": before_live,
        "without_pass": without,
        "during_pass": during,
    }


def part_flat(jobs: int) -> dict[str, Any]:
    setup = Setup(f"hkflat_{os.getpid()}", 0.0, 1000.0)
    setup.env.update(
        MAILPIPE_MODEL_BACKEND="rules",
        MAILPIPE_HOUSEKEEPING_INTERVAL=str(FLAT_INTERVAL_S),
        MAILPIPE_KEEP_ATTEMPTS_DAYS=repr(FLAT_KEEP_S / 86400),
        MAILPIPE_WORKER_HEALTH_FILE=str(setup.work / "worker.health"),
        MAILPIPE_BEAT_HEALTH_FILE=str(setup.work / "beat.health"),
    )
    fleet, beat = None, None
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        res = on(setup)
        fleet = Fleet(setup.env, setup.work).start()
        beat = celery_processes.beat(setup.env, setup.work).start()
        beat.wait_ready()
        started = time.monotonic()

        def sample() -> None:
            with psycopg.connect(setup.database.url, autocommit=True) as conn:
                while not stop.wait(FLAT_INTERVAL_S):
                    row = conn.execute("SELECT count(*) FROM run_attempt").fetchone()
                    assert row is not None
                    samples.append((round(time.monotonic() - started, 1), int(row[0])))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        from mailpipe.cli.ingest import store_emails
        from mailpipe.enqueue import enqueue_emails

        sent = 0
        while sent < jobs:
            wave = min(FLAT_WAVE, jobs - sent)
            enqueue_emails(store_emails(res, invoices(wave)), res)
            sent += wave
            wait_closed(setup.database.url, sent, 600)
        processed_s = time.monotonic() - started
        # The last attempts age out of the retention, then the next pass takes them.
        time.sleep(FLAT_KEEP_S + 2 * FLAT_INTERVAL_S + 2)
        stop.set()
        sampler.join()
        with psycopg.connect(setup.database.url) as conn:
            row = conn.execute(
                "SELECT (SELECT last_value FROM run_attempt_id_seq), "
                "(SELECT count(*) FROM run_attempt)"
            ).fetchone()
        assert row is not None
        passes = (setup.work / "beat.log").read_text().count("housekeeping: deleted")
    finally:
        stop.set()
        if beat is not None:
            beat.stop()
        if fleet is not None:
            fleet.stop()
        setup.close()
    counts = [count for _, count in samples]
    return {
        "jobs": jobs,
        "processed_s": round(processed_s, 1),
        "jobs_per_s": round(jobs / processed_s, 1),
        "attempts_written": row[0],
        "attempts_max": max(counts),
        "attempts_max_at_s": samples[counts.index(max(counts))][0],
        "attempts_at_end": row[1],
        "passes": passes,
        "samples": samples,
        "load": os.getloadavg(),
    }


def wait_closed(url: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) FROM pipeline_run WHERE status <> 'open'"
            ).fetchone()
            if row is not None and row[0] >= count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} runs not closed after {timeout} s")
            time.sleep(0.5)


def on(setup: Setup) -> Resources:
    """This process's resources on the setup, model calls on (the `rules` classifier answers in
    the CPU stage)."""
    mailpipe(setup.env, "model-calls", "on")
    return in_process(setup)


def print_sizes(found: dict[str, dict[str, dict[str, int]]]) -> None:
    stages = list(found)
    print(f"\n{'table':<16}" + "".join(f"{s:>30}" for s in stages))
    for table in found[stages[0]]:
        cells = []
        for stage in stages:
            entry = found[stage][table]
            cells.append(f"{entry['rows']:>12,} {entry['bytes'] / 2**20:>11,.1f} MiB")
        print(f"{table:<16}" + "".join(f"{c:>30}" for c in cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emails", type=int, default=1_000_000)
    parser.add_argument("--attempts-per-email", type=int, default=10)
    parser.add_argument("--live-rate", type=float, default=10.0)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--flat-jobs", type=int, default=20_000)
    parser.add_argument("--skip-flat", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    began = time.monotonic()
    report: dict[str, Any] = {"machine": harness.machine()}
    setup = Setup(f"hk_{os.getpid()}", 0.0, 1000.0)
    setup.env.update(
        MAILPIPE_MODEL_BACKEND="rules",
        MAILPIPE_WORKER_HEALTH_FILE=str(setup.work / "worker.health"),
    )
    try:
        res = on(setup)
        report["sizes"] = part_sizes(setup, res, args.emails)
        print_sizes(report["sizes"]["sizes"])
        report["live"] = part_live(setup, res, args.attempts_per_email, args.live_rate, args.window)
    finally:
        setup.close()
    if not args.skip_flat:
        # In a new interpreter: the Celery app is built once per process, on the Redis prefix
        # of the settings it first read.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            report["flat"] = pool.apply(part_flat, (args.flat_jobs,))
        print("flat:", {k: v for k, v in report["flat"].items() if k != "samples"})
    report["seconds"] = round(time.monotonic() - began)
    report["load_avg_at_end"] = os.getloadavg()
    print(json.dumps({k: v for k, v in report.items() if k != "sizes"}, indent=2))
    if args.json:
        harness.write_report(args.json, args, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
