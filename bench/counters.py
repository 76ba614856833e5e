"""Client-side counters of SQL statements and Redis commands, for bench/profile_job.py.

`install()` counts, in this process and the processes it forks later:
- every statement SQLAlchemy sends to a database (`before_cursor_execute` on every Engine),
  by verb and table;
- every Redis command redis-py sends through `Redis.execute_command` and pipelines (each command
  of a pipeline counted on its own, and the pipeline as one round trip).

Loaded into a benchmark worker with `-I bench.counters`, it also writes each process's counts to
`$MAILPIPE_BENCH_COUNTS_DIR/<pid>.json` after every task.
Commands kombu sends on a raw connection (its BRPOP) bypass redis-py's client and are not
counted here: the Redis server's own INFO commandstats covers them.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

SQL: Counter[str] = Counter()
REDIS: Counter[str] = Counter()
ROUND_TRIPS: Counter[str] = Counter()
_installed = False

_TABLE = re.compile(
    r"^\s*(?:(SELECT).*?\bFROM\s+(\w+)|(INSERT)\s+INTO\s+(\w+)|(UPDATE)\s+(\w+)"
    r"|(DELETE)\s+FROM\s+(\w+)"
    r"|(\w+))",
    re.IGNORECASE | re.DOTALL,
)


def _sql_kind(statement: str) -> str:
    found = _TABLE.match(statement)
    if not found:
        return "other"
    groups = [g for g in found.groups() if g]
    return " ".join(groups[:2]).upper() if len(groups) > 1 else groups[0].upper()


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    from redis.client import Pipeline, Redis
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "before_cursor_execute")
    def _count_sql(conn, cursor, statement, *_):  # type: ignore[no-untyped-def]
        SQL[_sql_kind(statement)] += 1

    @event.listens_for(Engine, "begin")
    def _count_begin(conn):  # type: ignore[no-untyped-def]
        SQL["BEGIN (implicit)"] += 1

    @event.listens_for(Engine, "commit")
    def _count_commit(conn):  # type: ignore[no-untyped-def]
        SQL["COMMIT"] += 1

    @event.listens_for(Engine, "rollback")
    def _count_rollback(conn):  # type: ignore[no-untyped-def]
        SQL["ROLLBACK"] += 1

    original_execute_command = Redis.execute_command
    original_pipeline_execute = Pipeline.execute

    def execute_command(self, *args, **options):  # type: ignore[no-untyped-def]
        if not isinstance(self, Pipeline):
            REDIS[str(args[0]).upper()] += 1
            ROUND_TRIPS["command"] += 1
        return original_execute_command(self, *args, **options)

    def pipeline_execute(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        for command_args, _options in self.command_stack:
            REDIS[str(command_args[0]).upper()] += 1
        ROUND_TRIPS["pipeline"] += 1
        return original_pipeline_execute(self, *args, **kwargs)

    Redis.execute_command = execute_command  # type: ignore[method-assign]
    Pipeline.execute = pipeline_execute  # type: ignore[method-assign]


def snapshot() -> dict[str, dict[str, int]]:
    return {"sql": dict(SQL), "redis": dict(REDIS), "round_trips": dict(ROUND_TRIPS)}


def reset() -> None:
    SQL.clear()
    REDIS.clear()
    ROUND_TRIPS.clear()


def _dump(**_: object) -> None:
    folder = os.environ.get("MAILPIPE_BENCH_COUNTS_DIR")
    if folder:
        path = Path(folder) / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(snapshot()))
        os.replace(tmp, path)


if os.environ.get("MAILPIPE_BENCH_COUNTS_DIR"):
    # Loaded into a worker (-I bench.counters): count from the start, dump after every task.
    from celery.signals import task_postrun, worker_process_init

    install()
    task_postrun.connect(_dump, weak=False)

    @worker_process_init.connect(weak=False)
    def _fresh_counts(**_: object) -> None:
        reset()
