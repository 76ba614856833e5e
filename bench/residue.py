"""What `mailpipe forget --sender` leaves of one sender's emails, looked for everywhere.

    .venv/bin/python -m bench.residue                   # this checkout's code
    .venv/bin/python -m bench.residue --src OTHER_TREE  # another checkout's (same venv)

A real fleet of one: a worker, `mailpipe web` and the CLI, each a process running the code at
`--src`, on a PostgreSQL database, a Redis key prefix and a blob folder of the run's own. Two
emails of one sender (one with a From header over 1,000 characters, one with a document whose
text is a blob of its own) and one of another sender are ingested and processed; the console is
searched for the sender and subject, a reprocess is started from the console's form and another
from the CLI, both by sender and subject; then `mailpipe forget --sender` erases the sender.
Every table's rows, the worker's, the console's and the CLI's log lines (the console's access log
among them), every blob and every Redis key under the prefix are then read for the sender's
address (as written and as a query string encodes it), the two subjects and the two email ids.
It prints what still names them, as counts and where; `--keep` keeps the logs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

from bench import harness
from mailpipe.cli.demo.fleet import CeleryProcess
from mailpipe.cli.demo.servers import free_port, terminate
from tests.support.services import delete_prefix

SENDER = "alice.target@residue.example"
OPERATOR = ("ops", "ops-password")
# The ids the emails get (the id sequence starts past it), so that a number in a log line or a
# key names one of them and nothing else.
FIRST_ID = 90001
QUEUES = "mailpipe,mailpipe.bulk,mailpipe.control,mailpipe.model,mailpipe.model.bulk"


def emails(tag: str) -> dict[str, bytes]:
    """The sender's two emails and a bystander's, by name."""
    long_name = " ".join(f"Alice{n:04d}" for n in range(120))  # 1,199 characters
    folded = "\r\n ".join(long_name[i : i + 70] for i in range(0, len(long_name), 70))
    text = "pay by the end of the month. " * 3000  # past the 64 KiB kept inline
    return {
        "document": (
            f"From: Alice Target <{SENDER}>\r\nTo: ops@residue.example\r\n"
            f"Subject: Quarterly invoice {tag}a\r\nMessage-ID: <{tag}a@residue.example>\r\n"
            'Content-Type: multipart/mixed; boundary="b"\r\n\r\n'
            "--b\r\nContent-Type: text/plain\r\n\r\nAmount due, see the terms\r\n"
            '--b\r\nContent-Type: text/plain; name="terms.txt"\r\n'
            'Content-Disposition: attachment; filename="terms.txt"\r\n\r\n'
            f"{text}\r\n--b--\r\n"
        ).encode(),
        "long_from": (
            f"From: {folded}\r\n <{SENDER}>\r\nTo: ops@residue.example\r\n"
            f"Subject: Second invoice {tag}b\r\nMessage-ID: <{tag}b@residue.example>\r\n\r\n"
            "Amount due: 12 EUR\r\n"
        ).encode(),
        "bystander": (
            "From: Bob <bob@other.example>\r\nTo: ops@residue.example\r\n"
            f"Subject: Lunch {tag}c\r\nMessage-ID: <{tag}c@other.example>\r\n\r\nNoon?\r\n"
        ).encode(),
    }


class Run:
    """One run's services and processes, all on the code at `src`."""

    def __init__(self, src: Path, folder: Path) -> None:
        self.src = src
        self.folder = folder
        self.database = harness.database(f"mailpipe_bench_residue_{os.getpid()}").create()
        self.prefix = f"bench-residue-{uuid.uuid4().hex[:8]}:"
        self.blobs = folder / "blobs"
        self.port = free_port()
        self.env = {
            **harness.env_without_settings(),
            **harness.base_env(
                database_url=self.database.url,
                prefix=self.prefix,
                blob_url=f"file://{self.blobs}",
                MAILPIPE_WEB_OPERATORS=":".join(OPERATOR),
                MAILPIPE_WEB_PORT=str(self.port),
            ),
            "PYTHONPATH": str(src),
        }
        self.worker: CeleryProcess | None = None
        self.web: subprocess.Popen[bytes] | None = None

    def cli(self, *args: str) -> str:
        """`mailpipe ARGS`; its stderr (the audit lines) goes to cli.log."""
        done = subprocess.run(
            [*harness.mailpipe_command(self.src), *args],
            env=self.env,
            cwd=self.src,
            capture_output=True,
            text=True,
            check=False,
        )
        with (self.folder / "cli.log").open("a") as log:
            log.write(done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"mailpipe {' '.join(args)}:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def sql(self, statement: str, *params: Any) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.database.url, autocommit=True) as conn:
            cursor = conn.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    def start(self) -> None:
        self.cli("db", "upgrade")
        self.sql("SELECT setval(pg_get_serial_sequence('email_message', 'id'), %s)", FIRST_ID - 1)
        self.cli("model-calls", "on")
        self.worker = CeleryProcess(
            role="worker",
            args=[
                "--pool",
                "prefork",
                "--concurrency",
                "1",
                "-Q",
                QUEUES,
                "--hostname",
                "residue@localhost",
                "--without-mingle",
                "--without-gossip",
                "--loglevel",
                "INFO",
            ],
            env=self.env,
            log_path=self.folder / "worker.log",
            nodename="residue@localhost",
            cwd=self.src,
        ).start()
        self.worker.wait_ready()
        with (self.folder / "web.log").open("ab") as log:
            self.web = subprocess.Popen(
                [*harness.mailpipe_command(self.src), "web"],
                env=self.env,
                cwd=self.src,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _wait(lambda: _answers(f"{self.url}/healthz"), "the console")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_succeeded(self, count: int) -> None:
        _wait(
            lambda: (
                self.sql("SELECT count(*) FROM pipeline_run WHERE status = 'succeeded'")[0][0]
                == count
            ),
            f"{count} succeeded runs",
        )

    def stop(self) -> None:
        terminate(self.web)
        if self.worker is not None:
            self.worker.stop()

    def close(self) -> None:
        self.stop()
        delete_prefix(harness.REDIS_URL, self.prefix)
        self.database.drop()


def _answers(url: str) -> bool:
    import requests

    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


def _wait(predicate: Any, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.2)


def act(run: Run, tag: str, subject: str) -> dict[str, Any]:
    """Ingest, process, search, reprocess twice, forget; what the forget said."""
    import requests

    folder = run.folder / "emails"
    harness.write_emails(folder, list(emails(tag).values()))
    run.cli("ingest", str(folder))
    run.wait_succeeded(3)
    query = {"sender": SENDER, "subject": subject}
    for path in ("/search", "/api/search"):
        found = requests.get(f"{run.url}{path}", params=query, auth=OPERATOR, timeout=30)
        found.raise_for_status()
    page = requests.get(f"{run.url}/failed", auth=OPERATOR, timeout=30).text
    token = re.search(r'name="csrf_token" value="([^"]+)"', page)
    assert token is not None, "no CSRF token on the failed list"
    form = {**query, "from": "classify", "in_lane": "live", "do": "reprocess"}
    posted = requests.post(
        f"{run.url}/reprocess",
        data={**form, "csrf_token": token[1]},
        auth=OPERATOR,
        timeout=30,
        allow_redirects=False,
    )
    assert posted.status_code == 303, posted.text
    run.wait_succeeded(3)
    run.cli("reprocess", "--sender", SENDER, "--subject", subject, "--from", "parse", "--yes")
    run.wait_succeeded(3)
    said = run.cli("forget", "--sender", SENDER, "--yes")
    run.stop()
    return {"forget_said": said.strip().splitlines()[-1] if said.strip() else ""}


def needles(tag: str) -> list[str]:
    """The text that names the sender or a subject of theirs, as stored, logged or encoded."""
    subjects = [f"Quarterly invoice {tag}a", f"Second invoice {tag}b"]
    found = [SENDER, quote(SENDER), quote_plus(SENDER), f"{tag}a", f"{tag}b"]
    found += [encoded for s in subjects for encoded in (quote(s), quote_plus(s))]
    return sorted({n.casefold() for n in found})


def _named(text: str, words: list[str], ids: re.Pattern[str]) -> str | None:
    """ "content" when `text` holds the sender or a subject, "id" when it holds only an id."""
    folded = text.casefold()
    if any(word in folded for word in words):
        return "content"
    return "id" if ids.search(text) else None


class Found:
    """What names the emails, by place ("tables/email_label", "logs/web.log", ...), and by kind:
    their content (the sender, a subject), or an id alone."""

    def __init__(self) -> None:
        self.places: dict[str, dict[str, int]] = {"content": {}, "id": {}}

    def add(self, place: str, kind: str | None, n: int = 1) -> None:
        if kind is not None:
            self.places[kind][place] = self.places[kind].get(place, 0) + n

    def report(self) -> dict[str, Any]:
        return {
            **{f"by_{kind}": dict(sorted(p.items())) for kind, p in self.places.items()},
            **{f"{kind}_total": sum(p.values()) for kind, p in self.places.items()},
        }


def scan(run: Run, tag: str) -> dict[str, Any]:
    """Where the sender's emails are still named."""
    words = needles(tag)
    ids = re.compile(rf"(?<![\d.])({FIRST_ID}|{FIRST_ID + 1})(?![\d])")
    found = Found()
    for (table,) in run.sql(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' "
        "ORDER BY table_name"
    ):
        for (row,) in run.sql(f'SELECT row_to_json(t)::text FROM "{table}" t'):
            found.add(f"table {table}", _named(row, words, ids))
    for name in ("worker.log", "web.log", "cli.log"):
        path = run.folder / name
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            access = re.search(r'"(GET|POST) \S+ HTTP/', line) is not None
            found.add(f"access log {name}" if access else f"log {name}", _named(line, words, ids))
    for path in run.blobs.rglob("*"):
        if path.is_file():
            key = str(path.relative_to(run.blobs))
            kind = _named(path.read_bytes().decode(errors="replace"), words, ids)
            found.add(f"blob {key.split('/')[0]}/", kind or _named(key, [], ids))
    for key, kind in _redis_naming(run, words, ids):
        found.add(f"redis {key}", kind)
    return found.report()


def _redis_naming(run: Run, words: list[str], ids: re.Pattern[str]) -> list[tuple[str, str]]:
    import redis

    client = redis.Redis.from_url(harness.REDIS_URL)
    named = []
    for raw in client.scan_iter(match=f"{run.prefix}*", count=1000):
        content = _value(client, raw)
        key = raw.decode().removeprefix(run.prefix)
        found = _named(repr(content), words, ids) or _named(key, words, ids)
        if found is not None:
            named.append((key, found))
    client.close()
    return named


def _value(client: Any, key: bytes) -> Any:
    read = {
        "string": client.get,
        "hash": client.hgetall,
        "list": lambda name: client.lrange(name, 0, -1),
        "set": client.smembers,
        "zset": lambda name: client.zrange(name, 0, -1),
    }.get(client.type(key).decode())
    return b"" if read is None else read(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=harness.REPO, help="The code to run.")
    parser.add_argument("--keep", action="store_true", help="Keep the logs' folder.")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="mailpipe-bench-residue-"))
    tag = f"zq{uuid.uuid4().hex[:8]}"
    run = Run(args.src.resolve(), folder)
    try:
        run.start()
        said = act(run, tag, f"{tag}a")
        print(json.dumps({"src": str(args.src), **said, **scan(run, tag)}, indent=2))
    finally:
        run.close()
        if args.keep:
            print(f"logs kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
