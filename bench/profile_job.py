"""The CPU stage's job of two checkouts side by side: time per job, a cProfile of the same jobs,
and the SQL statements and Redis commands each job sends.

    .venv/bin/python -m bench.profile_job --src DIR [--src DIR ...] [--workload plain|mixed]
                                          [--jobs 400] [--pairs 4] [--out DIR]

Each `--src` is a mailpipe checkout (this one is `.`; another one made with
`git worktree add DIR <commit>`). A checkout is only ever run, never imported here, as
bench/throughput.py runs its baseline: its own `mailpipe db upgrade`, `mailpipe model-calls on`
and `mailpipe ingest` on a PostgreSQL database of its own, then a child process started in DIR
with DIR first on PYTHONPATH that runs `mailpipe.pipeline.job.process_email(res, email_id)` in a
loop with `Resources.for_jobs(Settings())`, as a worker's child builds them. Redis is a private
`redis-server` on a free port, so that `INFO commandstats` counts the job alone.

Per checkout, over the same emails (`bench.workload`, PostgreSQL, local blobs, model calls on with
the `rules` classifier):

- time: `--pairs` children of `--jobs` jobs each, the checkouts alternating (the first of each
  pair changes every time); each child's median wall and CPU time per job (after a warm-up of
  20 jobs) and the CPU its PostgreSQL backends used per job, and the paired ratios;
- counts: the statements by verb and table, the transactions, and the Redis commands by name,
  per job;
- profile: cProfile over `--jobs` jobs, timed in CPU time (the machine may be shared; waiting on
  the services is theirs), written as `<out>/<name>.pstats`, and a table of the functions whose
  cumulative CPU time per job differs most between the first two checkouts.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench import harness

RUN = uuid.uuid4().hex[:8]
WARM_UP = 20

# The child: run in the checkout's folder, with its mailpipe first on the path.
CHILD = r"""
import cProfile, json, os, re, sys, time
from collections import Counter

import psutil
from redis import Redis
from sqlalchemy import event, text

from mailpipe.pipeline.job import process_email
from mailpipe.resources import Resources
from mailpipe.settings import Settings

mode, first, last, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
res = Resources.for_jobs(Settings())
with res.db.session() as session:
    ids = [row[0] for row in session.execute(
        __import__("sqlalchemy").text("SELECT id FROM email_message ORDER BY id")
    )]
ids = ids[first:last]
outcomes = Counter()
for email_id in ids[:WARM_UP]:
    outcomes[process_email(res, email_id).kind.value] += 1
ids = ids[WARM_UP:]
result = {"jobs": len(ids)}


def backends_cpu():
    # CPU seconds so far of the PostgreSQL backends serving this database (this process's)
    with res.db.session() as session:
        pids = session.execute(text(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        )).scalars().all()
    used = {}
    for pid in pids:
        try:
            used[pid] = sum(psutil.Process(pid).cpu_times()[:2])
        except psutil.Error:
            pass
    return used


if mode == "time":
    wall, cpu = [], []
    pg_before = backends_cpu()
    started = time.process_time()
    for email_id in ids:
        w, c = time.perf_counter(), time.process_time()
        outcomes[process_email(res, email_id).kind.value] += 1
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    cpu_all = time.process_time() - started
    pg_after = backends_cpu()
    pg = sum(used - pg_before.get(pid, 0.0) for pid, used in pg_after.items())
    result |= {"wall": wall, "cpu": cpu, "cpu_all": cpu_all, "postgres": pg}
elif mode == "profile":
    # CPU time, not wall time: the machine is shared, and waits are the services' own.
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for email_id in ids:
        outcomes[process_email(res, email_id).kind.value] += 1
    profiler.disable()
    profiler.dump_stats(out)
else:
    statements = Counter()
    verb_table = re.compile(r"^\s*(INSERT INTO|UPDATE|DELETE FROM)\s+(\w+)", re.S)

    def on_statement(_conn, _cursor, statement, *_):
        if statement.lstrip().startswith(("SELECT", "WITH")):
            table = re.search(r"\bFROM\s+(\w+)", statement)
            statements[f"SELECT {table.group(1) if table else '?'}"] += 1
        else:
            found = verb_table.match(statement)
            statements[" ".join(found.groups()) if found else statement.split()[0]] += 1

    def on_begin(_conn):
        statements["(transactions)"] += 1

    event.listen(res.db.engine, "before_cursor_execute", on_statement)
    event.listen(res.db.engine, "begin", on_begin)
    meter = Redis.from_url(os.environ["MAILPIPE_BROKER_URL"])
    meter.config_resetstat()
    for email_id in ids:
        outcomes[process_email(res, email_id).kind.value] += 1
    stats = meter.info("commandstats")
    commands = {
        name.removeprefix("cmdstat_"): value["calls"]
        for name, value in stats.items()
        if name not in ("cmdstat_info", "cmdstat_config|resetstat", "cmdstat_config")
    }
    result |= {"statements": dict(statements), "redis": commands}
result["outcomes"] = dict(outcomes)
res.close()
with open(out + ".json", "w") as f:
    json.dump(result, f)
""".replace("WARM_UP", str(WARM_UP))


TABLES = (
    "pipeline_run",
    "run_attempt",
    "email_message",
    "email_origin",
    "classification",
    "email_label",
)


class Checkout:
    def __init__(
        self,
        src: Path,
        name: str,
        redis_url: str,
        work: Path,
        emails: list[bytes],
        without: tuple[str, ...] = (),
    ):
        self.src, self.name = src, name
        self.database = harness.database(f"mailpipe_bench_pj_{RUN}_{name}")
        self.prefix = f"benchpj{RUN}{name}:"
        self.env = {
            **harness.env_without_settings(),
            **harness.base_env(
                database_url=self.database.create().url,
                prefix=self.prefix,
                blob_url=f"file://{work / ('blobs-' + name)}",
                PYTHONPATH=str(src),
            ),
            "MAILPIPE_BROKER_URL": redis_url,
        }
        harness.run_mailpipe(src, self.env, "db", "upgrade")
        if without:
            import psycopg

            with psycopg.connect(self.database.url, autocommit=True) as conn:
                for index in without:
                    conn.execute(f'DROP INDEX "{index}"')
        harness.run_mailpipe(src, self.env, "model-calls", "on")
        harness.ingest(src, self.env, harness.write_emails(work / "emails", emails), len(emails))

    def child(self, mode: str, first: int, last: int, out: Path) -> dict:
        subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(first), str(last), str(out)],
            env=self.env,
            cwd=self.src,
            check=True,
        )
        return json.loads(Path(f"{out}.json").read_text())

    def writes(self) -> dict[str, Any]:
        """What every job run on this checkout's database wrote: each table's rows inserted and
        updated, the updates that were HOT (no index entry written), and each index's size."""
        import psycopg

        with psycopg.connect(self.database.url, autocommit=True) as conn:
            tables = {
                name: {"ins": ins, "upd": upd, "hot": hot}
                for name, ins, upd, hot in conn.execute(
                    "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
                    " WHERE relname = ANY(%s)",
                    (list(TABLES),),
                )
            }
            indexes: dict[str, int] = dict(
                conn.execute(
                    "SELECT indexrelname, pg_relation_size(indexrelid) FROM pg_stat_user_indexes"
                    " WHERE relname = ANY(%s) ORDER BY relname, indexrelname",
                    (list(TABLES),),
                ).fetchall()
            )
        return {"tables": tables, "indexes": indexes}


def _function_key(func: tuple[str, int, str], srcs: list[Path]) -> str:
    """A function named by its file relative to its checkout (or its library), without the
    line, so that the same function of two checkouts has the same key."""
    path, _, name = func
    for src in srcs:
        if path.startswith(str(src) + "/"):
            path = path[len(str(src)) + 1 :]
            break
    else:
        path = re.sub(r"^.*/site-packages/", "", path)
    return f"{path}:{name}"


def profile_table(files: dict[str, Path], srcs: list[Path], jobs: int, limit: int = 40) -> str:
    """Cumulative and own µs per job, and calls per job, of every function in each profile, the
    largest differences first."""
    tables: dict[str, dict[str, tuple[float, float, float]]] = {}
    for name, path in files.items():
        stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
        table: dict[str, list[float]] = {}
        for func, (_cc, nc, tt, ct, _callers) in stats.items():
            row = table.setdefault(_function_key(func, srcs), [0.0, 0.0, 0.0])
            row[0] += ct / jobs * 1e6
            row[1] += tt / jobs * 1e6
            row[2] += nc / jobs
        tables[name] = {k: (a, b, c) for k, (a, b, c) in table.items()}
    a, b = list(tables)[:2]
    keys = set(tables[a]) | set(tables[b])
    zero = (0.0, 0.0, 0.0)

    def diff(key: str) -> float:
        return tables[b].get(key, zero)[0] - tables[a].get(key, zero)[0]

    lines = [
        f"| function | cum µs/job {a} | cum µs/job {b} | Δ | own µs/job {a} | own µs/job {b} "
        f"| calls/job {a} | calls/job {b} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in sorted(keys, key=lambda k: -abs(diff(k)))[:limit]:
        ra, rb = tables[a].get(key, zero), tables[b].get(key, zero)
        lines.append(
            f"| {key} | {ra[0]:.0f} | {rb[0]:.0f} | {diff(key):+.0f} | {ra[1]:.0f} | {rb[1]:.0f} "
            f"| {ra[2]:.2f} | {rb[2]:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    from bench.workload import mixed_workload, plain_workload
    from mailpipe.cli.demo.servers import PrivateRedis

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--src", type=Path, action="append", required=True)
    parser.add_argument("--workload", choices=("mixed", "plain"), default="plain")
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--without-indexes",
        help="comma-separated index names: one more checkout, the last --src with these indexes "
        "dropped after its migrations",
    )
    args = parser.parse_args()
    srcs = [src.resolve() for src in args.src]
    names = [
        subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        or f"src{i}"
        for i, src in enumerate(srcs)
    ]
    if len(set(names)) < len(names):
        names = [f"{name}{i}" for i, name in enumerate(names)]
    without: list[tuple[str, ...]] = [()] * len(srcs)
    if args.without_indexes:
        srcs.append(srcs[-1])
        names.append(f"{names[-1]}_without")
        without.append(tuple(args.without_indexes.split(",")))
    work = Path(tempfile.mkdtemp(prefix="mailpipe-profile-job-"))
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    per_child = args.jobs + WARM_UP
    slices = args.pairs + 2  # the timed children, the counts, the profile
    workload = mixed_workload if args.workload == "mixed" else plain_workload
    emails, kinds = workload(per_child * slices, seed=args.seed)
    print(f"machine: {harness.machine()}")
    print(f"workload: {kinds}; {args.jobs} jobs per child after {WARM_UP} to warm up")
    redis = PrivateRedis(work / "redis").start()
    checkouts: list[Checkout] = []
    try:
        for src, name, dropped in zip(srcs, names, without, strict=True):
            shutil.rmtree(work / "emails", ignore_errors=True)
            checkouts.append(Checkout(src, name, redis.url, work, emails, dropped))
        times: dict[str, list[tuple[float, float, float]]] = {c.name: [] for c in checkouts}
        for pair in range(args.pairs):
            order = checkouts[pair % len(checkouts) :] + checkouts[: pair % len(checkouts)]
            for c in order:
                found = c.child("time", pair * per_child, (pair + 1) * per_child, work / "t")
                wall = statistics.median(found["wall"]) * 1e6
                cpu = statistics.median(found["cpu"]) * 1e6
                pg = found["postgres"] / found["jobs"] * 1e6
                times[c.name].append((wall, cpu, pg))
                print(
                    f"pair {pair} {c.name}: median µs/job wall {wall:.0f} CPU {cpu:.0f}; "
                    f"PostgreSQL backends' CPU µs/job {pg:.0f} {found['outcomes']}",
                    flush=True,
                )
        summary: dict[str, object] = {"times": times}
        first = args.pairs * per_child
        counts: dict[str, Any] = {}
        for c in checkouts:
            found = c.child("count", first, first + per_child, work / "c")
            jobs = found["jobs"]
            counts[c.name] = {
                "statements": {k: v / jobs for k, v in sorted(found["statements"].items())},
                "redis": {k: v / jobs for k, v in sorted(found["redis"].items())},
                "outcomes": found["outcomes"],
            }
        summary["counts"] = counts
        profiles = {}
        for c in checkouts:
            path = out / f"{c.name}.pstats"
            c.child("profile", first + per_child, first + 2 * per_child, path)
            profiles[c.name] = path
        jobs_run = len(emails)
        writes = {c.name: c.writes() for c in checkouts}
        summary["writes"] = writes
    finally:
        for c in checkouts:
            c.database.drop()
        redis.stop()
        shutil.rmtree(work / "emails", ignore_errors=True)
        for c in checkouts:
            shutil.rmtree(work / f"blobs-{c.name}", ignore_errors=True)

    print(
        "\n| checkout | wall µs/job | CPU µs/job | PostgreSQL CPU µs/job | "
        "wall, CPU, PostgreSQL vs the first (paired) |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    base = times[names[0]]
    for name in names:
        medians = [statistics.median(t[i] for t in times[name]) for i in range(3)]
        paired = [
            statistics.median(t[i] / b[i] for t, b in zip(times[name], base, strict=True))
            for i in range(3)
        ]
        print(
            f"| {name} | {medians[0]:.0f} | {medians[1]:.0f} | {medians[2]:.0f} | "
            + ", ".join(f"{r:.3f}" for r in paired)
            + " |"
        )
    for kind in ("statements", "redis"):
        print(f"\n| {kind} per job | " + " | ".join(names) + " |")
        print("| --- |" + " ---: |" * len(names))
        keys = sorted({k for c in counts.values() for k in c[kind]})
        for key in keys:
            print(
                f"| {key} | "
                + " | ".join(f"{counts[n][kind].get(key, 0):.2f}" for n in names)
                + " |"
            )
        print(
            "| all | "
            + " | ".join(
                f"{sum(v for k, v in counts[n][kind].items() if not k.startswith('(')):.2f}"
                for n in names
            )
            + " |"
        )
    print(f"\n| rows per job ({jobs_run} jobs) | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for table in TABLES:
        cells = []
        for n in names:
            t = writes[n]["tables"].get(table, {"ins": 0, "upd": 0, "hot": 0})
            cells.append(
                f"{t['ins'] / jobs_run:.2f} ins, {t['upd'] / jobs_run:.2f} upd "
                f"({t['hot'] / jobs_run:.2f} HOT)"
            )
        print(f"| {table} | " + " | ".join(cells) + " |")
    print("\n| index bytes per job | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    all_indexes = sorted({i for n in names for i in writes[n]["indexes"]})
    for index in all_indexes:
        print(
            f"| {index} | "
            + " | ".join(
                f"{writes[n]['indexes'][index] / jobs_run:.0f}"
                if index in writes[n]["indexes"]
                else "-"
                for n in names
            )
            + " |"
        )
    print(
        "| all | "
        + " | ".join(f"{sum(writes[n]['indexes'].values()) / jobs_run:.0f}" for n in names)
        + " |"
    )
    if len(names) > 1:
        print(f"\n{profile_table(profiles, srcs, args.jobs)}")
    print(f"\nprofiles: {', '.join(str(p) for p in profiles.values())}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.update(harness.env_without_settings())
    sys.exit(main())
