"""Lanes: fresh mail arriving while a backfill waits, with the lanes and with everything in one
lane, in the same run.

    .venv/bin/python -m bench.lanes [--bulk 20000] [--live-rate 2] [--live-seconds 120] \\
        [--delay 1] [--rate 20] [--drain 300] [--json results.json]

Each way runs in a process of its own, on a fresh setup (bench/model_stage.py's `Setup`: a
PostgreSQL database, a Redis key prefix, a blob folder, the local Converse server answering after
`--delay` seconds) and the `worker` and `model` roles started from their Procfile lines verbatim,
with model calls on, the `bedrock` backend and a fleet limit of `--rate` calls/s.

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
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select

from bench import harness
from bench.model_stage import Fleet, Setup, mailpipe
from tests.support.bedrock_server import invoices

if TYPE_CHECKING:
    from mailpipe.resources import Resources


def one_way(
    lanes: bool,
    bulk: int,
    live_rate: float,
    live_seconds: float,
    delay: float,
    rate: float,
    drain: float,
) -> dict[str, Any]:
    setup = Setup("lanes" if lanes else "onelane", delay, rate)
    fleet = None
    try:
        mailpipe(setup.env, "model-calls", "on")
        backlog = harness.write_emails(setup.work / "backlog", invoices(bulk))
        mailpipe(setup.env, "ingest", *(["--lane", "bulk"] if lanes else []), str(backlog))
        res = in_process(setup)
        from mailpipe.storage.models import PipelineRun

        fleet = Fleet(setup.env, setup.work).start()
        live = send_live(res, live_rate, live_seconds)
        timed = live_latency(res, live, drain)
        with res.db.session() as session:
            bulk_closed = session.scalar(
                select(func.count())
                .select_from(PipelineRun)
                .where(
                    PipelineRun.email_id.not_in(live.started),
                    PipelineRun.closed_at >= naive(live.window_start),
                    PipelineRun.closed_at < naive(live.window_end),
                )
            )
        return {
            "lanes": lanes,
            **timed,
            "bulk_closed_in_window": int(bulk_closed or 0),
            "bulk_per_s_in_window": round(int(bulk_closed or 0) / live.seconds, 2),
            "model_calls": len(setup.server.arrivals()),
        }
    finally:
        if fleet is not None:
            fleet.stop()
        setup.close()


def in_process(setup: Setup) -> Resources:
    """This process's resources on `setup`'s environment, to store live emails and read runs.
    Once per process: the Celery app that sends the live emails reads its broker settings (the
    Redis prefix among them) the first time it sends, and keeps them."""
    os.environ.update({k: v for k, v in setup.env.items() if k.startswith("MAILPIPE_")})
    from mailpipe import resources
    from mailpipe.settings import get_settings

    get_settings.cache_clear()
    resources.reset()
    return resources.get_resources()


@dataclass(frozen=True)
class Live:
    """Live emails sent in a window: each one's id and when its store started."""

    started: dict[int, float]
    window_start: float
    window_end: float

    @property
    def seconds(self) -> float:
        return self.window_end - self.window_start


def send_live(res: Resources, rate: float, seconds: float) -> Live:
    """For `seconds`, `rate` emails a second stored and enqueued in the live lane, as upstream
    storage does (`store_emails`, then `enqueue_emails`), each at its due time."""
    from mailpipe.cli.ingest import store_emails
    from mailpipe.enqueue import enqueue_emails

    started: dict[int, float] = {}
    window_start = time.time()
    for number, raw in enumerate(invoices(int(rate * seconds))):
        due = window_start + number / rate
        time.sleep(max(0.0, due - time.time()))
        at = time.time()
        [email_id] = store_emails(res, [raw])
        enqueue_emails([email_id], res)
        started[email_id] = at
    return Live(started, window_start, time.time())


def live_latency(res: Resources, live: Live, drain: float) -> dict[str, object]:
    """Each live email's time from the start of its store to its run's close, waiting up to
    `drain` seconds for the last ones; one still open then counts as closed then (a lower
    bound)."""
    from mailpipe.storage.models import PipelineRun, RunStatus

    def closed_at() -> dict[int, float]:
        with res.db.session() as session:
            rows = session.execute(
                select(PipelineRun.email_id, PipelineRun.closed_at).where(
                    PipelineRun.email_id.in_(live.started), PipelineRun.status != RunStatus.OPEN
                )
            ).all()
        return {i: at.replace(tzinfo=UTC).timestamp() for i, at in rows if at is not None}

    deadline = time.monotonic() + drain
    done = closed_at()
    while len(done) < len(live.started) and time.monotonic() < deadline:
        time.sleep(1)
        done = closed_at()
    cut = time.time()
    latencies = [done.get(i, cut) - at for i, at in live.started.items()]
    return {
        "live_emails": len(live.started),
        "live_not_closed_within_drain": len(live.started) - len(done),
        "live_latency_s": {
            "p50": round(statistics.median(latencies), 2),
            "p99": round(harness.percentile(latencies, 0.99), 2),
            "max": round(max(latencies), 2),
        },
    }


def naive(timestamp: float) -> datetime:
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
    given = (args.bulk, args.live_rate, args.live_seconds, args.delay, args.rate, args.drain)
    # Each way in a process of its own (`in_process`).
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        ways = [pool.apply(one_way, (lanes, *given)) for lanes in (True, False)]
    with_lanes, one_lane = ways
    report = {
        "machine": harness.machine(),
        "args": vars(args) | {"json": str(args.json) if args.json else None},
        "ways": ways,
        "bulk_throughput_lanes_over_one_lane": round(
            with_lanes["bulk_per_s_in_window"] / max(one_lane["bulk_per_s_in_window"], 1e-9),
            3,
        ),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
