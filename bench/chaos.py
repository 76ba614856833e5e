"""Chaos run: N emails through two prefork workers while faults are injected on a schedule.

    .venv/bin/python bench/chaos.py --n 10000 --json chaos.json

Faults: a worker child SIGKILLed every few seconds, one worker SIGKILLed whole, one worker sent
SIGTERM (soft shutdown), one Redis flush, one PostgreSQL restart, a spell of S3 errors (a proxy in
front of moto's S3 server answers 503), and a few poison jobs that segfault their child every
time. Each stopped worker is replaced, so two keep running. Then it reports, as a table and JSON:
emails, each terminal state, lost (no terminal state by the deadline), duplicated artifacts (any
row that exists more often than once per email or per part), poison jobs and their attempts, and
the time to drain.

It runs against the machine's real PostgreSQL (a database of its own, and it restarts the
server once) and Redis (database 11, which it flushes), so it is for a test machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "corpus"
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402

REDIS_DB_URL = "redis://127.0.0.1:6379/11"
TERMINAL = ("succeeded", "duplicate", "failed")


def chaos_env(database_url: str, s3_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "MAILPIPE_DATABASE_URL": database_url,
            "MAILPIPE_BROKER_URL": REDIS_DB_URL,
            "MAILPIPE_REDIS_PREFIX": "",
            "MAILPIPE_BLOB_URL": "s3://chaos/blobs",
            "MAILPIPE_S3_ENDPOINT_URL": s3_url,
            "MAILPIPE_VISIBILITY_TIMEOUT": "30",
            "MAILPIPE_TASK_SOFT_TIME_LIMIT": "15",
            "MAILPIPE_TASK_TIME_LIMIT": "20",
            "MAILPIPE_RETRY_BACKOFF_BASE": "1",
            "MAILPIPE_RETRY_BACKOFF_MAX": "6",
            "MAILPIPE_LEASE_TTL": "6",
            "MAILPIPE_SWEEP_INTERVAL": "5",
            "MAILPIPE_DEDUP_TTL": "120",
            "MAILPIPE_SOFT_SHUTDOWN_TIMEOUT": "5",
            "MAILPIPE_BEAT_LOCK_TIMEOUT": "10",
            "AWS_ACCESS_KEY_ID": "chaos",
            "AWS_SECRET_ACCESS_KEY": "chaos",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    return env


def build_emails(n: int, poison: int, seed: int) -> tuple[list[bytes], list[int]]:
    """Corpus emails, generated ones with PDF and DOCX attachments, ~10% copies, and poison."""
    from email.message import EmailMessage

    from mailpipe.ingest import RawEmail, read_sources
    from mailpipe.pipeline.parse import looks_like_email

    rng = random.Random(seed)
    corpus = [i.data for i in read_sources([CORPUS / "emails"]) if isinstance(i, RawEmail) and looks_like_email(i.data)]
    documents = sorted(CORPUS.joinpath("documents").rglob("*.pdf")) + sorted(
        CORPUS.joinpath("documents").rglob("*.docx")
    )
    emails: list[bytes] = []
    while len(emails) < n - poison:
        roll = rng.random()
        if roll < 0.25:
            emails.append(corpus[rng.randrange(len(corpus))])
        elif roll < 0.35 and emails:
            emails.append(emails[rng.randrange(len(emails))])  # a copy of one already in the run
        else:
            k = len(emails)
            message = EmailMessage()
            message["From"] = f"sender{k % 97}@example.org"
            message["To"] = "team@example.org"
            message["Subject"] = rng.choice(["Invoice", "Newsletter", "Support ticket", "Hello"]) + f" {k}"
            message["Message-ID"] = f"<chaos-{seed}-{k}@example.org>"
            message.set_content(f"Message {k}. Amount due: {k} EUR. Unsubscribe at any time.")
            if rng.random() < 0.3:
                document = documents[rng.randrange(len(documents))]
                subtype = "pdf" if document.suffix == ".pdf" else "vnd.openxmlformats-officedocument.wordprocessingml.document"
                message.add_attachment(document.read_bytes(), maintype="application", subtype=subtype, filename=document.name)
            emails.append(message.as_bytes())
    first_poison = len(emails)
    for k in range(poison):
        emails.append(f"From: p@example.org\r\nSubject: poison {k}\r\nMessage-ID: <poison-{seed}-{k}@x>\r\n\r\nboom\r\n".encode())
    return emails, list(range(first_poison, first_poison + poison))


class Chaos:
    def __init__(self, n: int, poison: int, seed: int, deadline: float, workdir: Path) -> None:
        self.n, self.poison, self.seed, self.deadline = n, poison, seed, deadline
        self.workdir = workdir
        self.database = f"mailpipe_chaos_{os.getpid()}"
        self.events: list[dict[str, object]] = []
        self.rng = random.Random(seed)
        self.started = 0.0

    def log(self, fault: str, **details: object) -> None:
        event = {"t": round(time.monotonic() - self.started, 2), "fault": fault, **details}
        self.events.append(event)
        print(f"[{event['t']:7.2f}s] {fault} {details if details else ''}", flush=True)

    def run(self) -> dict[str, object]:
        s3_port = harness.free_port()
        s3 = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)],
            stdout=(self.workdir / "moto.log").open("wb"), stderr=subprocess.STDOUT,
        )
        database_url = harness.create_database(self.database)
        from tests.support.flaky_proxy import FlakyProxy

        _wait_port(s3_port)
        self.proxy = FlakyProxy(f"http://127.0.0.1:{s3_port}").start()
        self.env = chaos_env(database_url, self.proxy.url)
        os.environ.update(self.env)
        try:
            return self._run()
        finally:
            for process in getattr(self, "processes", []):
                process.stop(timeout=15)
            self.proxy.stop()
            s3.terminate()
            s3.wait(10)
            _restart_postgres_if_down()
            harness.drop_database(self.database)

    def _run(self) -> dict[str, object]:
        import boto3

        from mailpipe import flags, localfleet
        from mailpipe.enqueue import enqueue_emails
        from mailpipe.ingest import store_emails
        from mailpipe.migrate import upgrade
        from mailpipe.resources import get_resources
        from tests.support.faults import set_fault

        res = get_resources()
        upgrade(res.settings.database_url)
        res.redis.flushdb()
        boto3.client("s3", endpoint_url=self.env["MAILPIPE_S3_ENDPOINT_URL"]).create_bucket(Bucket="chaos")
        with res.db.transaction() as session:
            flags.set_model_calls(session, True)
        raws, poison_positions = build_emails(self.n, self.poison, self.seed)
        ids: list[int] = []
        for start in range(0, len(raws), 500):
            ids.extend(store_emails(res, raws[start : start + 500]))
        self.poison_ids = [ids[p] for p in poison_positions]
        for email_id in self.poison_ids:
            set_fault(res.redis, email_id, "segfault")

        def worker(name: str) -> localfleet.CeleryProcess:
            process = localfleet.worker(self.env, self.workdir, name=name, extra_args=("-I", "tests.support.faults"))
            self.processes.append(process.start())
            return process

        self.processes: list[localfleet.CeleryProcess] = []
        workers = [worker("chaos-a"), worker("chaos-b")]
        for process in workers:
            process.wait_ready()
        self.processes.append(localfleet.beat(self.env, self.workdir, "chaos-beat").start())

        self.started = time.monotonic()
        enqueue_emails(ids, res)
        self.log("enqueued", emails=len(ids))
        stop = threading.Event()
        done = threading.Event()
        injector = threading.Thread(target=self._inject, args=(workers, worker, stop, done), daemon=True)
        injector.start()

        drained_at = None
        while time.monotonic() - self.started < self.deadline:
            if done.is_set() and self._open_count(res) == 0:
                drained_at = time.monotonic() - self.started
                break
            time.sleep(1)
        stop.set()
        injector.join(30)
        return self._report(res, ids, drained_at)

    def _inject(self, workers, start_worker, stop: threading.Event, done: threading.Event) -> None:  # type: ignore[no-untyped-def]
        # Spread the one-off faults over the first part of the expected drain (~25 emails/s).
        expected = max(20.0, self.n / 25)
        schedule = [
            (0.10 * expected, "kill_worker"),
            (0.20 * expected, "sigterm_worker"),
            (0.30 * expected, "redis_flush"),
            (0.40 * expected, "postgres_restart"),
            (0.50 * expected, "s3_errors"),
        ]
        next_child_kill = 2.0
        while schedule and not stop.is_set():
            now = time.monotonic() - self.started
            if now >= next_child_kill:
                self._kill_a_child(workers)
                next_child_kill = now + 3.0
            if now >= schedule[0][0]:
                _, fault = schedule.pop(0)
                getattr(self, f"_{fault}")(workers, start_worker)
            time.sleep(0.2)
        done.set()

    def _kill_a_child(self, workers) -> None:  # type: ignore[no-untyped-def]
        live = [w for w in workers if w.alive() and w.child_pids()]
        if live:
            target = self.rng.choice(live)
            pid = self.rng.choice(target.child_pids())
            try:
                os.kill(pid, signal.SIGKILL)
                self.log("child_sigkill", worker=target.nodename, pid=pid)
            except ProcessLookupError:
                pass

    def _kill_worker(self, workers, start_worker) -> None:  # type: ignore[no-untyped-def]
        victim = workers.pop(0)
        victim.kill()
        self.log("worker_sigkill", worker=victim.nodename)
        workers.append(start_worker("chaos-c"))

    def _sigterm_worker(self, workers, start_worker) -> None:  # type: ignore[no-untyped-def]
        victim = workers.pop(0)
        victim.signal(signal.SIGTERM)
        self.log("worker_sigterm", worker=victim.nodename)
        workers.append(start_worker("chaos-d"))

    def _redis_flush(self, workers, start_worker) -> None:  # type: ignore[no-untyped-def]
        from mailpipe.resources import get_resources

        get_resources().redis.flushdb()
        self.log("redis_flush")
        from tests.support.faults import set_fault

        for email_id in self.poison_ids:  # the faults lived in Redis too
            set_fault(get_resources().redis, email_id, "segfault")

    def _postgres_restart(self, workers, start_worker) -> None:  # type: ignore[no-untyped-def]
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", _pg_version(), "main", "restart"],
            check=True, capture_output=True,
        )
        self.log("postgres_restart")

    def _s3_errors(self, workers, start_worker) -> None:  # type: ignore[no-untyped-def]
        self.proxy.fail_for(4.0)
        self.log("s3_errors", seconds=4.0)

    def _open_count(self, res) -> int:  # type: ignore[no-untyped-def]
        from sqlalchemy import func, select

        from mailpipe.models import EmailMessage, PipelineRun, RunStatus

        try:
            with res.db.session() as session:
                no_run = session.scalar(select(func.count()).select_from(EmailMessage).where(EmailMessage.has_run.is_(False)))
                open_runs = session.scalar(select(func.count()).select_from(PipelineRun).where(PipelineRun.status == RunStatus.OPEN))
            return (no_run or 0) + (open_runs or 0)
        except Exception:  # noqa: BLE001 - PostgreSQL restarting: ask again next second
            return -1

    def _report(self, res, ids: list[int], drained_at: float | None) -> dict[str, object]:  # type: ignore[no-untyped-def]
        from sqlalchemy import func, select, text

        from mailpipe.models import Classification, PipelineRun

        with res.db.session() as session:
            statuses = dict(session.execute(select(PipelineRun.status, func.count()).group_by(PipelineRun.status)).all())
            runs = session.scalar(select(func.count()).select_from(PipelineRun))
            duplicated = {
                table: session.scalar(text(f"SELECT count(*) FROM (SELECT 1 FROM {table} GROUP BY {key} HAVING count(*) > 1) d"))
                for table, key in (
                    ("pipeline_run", "email_id"),
                    ("document", "email_id, part_index"),
                    ("classification", "run_id"),
                    ("email_label", "email_id, label"),
                    ("email_origin", "fingerprint"),
                )
            }
            # Copies convert nothing and are never classified.
            duplicated["artifacts_on_copies"] = session.scalar(text(
                "SELECT count(*) FROM email_message e WHERE e.duplicate_of IS NOT NULL AND "
                "(EXISTS (SELECT 1 FROM document d WHERE d.email_id = e.id) OR "
                "EXISTS (SELECT 1 FROM classification c WHERE c.email_id = e.id))"
            ))
            succeeded_without_one_classification = session.scalar(text(
                "SELECT count(*) FROM pipeline_run r WHERE r.status = 'succeeded' AND "
                "(SELECT count(*) FROM classification c WHERE c.run_id = r.id) <> 1"
            ))
            poison = [
                {"email": row.email_id, "status": row.status.value, "attempts": row.attempts, "error": row.error}
                for row in session.scalars(select(PipelineRun).where(PipelineRun.email_id.in_(self.poison_ids)))
            ]
            failed_other = [
                {"email": row.email_id, "attempts": row.attempts, "error": row.error}
                for row in session.scalars(
                    select(PipelineRun).where(PipelineRun.status == "failed", PipelineRun.email_id.not_in(self.poison_ids))
                )
            ]
            classifications = session.scalar(select(func.count()).select_from(Classification))
        terminal = {status.value: count for status, count in statuses.items()}
        lost = len(ids) - sum(terminal.get(s, 0) for s in TERMINAL)
        return {
            "emails": len(ids),
            "runs": runs,
            "terminal": {s: terminal.get(s, 0) for s in TERMINAL},
            "lost": lost,
            "duplicated": sum(duplicated.values()) + succeeded_without_one_classification,
            "duplicated_by_kind": {**duplicated, "succeeded_without_one_classification": succeeded_without_one_classification},
            "classifications": classifications,
            "poison": poison,
            "failed_other": failed_other,
            "drain_seconds": None if drained_at is None else round(drained_at, 1),
            "faults": self.events,
            "s3_requests_failed": self.proxy.failed_requests,
        }


def _pg_version() -> str:
    return sorted(os.listdir("/etc/postgresql"))[-1]


def _restart_postgres_if_down() -> None:
    if subprocess.run(["pg_isready", "-h", "127.0.0.1", "-p", "5432"], capture_output=True).returncode != 0:
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", _pg_version(), "main", "start"], check=False)
        time.sleep(2)


def _wait_port(port: int) -> None:
    for _ in range(300):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def print_table(report: dict[str, object]) -> None:
    rows = [
        ("emails", report["emails"]),
        *((f"  {status}", count) for status, count in report["terminal"].items()),  # type: ignore[union-attr]
        ("lost", report["lost"]),
        ("duplicated artifacts", report["duplicated"]),
        ("poison jobs", len(report["poison"])),  # type: ignore[arg-type]
        ("  their attempts", sorted({p["attempts"] for p in report["poison"]})),  # type: ignore[union-attr, index]
        ("other failed runs", len(report["failed_other"])),  # type: ignore[arg-type]
        ("time to drain (s)", report["drain_seconds"]),
        ("faults injected", len(report["faults"])),  # type: ignore[arg-type]
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--poison", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--deadline", type=float, default=3600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mailpipe-chaos-") as workdir:
        report = Chaos(args.n, args.poison, args.seed, args.deadline, Path(workdir)).run()
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["lost"] == 0 and report["duplicated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
