"""How fast a job comes back after its worker is stopped or its child is killed.

    .venv/bin/python -m bench.failover --repeat 5

- SIGTERM: a worker (REMAP_SIGTERM=SIGQUIT, as deployed) is stopped while a long job runs; the
  job is requeued when the soft-shutdown window ends and starts on a second worker. Reported:
  the time from the window's end to that start, against the visibility timeout that would have
  brought the job back otherwise.
- Child killed: a job SIGKILLs its own child once; reported: the time from the first start to
  the next one (the pool noticing the death, worker_lost_wait, the requeue, the lease takeover).
- Worker killed: a worker holding four jobs (two running, two reserved for its busy children) is
  SIGKILLed whole, at the default heartbeat settings, with a second worker up; reported: the
  time from the kill to the last of the four starting on the second worker, against the
  visibility timeout (kombu's own recovery).
- Hard time limit: a job that ignores the soft limit is killed by the hard one (2 s and 3 s
  here); reported: the time from the kill to the job's next start.

A lost attempt (a killed child, a worker killed whole, the hard time limit) waits out its
backoff before the next: the backoff is shortened here (`MAILPIPE_RETRY_BACKOFF_BASE` 1 s, so
0.5 to 1 s for a first attempt) so that the figures show the recovery path, not the backoff's
default minutes.

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

from bench import harness
from mailpipe.cli.demo import fleet
from tests.support.services import Database, delete_prefix

SOFT_SHUTDOWN_S = 5.0
VISIBILITY_S = 1800
BACKOFF_BASE_S = 1.0


def setup(workdir: Path) -> Database:
    database = harness.database(f"mailpipe_failover_{os.getpid()}").create()
    os.environ.update(
        {
            "MAILPIPE_DATABASE_URL": database.url,
            "MAILPIPE_BROKER_URL": harness.REDIS_URL,
            "MAILPIPE_REDIS_PREFIX": f"failover{uuid.uuid4().hex[:8]}:",
            "MAILPIPE_BLOB_URL": f"file://{workdir / 'blobs'}",
            "MAILPIPE_SOFT_SHUTDOWN_TIMEOUT": str(SOFT_SHUTDOWN_S),
            "MAILPIPE_VISIBILITY_TIMEOUT": str(VISIBILITY_S),
            "MAILPIPE_RETRY_BACKOFF_BASE": str(BACKOFF_BASE_S),
        }
    )
    return database


def teardown(database: Database) -> None:
    from mailpipe.resources import get_resources

    get_resources().close()
    delete_prefix(harness.REDIS_URL, os.environ["MAILPIPE_REDIS_PREFIX"])
    database.drop()


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
    return (
        f"From: a@example.org\r\nSubject: {tag}\r\nMessage-ID: <{tag}@x>\r\n\r\nbody\r\n".encode()
    )


def measure_sigterm(res, workdir: Path) -> float:  # type: ignore[no-untyped-def]
    from mailpipe.cli.ingest import store_emails
    from mailpipe.enqueue import enqueue_email
    from tests.support.faults import set_fault

    env = dict(os.environ)
    leaving = fleet.worker(
        {**env, "REMAP_SIGTERM": "SIGQUIT"},
        workdir,
        name=f"leaving-{uuid.uuid4().hex[:6]}",
        extra_args=("-I", "tests.support.faults"),
    ).start()
    staying = None
    try:
        leaving.wait_ready()
        [email_id] = store_emails(res, [email(f"term-{uuid.uuid4().hex}")])
        set_fault(res.redis, email_id, "slow:60", times=1)
        enqueue_email(email_id)
        starts(res, email_id, 1)
        staying = fleet.worker(
            env,
            workdir,
            name=f"staying-{uuid.uuid4().hex[:6]}",
            extra_args=("-I", "tests.support.faults"),
        ).start()
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
    from mailpipe.cli.ingest import store_emails
    from mailpipe.enqueue import enqueue_email
    from tests.support.faults import set_fault

    worker = fleet.worker(
        dict(os.environ),
        workdir,
        name=f"kill-{uuid.uuid4().hex[:6]}",
        extra_args=("-I", "tests.support.faults"),
    ).start()
    try:
        worker.wait_ready()
        [email_id] = store_emails(res, [email(f"kill-{uuid.uuid4().hex}")])
        set_fault(res.redis, email_id, "sigkill", times=1)
        enqueue_email(email_id)
        first, second = starts(res, email_id, 2)[:2]
        return second - first
    finally:
        worker.stop()


def measure_worker_kill(res, workdir: Path) -> float:  # type: ignore[no-untyped-def]
    from mailpipe.cli.ingest import store_emails
    from mailpipe.enqueue import enqueue_emails
    from tests.support.faults import runs_key, set_fault

    env = dict(os.environ)
    doomed = fleet.worker(
        env,
        workdir,
        name=f"doomed-{uuid.uuid4().hex[:6]}",
        extra_args=("-I", "tests.support.faults"),
    ).start()
    rescuer = None
    try:
        doomed.wait_ready()
        ids = store_emails(res, [email(f"doomed-{uuid.uuid4().hex}") for _ in range(4)])
        for email_id in ids:
            set_fault(res.redis, email_id, "slow:20", times=1)
        enqueue_emails(ids)
        deadline = time.monotonic() + 60
        unacked = os.environ["MAILPIPE_REDIS_PREFIX"] + "unacked"
        while (
            sum(int(res.redis.get(runs_key(i)) or 0) for i in ids) < 2
            or res.redis.hlen(unacked) < 4
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("the doomed worker did not take all four jobs")
            time.sleep(0.05)
        # Four children: the four jobs start as soon as they are back, whichever is slow.
        rescuer = fleet.worker(
            env,
            workdir,
            name=f"rescuer-{uuid.uuid4().hex[:6]}",
            concurrency=4,
            extra_args=("-I", "tests.support.faults"),
        ).start()
        rescuer.wait_ready()
        killed_at = time.time()
        doomed.kill()
        # Started on the doomed worker: wait for the second start; reserved there: for the first.
        needed = {email_id: int(res.redis.get(runs_key(email_id)) or 0) + 1 for email_id in ids}
        last = max(starts(res, email_id, n, 300)[n - 1] for email_id, n in needed.items())
        wait_closed(res, ids)  # nothing of this measurement is left for the next
        return last - killed_at
    finally:
        doomed.stop()
        if rescuer is not None:
            rescuer.stop()


def wait_closed(res, email_ids: list[int], timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import func, select

    from mailpipe.storage.models import PipelineRun, RunStatus

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with res.db.session() as session:
            still_open = session.scalar(
                select(func.count())
                .select_from(PipelineRun)
                .where(PipelineRun.email_id.in_(email_ids), PipelineRun.status == RunStatus.OPEN)
            )
        if not still_open:
            return
        time.sleep(0.2)
    raise TimeoutError(f"runs of {email_ids} still open")


def measure_hard_limit(res, workdir: Path) -> float:  # type: ignore[no-untyped-def]
    from mailpipe.cli.ingest import store_emails
    from mailpipe.enqueue import enqueue_email
    from tests.support.faults import set_fault

    # The worker's own time limits apply: a job is sent without limits of its sender's.
    env = {**os.environ, "MAILPIPE_TASK_SOFT_TIME_LIMIT": "2", "MAILPIPE_TASK_TIME_LIMIT": "3"}
    worker = fleet.worker(
        env,
        workdir,
        name=f"limit-{uuid.uuid4().hex[:6]}",
        extra_args=("-I", "tests.support.faults"),
    ).start()
    try:
        worker.wait_ready()
        [email_id] = store_emails(res, [email(f"limit-{uuid.uuid4().hex}")])
        set_fault(res.redis, email_id, "hang", times=1)
        enqueue_email(email_id)
        first, second = starts(res, email_id, 2, 120)[:2]
        return second - (first + 3)
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
            from mailpipe.resources import get_resources
            from mailpipe.storage import flags
            from mailpipe.storage.migrate import upgrade

            res = get_resources()
            upgrade(res.settings.database_url)
            with res.db.transaction() as session:
                flags.set_model_calls(session, True)
            sigterm = [measure_sigterm(res, workdir) for _ in range(args.repeat)]
            child = [measure_child_kill(res, workdir) for _ in range(args.repeat)]
            worker = [measure_worker_kill(res, workdir) for _ in range(args.repeat)]
            limit = [measure_hard_limit(res, workdir) for _ in range(args.repeat)]
        finally:
            teardown(database)
    report = {
        "repeat": args.repeat,
        "soft_shutdown_s": SOFT_SHUTDOWN_S,
        "visibility_timeout_s": VISIBILITY_S,
        "sigterm_requeue_latency_s": {"median": statistics.median(sigterm), "all": sigterm},
        "child_kill_rerun_delay_s": {"median": statistics.median(child), "all": child},
        "worker_kill_last_job_restart_s": {"median": statistics.median(worker), "all": worker},
        "hard_limit_kill_to_next_start_s": {"median": statistics.median(limit), "all": limit},
    }
    print(f"{'measure':<44} {'median':>8}  runs")
    print(
        f"{'SIGTERM: window end -> start elsewhere (s)':<44} {statistics.median(sigterm):8.2f}  "
        + " ".join(f"{v:.2f}" for v in sigterm)
    )
    print(f"{'  ... the visibility timeout it beats (s)':<44} {VISIBILITY_S:8.0f}")
    print(
        f"{'child SIGKILL: first start -> next start (s)':<44} {statistics.median(child):8.2f}  "
        + " ".join(f"{v:.2f}" for v in child)
    )
    print(
        f"{'worker SIGKILL -> its last job starts (s)':<44} {statistics.median(worker):8.2f}  "
        + " ".join(f"{v:.2f}" for v in worker)
    )
    print(f"{'  ... the visibility timeout it beats (s)':<44} {VISIBILITY_S:8.0f}")
    print(
        f"{'hard limit kill -> next start (s)':<44} {statistics.median(limit):8.2f}  "
        + " ".join(f"{v:.2f}" for v in limit)
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
