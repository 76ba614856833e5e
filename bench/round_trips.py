"""What one round trip to PostgreSQL and to Redis costs this machine's CPUs, client and server.

    .venv/bin/python -m bench.round_trips [--calls 4000] [--repeat 5] [--json FILE]

A plain email's job makes 12 PostgreSQL round trips (8 statements, and the BEGIN and COMMIT of
its two transactions) and 2 Redis ones (its lease taken and given back), each a send, a wait and
a receive over loopback TCP. Each variant below times `--calls` round trips that do no work of
their own, by the CPU time of the calling process and of the server process that answers it (the
connection's PostgreSQL backend; redis-server when it runs on this machine); repetitions are
interleaved, figures are medians in µs per round trip:

- postgres: `SELECT 1` on a psycopg connection in autocommit, the driver alone;
- sqlalchemy: the same statement as a Core `select` through a `Session` of mailpipe's own
  `Database` (the engine a job uses), in one transaction: the driver and SQLAlchemy's execution
  path, as a job's statements take it;
- redis: `PING` on a redis-py client built as mailpipe's (`Resources.redis`).

The PostgreSQL server is the benchmarks' (`MAILPIPE_BENCH_PG_ADMIN_URL`, its own database), the
Redis server `MAILPIPE_BENCH_REDIS_URL`; nothing is written to either.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import psycopg
from redis import Redis
from sqlalchemy import literal, select

from bench import harness
from mailpipe.storage.db import Database

# One measurement: (client µs, server µs) per call, the server's None when it is not measurable.
Cost = tuple[float, float | None]


def measure(call: Callable[[], object], server: psutil.Process | None, calls: int) -> Cost:
    call()  # a first call outside the count: a prepared statement, a connection's first use
    server_before = sum(server.cpu_times()[:2]) if server else 0.0
    started = time.process_time()
    for _ in range(calls):
        call()
    client = time.process_time() - started
    server_used = sum(server.cpu_times()[:2]) - server_before if server else None
    return 1e6 * client / calls, None if server_used is None else 1e6 * server_used / calls


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    pg = psycopg.connect(harness.PG_ADMIN_URL, autocommit=True)
    database = Database(harness.PG_ADMIN_URL)
    session = database.session()
    session.begin()
    redis = Redis.from_url(harness.REDIS_URL, socket_timeout=10, socket_connect_timeout=5)
    one = select(literal(1))

    pg_backend = pg.execute("SELECT pg_backend_pid()").fetchone()
    sql_backend = session.connection().exec_driver_sql("SELECT pg_backend_pid()").scalar()
    assert pg_backend is not None and sql_backend is not None
    variants: dict[str, tuple[Callable[[], object], psutil.Process | None]] = {
        "postgres": (lambda: pg.execute("SELECT 1").fetchone(), psutil.Process(pg_backend[0])),
        "sqlalchemy": (lambda: session.execute(one).scalar(), psutil.Process(sql_backend)),
        "redis": (redis.ping, harness.local_redis_server(redis)),
    }
    runs: dict[str, list[Cost]] = {name: [] for name in variants}
    try:
        for repetition in range(args.repeat):
            for name in harness.rotated(list(variants), repetition):
                call, server = variants[name]
                runs[name].append(measure(call, server, args.calls))
    finally:
        session.rollback()
        session.close()
        database.dispose()
        pg.close()
        redis.close()

    print(f"{args.calls} round trips per measurement, {args.repeat} measurements, medians")
    print(f"{'':>12} {'client µs':>10} {'server µs':>10} {'total µs':>10}")
    summary: dict[str, dict[str, float | None]] = {}
    for name, costs in runs.items():
        client = statistics.median(c for c, _ in costs)
        servers = [s for _, s in costs if s is not None]
        server = statistics.median(servers) if servers else None
        total = client + (server or 0.0)
        summary[name] = {"client_us": client, "server_us": server, "total_us": total}
        shown = "-" if server is None else f"{server:.0f}"
        print(f"{name:>12} {client:>10.0f} {shown:>10} {total:>10.0f}")
    if args.json:
        args.json.write_text(
            json.dumps({"machine": harness.machine(), "medians": summary, "runs": runs}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
