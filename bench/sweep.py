"""Sweep time on PostgreSQL against the number of stored emails, with a fixed set of candidates.

    .venv/bin/python bench/sweep.py --sizes 100000 1000000 --candidates 1000 --repeat 5

For each size it bulk-inserts that many emails (with runs, most of them closed) into a database
of its own, of which `--candidates` need the sweeper: half have no run yet, half have an open run
whose job was lost. It then times full sweeps (the real `mailpipe.sweeper.sweep`, enqueueing to the
local Redis under a key prefix of its own), restoring the candidates between repetitions, and
prints the EXPLAIN (ANALYZE, BUFFERS) of the sweeper's two batch queries. The cost should follow
the candidates, so the time ratio between sizes should stay near 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402


def prepare(size: int, candidates: int) -> str:
    import sqlalchemy

    url = harness.create_database(f"mailpipe_bench_sweep_{size}")
    from mailpipe.migrate import upgrade

    upgrade(url)
    engine = sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    no_run = candidates // 2
    lost = candidates - no_run
    with engine.begin() as conn:
        # Emails 1..size; the last `no_run` have no run yet.
        conn.exec_driver_sql(
            "INSERT INTO email_message (blob_key, size, sha256, created_at, needs_review, has_run) "
            "SELECT 'raw/' || g, 1000, md5(g::text), now(), false, g <= %(with_run)s "
            "FROM generate_series(1, %(size)s) g",
            {"size": size, "with_run": size - no_run},
        )
        # Runs for the others: the first `lost` are open with a lost job, the rest succeeded.
        conn.exec_driver_sql(
            "INSERT INTO pipeline_run (email_id, status, attempts, sweep_count, created_at, updated_at, "
            "closed_at, classified_at) SELECT g, "
            "CASE WHEN g <= %(lost)s THEN 'open'::run_status ELSE 'succeeded'::run_status END, "
            "CASE WHEN g <= %(lost)s THEN 1 ELSE 1 END, 0, now(), now(), "
            "CASE WHEN g <= %(lost)s THEN NULL ELSE now() END, "
            "CASE WHEN g <= %(lost)s THEN NULL ELSE now() END "
            "FROM generate_series(1, %(with_run)s) g",
            {"lost": lost, "with_run": size - no_run},
        )
        conn.exec_driver_sql("ANALYZE")
    engine.dispose()
    return url


def restore_candidates(res, size: int, candidates: int) -> None:  # type: ignore[no-untyped-def]
    """Undo what a sweep did, so every repetition sees the same candidates."""
    from sqlalchemy import text

    no_run = candidates // 2
    first_no_run = size - no_run + 1
    with res.db.transaction() as session:
        session.execute(text("DELETE FROM pipeline_run WHERE email_id >= :f"), {"f": first_no_run})
        session.execute(text("UPDATE email_message SET has_run = false WHERE id >= :f"), {"f": first_no_run})
        session.execute(text("UPDATE pipeline_run SET sweep_count = 0, status = 'open' WHERE email_id <= :l"), {"l": candidates - no_run})
        session.execute(text("DELETE FROM sweep_report"))
    harness.delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])


def explain(res) -> dict[str, str]:  # type: ignore[no-untyped-def]
    from sqlalchemy import text
    from sqlalchemy.dialects import postgresql

    from mailpipe import sweeper
    from mailpipe.models import utcnow

    plans = {}
    for name, query in (
        ("emails without run", sweeper.emails_without_run(0, 1000)),
        ("open runs (model calls on)", sweeper.open_runs(0, 1000, True, utcnow())),
    ):
        sql = str(query.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
        with res.db.session() as session:
            rows = session.execute(text("EXPLAIN (ANALYZE, BUFFERS) " + sql)).scalars().all()
        plans[name] = sql + "\n\n" + "\n".join(rows)
    return plans


def measure(size: int, candidates: int, repeat: int) -> dict[str, object]:
    url = prepare(size, candidates)
    os.environ["MAILPIPE_DATABASE_URL"] = url
    from mailpipe import flags, resources, sweeper
    from mailpipe.enqueue import enqueue_emails
    from mailpipe.metrics import LogMetricsSink
    from mailpipe.settings import get_settings

    get_settings.cache_clear()
    resources.reset()
    res = resources.get_resources()
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    times = []
    for _ in range(repeat):
        restore_candidates(res, size, candidates)
        started = time.perf_counter()
        result = sweeper.sweep(res, lambda ids: enqueue_emails(ids, res), lambda: 1, LogMetricsSink())
        times.append(time.perf_counter() - started)
        assert result.readded_no_run + result.readded_stalled == candidates, result.summary()
    restore_candidates(res, size, candidates)  # explain the queries as a sweep first sees them
    plans = explain(res)
    res.close()
    harness.delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])
    harness.drop_database(f"mailpipe_bench_sweep_{size}")
    return {"size": size, "candidates": candidates, "seconds": times, "median_s": statistics.median(times), "plans": plans}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--candidates", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--explain-out", type=Path, help="write the EXPLAIN output here")
    args = parser.parse_args()
    os.environ["MAILPIPE_BROKER_URL"] = harness.REDIS_URL
    os.environ["MAILPIPE_REDIS_PREFIX"] = f"benchsweep{uuid.uuid4().hex[:8]}:"
    results = [measure(size, args.candidates, args.repeat) for size in args.sizes]
    base = results[0]["median_s"]
    print(f"{'stored emails':>14} {'candidates':>10} {'median sweep (s)':>17} {'ratio':>6}  runs")
    for r in results:
        print(f"{r['size']:>14,} {r['candidates']:>10,} {r['median_s']:>17.3f} {r['median_s'] / base:>6.2f}  "
              + " ".join(f"{t:.3f}" for t in r["seconds"]))
    if args.explain_out:
        args.explain_out.write_text("\n\n".join(
            f"-- {r['size']:,} emails: {name}\n{plan}" for r in results for name, plan in r["plans"].items()
        ))
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "plans"} for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
