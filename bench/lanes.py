"""Lanes: fresh mail arriving while a backfill waits, with the lanes and with everything in one
lane, in the same run.

    .venv/bin/python -m bench.lanes [--bulk 20000] [--live-rate 2] [--live-seconds 120] \\
        [--delay 1] [--rate 20] [--drain 300] [--json results.json]

Each way gets a fresh setup of its own (bench/model_stage.py's `Setup`: a PostgreSQL database, a
Redis key prefix, a blob folder, the local Converse server answering after `--delay` seconds) and
the `worker` and `model` roles started from their Procfile lines verbatim, with model calls on,
the `bedrock` backend and a fleet limit of `--rate` calls/s.

1. `--bulk` emails are stored and enqueued by `mailpipe ingest --lane bulk` (with the lanes) or
   `mailpipe ingest` (one lane: every job in the live queues, as before lanes), before the roles
   start, so the whole backlog waits at the CPU stage.
2. The roles start; for `--live-seconds`, `--live-rate` emails a second are stored and enqueued
   in the live lane by this process (`store_emails`, then `enqueue_emails`), each one timed from
   the start of its store.
3. The live emails get `--drain` seconds more to close; one that has not closed by then counts
   as closed then (its latency is a lower bound, and the report says how many).

Reported per way: each live email's time from ingest to its run's close (p50, p99, max), and the
bulk emails whose runs closed during the arrival window, per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import func, select

from bench import harness
from bench.model_stage import Fleet, Setup, mailpipe
from tests.support.bedrock_server import invoices


def one_way(
    lanes: bool,
    bulk: int,
    live_rate: float,
    live_seconds: float,
    delay: float,
    rate: float,
    drain: float,
) -> dict[str, object]:
    setup = Setup("lanes" if lanes else "onelane", delay, rate)
    fleet = None
    try:
        mailpipe(setup.env, "model-calls", "on")
        backlog = harness.write_emails(setup.work / "backlog", invoices(bulk))
        mailpipe(setup.env, "ingest", *(["--lane", "bulk"] if lanes else []), str(backlog))
        os.environ.update({k: v for k, v in setup.env.items() if k.startswith("MAILPIPE_")})
        from mailpipe import resources
        from mailpipe.cli.ingest import store_emails
        from mailpipe.enqueue import enqueue_emails
        from mailpipe.settings import get_settings
        from mailpipe.storage.models import PipelineRun, RunStatus

        get_settings.cache_clear()
        resources.reset()
        res = resources.get_resources()
        fleet = Fleet(setup.env, setup.work).start()

        live = invoices(int(live_rate * live_seconds))
        ingested: dict[int, float] = {}
        window_start = time.time()
        for number, raw in enumerate(live):
            due = window_start + number / live_rate
            time.sleep(max(0.0, due - time.time()))
            started = time.time()
            [email_id] = store_emails(res, [raw])
            enqueue_emails([email_id], res)
            ingested[email_id] = started
        window_end = time.time()

        def closed_at() -> dict[int, float]:
            with res.db.session() as session:
                rows = session.execute(
                    select(PipelineRun.email_id, PipelineRun.closed_at).where(
                        PipelineRun.email_id.in_(ingested), PipelineRun.status != RunStatus.OPEN
                    )
                ).all()
            return {i: at.replace(tzinfo=UTC).timestamp() for i, at in rows}

        deadline = time.monotonic() + drain
        done = closed_at()
        while len(done) < len(ingested) and time.monotonic() < deadline:
            time.sleep(1)
            done = closed_at()
        cut = time.time()
        latencies = [done.get(i, cut) - at for i, at in ingested.items()]
        with res.db.session() as session:
            bulk_closed = session.scalar(
                select(func.count())
                .select_from(PipelineRun)
                .where(
                    PipelineRun.email_id.not_in(ingested),
                    PipelineRun.closed_at >= _naive(window_start),
                    PipelineRun.closed_at < _naive(window_end),
                )
            )
        return {
            "lanes": lanes,
            "live_emails": len(ingested),
            "live_not_closed_within_drain": len(ingested) - len(done),
            "live_latency_s": {
                "p50": round(statistics.median(latencies), 2),
                "p99": round(harness.percentile(latencies, 0.99), 2),
                "max": round(max(latencies), 2),
            },
            "bulk_closed_in_window": int(bulk_closed or 0),
            "bulk_per_s_in_window": round(int(bulk_closed or 0) / (window_end - window_start), 2),
            "model_calls": len(setup.server.arrivals()),
        }
    finally:
        if fleet is not None:
            fleet.stop()
        setup.close()


def _naive(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, UTC).replace(tzinfo=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bulk", type=int, default=20_000)
    parser.add_argument("--live-rate", type=float, default=2.0)
    parser.add_argument("--live-seconds", type=float, default=120.0)
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--drain", type=float, default=300.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ways = [
        one_way(
            lanes, args.bulk, args.live_rate, args.live_seconds, args.delay, args.rate, args.drain
        )
        for lanes in (True, False)
    ]
    with_lanes, one_lane = ways
    report = {
        "machine": harness.machine(),
        "args": vars(args) | {"json": str(args.json) if args.json else None},
        "ways": ways,
        "bulk_throughput_lanes_over_one_lane": round(
            with_lanes["bulk_per_s_in_window"] / max(one_lane["bulk_per_s_in_window"], 1e-9),
            3,  # type: ignore[operator]
        ),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
