"""Sweep time on PostgreSQL against the number of stored emails, with a fixed set of candidates,
and against a backlog of jobs waiting in the broker.

    .venv/bin/python -m bench.sweep --sizes 100000 1000000 --candidates 1000 --repeat 5
    .venv/bin/python -m bench.sweep --backlog 1000000 --repeat 3

For each size it bulk-inserts that many emails (with runs, most of them closed) into a database
of its own, of which `--candidates` need the sweeper: half have no run yet, half have an open run
whose job was lost. It then times full sweeps (the real `mailpipe.operations.sweeper.sweep`, enqueueing to the
local Redis under a key prefix of its own), restoring the candidates between repetitions, and
prints the EXPLAIN (ANALYZE, BUFFERS) of the sweeper's two batch queries. The cost should follow
the candidates, so the time ratio between sizes should stay near 1.

With `--backlog N` it stores N emails without a run and puts a job for each in the broker (the
message a real enqueue publishes, copied with each email's id: the broker holds exactly what
`enqueue_emails` would leave), with their markers, then times full sweeps, none of which may
re-add anything. Beside each sweep it times, in the same run, the floor of any sweep over those
candidates (the keyset scan of the N emails in the database) and the read of the broker alone.
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

from bench import harness
from tests.support.services import delete_prefix


def prepare(size: int, candidates: int) -> str:
    import sqlalchemy

    from mailpipe.storage.migrate import upgrade

    url = harness.database(f"mailpipe_bench_sweep_{size}").create().url

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
        session.execute(
            text("UPDATE email_message SET has_run = false WHERE id >= :f"), {"f": first_no_run}
        )
        session.execute(
            text("UPDATE pipeline_run SET sweep_count = 0, status = 'open' WHERE email_id <= :l"),
            {"l": candidates - no_run},
        )
        session.execute(text("DELETE FROM sweep_report"))
    delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])


def explain(res) -> dict[str, str]:  # type: ignore[no-untyped-def]
    from sqlalchemy import text
    from sqlalchemy.dialects import postgresql

    from mailpipe.operations import sweeper
    from mailpipe.storage.models import utcnow

    plans = {}
    for name, query in (
        ("emails without run", sweeper.emails_without_run(0, 1000)),
        ("open runs (model calls on)", sweeper.open_runs(0, 1000, True, utcnow())),
    ):
        sql = str(
            query.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True})
        )
        with res.db.session() as session:
            rows = session.execute(text("EXPLAIN (ANALYZE, BUFFERS) " + sql)).scalars().all()
        plans[name] = sql + "\n\n" + "\n".join(rows)
    return plans


def resources_on(url: str):  # type: ignore[no-untyped-def]
    """This process's Resources on the database at `url`, with model calls on."""
    os.environ["MAILPIPE_DATABASE_URL"] = url
    from mailpipe import resources
    from mailpipe.settings import get_settings
    from mailpipe.storage import flags

    get_settings.cache_clear()
    resources.reset()
    res = resources.get_resources()
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)
    return res


def measure(size: int, candidates: int, repeat: int) -> dict[str, object]:
    from mailpipe.enqueue import enqueue_emails
    from mailpipe.operations import sweeper

    res = resources_on(prepare(size, candidates))
    times = []
    try:
        for _ in range(repeat):
            restore_candidates(res, size, candidates)
            started = time.perf_counter()
            result = sweeper.sweep(res, lambda ids, task: enqueue_emails(ids, res, task).sent)
            times.append(time.perf_counter() - started)
            assert result.readded_no_run + result.readded_stalled == candidates, result.summary()
        restore_candidates(res, size, candidates)  # explain the queries as a sweep first sees them
        plans = explain(res)
    finally:
        res.close()
        delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])
        harness.database(f"mailpipe_bench_sweep_{size}").drop()
    return {
        "size": size,
        "candidates": candidates,
        "seconds": times,
        "median_s": statistics.median(times),
        "plans": plans,
    }


def prepare_backlog(size: int) -> str:
    import sqlalchemy

    from mailpipe.storage.migrate import upgrade

    url = harness.database(f"mailpipe_bench_backlog_{size}").create().url

    upgrade(url)
    engine = sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO email_message (blob_key, size, sha256, created_at, needs_review, has_run) "
            "SELECT 'raw/' || g, 1000, md5(g::text), now(), false, false "
            "FROM generate_series(1, %(size)s) g",
            {"size": size},
        )
        conn.exec_driver_sql("ANALYZE")
    engine.dispose()
    return url


def fill_broker(res, size: int) -> None:  # type: ignore[no-untyped-def]
    """One job per email in the broker, and its marker, as an enqueue leaves them: the message a
    real publish wrote, with each email's id in its arguments and headers and a task id of its
    own (publishing a million through Celery one by one would take minutes, to the same bytes)."""
    import base64
    import json as jsonlib

    from mailpipe.app.tasks import process_email
    from mailpipe.broker import layout
    from mailpipe.coordination import redis_keys

    queue = layout.priority_lists(res.settings.queue)[0]
    process_email.apply_async((1,))
    template = jsonlib.loads(res.redis.rpop(queue))
    body = jsonlib.loads(base64.b64decode(template["body"]))
    pipe = res.redis.pipeline(transaction=False)
    stamp = f"{time.time():.3f}"
    for email_id in range(1, size + 1):
        task_id = str(uuid.uuid4())
        body[0] = [email_id]
        template["body"] = base64.b64encode(jsonlib.dumps(body).encode()).decode()
        headers = template["headers"]
        headers.update(id=task_id, root_id=task_id, argsrepr=f"({email_id},)")
        headers[layout.EMAIL_ID_HEADER] = email_id
        template["properties"].update(correlation_id=task_id, delivery_tag=str(uuid.uuid4()))
        pipe.lpush(queue, jsonlib.dumps(template))
        pipe.set(redis_keys.job_marker(email_id), stamp, ex=res.settings.dedup_ttl)
        if email_id % 5000 == 0:
            pipe.execute()
    pipe.execute()


def measure_backlog(size: int, repeat: int) -> dict[str, object]:
    from mailpipe.broker import layout
    from mailpipe.enqueue import enqueue_emails
    from mailpipe.operations import sweeper

    res = resources_on(prepare_backlog(size))
    try:
        fill_broker(res, size)
        memory = res.redis.info("memory")["used_memory"]
        rows: dict[str, list[float]] = {"sweep": [], "database floor": [], "broker read": []}
        for _ in range(repeat):
            started = time.perf_counter()
            with res.db.session() as session:
                last = 0
                while ids := list(
                    session.scalars(sweeper.emails_without_run(last, res.settings.sweep_batch_size))
                ):
                    last = ids[-1]
            rows["database floor"].append(time.perf_counter() - started)
            started = time.perf_counter()
            found = layout.emails_in_broker(res.redis, [res.settings.queue])
            rows["broker read"].append(time.perf_counter() - started)
            assert len(found) == size
            started = time.perf_counter()
            result = sweeper.sweep(res, lambda ids, task: enqueue_emails(ids, res, task).sent)
            rows["sweep"].append(time.perf_counter() - started)
            assert (result.readded_no_run, result.readded_stalled, result.skipped_queued) == (
                0,
                0,
                size,
            ), result.summary()
        depth = layout.queue_stats(res.redis, res.settings.queue).depth
        assert depth == size, depth
    finally:
        res.close()
        delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])
        harness.database(f"mailpipe_bench_backlog_{size}").drop()
    return {
        "backlog": size,
        "redis_used_mb": memory / 2**20,
        "seconds": rows,
        "median_s": {name: statistics.median(times) for name, times in rows.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--candidates", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--explain-out", type=Path, help="write the EXPLAIN output here")
    parser.add_argument(
        "--backlog", type=int, help="time sweeps over this many waiting jobs instead"
    )
    args = parser.parse_args()
    os.environ["MAILPIPE_BROKER_URL"] = harness.REDIS_URL
    os.environ["MAILPIPE_REDIS_PREFIX"] = f"benchsweep{uuid.uuid4().hex[:8]}:"
    if args.backlog:
        r = measure_backlog(args.backlog, args.repeat)
        floor = r["median_s"]["database floor"]
        print(
            f"{r['backlog']:,} jobs waiting in the broker ({r['redis_used_mb']:.0f} MB in Redis); "
            "every sweep re-added 0"
        )
        print(f"{'':>15} {'median (s)':>11} {'x floor':>8}  runs")
        for name, times in r["seconds"].items():
            print(
                f"{name:>15} {r['median_s'][name]:>11.2f} {r['median_s'][name] / floor:>8.2f}  "
                + " ".join(f"{t:.2f}" for t in times)
            )
        if args.json:
            args.json.write_text(json.dumps(r, indent=2))
        return 0
    results = [measure(size, args.candidates, args.repeat) for size in args.sizes]
    base = results[0]["median_s"]
    print(f"{'stored emails':>14} {'candidates':>10} {'median sweep (s)':>17} {'ratio':>6}  runs")
    for r in results:
        print(
            f"{r['size']:>14,} {r['candidates']:>10,} {r['median_s']:>17.3f} {r['median_s'] / base:>6.2f}  "
            + " ".join(f"{t:.3f}" for t in r["seconds"])
        )
    if args.explain_out:
        args.explain_out.write_text(
            "\n\n".join(
                f"-- {r['size']:,} emails: {name}\n{plan}"
                for r in results
                for name, plan in r["plans"].items()
            )
        )
    if args.json:
        args.json.write_text(
            json.dumps([{k: v for k, v in r.items() if k != "plans"} for r in results], indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
