"""The console on a large database: its pages and the job status API over HTTP, and the query
functions behind them.

    .venv/bin/python -m bench.console --emails 1000000 --failed 10000 --repeat 200

Seeds a database of its own (INSERT ... SELECT generate_series): `--emails` emails, each with a
run, `--failed` of them failed across five error classes (one in twenty dismissed, one in ten
marked for review) with three attempts each in their history, the rest succeeded. Then starts
`mailpipe web` on a free loopback port with a user of its own and requests each page `--repeat`
times on one keep-alive connection, the pages in turn, after a few warm-up requests each; then
times each query function `--repeat` times. Prints p50 and p99 in milliseconds, as the client
measured them: the server's work plus the loopback's round trip.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import itertools
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench import harness
from bench.sweep import resources_on
from mailpipe.cli.demo.servers import free_port
from tests.support.services import delete_prefix
from tests.support.waits import wait_for

ERROR_CLASSES = ("BlobMissing", "InputRejected", "OperationalError", "AttemptsUsedUp", "Stalled")
DB_NAME = "mailpipe_bench_console"
WARM_UP = 5


def prepare(emails: int, failed: int) -> str:
    import sqlalchemy

    from mailpipe.storage.migrate import upgrade

    url = harness.database(DB_NAME).create().url
    upgrade(url)
    engine = sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    # Every `step`-th email failed; the failed ones are spread over the ids and over a day.
    given = {
        "emails": emails,
        "step": max(1, emails // failed),
        "failed": failed,
        "classes": list(ERROR_CLASSES),
    }
    is_failed = "g %% %(step)s = 0 AND g / %(step)s <= %(failed)s"
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO email_message (blob_key, size, sha256, created_at, needs_review, "
            "review_reason, has_run, subject) "
            "SELECT 'raw/' || g, 1000, md5(g::text), now(), "
            f"({is_failed}) AND (g / %(step)s) %% 10 = 0, "
            f"CASE WHEN ({is_failed}) AND (g / %(step)s) %% 10 = 0 THEN 'stalled' END, "
            "true, 'subject ' || g FROM generate_series(1, %(emails)s) g",
            given,
        )
        conn.exec_driver_sql(
            "INSERT INTO pipeline_run (email_id, status, attempts, sweep_count, created_at, "
            "updated_at, closed_at, converted_at, error_class, error, dismissed_at) SELECT g, "
            f"CASE WHEN {is_failed} THEN 'failed'::run_status ELSE 'succeeded'::run_status END, "
            "1, 0, now(), now(), now() - (g %% 86400) * interval '1 second', "
            "CASE WHEN g %% 3 = 0 THEN now() END, "
            f"CASE WHEN {is_failed} THEN (%(classes)s::text[])[1 + (g / %(step)s) %% 5] END, "
            f"CASE WHEN {is_failed} THEN 'failed for good' END, "
            f"CASE WHEN ({is_failed}) AND (g / %(step)s) %% 20 = 1 THEN now() END "
            "FROM generate_series(1, %(emails)s) g",
            given,
        )
        conn.exec_driver_sql(
            "INSERT INTO run_attempt (run_id, email_id, stage, attempt, started_at, ended_at, "
            "outcome, error_class, error, host) "
            "SELECT r.id, r.email_id, 'cpu', a, r.closed_at, r.closed_at, "
            "CASE WHEN a = 3 THEN 'failed' ELSE 'retrying' END, r.error_class, r.error, 'w1' "
            "FROM pipeline_run r, generate_series(1, 3) a WHERE r.status = 'failed'"
        )
    # What autovacuum does to a table loaded so (the bench machine's server runs without it):
    # statistics for the planner and the visibility map the index-only scans read.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")
    engine.dispose()
    return url


def timed(call: Callable[[], Any], repeat: int) -> dict[str, float]:
    call()  # the first call pays for connections and plans, as no later one does
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return percentiles(times)


def percentiles(times: list[float]) -> dict[str, float]:
    return {
        "p50_ms": statistics.median(times),
        "p99_ms": harness.percentile(times, 0.99),
    }


def pages(res: Any, per_page: int) -> dict[str, str]:
    """The console's pages and API calls to time, by name: the failed list's first and last
    pages, whole and by one error class, an email's page and its job's state."""
    from mailpipe.operations.status import FailedFilter, failed_page

    with res.db.session() as session:
        last = failed_page(session, None, 1, per_page).pages
        last_of_class = failed_page(session, FailedFilter(ERROR_CLASSES[2]), 1, per_page).pages
        [row] = failed_page(session, None, 1, 1).rows
    email_id = row["email_id"]
    of_class = f"/failed?error_class={ERROR_CLASSES[2]}"
    return {
        "overview": "/",
        "failed first": "/failed",
        "failed last": f"/failed?page={last}",
        "failed class first": of_class,
        "failed class last": f"{of_class}&page={last_of_class}",
        "email page": f"/emails/{email_id}",
        "api jobs": f"/api/jobs/{email_id}",
        "api queues": "/api/queues",
    }


@dataclass(frozen=True)
class Call:
    """One request: a GET, or an action with a JSON body."""

    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None = None
    # What the JSON answer holds when the call did what it was for, checked once the clock has
    # stopped (None: any 200 will do).
    expect: dict[str, Any] | None = None


def basic_auth(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def measure_http(url: str, paths: dict[str, str], repeat: int) -> dict[str, dict[str, float]]:
    """`mailpipe web` on the database at `url`: each of `paths` requested `repeat` times, in
    turn, on one keep-alive connection, as a signed-in operator (plain password)."""
    password = secrets.token_hex(16)
    headers = basic_auth("bench", password)
    calls = {name: itertools.repeat(Call("GET", path, headers)) for name, path in paths.items()}
    with web_server(url, {"MAILPIPE_WEB_OPERATORS": f"bench:{password}"}) as conn:
        return in_turns(conn, calls, repeat)


@contextmanager
def web_server(url: str, settings: dict[str, str]) -> Iterator[http.client.HTTPConnection]:
    """`mailpipe web` on the database at `url` and a free loopback port, with `settings` (its
    users) on top of the run's: a keep-alive connection to it once it answers. The server's
    output is shown when the block fails."""
    port = free_port()
    env = harness.env_without_settings() | {
        "MAILPIPE_DATABASE_URL": url,
        "MAILPIPE_BROKER_URL": harness.REDIS_URL,
        "MAILPIPE_REDIS_PREFIX": os.environ["MAILPIPE_REDIS_PREFIX"],
        "MAILPIPE_WEB_HOST": "127.0.0.1",
        "MAILPIPE_WEB_PORT": str(port),
        **settings,
    }
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "mailpipe"), "web"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            wait_for(lambda: _healthy(conn, server), 30, "mailpipe web to answer")
            yield conn
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-3000:])
            raise
        finally:
            conn.close()
            server.terminate()
            server.wait(30)


def in_turns(
    conn: http.client.HTTPConnection, calls: Mapping[str, Iterator[Call]], repeat: int
) -> dict[str, dict[str, float]]:
    """The next call of each of `calls` in turn, WARM_UP rounds and then `repeat` timed: p50
    and p99 of each, as the client measured them."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(WARM_UP + repeat):
        for name, made in calls.items():
            call = next(made)
            started = time.perf_counter()
            answer = _request(conn, call)
            if round_ >= WARM_UP:
                times[name].append((time.perf_counter() - started) * 1000)
            _check(name, call, answer)
    return {name: percentiles(taken) for name, taken in times.items()}


def _request(conn: http.client.HTTPConnection, call: Call) -> bytes:
    if call.body is None:
        conn.request(call.method, call.path, headers=call.headers)
    else:
        headers = call.headers | {"Content-Type": "application/json"}
        conn.request(call.method, call.path, json.dumps(call.body), headers)
    response = conn.getresponse()
    body = response.read()
    if response.status != 200:
        raise RuntimeError(f"{call.method} {call.path}: {response.status} {body[:300]!r}")
    return body


def _check(name: str, call: Call, answer: bytes) -> None:
    if call.expect is None:
        return
    got = json.loads(answer)
    held = {key: got.get(key) for key in call.expect}
    if held != call.expect:
        raise RuntimeError(f"{name}: {call.method} {call.path} answered {held}, not {call.expect}")


def _healthy(conn: http.client.HTTPConnection, server: subprocess.Popen[bytes]) -> bool:
    if server.poll() is not None:
        raise RuntimeError(f"mailpipe web exited with {server.returncode}")
    try:
        _request(conn, Call("GET", "/healthz", {}))
    except ConnectionError:
        conn.close()
        return False
    return True


def measure(res: Any, repeat: int, per_page: int) -> dict[str, dict[str, float]]:
    from mailpipe.operations.status import (
        FailedFilter,
        email_detail,
        error_classes,
        failed_page,
        fleet_status,
        job_state,
    )

    every = FailedFilter()
    one_class = FailedFilter(error_class=ERROR_CLASSES[2])
    with res.db.session() as session:
        last = failed_page(session, every, 1, per_page).pages
        last_of_class = failed_page(session, one_class, 1, per_page).pages
        [row] = failed_page(session, every, 1, 1).rows
    email_id = row["email_id"]

    def in_session(query: Callable[[Any], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with res.db.session() as session:
                return query(session)

        return call

    calls: dict[str, Callable[[], Any]] = {
        "failed_page first": in_session(lambda s: failed_page(s, every, 1, per_page)),
        "failed_page last": in_session(lambda s: failed_page(s, every, last, per_page)),
        "failed_page class first": in_session(lambda s: failed_page(s, one_class, 1, per_page)),
        "failed_page class last": in_session(
            lambda s: failed_page(s, one_class, last_of_class, per_page)
        ),
        "error_classes": in_session(error_classes),
        "email_detail": in_session(lambda s: email_detail(s, email_id)),
        "job_state": in_session(lambda s: job_state(res, s, email_id)),
        "fleet_status": lambda: fleet_status(res),
    }
    return {name: timed(call, repeat) for name, call in calls.items()}


# --- the search (docs/benchmarks.md, "Search") -------------------------------------------------

SEARCH_DB = "mailpipe_bench_search"
# The received times span this many days, the newest ending now.
SEARCH_DAYS = 30
LABELED = ("newsletter", "invoice", "personal", "security", "spam", "bounce")
_HASH = "(hashint4({0}) & 2147483647)"

# The emails, in steps, each a statement on temporary tables and then the tables themselves.
# `seed`: random numbers per email. `mail`: its run state, whether a job has read its headers,
# the email it is a copy of, the kind of its sender (0-5 a person, 6-8 a newsletter, 9 billing).
# `head`: its headers, those of the email it copies.
SEARCH_SEED = [
    "CREATE TEMP TABLE seed AS SELECT g, "
    + ", ".join(f"{_HASH.format(f'g + {k * 300_000_000}')} AS r{k}" for k in range(1, 6))
    + " FROM generate_series(1, %(emails)s) g",
    "CREATE TEMP TABLE mail AS SELECT *, CASE "
    "WHEN g > %(emails)s - 2000 THEN 'no_run' "
    "WHEN g > %(emails)s - 5000 OR r1 %% 1000 = 2 THEN 'open' "
    "WHEN r1 %% 100 = 0 AND r5 %% 20 = 0 THEN 'dismissed' "
    "WHEN r1 %% 100 = 0 THEN 'failed' "
    "WHEN r1 %% 100 = 1 AND g > 1000 THEN 'duplicate' "
    "ELSE 'succeeded' END AS state, r2 %% 10 AS kind FROM seed",
    "ALTER TABLE mail ADD COLUMN read boolean, ADD COLUMN orig int",
    # Half the failed runs failed before their origin step, half of the newest open ones wait
    # for their first; a copy copies an email up to a thousand before it.
    "UPDATE mail SET "
    "read = state <> 'no_run' AND NOT (state IN ('failed', 'dismissed', 'open') AND r4 %% 2 = 0),"
    " orig = CASE WHEN state = 'duplicate' THEN g - 1 - r3 %% 1000 ELSE g END",
    "CREATE TEMP TABLE head AS SELECT m.g, "
    "CASE WHEN o.kind < 6 THEN 'User ' || o.r3 %% 100000 || ' <user' || o.r3 %% 100000 "
    "|| '@d' || o.r3 %% 2000 || '.example>' "
    "WHEN o.kind < 9 THEN 'news@list' || o.r3 %% 50 || '.example' "
    "ELSE 'Billing <billing@shop' || o.r3 %% 200 || '.example>' END AS sender, "
    "CASE WHEN o.kind = 9 THEN 'Invoice INV-' || o.g || ' ' ELSE '' END || concat_ws(' ', "
    + ", ".join(
        "(%(words)s::text[])[1 + floor(%(vocabulary)s * power("
        + _HASH.format(f"o.g * 8 + {k}")
        + " / 2147483648.0, 3))::int]"
        for k in range(1, 6)
    )
    + ") AS subject, md5(o.g::text) || '@mail' || o.g %% 100 || '.example' AS message_id, "
    "o.read AND o.state <> 'duplicate' AS orig_has_origin "
    "FROM mail m JOIN mail o ON o.g = m.orig",
    # Foreign keys unchecked while the rows go in: origins and emails point at each other.
    "SET session_replication_role = replica",
    "INSERT INTO email_message (id, blob_key, size, sha256, received_at, created_at, "
    "needs_review, review_reason, has_run, subject, sender, lane, origin_id, duplicate_of) "
    "SELECT m.g, 'raw/' || m.g, 1000, md5(m.g::text), t.at, t.at, m.r5 %% 1000 = 7, "
    "CASE WHEN m.r5 %% 1000 = 7 THEN 'the model named a label out of the list' END, "
    "m.state <> 'no_run', CASE WHEN m.read THEN h.subject END, "
    "CASE WHEN m.read THEN h.sender END, "
    "CASE WHEN m.g BETWEEN %(emails)s / 5 AND 2 * %(emails)s / 5 THEN 'bulk' ELSE 'live' END, "
    "CASE WHEN m.read AND h.orig_has_origin THEN m.orig END, "
    "CASE WHEN m.state = 'duplicate' THEN m.orig END "
    "FROM mail m JOIN head h USING (g), LATERAL (SELECT %(end)s::timestamp - "
    "(%(emails)s - m.g) * %(step)s * interval '1 second' - m.r3 %% 300 * interval '1 second'"
    " AS at) t ORDER BY m.g",
    "INSERT INTO email_origin (id, fingerprint, message_id, first_email_id, created_at) "
    "SELECT m.g, md5('origin' || m.g), h.message_id, m.g, now() FROM mail m JOIN head h "
    "USING (g) WHERE m.read AND m.state <> 'duplicate'",
    "INSERT INTO pipeline_run (email_id, status, attempts, sweep_count, created_at, updated_at, "
    "closed_at, converted_at, error_class, error, dismissed_at) SELECT g, "
    "(CASE WHEN state = 'dismissed' THEN 'failed' ELSE state END)::run_status, 1, 0, now(), "
    "now(), CASE WHEN state <> 'open' THEN now() END, CASE WHEN read THEN now() END, "
    "CASE WHEN state IN ('failed', 'dismissed') THEN (%(classes)s::text[])[1 + r3 %% 5] "
    "WHEN state = 'open' AND r4 %% 10 = 1 THEN 'OperationalError' END, "
    "CASE WHEN state IN ('failed', 'dismissed') OR (state = 'open' AND r4 %% 10 = 1) "
    "THEN 'failed for good' END, CASE WHEN state = 'dismissed' THEN now() END "
    "FROM mail WHERE state <> 'no_run' ORDER BY g",
    "INSERT INTO email_label (email_id, label, source, confidence, created_at) "
    "SELECT g, label, 'model', 0.9, now() FROM mail, LATERAL (VALUES "
    "('newsletter', kind BETWEEN 6 AND 8 AND r5 %% 10 < 9), "
    "('invoice', kind = 9 OR r5 %% 50 = 0), "
    "('personal', kind < 6 AND r5 %% 5 = 2), "
    "('security', r5 %% 50 = 1), "
    "('spam', r4 %% 20 = 3), "
    "('bounce', r4 %% 100 = 5)) AS l(label, given) "
    "WHERE given AND state IN ('succeeded', 'duplicate') ORDER BY g",
    "SET session_replication_role = DEFAULT",
    *(
        f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))"
        for table in ("email_message", "email_origin", "pipeline_run", "email_label")
    ),
]


def vocabulary(size: int = 2000) -> list[str]:
    """Subject words: the workload's, then made-up ones of two to four syllables; the search
    seed draws the first ones most often (a word's share falls as its rank's cube root)."""
    from bench.workload import WORDS

    rng = random.Random(8)
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    words = list(WORDS)
    while len(words) < size:
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(2, 4)))
        if word not in words:
            words.append(word)
    return words


def prepare_search(name: str, emails: int, revision: str = "head") -> str:
    """A database of `emails` emails as the search finds them, at schema `revision`."""
    import psycopg

    from mailpipe.storage.migrate import upgrade

    url = harness.database(name).create().url
    upgrade(url, revision)
    words = vocabulary()
    given = {
        "emails": emails,
        "words": words,
        "vocabulary": len(words),
        "classes": list(ERROR_CLASSES),
        "end": datetime.now(UTC).replace(tzinfo=None, microsecond=0),
        "step": SEARCH_DAYS * 86400 / emails,
    }
    with psycopg.connect(url) as conn:
        for statement in SEARCH_SEED:
            conn.execute(statement, given)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    return url


def search_cases(res: Any) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
    """The searches to time, by name: each filter alone (some with a rare and a common value),
    and every two filters together, each with its typical value."""
    from sqlalchemy import select

    from mailpipe.storage.models import EmailMessage, EmailOrigin

    with res.db.session() as session:
        end = session.scalar(select(EmailMessage.received_at).order_by(EmailMessage.id.desc()))
        middle = session.scalar(select(EmailMessage.id).order_by(EmailMessage.id.desc())) // 2
        message_id = session.scalar(
            select(EmailOrigin.message_id).where(EmailOrigin.first_email_id >= middle).limit(1)
        )
        sender = session.scalar(
            select(EmailMessage.sender)
            .where(EmailMessage.id >= middle, EmailMessage.sender.like("User %"))
            .limit(1)
        )
    assert end is not None and message_id is not None and sender is not None
    words = vocabulary()

    def day(days_ago: float, hours: float = 24) -> dict[str, str]:
        since = end - timedelta(days=days_ago)
        return {"since": since.isoformat(), "until": (since + timedelta(hours=hours)).isoformat()}

    # A word's share of the subjects falls with its rank: words[0] is in 34 % of them,
    # words[60] in 0.8 % (where reading the index and walking the newest emails cost alike, the
    # slowest share), words[600] in 0.2 %, words[1500] in 0.1 %.
    typical = {
        "message_id": {"message_id": message_id},
        "sender": {"sender": sender.split("<")[1].rstrip(">")},
        "subject": {"subject": words[600]},
        "time": day(10),
        "state": {"state": "failed"},
        "error_class": {"error_class": "OperationalError"},
        "label": {"label": "invoice"},
        "lane": {"lane": "bulk"},
        "review": {"review": "yes"},
    }
    alone = {
        **{f"{name} ({_shown(values)})": values for name, values in typical.items()},
        "sender, a newsletter": {"sender": "news@list7.example"},
        "sender, a domain": {"sender": "@d17.example"},
        "subject, the commonest word": {"subject": words[0]},
        "subject, a word of 0.8 %": {"subject": words[60]},
        "subject, a rare word": {"subject": words[1500]},
        "subject, two words": {"subject": f"{words[3]} {words[60]}"},
        "time, an hour": day(10, 1),
        "time, the older half": {"until": (end - timedelta(days=SEARCH_DAYS / 2)).isoformat()},
        **{f"state {state}": {"state": state} for state in ("open", "no_run", "dismissed")},
        **{f"state {state}": {"state": state} for state in ("duplicate", "succeeded")},
        "label, rare": {"label": "bounce"},
        "lane live": {"lane": "live"},
        "none": {},
    }
    names = list(typical)
    together = {
        f"{a} + {b}": {**typical[a], **typical[b]}
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    # The slowest share of a word, with each filter of another table.
    slowest = {"subject": words[60]}
    for name in ("state", "error_class", "label"):
        together[f"subject of 0.8 % + {name}"] = {**slowest, **typical[name]}
    return alone, together


def _shown(values: dict[str, str]) -> str:
    return ", ".join(f"{key}={value}" for key, value in values.items())


def measure_search(url: str, repeat: int) -> dict[str, Any]:
    """Each search as the console's page over HTTP and as `search.find`, `repeat` times."""
    from urllib.parse import urlencode

    from mailpipe.operations.search import find, read_search

    res = resources_on(url)
    try:
        alone, together = search_cases(res)
        cases = {**alone, **together}
        found: dict[str, int] = {}
        calls: dict[str, Callable[[], Any]] = {}
        for name, values in cases.items():
            filt, _ = read_search(values)

            def call(filt: Any = filt) -> Any:
                with res.db.session() as session, session.begin():
                    return find(session, filt)

            found[name] = len(call().rows)
            calls[name] = call
        served = measure_http(
            url, {name: f"/search?{urlencode(values)}" for name, values in cases.items()}, repeat
        )
        queried = {name: timed(call, repeat) for name, call in calls.items()}
    finally:
        res.close()
    return {
        "cases": cases,
        "alone": list(alone),
        "found": found,
        "http": served,
        "queries": queried,
    }


def search_main(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    url = prepare_search(SEARCH_DB, args.emails)
    seeded_s = time.perf_counter() - started
    try:
        results = measure_search(url, args.repeat)
    finally:
        delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])
        harness.database(SEARCH_DB).drop()
    print(f"{args.emails:,} emails, seeded in {seeded_s:.0f} s; {args.repeat} calls each")
    print(f"{'search':>60} {'found':>5} {'HTTP p50':>9} {'p99':>7} {'find p50':>9} {'p99':>7}")
    for name in results["cases"]:
        http_, query = results["http"][name], results["queries"][name]
        print(
            f"{name[:60]:>60} {results['found'][name]:>5} {http_['p50_ms']:>9.2f} "
            f"{http_['p99_ms']:>7.2f} {query['p50_ms']:>9.2f} {query['p99_ms']:>7.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, **results}))
    return 0


# --- ingest with and without the search's indexes -----------------------------------------------

INGEST_DBS = {"with": "mailpipe_bench_ingest_with", "without": "mailpipe_bench_ingest_without"}
# The schema with the search's indexes (0011) and the one before them: the same columns.
WITH_REVISION, WITHOUT_REVISION = "0011", "0010"


def ingest_main(args: argparse.Namespace) -> int:
    """`mailpipe ingest` of the same emails into two databases of `--emails` emails, one with the
    search's indexes and one without, in turns; then the origin step's writes for them, one
    transaction per email as a job makes them, where the subject and sender reach the trigram
    indexes. Paired: each repetition times both, the one first that went second before."""
    from bench.workload import plain_workload
    from mailpipe.cli.ingest import ingest
    from mailpipe.mail.parse import ParseLimits, parse_email
    from mailpipe.pipeline.origin import find_origin, link_to_origin
    from mailpipe.resources import Resources
    from mailpipe.settings import Settings

    started = time.perf_counter()
    urls = {
        variant: prepare_search(
            name, args.emails, WITH_REVISION if variant == "with" else WITHOUT_REVISION
        )
        for variant, name in INGEST_DBS.items()
    }
    seeded_s = time.perf_counter() - started
    # Other emails each repetition, the same for both databases: each one's origin is new.
    per = args.ingest_emails
    emails, _ = plain_workload(per * args.repeat)
    limits = ParseLimits(max_bytes=1 << 26, max_depth=25, max_parts=1000, body_max_chars=200_000)
    times: dict[str, dict[str, list[float]]] = {
        variant: {"ingest": [], "origin": []} for variant in urls
    }
    with tempfile.TemporaryDirectory() as scratch:
        folders = [
            harness.write_emails(Path(scratch) / f"emails-{n}", emails[n * per : (n + 1) * per])
            for n in range(args.repeat)
        ]
        resources = {
            variant: Resources(
                Settings(database_url=url, blob_url=f"file://{scratch}/blobs-{variant}")
            )
            for variant, url in urls.items()
        }
        try:
            for repetition, folder in enumerate(folders):
                raws = emails[repetition * per : (repetition + 1) * per]
                parsed = [parse_email(raw, limits) for raw in raws]
                for variant in harness.rotated(list(urls), repetition):
                    res = resources[variant]
                    began = time.perf_counter()
                    report = ingest(res, [folder], enqueue=False)
                    times[variant]["ingest"].append(time.perf_counter() - began)
                    assert report.stored == per and not report.rejected, report
                    began = time.perf_counter()
                    for email_id, email in zip(report.email_ids, parsed, strict=True):
                        with res.db.transaction() as session:
                            link_to_origin(
                                session, email_id, email, find_origin(session, email_id, email)
                            )
                    times[variant]["origin"].append(time.perf_counter() - began)
        finally:
            for res in resources.values():
                res.close()
            for name in INGEST_DBS.values():
                harness.database(name).drop()
    rates = {
        variant: {step: [per / s for s in taken] for step, taken in steps.items()}
        for variant, steps in times.items()
    }
    ratios = {
        step: [w / o for w, o in zip(rates["with"][step], rates["without"][step], strict=True)]
        for step in ("ingest", "origin")
    }
    print(
        f"{args.emails:,} emails in each database (seeded in {seeded_s:.0f} s), "
        f"{per:,} ingested per repetition, {args.repeat} repetitions; emails/s, medians"
    )
    print(f"{'step':>28} {'with':>9} {'without':>9} {'with / without':>15}")
    for step, title in (
        ("ingest", "ingest (store, no enqueue)"),
        ("origin", "origin step's writes"),
    ):
        print(
            f"{title:>28} {harness.median(rates['with'][step]):>9.0f} "
            f"{harness.median(rates['without'][step]):>9.0f} "
            f"{harness.median(ratios[step]):>15.3f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": None}, "rates": rates, "ratios": ratios})
        )
    return 0


# --- the write API (docs/benchmarks.md, "API actions") -------------------------------------------


def api_targets(res: Any, count: int) -> dict[str, list[int]]:
    """`count` emails for each action that changes one, none shared: listed failed runs not
    marked for review to retry and to dismiss, dismissed runs, emails marked for review, and
    succeeded runs to move, to reprocess by id and to reprocess (and plan) by a subject word.
    The subject's emails have six-digit ids: `subject <id>` is then the one subject holding
    the id, as a word and as text."""
    from sqlalchemy import select

    from mailpipe.storage.models import EmailMessage, PipelineRun, RunStatus

    run, email = PipelineRun, EmailMessage
    failed = run.status == RunStatus.FAILED

    def emails(*where: Any, times: int = 1) -> list[list[int]]:
        query = select(run.email_id).join(email, email.id == run.email_id).where(*where)
        with res.db.session() as session:
            ids = list(session.scalars(query.order_by(run.email_id).limit(count * times)))
        if len(ids) < count * times:
            raise RuntimeError(f"{len(ids)} emails where {count * times} are needed: seed more")
        return [ids[n * count : (n + 1) * count] for n in range(times)]

    retry, dismiss = emails(failed, run.dismissed_at.is_(None), ~email.needs_review, times=2)
    [undo] = emails(failed, run.dismissed_at.is_not(None))
    [review] = emails(email.needs_review)
    move, one, by_word, planned = emails(
        run.status == RunStatus.SUCCEEDED, email.id.between(100_001, 999_999), times=4
    )
    return {
        "retry": retry,
        "dismiss": dismiss,
        "undo dismiss": undo,
        "clear review": review,
        "move lane": move,
        "reprocess": one,
        "reprocess by subject": by_word,
        "reprocess by subject, dry run": planned,
    }


def api_calls(
    targets: dict[str, list[int]], token: str, password: str, email_id: int
) -> dict[str, Iterator[Call]]:
    """Each action and read of the API, by name: the next call of each acts on the next email of
    its targets (a call per email), or switches back what the call before it switched; the page
    of one email `email_id` as a signed-in operator, the rest with the bearer token."""
    bearer = {"Authorization": f"Bearer {token}"}

    def on_each(
        name: str, action: str, body: Any = None, answer: Callable[[int], Any] | None = None
    ) -> Iterator[Call]:
        """`action` on each email of `targets[name]`; it answers `answer(email)`, by default
        that it did it to that email."""
        for n in targets[name]:
            done = {"done": [n]} if answer is None else answer(n)
            yield Call("POST", f"/api/emails/{n}/{action}", bearer, body or {}, done)

    def by_subject(name: str, dry_run: bool) -> Iterator[Call]:
        done = {"emails": 1, "reprocess_id": None} if dry_run else {"emails": 1, "enqueued": 1}
        for n in targets[name]:
            body = {"subject": str(n), "from": "classify", "dry_run": dry_run}
            if not dry_run:
                body["expect"] = 1  # the count its plan gives, echoed
            yield Call("POST", "/api/reprocess", bearer, body, done)

    def again(method: str, path: str, body: Any = None, expect: Any = None) -> Iterator[Call]:
        return itertools.repeat(Call(method, path, bearer, body, expect))

    page = basic_auth("bench", password)
    # In turns, a pause then a resume, the switch on then off: each call changes the state.
    return {
        "POST retry": on_each("retry", "retry", answer=lambda n: {"done": [n], "enqueued": 1}),
        "POST dismiss": on_each("dismiss", "dismiss"),
        "POST undo-dismiss": on_each("undo dismiss", "undo-dismiss"),
        "POST clear-review": on_each("clear review", "clear-review"),
        "POST lane (to bulk)": on_each("move lane", "lane", {"lane": "bulk"}),
        "POST reprocess (one email)": on_each(
            "reprocess", "reprocess", {"from": "classify"}, lambda n: {"emails": 1, "enqueued": 1}
        ),
        "POST /reprocess by subject, dry run": by_subject("reprocess by subject, dry run", True),
        "POST /reprocess by subject": by_subject("reprocess by subject", False),
        "POST stages/cpu/pause": again(
            "POST", "/api/stages/cpu/pause", {"reason": "bench"}, {"paused": True}
        ),
        "POST stages/cpu/resume": again("POST", "/api/stages/cpu/resume", {}, {"was_paused": True}),
        "PUT model-calls on": again("PUT", "/api/model-calls", {"on": True}, {"model_calls": True}),
        "PUT model-calls off": again(
            "PUT", "/api/model-calls", {"on": False}, {"model_calls": False}
        ),
        "GET /api/failed": again("GET", "/api/failed"),
        "GET /api/review": again("GET", "/api/review"),
        "GET /api/search?state=failed": again("GET", "/api/search?state=failed"),
        "GET /api/activity": again("GET", "/api/activity"),
        "GET /api/jobs/<id>": again("GET", f"/api/jobs/{email_id}"),
        "GET /emails/<id> (page)": itertools.repeat(Call("GET", f"/emails/{email_id}", page)),
    }


def web_token() -> tuple[str, str]:
    """A new operator's token for the API, as `mailpipe web-token` makes one: the token and its
    MAILPIPE_WEB_TOKENS entry."""
    made = subprocess.run(
        [str(Path(sys.executable).parent / "mailpipe"), "web-token", "bench", "--role", "operator"],
        env=harness.env_without_settings(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    token = made.split("(give it to the caller; it is not kept): ")[1].split()[0]
    return token, made.split("MAILPIPE_WEB_TOKENS entry: ")[1].split()[0]


def api_main(args: argparse.Namespace) -> int:
    """Each action of the write API on `--emails` emails and `--failed` failed runs (the console's
    database, `prepare`), `--repeat` times after WARM_UP each, in turns on one keep-alive
    connection, with an operator's bearer token; and the API's reads beside them."""
    from mailpipe.operations.status import failed_page

    started = time.perf_counter()
    url = prepare(args.emails, args.failed)
    seeded_s = time.perf_counter() - started
    res = resources_on(url)
    try:
        targets = api_targets(res, args.repeat + WARM_UP)
        with res.db.session() as session:
            [row] = failed_page(session, None, 1, 1).rows
        token, entry = web_token()
        password = secrets.token_hex(16)
        users = {"MAILPIPE_WEB_OPERATORS": f"bench:{password}", "MAILPIPE_WEB_TOKENS": entry}
        with web_server(url, users) as conn:
            calls = api_calls(targets, token, password, row["email_id"])
            served = in_turns(conn, calls, args.repeat)
    finally:
        res.close()
        delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])
        harness.database(DB_NAME).drop()
    print(
        f"{args.emails:,} emails, {args.failed:,} failed runs, seeded in {seeded_s:.0f} s; "
        f"{args.repeat} calls each after {WARM_UP} warm-up, each changing call on an email of "
        "its own"
    )
    print(f"{'API call':>40} {'p50 (ms)':>9} {'p99 (ms)':>9}")
    for name, times in served.items():
        print(f"{name:>40} {times['p50_ms']:>9.2f} {times['p99_ms']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "http": served}))
    return 0


# --- the overview's activity charts (docs/benchmarks.md, "Activity charts") --------------------

ACTIVITY_DB = "mailpipe_bench_activity"
# Each email's attempts as a fleet writes them, their end times spread evenly over `days` up to
# now: the CPU stage's (one in fifty retried first, one in a hundred a duplicate, the rest handed
# off to the model stage) and the model stage's (one in thirty deferred first, one in two
# hundred failed, the rest succeeded), about 2.1 per email; then a day of the metrics report's
# samples, one a minute per lane. Rows go in in the order of their end, as a fleet writes them.
ACTIVITY_SEED = [
    "CREATE TEMP TABLE seed AS SELECT g, hashint4(g) & 2147483647 AS r, %(end)s::timestamp - "
    "(%(emails)s - g) * %(step)s * interval '1 second' AS at FROM generate_series(1, %(emails)s) g",
    "INSERT INTO email_message (id, blob_key, size, sha256, received_at, created_at, has_run) "
    "SELECT g, 'raw/' || g, 1000, md5(g::text), at - interval '5 seconds', at, true FROM seed",
    "INSERT INTO pipeline_run (id, email_id, status, attempts, sweep_count, created_at, "
    "updated_at, closed_at, converted_at, error_class, error) SELECT g, g, "
    "(CASE WHEN r %% 200 = 3 THEN 'failed' ELSE 'succeeded' END)::run_status, 1, 0, at, at, at, "
    "at - interval '3 seconds', CASE WHEN r %% 200 = 3 THEN 'InputRejected' END, "
    "CASE WHEN r %% 200 = 3 THEN 'InputRejected: no' END FROM seed",
    "CREATE TEMP TABLE attempt AS "
    "SELECT g, 'cpu' AS stage, 1 AS attempt, at - interval '20 seconds' AS ended_at, "
    "0.3 AS seconds, 'retrying' AS outcome FROM seed WHERE r %% 50 = 0 "
    "UNION ALL SELECT g, 'cpu', 1 + (r %% 50 = 0)::int, at - interval '3 seconds', "
    "0.05 + (r >> 8) %% 450 / 1000.0, "
    "CASE WHEN r %% 100 = 1 THEN 'duplicate' ELSE 'handed_off' END FROM seed "
    "UNION ALL SELECT g, 'model', 1, at - interval '2 seconds', 0.01, 'deferred' FROM seed "
    "WHERE r %% 30 = 2 "
    "UNION ALL SELECT g, 'model', 1, at, 0.5 + (r >> 12) %% 2500 / 1000.0, "
    "CASE WHEN r %% 200 = 3 THEN 'failed' ELSE 'succeeded' END FROM seed WHERE r %% 100 <> 1",
    "INSERT INTO run_attempt (run_id, email_id, stage, attempt, started_at, ended_at, outcome, "
    "host) SELECT g, g, stage, attempt, ended_at - seconds * interval '1 second', ended_at, "
    "outcome, 'w1' FROM attempt ORDER BY ended_at",
    "INSERT INTO queue_sample (measured_at, queue, lane, depth, oldest_age_s) "
    "SELECT %(end)s::timestamp - m * interval '1 minute', q, l, "
    "(hashint4(m * 4 + k) & 2147483647) %% 500, (hashint4(m * 8 + k) & 2147483647) %% 600 "
    "FROM generate_series(0, 1439) m, (VALUES (0, 'mailpipe', 'live'), (1, 'mailpipe', 'bulk'), "
    "(2, 'mailpipe.model', 'live'), (3, 'mailpipe.model', 'bulk')) AS lanes(k, q, l) ORDER BY m DESC",
    *(
        f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT max(id) FROM {table}))"
        for table in ("email_message", "pipeline_run")
    ),
]


def prepare_activity(emails: int, days: float, without: list[str]) -> str:
    """A database of `emails` emails and their attempts over `days`, less the indexes named in
    `without` (to measure what each is worth)."""
    import psycopg

    from mailpipe.storage.migrate import upgrade

    url = harness.database(ACTIVITY_DB).create().url
    upgrade(url)
    given = {
        "emails": emails,
        "end": datetime.now(UTC).replace(tzinfo=None),
        "step": days * 86400 / emails,
    }
    with psycopg.connect(url) as conn:
        for statement in ACTIVITY_SEED:
            conn.execute(statement, given)
        for index in without:
            conn.execute(f"DROP INDEX {index}")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    return url


def activity_main(args: argparse.Namespace) -> int:
    """The overview's charts' data, for the hour and the day: `/api/activity` and the overview
    page over HTTP, and `activity.fleet_activity`, each `--repeat` times."""
    from sqlalchemy import func, select

    from mailpipe.operations.activity import WINDOWS, fleet_activity
    from mailpipe.storage.models import RunAttempt

    started = time.perf_counter()
    url = prepare_activity(args.emails, args.activity_days, args.activity_without)
    seeded_s = time.perf_counter() - started
    res = resources_on(url)
    try:
        with res.db.session() as session:
            attempts = session.scalar(select(func.count()).select_from(RunAttempt))
            ended = {
                name: session.scalar(
                    select(func.count()).where(
                        RunAttempt.ended_at >= window.start(datetime.now(UTC).replace(tzinfo=None))
                    )
                )
                for name, window in WINDOWS.items()
            }
        paths = {
            **{f"api {name}": f"/api/activity?window={name}" for name in WINDOWS},
            **{f"overview {name}": f"/?window={name}" for name in WINDOWS},
        }
        served = measure_http(url, paths, args.repeat)

        def call(name: str) -> Callable[[], Any]:
            def query() -> Any:
                with res.db.session() as session:
                    return fleet_activity(session, WINDOWS[name])

            return query

        queried = {f"fleet_activity {name}": timed(call(name), args.repeat) for name in WINDOWS}
    finally:
        res.close()
        delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])
        harness.database(ACTIVITY_DB).drop()
    without = ", ".join(args.activity_without) or "none"
    print(
        f"{args.emails:,} emails, {attempts:,} attempts over {args.activity_days:g} days "
        f"({ended['hour']:,} in the last hour, {ended['day']:,} in the last day), seeded in "
        f"{seeded_s:.0f} s; indexes left out: {without}; {args.repeat} calls each"
    )
    print(f"{'':>24} {'p50 (ms)':>9} {'p99 (ms)':>9}")
    for name, times in {**served, **queried}.items():
        print(f"{name:>24} {times['p50_ms']:>9.2f} {times['p99_ms']:>9.2f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": None},
                    "attempts": attempts,
                    "ended": ended,
                    "http": served,
                    "queries": queried,
                }
            )
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emails", type=int, default=1_000_000)
    parser.add_argument("--failed", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--per-page", type=int, default=50)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--search",
        action="store_true",
        help="Time the search instead: each filter alone and every two together.",
    )
    parser.add_argument(
        "--ingest",
        action="store_true",
        help="Time ingest and the origin step's writes with the search's indexes and without.",
    )
    parser.add_argument("--ingest-emails", type=int, default=5000, help="Per repetition.")
    parser.add_argument(
        "--api-actions",
        action="store_true",
        help="Time each action of the write API, and its reads, with a bearer token instead.",
    )
    parser.add_argument(
        "--activity",
        action="store_true",
        help="Time the overview's activity charts' data for the hour and the day instead.",
    )
    parser.add_argument(
        "--activity-days", type=float, default=1.0, help="The attempts' end times span this."
    )
    parser.add_argument(
        "--activity-without", action="append", default=[], help="An index to drop first."
    )
    args = parser.parse_args()
    os.environ["MAILPIPE_BROKER_URL"] = harness.REDIS_URL
    os.environ["MAILPIPE_REDIS_PREFIX"] = f"benchconsole{uuid.uuid4().hex[:8]}:"
    if args.search:
        return search_main(args)
    if args.ingest:
        return ingest_main(args)
    if args.activity:
        return activity_main(args)
    if args.api_actions:
        return api_main(args)
    started = time.perf_counter()
    url = prepare(args.emails, args.failed)
    seeded_s = time.perf_counter() - started
    res = resources_on(url)
    try:
        served = measure_http(url, pages(res, args.per_page), args.repeat)
        results = measure(res, args.repeat, args.per_page)
    finally:
        res.close()
        delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])
        harness.database(DB_NAME).drop()
    print(
        f"{args.emails:,} emails, {args.failed:,} failed runs, seeded in {seeded_s:.0f} s; "
        f"{args.repeat} calls each"
    )
    for title, figures in (("HTTP on loopback", served), ("query function", results)):
        print(f"{title:>24} {'p50 (ms)':>9} {'p99 (ms)':>9}")
        for name, times in figures.items():
            print(f"{name:>24} {times['p50_ms']:>9.2f} {times['p99_ms']:>9.2f}")
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": None}, "http": served, "queries": results})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
