"""Many mailboxes with waiting work: what each costs Redis, and what sending their jobs costs.

    .venv/bin/python -m bench.many_mailboxes [--mailboxes 100000] [--json results.json]

In a Redis key prefix of this run's own, `--mailboxes` jobs are enqueued with
`mailpipe.enqueue.enqueue_emails` (their markers, their shard queues' lengths, the jobs), first
each in a mailbox of its own, then all in one mailbox, then with no mailbox (the lane's own
queue), each on an empty prefix. Reported for each: Redis's memory after (`used_memory` beside
the empty prefix's), bytes per waiting job, and the enqueue's time per job; and the difference
per mailbox between the first and the second, which is what a waiting mailbox costs beyond its
jobs. No rows are needed: the jobs are only sent, never run.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from pathlib import Path
from typing import Any

from bench import harness
from tests.support.services import delete_prefix

BATCH = 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mailboxes", type=int, default=100_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prefix = f"benchboxes{uuid.uuid4().hex[:8]}:"
    os.environ.update(
        harness.base_env(
            database_url="sqlite:///:memory:", prefix=prefix, blob_url="file:///nonexistent"
        )
    )
    from redis import Redis

    from mailpipe.enqueue import enqueue_emails
    from mailpipe.resources import get_resources

    res = get_resources()
    redis = Redis.from_url(harness.REDIS_URL)
    count = args.mailboxes
    ways: dict[str, Any] = {}
    for way in ("a mailbox each", "one mailbox", "no mailbox"):
        delete_prefix(harness.REDIS_URL, prefix)
        before = int(redis.info("memory")["used_memory"])
        started = time.perf_counter()
        for start in range(1, count + 1, BATCH):
            ids = list(range(start, min(start + BATCH, count + 1)))
            if way == "no mailbox":
                boxes = None
            elif way == "one mailbox":
                boxes = dict.fromkeys(ids, f"customer-{count}")  # a name as long
            else:
                boxes = {i: f"customer-{i}" for i in ids}
            enqueue_emails(ids, res, mailboxes=boxes)
        seconds = time.perf_counter() - started
        used = int(redis.info("memory")["used_memory"]) - before
        ways[way] = {
            "redis_bytes": used,
            "bytes_per_job": round(used / count, 1),
            "enqueue_us_per_job": round(seconds / count * 1e6, 1),
        }
    delete_prefix(harness.REDIS_URL, prefix)
    beyond = (ways["a mailbox each"]["redis_bytes"] - ways["one mailbox"]["redis_bytes"]) / count
    return harness.publish(
        args,
        {
            "mailboxes": count,
            "ways": ways,
            "bytes_per_waiting_mailbox_beyond_its_jobs": round(beyond, 1),
        },
    )


if __name__ == "__main__":
    raise SystemExit(main())
