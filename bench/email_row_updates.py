"""What the two updates a job makes to its `email_message` row cost PostgreSQL, on the schema of
each checkout: WAL records and bytes, buffers touched and execution time, from
`EXPLAIN (ANALYZE, WAL, BUFFERS)`, which counts one statement's own work whatever else the server
runs (the WAL bytes and records are the same on any machine).

    .venv/bin/python -m bench.email_row_updates --src DIR [--src DIR ...] [--rows 1000]
                                                [--without-indexes NAME,NAME ...]

Each `--src` is a mailpipe checkout whose own `mailpipe db upgrade` makes the schema of a
database of its own. `--without-indexes` (repeatable): one more schema, the last `--src`'s with
those indexes dropped. In each, `--rows` emails are inserted as ingest stores them (no subject,
sender or origin yet) with one origin each, then for each email, in turn, the two statements a
plain job sends to its row, as SQL of the same shape:

- the flag: `has_run` set at the run's first claim (mailpipe.pipeline.runs, `_FLAG_HAS_RUN`);
- the link: the origin, the subject and the sender set by the origin step
  (mailpipe.pipeline.origin, `link_to_origin`).

Also printed: how many of the updates were HOT (PostgreSQL wrote no index entry for them).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import psycopg

from bench import harness

RUN = uuid.uuid4().hex[:8]

FLAG = "UPDATE email_message SET has_run = true WHERE id = %s AND has_run IS false"
LINK = (
    "UPDATE email_message SET origin_id = %s, duplicate_of = NULL, subject = %s, sender = %s "
    "WHERE id = %s"
)


def _statements(email_id: int) -> list[tuple[str, str, tuple[object, ...]]]:
    subject = f"Invoice {email_id} for the quarter, amount due"
    sender = f"Billing Team <billing{email_id % 50}@acme.example>"
    return [("flag", FLAG, (email_id,)), ("link", LINK, (email_id, subject, sender, email_id))]


def measure(url: str, rows: int) -> dict[str, object]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO email_message (blob_key, size, sha256, received_at, created_at) "
            "SELECT 'k' || g, 100, md5(g::text), now(), now() FROM generate_series(1, %s) g",
            (rows,),
        )
        conn.execute(
            "INSERT INTO email_origin (fingerprint, message_id, first_email_id, created_at) "
            "SELECT md5(g::text), 's' || g || '@acme', g, now() FROM generate_series(1, %s) g",
            (rows,),
        )
        seen: dict[str, list[tuple[float, float, float, float]]] = {"flag": [], "link": []}
        for email_id in range(1, rows + 1):
            for name, sql, args in _statements(email_id):
                row = conn.execute(
                    "EXPLAIN (ANALYZE, WAL, BUFFERS, FORMAT JSON) " + sql,
                    args,
                ).fetchone()
                assert row is not None
                plan = row[0][0]
                top = plan["Plan"]
                blocks = sum(top[k] for k in ("Shared Hit Blocks", "Shared Read Blocks"))
                seen[name].append(
                    (top["WAL Records"], top["WAL Bytes"], blocks, plan["Execution Time"])
                )
    # A backend's table statistics reach the views when it disconnects at the latest.
    time.sleep(0.5)
    with psycopg.connect(url, autocommit=True) as conn:
        found = conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
            "WHERE relname = 'email_message'"
        ).fetchone()
    assert found is not None
    result: dict[str, object] = {
        name: {
            "wal_records": statistics.mean(r[0] for r in runs),
            "wal_bytes": statistics.mean(r[1] for r in runs),
            "blocks": statistics.mean(r[2] for r in runs),
            "execution_us_median": statistics.median(r[3] for r in runs) * 1000,
        }
        for name, runs in seen.items()
    }
    result["updates"], result["hot"] = found
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--src", type=Path, action="append", required=True)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--without-indexes", action="append", default=[])
    args = parser.parse_args()
    schemas: list[tuple[str, Path, list[str]]] = []
    for i, src in enumerate(s.resolve() for s in args.src):
        name = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        schemas.append((name or f"src{i}", src, []))
    for dropped in args.without_indexes:
        last = schemas[len(args.src) - 1]
        schemas.append((f"{last[0]} without {dropped}", last[1], dropped.split(",")))
    print(f"machine: {harness.machine()}")
    print("\n| schema | statement | WAL records | WAL bytes | buffers | execution µs (median) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    hot = []
    for n, (name, src, dropped) in enumerate(schemas):
        database = harness.database(f"mailpipe_bench_rows_{RUN}_{n}").create()
        try:
            env = {
                **harness.env_without_settings(),
                "MAILPIPE_DATABASE_URL": database.url,
                "PYTHONPATH": str(src),
            }
            harness.run_mailpipe(src, env, "db", "upgrade")
            with psycopg.connect(database.url, autocommit=True) as conn:
                for index in dropped:
                    conn.execute(f'DROP INDEX "{index}"')
            found = measure(database.url, args.rows)
        finally:
            database.drop()
        for statement in ("flag", "link"):
            s = found[statement]
            print(
                f"| {name} | {statement} | {s['wal_records']:.2f} | {s['wal_bytes']:.0f} | "  # type: ignore[index]
                f"{s['blocks']:.1f} | {s['execution_us_median']:.0f} |",  # type: ignore[index]
                flush=True,
            )
        hot.append(f"{name}: {found['hot']} of {found['updates']} updates HOT")
    print("\n" + "\n".join(hot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
