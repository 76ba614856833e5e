"""`mailpipe demo`: the bundled sample emails through a real prefork worker, end to end.

Runs on the embedded default (a SQLite file and a blob folder under ./var/demo, the local Redis)
under its own Redis key prefix, so it never mixes with a fleet using the same Redis. With no Redis
to reach (`MAILPIPE_BROKER_URL`, by default localhost:6379), it starts a `redis-server` of its own
on a free loopback port when one is installed, and stops it at the end; without one it says how to
get one, in a line, and exits 4 (a service unavailable).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources as package_files
from pathlib import Path

from rich.console import Console
from rich.table import Table
from sqlalchemy import select

DEMO_DIR = Path("var/demo")
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Expected:
    status: str
    labels: frozenset[str] = frozenset()
    documents: int = 0


# The two copies run at once on the two children: whichever records the origin first is the
# original, the other its duplicate. Either order is right; the pair is checked together.
COPIES = ("04-copy-a.eml", "04-copy-b.eml")
EXPECTED = {
    "01-plain-invoice.eml": Expected("succeeded", frozenset({"invoice"})),
    "02-html-newsletter.eml": Expected("succeeded", frozenset({"newsletter"})),
    "03-multipart-attachment.eml": Expected("succeeded", frozenset({"support"}), documents=1),
    "04-copy-a.eml": Expected("succeeded or duplicate"),
    "04-copy-b.eml": Expected("succeeded or duplicate"),
    "05-malformed.eml": Expected("failed"),
}


def sample_emails() -> dict[str, bytes]:
    folder = package_files.files("mailpipe.cli.demo").joinpath("emails")
    return {name: folder.joinpath(name).read_bytes() for name in sorted(EXPECTED)}


def demo_environment(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["MAILPIPE_DATABASE_URL"] = f"sqlite:///{root / 'mailpipe.db'}"
    env["MAILPIPE_BLOB_URL"] = f"file://{root / 'blobs'}"
    env["MAILPIPE_REDIS_PREFIX"] = f"demo{os.getpid()}:"
    env["MAILPIPE_MODEL_BACKEND"] = "rules"
    return env


NO_REDIS_EXIT = 4  # the CLI's code for a service unavailable


def broker_url() -> str:
    """The Redis the demo would use: MAILPIPE_BROKER_URL, or the settings' default."""
    from mailpipe.settings import Settings

    return os.environ.get("MAILPIPE_BROKER_URL") or Settings.model_fields["broker_url"].default


def redis_answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def run_demo(console: Console, keep: bool = False, root: Path = DEMO_DIR) -> int:
    from mailpipe.cli.demo.servers import PrivateRedis, redis_server
    from mailpipe.storage.migrate import shown_url

    url = broker_url()
    private: PrivateRedis | None = None
    if not redis_answers(url):
        if redis_server() is None:
            print(
                f"mailpipe demo: no Redis at {shown_url(url)} and no redis-server to start: "
                "pip install 'mailpipe[demo]' (it ships one), install Redis (apt-get install "
                "redis-server, brew install redis) or set MAILPIPE_BROKER_URL to a Redis you "
                "can reach",
                file=sys.stderr,
            )
            return NO_REDIS_EXIT
        logs = Path(tempfile.mkdtemp(prefix="mailpipe-demo-redis-"))
        private = PrivateRedis(logs / "redis-server.log").start()
        url = private.url
        console.print(
            f"no Redis at {shown_url(broker_url())}: started redis-server on {url} for the "
            "demo, stopped at the end",
            soft_wrap=True,
        )
    try:
        return _run_demo(console, keep, root, url)
    finally:
        if private is not None:
            private.stop()
            if keep:
                console.print("the demo's own Redis is stopped: its queues are gone, the rows stay")
            shutil.rmtree(private.log_path.parent, ignore_errors=True)


def _run_demo(console: Console, keep: bool, root: Path, url: str) -> int:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    env = demo_environment(root.resolve())
    env["MAILPIPE_BROKER_URL"] = url
    # This process must use the demo's settings too: set them before anything reads them.
    os.environ.update(env)
    from mailpipe import resources
    from mailpipe.cli.demo import fleet as localfleet
    from mailpipe.cli.ingest import store_emails
    from mailpipe.enqueue import enqueue_emails
    from mailpipe.resources import get_resources
    from mailpipe.settings import get_settings
    from mailpipe.storage import flags
    from mailpipe.storage.migrate import upgrade

    get_settings.cache_clear()
    resources.reset()
    res = get_resources()
    upgrade(res.settings.database_url)
    with res.db.transaction() as session:
        flags.set_model_calls(session, True)

    worker = localfleet.worker(env, root / "logs", concurrency=2, name="demo")
    console.print("starting a prefork worker (-c 2) ...")
    worker.start()
    try:
        worker.wait_ready()
        samples = sample_emails()
        started = time.perf_counter()
        ids = dict(zip(samples, store_emails(res, list(samples.values())), strict=True))
        enqueue_emails(list(ids.values()), res)
        finished = _wait_for_runs(res, list(ids.values()), TIMEOUT_S)
        elapsed = time.perf_counter() - started
    finally:
        worker.stop()
    ok = _report(console, res, ids, elapsed, finished)
    if keep:
        kept = " ".join(
            f"{name}={env[name]}"
            for name in (
                "MAILPIPE_DATABASE_URL",
                "MAILPIPE_BLOB_URL",
                "MAILPIPE_BROKER_URL",
                "MAILPIPE_REDIS_PREFIX",
            )
        )
        console.print(
            f"kept {root}; to look at it: {kept} mailpipe status (or mailpipe web)", soft_wrap=True
        )
    else:
        shutil.rmtree(root, ignore_errors=True)
        # The demo's queues, markers and kombu bindings, all under its own prefix.
        for key in res.redis.scan_iter(match=res.settings.redis_prefix + "*", count=1000):
            res.redis.delete(key)
    return 0 if ok else 1


def _wait_for_runs(res, email_ids: list[int], timeout: float) -> bool:
    from mailpipe.storage.models import PipelineRun, RunStatus

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with res.db.session() as session:
            statuses = session.scalars(
                select(PipelineRun.status).where(PipelineRun.email_id.in_(email_ids))
            ).all()
        if len(statuses) == len(email_ids) and RunStatus.OPEN not in statuses:
            return True
        time.sleep(0.2)
    return False


def _report(console: Console, res, ids: dict[str, int], elapsed: float, finished: bool) -> bool:
    """A table per run status, the labels found, and whether every sample did as expected."""
    from mailpipe.operations.status import email_detail

    by_status: dict[str, list[tuple[str, dict, bool]]] = {}
    all_ok = finished
    with res.db.session() as session:
        details = {name: email_detail(session, email_id) for name, email_id in ids.items()}
    copies_ok = _copies_linked(details[COPIES[0]], details[COPIES[1]])
    for name, detail in details.items():
        assert detail is not None
        status = (detail["run"] or {}).get("status", "no run")
        expected = EXPECTED[name]
        labels = {label["label"] for label in detail["labels"]}
        converted = [d for d in detail["documents"] if d["status"] == "converted"]
        if name in COPIES:
            ok = copies_ok
        else:
            ok = (
                status == expected.status
                and expected.labels <= labels
                and len(converted) >= expected.documents
            )
        all_ok &= ok
        by_status.setdefault(status, []).append((name, detail, ok))

    found: dict[str, int] = {}
    for status, rows in sorted(by_status.items()):
        table = Table(
            "sample",
            "id",
            "labels",
            "documents",
            "error",
            "as expected",
            title=f"{status} ({len(rows)})",
            title_justify="left",
        )
        for name, detail, ok in rows:
            names = sorted(label["label"] for label in detail["labels"])
            for label in names:
                found[label] = found.get(label, 0) + 1
            table.add_row(
                name,
                str(detail["id"]),
                ", ".join(names) or "-",
                ", ".join(f"{d['filename']} ({d['status']})" for d in detail["documents"]) or "-",
                ((detail["run"] or {}).get("error") or "-")[:50],
                "[green]yes[/]" if ok else f"[red]no, expected {EXPECTED[name].status}[/]",
            )
        console.print(table)
    console.print(
        "labels found: "
        + (", ".join(f"{label} ({n})" for label, n in sorted(found.items())) or "none"),
        soft_wrap=True,
    )
    console.print(
        f"{len(ids)} emails through a prefork worker (-c 2) in {elapsed:.2f}s: "
        + ("every sample reached its expected state" if all_ok else "[red]some samples did not[/]"),
        soft_wrap=True,
    )
    return all_ok


def _copies_linked(first: dict | None, second: dict | None) -> bool:
    """One copy succeeded, the other is its duplicate, linked to it."""
    if first is None or second is None:
        return False
    statuses = {(first["run"] or {}).get("status"), (second["run"] or {}).get("status")}
    if statuses != {"succeeded", "duplicate"}:
        return False
    original, copy = (first, second) if first["run"]["status"] == "succeeded" else (second, first)
    return copy["duplicate_of"] == original["id"]
