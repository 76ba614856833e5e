"""One mailbox's flood with nobody else waiting: each stage's throughput with the mailboxes' shard
queues and with one queue per lane, paired in the same run.

    .venv/bin/python -m bench.flood_alone [--emails 2000] [--repeat 5] [--delay 0.05] \\
        [--rate 1000] [--waiting 100000] [--json results.json]

Each measurement has a fresh setup of its own (bench/model_stage.py's `Setup`: a PostgreSQL
database, a Redis key prefix, a blob folder, the local Converse server answering after `--delay`
seconds) and the `worker` and `model` roles started from their Procfile lines verbatim, with the
`bedrock` backend and a fleet limit of `--rate` calls/s, high enough that the roles, not the
limit, set the pace. The two ways differ by `MAILPIPE_MAILBOX_QUEUES` alone: 16 (the default: the
flood's jobs wait in its two shards among each lane's 17 queues) or 0 (every job of a lane in one
queue, as before mailboxes). A third way has the shards and `--waiting` other mailboxes' jobs
waiting in the bulk lane, one job each (of emails that do not exist), which the live flood goes
before. Each repetition runs every way, in an order that changes each time.

1. CPU stage: with model calls off, `--emails` emails are stored and enqueued by
   `mailpipe ingest --mailbox flood` (and the waiting jobs sent) before the roles start; timed
   from the roles being ready to the last CPU stage done (every run then waits for model calls).
2. Model stage: `mailpipe model-calls on`, whose sweep sends every waiting run's model-stage job
   with its mailbox; timed from the switch to the last run closed. Not for the third way, whose
   worker then takes the waiting jobs beside the model stage.

Reported per way: each stage's emails/s (median over the repetitions), and each way's ratio to
one queue's, paired per repetition (median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness
from bench.model_stage import REPO, Fleet, Setup, closed, converted, mailpipe, wait
from tests.support.bedrock_server import invoices

FLOOD = "flood"
ONE_QUEUE, SHARDS, WAITING = "one queue", "shards", "shards, others waiting"
# Sends `count` bulk-lane jobs of emails that do not exist, a mailbox each, in the setup's key
# space: argv is the first id and the count.
SEND_WAITING = """
import sys
from mailpipe.broker.queues import Lane
from mailpipe.enqueue import enqueue_emails
first, count = int(sys.argv[1]), int(sys.argv[2])
for start in range(first, first + count, 1000):
    ids = list(range(start, min(start + 1000, first + count)))
    enqueue_emails(ids, lane=Lane.BULK, mailboxes={i: f"customer-{i}" for i in ids})
"""


def one_way(
    way: str, emails: list[bytes], delay: float, rate: float, waiting: int
) -> dict[str, float]:
    setup = Setup("alone", delay, rate)
    setup.env["MAILPIPE_MAILBOX_QUEUES"] = "0" if way == ONE_QUEUE else "16"
    fleet = None
    try:
        mailpipe(setup.env, "model-calls", "off")
        folder = harness.write_emails(setup.work / "flood", emails)
        harness.ingest(REPO, setup.env, folder, len(emails), "--mailbox", FLOOD)
        if way == WAITING:
            args = [str(10**9), str(waiting)]
            subprocess.run([sys.executable, "-c", SEND_WAITING, *args], env=setup.env, check=True)
        fleet = Fleet(setup.env, setup.work).start()
        started = time.monotonic()
        wait(lambda: converted(setup.database) == len(emails), 3600, "every CPU stage")
        figures = {"cpu_per_s": len(emails) / (time.monotonic() - started)}
        if way != WAITING:
            switched = time.monotonic()
            mailpipe(setup.env, "model-calls", "on")
            wait(lambda: closed(setup.database) == len(emails), 3600, "every run to close")
            figures["model_per_s"] = len(emails) / (time.monotonic() - switched)
    finally:
        if fleet is not None:
            fleet.stop()
        setup.close()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--emails", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--waiting", type=int, default=100_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    emails = invoices(args.emails)
    ways = (ONE_QUEUE, SHARDS, WAITING)
    runs: list[dict[str, dict[str, float]]] = []
    for repetition in range(args.repeat):
        order = ways[repetition % 3 :] + ways[: repetition % 3]
        given = (emails, args.delay, args.rate, args.waiting)
        runs.append({way: one_way(way, *given) for way in order})
        print(json.dumps({"repetition": repetition, **runs[-1]}), flush=True)
    report: dict[str, Any] = {"runs": runs}
    for stage in ("cpu_per_s", "model_per_s"):
        measured = [way for way in ways if stage in runs[0][way]]
        report[stage] = {
            "median_by_way": {
                way: round(statistics.median(run[way][stage] for run in runs), 1)
                for way in measured
            },
            "over_one_queue_paired_median": {
                way: round(
                    statistics.median(run[way][stage] / run[ONE_QUEUE][stage] for run in runs), 3
                )
                for way in measured
                if way != ONE_QUEUE
            },
        }
    return harness.publish(args, report)


if __name__ == "__main__":
    raise SystemExit(main())
