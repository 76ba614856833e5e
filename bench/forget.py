"""`mailpipe forget --sender` of every email from one address: 10,000 among 200,000 emails on
PostgreSQL, with their blobs in a local blob folder.

    .venv/bin/python -m bench.forget --emails 200000 --forgotten 10000

It seeds a database of its own with SQL: emails 1..N, every (N / forgotten)-th from the one
sender, each with its origin, a succeeded run, two attempts (the CPU stage handed off, the model
stage succeeded), a classification, two labels and a document; each email of the sender also has
its raw email and its document's text as files in a temporary blob folder (the others' blobs are
never read by forget). It then times, in this process, the dry run and the forget itself through
`mailpipe.operations.actions.forget` (what `mailpipe forget --sender ADDRESS --yes` runs, in
batches of 500), and checks that nothing of the sender is left and everything else is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from bench import harness
from tests.support.services import delete_prefix

if TYPE_CHECKING:
    from mailpipe.resources import Resources

SENDER = "bob@acme.example"


def seed(url: str, emails: int, every: int) -> list[tuple[int, str]]:
    """The emails and their rows; returns each chosen email's id and raw blob key."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    given = {"n": emails, "every": every}
    hex64 = "md5(g::text) || md5((g + 1)::text)"
    chosen = "g %% %(every)s = 0"
    statements = [
        "INSERT INTO email_message (id, blob_key, size, sha256, received_at, created_at, "
        "needs_review, has_run, sender, subject, lane) "
        f"SELECT g, 'raw/' || left({hex64}, 2) || '/' || {hex64} || '.eml', 2000, {hex64}, "
        "now() - g * interval '1 second', now(), false, true, "
        f"CASE WHEN {chosen} THEN 'Bob <{SENDER}>' ELSE 'Person ' || g || ' <p' || g || "
        "'@example.org>' END, 'Invoice ' || g, 'live' FROM generate_series(1, %(n)s) g",
        "INSERT INTO email_origin (id, fingerprint, message_id, first_email_id, created_at) "
        f"SELECT g, {hex64}, g || '@example.org', g, now() FROM generate_series(1, %(n)s) g",
        "UPDATE email_message SET origin_id = id",
        "INSERT INTO pipeline_run (id, email_id, status, attempts, claims, cutoffs, sweep_count, "
        "converted_at, classified_at, created_at, updated_at, closed_at) "
        "SELECT g, g, 'succeeded', 1, 2, 0, 0, now(), now(), now(), now(), now() "
        "FROM generate_series(1, %(n)s) g",
        "INSERT INTO run_attempt (run_id, email_id, stage, attempt, started_at, ended_at, outcome, "
        "host) SELECT g, g, s.stage, 1, now(), now(), s.outcome, 'bench' "
        "FROM generate_series(1, %(n)s) g, (VALUES ('cpu', 'handed_off'), ('model', 'succeeded')) "
        "AS s(stage, outcome)",
        "INSERT INTO classification (run_id, email_id, model_id, prompt_version, output, labels, "
        "input_tokens, output_tokens, latency_ms, created_at) SELECT g, g, 'bench', 'v1', "
        '\'{"labels": ["invoice"]}\', \'[["invoice", 0.9]]\', 500, 20, 300, now() '
        "FROM generate_series(1, %(n)s) g",
        "INSERT INTO email_label (email_id, label, source, confidence, created_at) "
        "SELECT g, l, 'model', 0.9, now() FROM generate_series(1, %(n)s) g, "
        "(VALUES ('invoice'), ('support')) AS l(l)",
        "INSERT INTO document (email_id, part_index, filename, content_type, size, sha256, status, "
        "text, text_blob_key, page_count, updated_at) SELECT g, 0, 'invoice.pdf', "
        f"'application/pdf', 50000, {hex64}, 'converted', "
        f"CASE WHEN {chosen} THEN NULL ELSE 'Amount due' END, "
        f"CASE WHEN {chosen} THEN 'text/' || g || '/0.txt' END, 1, now() "
        "FROM generate_series(1, %(n)s) g",
    ]
    with engine.begin() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement, given)
        for table in ("email_message", "email_origin", "pipeline_run"):
            conn.exec_driver_sql(
                f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), %(n)s)", given
            )
        conn.exec_driver_sql("ANALYZE")
        keys = conn.exec_driver_sql(
            "SELECT id, blob_key FROM email_message WHERE id %% %(every)s = 0", given
        ).all()
    engine.dispose()
    return [(email_id, key) for email_id, key in keys]


def write_blobs(folder: Path, keys: list[tuple[int, str]]) -> None:
    for email_id, key in keys:
        for name, data in (
            (key, b"From: Bob\r\n\r\nhi\r\n"),
            (f"text/{email_id}/0.txt", b"x" * 70_000),
        ):
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def counts(res: Resources) -> dict[str, int]:
    from sqlalchemy import text

    with res.db.session() as session:
        return {
            table: session.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
            for table in (
                "email_message",
                "email_origin",
                "pipeline_run",
                "run_attempt",
                "classification",
                "email_label",
                "document",
            )
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emails", type=int, default=200_000)
    parser.add_argument("--forgotten", type=int, default=10_000)
    args = parser.parse_args()
    every = args.emails // args.forgotten
    name = f"mailpipe_bench_forget_{os.getpid()}"
    database = harness.database(name).create()
    folder = Path(tempfile.mkdtemp(prefix="mailpipe-bench-forget-"))
    prefix = f"bench-forget-{uuid.uuid4().hex[:8]}:"
    os.environ.update(
        harness.base_env(database_url=database.url, prefix=prefix, blob_url=f"file://{folder}")
    )
    from mailpipe.enqueue import sender
    from mailpipe.operations import actions, erasure
    from mailpipe.resources import get_resources
    from mailpipe.storage.migrate import upgrade

    try:
        upgrade(database.url)
        started = time.perf_counter()
        keys = seed(database.url, args.emails, every)
        write_blobs(folder, keys)
        seeded_s = time.perf_counter() - started
        res = get_resources()
        before = counts(res)
        filt = erasure.selection(sender=SENDER)

        started = time.perf_counter()
        planned = actions.forget(res, filt=filt, enqueue=sender(res), user="bench", dry_run=True)
        plan_s = time.perf_counter() - started
        started = time.perf_counter()
        done = actions.forget(res, filt=filt, enqueue=sender(res), user="bench")
        forget_s = time.perf_counter() - started

        after = counts(res)
        assert len(done.email_ids) == len(keys) == args.forgotten, len(done.email_ids)
        assert done.rows == planned.rows, (done.rows, planned.rows)
        per_email = {"run_attempt": 2, "email_label": 2}
        assert all(before[t] - after[t] == args.forgotten * per_email.get(t, 1) for t in before), (
            before,
            after,
        )
        assert not any((folder / "text").iterdir()) and not any((folder / "raw").rglob("*.eml"))
        res.close()
        print(
            json.dumps(
                {
                    "emails": args.emails,
                    "forgotten": len(done.email_ids),
                    "seed_s": round(seeded_s, 1),
                    "dry_run_s": round(plan_s, 2),
                    "forget_s": round(forget_s, 2),
                    "emails_per_s": round(len(done.email_ids) / forget_s),
                    "rows": done.rows,
                    "blobs": done.blobs,
                    "machine": harness.machine(),
                },
                indent=2,
            )
        )
    finally:
        delete_prefix(harness.REDIS_URL, prefix)
        shutil.rmtree(folder, ignore_errors=True)
        database.drop()


if __name__ == "__main__":
    main()
