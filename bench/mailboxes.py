"""The mailboxes with waiting work on a large database: status's top ten and the report's
OldestMailboxWaitSeconds, each one grouped statement.

    .venv/bin/python -m bench.mailboxes --emails 1000000 --mailboxes 100000 --repeat 20

Seeds a database of its own (INSERT ... SELECT generate_series): `--emails` emails spread over
`--mailboxes` mailboxes by a hash of the id (one of them the default mailbox, NULL), and one
flood mailbox holding a tenth of all; one in ten emails in the bulk lane. Every email waits: half with
an open run (a third of those at the model stage), half with no run yet, so every mailbox has
waiting work. Then times each function `--repeat` times after one call that warms the plans and
the cache, and prints p50 and p99 in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import time

from bench import harness
from bench.console import percentiles
from bench.sweep import resources_on

DB_NAME = "mailpipe_bench_mailboxes"


def prepare(emails: int, mailboxes: int) -> str:
    import sqlalchemy

    from mailpipe.storage.migrate import upgrade

    url = harness.database(DB_NAME).create().url
    upgrade(url)
    engine = sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    given = {"emails": emails, "mailboxes": mailboxes}
    with engine.begin() as conn:
        # Every tenth email is the flood's; the others go to mailboxes by a hash of the id,
        # mailbox 0 being the default one (NULL). Stored over the last day.
        conn.exec_driver_sql(
            "INSERT INTO email_message (blob_key, size, sha256, created_at, has_run, lane, "
            "mailbox) SELECT 'raw/' || g, 1000, md5(g::text), "
            "now() - ((%(emails)s - g) %% 86400) * interval '1 second', g %% 2 = 0, "
            "CASE WHEN g %% 10 = 3 THEN 'bulk' ELSE 'live' END, "
            "CASE WHEN g %% 10 = 0 THEN 'flood@example.com' "
            "WHEN h = 0 THEN NULL ELSE 'mailbox-' || h || '@example.com' END "
            "FROM generate_series(1, %(emails)s) g, "
            "LATERAL (SELECT abs(hashint4(g)) %% %(mailboxes)s AS h) m",
            given,
        )
        conn.exec_driver_sql(
            "INSERT INTO pipeline_run (email_id, status, attempts, sweep_count, created_at, "
            "updated_at, converted_at) SELECT id, 'open'::run_status, 1, 0, created_at, "
            "created_at, CASE WHEN id %% 3 = 0 THEN created_at + interval '1 second' END "
            "FROM email_message WHERE has_run"
        )
    # What autovacuum does to a table loaded so: statistics, and the visibility map.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")
    engine.dispose()
    return url


def measure(emails: int, mailboxes: int, repeat: int) -> dict[str, object]:
    from mailpipe.operations.waiting import oldest_mailbox_waits, top_mailboxes
    from mailpipe.storage.models import utcnow

    res = resources_on(prepare(emails, mailboxes))
    try:
        with res.db.reading() as session:
            found = top_mailboxes(session, utcnow())
            waits = oldest_mailbox_waits(session, utcnow())
            timings = {}
            for name, call in (
                ("top_mailboxes", lambda: top_mailboxes(session, utcnow())),
                ("oldest_mailbox_waits", lambda: oldest_mailbox_waits(session, utcnow())),
            ):
                times = []
                for _ in range(repeat):
                    started = time.perf_counter()
                    call()
                    times.append((time.perf_counter() - started) * 1000)
                timings[name] = percentiles(times)
    finally:
        res.db.engine.dispose()
        harness.database(DB_NAME).drop()
    return {
        "emails": emails,
        "mailboxes_waiting": found.mailboxes,
        "top": found.top[0].mailbox,
        "waits": {f"{stage}/{lane}": age for (stage, lane), age in waits.items()},
        **timings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emails", type=int, default=1_000_000)
    parser.add_argument("--mailboxes", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(json.dumps(measure(args.emails, args.mailboxes, args.repeat), indent=2))


if __name__ == "__main__":
    main()
