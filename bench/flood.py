"""A flood in one mailbox: other mailboxes' fresh mail arriving while it waits, with the
mailboxes' shard queues and with one queue per lane, in the same run.

    .venv/bin/python -m bench.flood [--flood 2000] [--others 20] [--every 1] [--delay 0.5] \\
        [--rate 20] [--drain 300] [--json results.json]

Each way runs in a process of its own, on a fresh setup (bench/model_stage.py's `Setup`: a
PostgreSQL database, a Redis key prefix, a blob folder, the local Converse server answering after
`--delay` seconds) and the `worker` and `model` roles started from their Procfile lines verbatim,
with model calls on, the `bedrock` backend and a fleet limit of `--rate` calls/s. The one way
differs from the other by `MAILPIPE_MAILBOX_QUEUES` alone: 16 (the default) or 0 (every job of a
lane in one queue, as before mailboxes).

1. `--flood` emails are stored and enqueued by `mailpipe ingest --mailbox flood`, before the roles
   start, so the whole flood waits at the CPU stage.
2. The roles start; once the first of the flood's runs has closed, `--others` mailboxes each
   receive one email, one every `--every` seconds, stored and enqueued by this process as
   upstream storage does (`store_emails`, then `enqueue_email(id, mailbox=...)`), each timed from
   the start of its store to its run's close.
3. They get `--drain` seconds more to close; one that has not closed by then counts as closed then
   (its wait is a lower bound, and the report says how many).

Reported per way: the other mailboxes' waits (p50, p99, max), and the flood's runs closed per
second from the first other email's store to the last one's close, against the limit.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from datetime import UTC
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from bench import harness
from bench.lanes import in_process, naive
from bench.model_stage import Fleet, Setup, mailpipe
from tests.support.bedrock_server import invoices

FLOOD = "flood"


def one_way(
    shards: int, flood: int, others: int, every: float, delay: float, rate: float, drain: float
) -> dict[str, Any]:
    setup = Setup(f"flood{shards}", delay, rate)
    setup.env["MAILPIPE_MAILBOX_QUEUES"] = str(shards)
    fleet = None
    try:
        mailpipe(setup.env, "model-calls", "on")
        folder = harness.write_emails(setup.work / "flood", invoices(flood))
        mailpipe(setup.env, "ingest", "--mailbox", FLOOD, str(folder))
        res = in_process(setup)
        from mailpipe.cli.ingest import store_emails
        from mailpipe.enqueue import enqueue_email
        from mailpipe.storage.models import EmailMessage, PipelineRun, RunStatus

        def closed_at(ids: list[int]) -> dict[int, float]:
            with res.db.session() as session:
                rows = session.execute(
                    select(PipelineRun.email_id, PipelineRun.closed_at).where(
                        PipelineRun.email_id.in_(ids), PipelineRun.status != RunStatus.OPEN
                    )
                ).all()
            return {i: harness_ts(at) for i, at in rows if at is not None}

        def flood_closed(since: float, until: float) -> int:
            with res.db.session() as session:
                return int(
                    session.scalar(
                        select(func.count())
                        .select_from(PipelineRun)
                        .join(EmailMessage, EmailMessage.id == PipelineRun.email_id)
                        .where(
                            EmailMessage.mailbox == FLOOD,
                            PipelineRun.closed_at >= naive(since),
                            PipelineRun.closed_at < naive(until),
                        )
                    )
                    or 0
                )

        fleet = Fleet(setup.env, setup.work).start()
        deadline = time.monotonic() + 120
        while not flood_closed(0, time.time() + 1) and time.monotonic() < deadline:
            time.sleep(0.2)
        started: dict[int, float] = {}
        window_start = time.time()
        for number, raw in enumerate(invoices(others, subject="Hello")):
            time.sleep(max(0.0, window_start + number * every - time.time()))
            at = time.time()
            name = f"customer-{number}"
            [email_id] = store_emails(res, [raw], mailbox=name)
            enqueue_email(email_id, mailbox=name)
            started[email_id] = at
        ids = list(started)
        limit = time.monotonic() + drain
        done = closed_at(ids)
        while len(done) < len(ids) and time.monotonic() < limit:
            time.sleep(0.5)
            done = closed_at(ids)
        cut = time.time()
        waits = [done.get(i, cut) - at for i, at in started.items()]
        window_end = max(done.values(), default=cut) if len(done) == len(ids) else cut
        flood_in_window = flood_closed(window_start, window_end)
        flood_rate = flood_in_window / max(window_end - window_start, 1e-9)
        return {
            "mailbox_queues": shards,
            "others": len(ids),
            "others_not_closed_within_drain": len(ids) - len(done),
            "others_wait_s": {
                "p50": round(statistics.median(waits), 2),
                "p99": round(harness.percentile(waits, 0.99), 2),
                "max": round(max(waits), 2),
            },
            "flood_closed_per_s_in_window": round(flood_rate, 2),
            "flood_rate_over_limit": round(flood_rate / rate, 3),
        }
    finally:
        if fleet is not None:
            fleet.stop()
        setup.close()


def harness_ts(at: Any) -> float:
    """A naive UTC time read from the database, as a unix time."""
    return float(at.replace(tzinfo=UTC).timestamp())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=2000)
    parser.add_argument("--others", type=int, default=20)
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--delay", type=float, default=0.5)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--drain", type=float, default=300.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    given = (args.flood, args.others, args.every, args.delay, args.rate, args.drain)
    # Each way in a process of its own (`bench.lanes.in_process`).
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        ways = [pool.apply(one_way, (shards, *given)) for shards in (16, 0)]
    return harness.publish(args, {"ways": ways})


if __name__ == "__main__":
    raise SystemExit(main())
