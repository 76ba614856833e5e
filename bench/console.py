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
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
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


def measure_http(url: str, paths: dict[str, str], repeat: int) -> dict[str, dict[str, float]]:
    """`mailpipe web` on the database at `url`: each of `paths` requested `repeat` times, in
    turn, on one keep-alive connection."""
    password = secrets.token_hex(16)
    port = free_port()
    env = harness.env_without_settings() | {
        "MAILPIPE_DATABASE_URL": url,
        "MAILPIPE_BROKER_URL": harness.REDIS_URL,
        "MAILPIPE_REDIS_PREFIX": os.environ["MAILPIPE_REDIS_PREFIX"],
        "MAILPIPE_WEB_HOST": "127.0.0.1",
        "MAILPIPE_WEB_PORT": str(port),
        "MAILPIPE_WEB_OPERATORS": f"bench:{password}",
    }
    headers = {"Authorization": "Basic " + base64.b64encode(f"bench:{password}".encode()).decode()}
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
            for path in paths.values():
                for _ in range(WARM_UP):
                    _get(conn, path, headers)
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(repeat):
                for name, path in paths.items():
                    started = time.perf_counter()
                    _get(conn, path, headers)
                    times[name].append((time.perf_counter() - started) * 1000)
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-3000:])
            raise
        finally:
            conn.close()
            server.terminate()
            server.wait(30)
    return {name: percentiles(taken) for name, taken in times.items()}


def _get(conn: http.client.HTTPConnection, path: str, headers: dict[str, str]) -> bytes:
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    body = response.read()
    if response.status != 200:
        raise RuntimeError(f"GET {path}: {response.status} {body[:300]!r}")
    return body


def _healthy(conn: http.client.HTTPConnection, server: subprocess.Popen[bytes]) -> bool:
    if server.poll() is not None:
        raise RuntimeError(f"mailpipe web exited with {server.returncode}")
    try:
        _get(conn, "/healthz", {})
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emails", type=int, default=1_000_000)
    parser.add_argument("--failed", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--per-page", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ["MAILPIPE_BROKER_URL"] = harness.REDIS_URL
    os.environ["MAILPIPE_REDIS_PREFIX"] = f"benchconsole{uuid.uuid4().hex[:8]}:"
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
