"""The console's queries on a large database: the failed list's first and last pages, with and
without a filter, an email's detail, a job's state and the fleet's status.

    .venv/bin/python -m bench.console --emails 1000000 --failed 10000 --repeat 200

Seeds a database of its own (INSERT ... SELECT generate_series): `--emails` emails, each with a
run, `--failed` of them failed across five error classes (one in twenty dismissed, one in ten
marked for review) with three attempts each in their history, the rest succeeded; then times
each query function `--repeat` times and prints p50 and p99 in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import harness
from bench.sweep import resources_on
from tests.support.services import delete_prefix

ERROR_CLASSES = ("BlobMissing", "InputRejected", "OperationalError", "AttemptsUsedUp", "Stalled")
DB_NAME = "mailpipe_bench_console"


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
        conn.exec_driver_sql("ANALYZE")
    engine.dispose()
    return url


def timed(call: Callable[[], Any], repeat: int) -> dict[str, float]:
    call()  # the first call pays for connections and plans, as no later one does
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return {
        "p50_ms": statistics.median(times),
        "p99_ms": times[min(len(times) - 1, round(0.99 * len(times)) - 1)],
    }


def measure(res: Any, repeat: int, per_page: int) -> dict[str, dict[str, float]]:
    from mailpipe.operations.status import (
        FailedFilter,
        email_detail,
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
        results = measure(res, args.repeat, args.per_page)
    finally:
        res.close()
        delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])
        harness.database(DB_NAME).drop()
    print(
        f"{args.emails:,} emails, {args.failed:,} failed runs, seeded in {seeded_s:.0f} s; "
        f"{args.repeat} calls each"
    )
    print(f"{'query':>24} {'p50 (ms)':>9} {'p99 (ms)':>9}")
    for name, figures in results.items():
        print(f"{name:>24} {figures['p50_ms']:>9.2f} {figures['p99_ms']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, **results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
