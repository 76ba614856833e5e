"""How fast a job comes back after its worker is stopped or its child is killed.

    .venv/bin/python bench/failover.py --repeat 5

- SIGTERM: a worker (REMAP_SIGTERM=SIGQUIT, as deployed) is stopped while a long job runs; the
  job is requeued when the soft-shutdown window ends and starts on a second worker. Reported:
  the time from the window's end to that start, against the visibility timeout that would have
  brought the job back otherwise.
- Child killed: a job SIGKILLs its own child once; reported: the time from the first start to
  the next one (the pool noticing the death, worker_lost_wait, the requeue, the lease takeover).

Real workers, PostgreSQL (a database of its own), Redis (a key prefix of its own), local blobs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402
SOFT_SHUTDOWN_S = 5.0
VISIBILITY_S = 900


def setup(workdir: Path) -> str:
    database = f"mailpipe_failover_{os.getpid()}"
    os.environ.update(
        {
            "MAILPIPE_DATABASE_URL": harness.create_database(database),
            "MAILPIPE_BROKER_URL": harness.REDIS_URL,
            "MAILPIPE_REDIS_PREFIX": f"failover{uuid.uuid4().hex[:8]}:",
            "MAILPIPE_BLOB_URL": f"file://{workdir / 'blobs'}",
            "MAILPIPE_SOFT_SHUTDOWN_TIMEOUT": str(SOFT_SHUTDOWN_S),
            "MAILPIPE_VISIBILITY_TIMEOUT": str(VISIBILITY_S),
        }
    )
    return database


def teardown(database: str) -> None:
    from mailpipe.resources import get_resources

    get_resources().close()
    harness.delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])
    harness.drop_database(database)


def starts(res, email_id: int, n: int, timeout: float = 120) -> list[float]:  # type: ignore[no-untyped-def]
    from tests.support.faults import starts_key

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [float(t) for t in res.redis.lrange(starts_key(email_id), 0, -1)]
        if len(found) >= n:
            return found
        time.sleep(0.02)
    raise TimeoutError(f"email {email_id}: fewer than {n} starts")


def email(tag: str) -> bytes:
    return f"From: a@example.org\r\nSubject: {tag}\r\nMessage-ID: <{tag}@x>\r\n\r\nbody\r\n".encode()


def measure_sigterm(res, workdir: Path) -> float:  # type: ignore[no-untyped-def]
    from mailpipe import localfleet
    from mailpipe.enqueue import enqueue_email
    from mailpipe.ingest import store_emails
    from tests.support.faults import set_fault

    env = dict(os.environ)
    leaving = localfleet.worker({**env, "REMAP_SIGTERM": "SIGQUIT"}, workdir, name=f"leaving-{uuid.uuid4().hex[:6]}",
                                extra_args=("-I", "tests.support.faults")).start()
    staying = None
    try:
        leaving.wait_ready()
        [email_id] = store_emails(res, [email(f"term-{uuid.uuid4().hex}")])
        set_fault(res.redis, email_id, "slow:60", times=1)
        enqueue_email(email_id)
        starts(res, email_id, 1)
        staying = localfleet.worker(env, workdir, name=f"staying-{uuid.uuid4().hex[:6]}",
                                    extra_args=("-I", "tests.support.faults")).start()
        staying.wait_ready()
        sent_at = time.time()
        leaving.signal(signal.SIGTERM)
        second = starts(res, email_id, 2)[1]
        return second - (sent_at + SOFT_SHUTDOWN_S)
    finally:
        leaving.stop()
        if staying is not None:
            staying.stop()


def measure_child_kill(res, workdir: Path) -> float:  # type: ignore[no-untyped-def]
    from mailpipe import localfleet
    from mailpipe.enqueue import enqueue_email
    from mailpipe.ingest import store_emails
    from tests.support.faults import set_fault

    worker = localfleet.worker(dict(os.environ), workdir, name=f"kill-{uuid.uuid4().hex[:6]}",
                               extra_args=("-I", "tests.support.faults")).start()
    try:
        worker.wait_ready()
        [email_id] = store_emails(res, [email(f"kill-{uuid.uuid4().hex}")])
        set_fault(res.redis, email_id, "sigkill", times=1)
        enqueue_email(email_id)
        first, second = starts(res, email_id, 2)[:2]
        return second - first
    finally:
        worker.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mailpipe-failover-") as tmp:
        workdir = Path(tmp)
        database = setup(workdir)
        try:
            from mailpipe import flags
            from mailpipe.migrate import upgrade
            from mailpipe.resources import get_resources

            res = get_resources()
            upgrade(res.settings.database_url)
            with res.db.transaction() as session:
                flags.set_model_calls(session, True)
            sigterm = [measure_sigterm(res, workdir) for _ in range(args.repeat)]
            child = [measure_child_kill(res, workdir) for _ in range(args.repeat)]
        finally:
            teardown(database)
    report = {
        "repeat": args.repeat,
        "soft_shutdown_s": SOFT_SHUTDOWN_S,
        "visibility_timeout_s": VISIBILITY_S,
        "sigterm_requeue_latency_s": {"median": statistics.median(sigterm), "all": sigterm},
        "child_kill_rerun_delay_s": {"median": statistics.median(child), "all": child},
    }
    print(f"{'measure':<44} {'median':>8}  runs")
    print(f"{'SIGTERM: window end -> start elsewhere (s)':<44} {statistics.median(sigterm):8.2f}  "
          + " ".join(f"{v:.2f}" for v in sigterm))
    print(f"{'  ... the visibility timeout it beats (s)':<44} {VISIBILITY_S:8.0f}")
    print(f"{'child SIGKILL: first start -> next start (s)':<44} {statistics.median(child):8.2f}  "
          + " ".join(f"{v:.2f}" for v in child))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
