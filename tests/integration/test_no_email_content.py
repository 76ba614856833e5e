"""No email content in any stored error, log line or Flower's view of a task, on real processes.

The shared corpus and the hostile emails (tests/support/hostile.py) go through a prefork worker
with beat beside it and Flower watching, JSON logs as deployed. A few emails meet a bug whose
message quotes their subject and body (tests/support/faults.py): `quote` in a step, retried
until its run fails; `quote-outside` in the task itself, so that it leaves for Celery. Then
every stored error, every line the three processes wrote, every task Flower lists and every
value under the fleet's Redis prefix is searched for words of the emails' subjects and bodies:
words of six letters or more that no code the processes run (mailpipe's, the tests' support,
the libraries', Python's) holds, since a traceback's frames and a library's log lines quote code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sysconfig
import uuid
from collections.abc import Iterable
from pathlib import Path

import pytest
from sqlalchemy import select

from mailpipe.cli.ingest import store_emails
from mailpipe.mail.parse import ParsedEmail
from mailpipe.storage.models import Document, EmailMessage, PipelineRun, RunAttempt
from tests.support.corpus import parse_corpus
from tests.support.emails import raw_email
from tests.support.flower import Flower
from tests.support.hostile import INPUTS
from tests.support.paths import REPO
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

# Emails that meet the quoting bug: each with words of its own, in its subject and its body.
QUOTED = {
    "quote": raw_email("Quarterly Sonnenschein figures", body="Please wire the Zahlungseingang."),
    "quote-outside": raw_email(
        "Marmalade Kumquatish order", sender="b@example.org", body="The Brontosaurier invoice."
    ),
}
WORD = re.compile(r"[A-Za-z]{6,}")
LETTERS = re.compile(r"[A-Za-z]+")
HEX_ONLY = re.compile(r"[a-fA-F]+")  # a word a task id or a hash could hold by chance
CODE = [
    REPO / "mailpipe",
    REPO / "tests" / "support",
    Path(sysconfig.get_paths()["purelib"]),
    Path(sysconfig.get_paths()["stdlib"]),
]


def words_of(texts: Iterable[str]) -> set[str]:
    return {w.lower() for text in texts for w in WORD.findall(text) if not HEX_ONLY.fullmatch(w)}


class InCode:
    """Which of `words` some code the processes run holds, inside a longer word too: grep reads
    it all (300 MB) in the background while the processes run."""

    def __init__(self, words: set[str], folder: Path) -> None:
        patterns = folder / "words.txt"
        patterns.write_text("\n".join(v for w in words for v in (w, w.capitalize(), w.upper())))
        self.found = folder / "found.txt"
        with self.found.open("w") as out:
            self.grep = subprocess.Popen(
                ["grep", "-rhoF", "--include=*.py", "-f", str(patterns), *map(str, CODE)],
                stdout=out,
                stderr=subprocess.PIPE,
                env={**os.environ, "LC_ALL": "C"},
            )

    def words(self) -> set[str]:
        _, errors = self.grep.communicate(timeout=120)
        assert self.grep.returncode in (0, 1), errors
        return {line.lower() for line in self.found.read_text().splitlines()}


def hostile_emails() -> tuple[list[bytes], set[str]]:
    """The hostile inputs (not the references), each Subject given words of its own, and the
    words."""
    emails, words = [], set()
    for number, (name, build) in enumerate(INPUTS.items()):
        raw = build()
        if name.startswith("reference") or raw is None:
            continue
        own = [f"Hostilis{chr(97 + number)}", f"Quibbler{chr(97 + number)}x"]
        assert b"Subject: " in raw, name
        emails.append(raw.replace(b"Subject: ", f"Subject: {' '.join(own)} ".encode(), 1))
        words |= {w.lower() for w in own}
    return emails, words


def found(words: set[str], texts: dict[str, str]) -> dict[str, list[str]]:
    """Each place among `texts` that holds one of `words` (a run of letters, in any case), with
    the word and what is around it."""
    hits: dict[str, list[str]] = {}
    for place, text in texts.items():
        for match in LETTERS.finditer(text):
            if match.group().lower() in words:
                around = text[max(0, match.start() - 80) : match.end() + 80]
                hits.setdefault(place, []).append(f"{match.group()!r} in ...{around}...")
    return hits


def stored_errors(res) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Every column that holds an error or a reason, row by row."""
    columns = [
        PipelineRun.error,
        RunAttempt.error,
        Document.error,
        EmailMessage.review_reason,
    ]
    texts = {}
    with res.db.session() as session:
        for column in columns:
            for number, value in enumerate(session.scalars(select(column))):
                if value:
                    texts[f"{column} #{number}"] = value
    return texts


def redis_values(res, prefix: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Every value under the fleet's key prefix (queued messages, pauses, markers...)."""
    redis = res.redis
    texts = {}
    for key in redis.scan_iter(match=f"{prefix}*", count=1000):
        kind = redis.type(key).decode()
        if kind == "string":
            values = [redis.get(key)]
        elif kind == "hash":
            values = [v for pair in redis.hgetall(key).items() for v in pair]
        elif kind == "list":
            values = redis.lrange(key, 0, -1)
        elif kind == "zset":
            values = redis.zrange(key, 0, -1)
        elif kind == "set":
            values = list(redis.smembers(key))
        else:
            continue
        texts[f"redis {key.decode()}"] = "\n".join(
            v.decode(errors="replace") for v in values if v is not None
        )
    return texts


def test_no_word_of_an_email_is_in_any_error_log_line_or_task(res, fleet, tmp_path) -> None:  # type: ignore[no-untyped-def]
    corpus = parse_corpus()
    hostile, hostile_words = hostile_emails()
    parsed = [c.parsed for c in corpus if isinstance(c.parsed, ParsedEmail)]
    words = words_of([text for p in parsed for text in (p.subject, p.body_text)])
    words |= words_of(raw.decode() for raw in QUOTED.values()) | hostile_words
    in_code = InCode(words, tmp_path)
    password = uuid.uuid4().hex
    f = fleet(MAILPIPE_LOG_FORMAT="json", MAILPIPE_FLOWER_BASIC_AUTH=f"ops:{password}")
    dashboard = Flower(f.env, tmp_path / "flower.log", auth=("ops", password))
    try:
        dashboard.wait_ready()
        worker = f.worker("no-content")
        beat = f.beat()

        def heard() -> set[str]:  # the workers whose events reached Flower
            data = dashboard.get("/workers", params={"json": "1"}).json()["data"]
            return {info["hostname"] for info in data}

        wait_for(lambda: worker.nodename in heard(), 30, "Flower to hear from the worker")

        quote, outside = quoted = store_emails(res, list(QUOTED.values()))
        f.set_fault(quote, "quote")  # every attempt, until the run fails
        f.set_fault(outside, "quote-outside", times=1)
        ids = store_emails(res, [c.raw for c in corpus] + hostile)
        f.enqueue(quoted + ids)
        wait_until_closed(res, [quote, *ids], timeout=120)

        def listed() -> dict[str, dict]:
            return {t["args"]: t for t in dashboard.get("/api/tasks").json().values()}

        wait_for(
            lambda: listed().get(f"({outside},)", {}).get("state") == "FAILURE",
            30,
            "Flower to list the task the bug left",
        )
        flower_tasks = dashboard.get("/api/tasks").text
        tasks = listed()
    finally:
        f.stop()
        dashboard.stop()

    # What the processes did, so that what is searched below is known to be there.
    with res.db.session() as session:
        run = session.scalars(select(PipelineRun).where(PipelineRun.email_id == quote)).one()
        statuses = {s.value for s in session.scalars(select(PipelineRun.status))}
    assert run.status.value == "failed"
    assert run.error.startswith("gave up after 4 attempts: unexpected ValueError")
    assert {"failed", "succeeded"} <= statuses
    assert tasks[f"({quote},)"]["exception"].startswith("RunFailed(")
    left = tasks[f"({outside},)"]
    assert "ValueError" in left["exception"]
    assert "in _process_email_with_faults" in left["traceback"]
    worker_log = worker.log_path.read_text()
    assert worker_log.count('"exc_info": "Traceback') >= 5  # 4 attempts, and the task's failure

    words -= in_code.words()
    assert {"sonnenschein", "zahlungseingang", "kumquatish", "brontosaurier"} <= words
    assert len(words) > 1000, f"only {len(words)} words of the emails to look for"
    # The search finds them where an email's own words belong: the subjects its row keeps.
    with res.db.session() as session:
        subjects = "\n".join(s for s in session.scalars(select(EmailMessage.subject)) if s)
    assert len(words & {w.lower() for w in LETTERS.findall(subjects)}) > 20

    texts = {
        **stored_errors(res),
        **redis_values(res, f.prefix),
        "Flower's /api/tasks": flower_tasks,
        "worker log": worker_log,
        "beat log": beat.log_path.read_text(),
        "Flower's log": dashboard.log_path.read_text(),
    }
    hits = found(words, texts)
    assert not hits, "\n".join(
        f"{place}: {said}" for place, each in hits.items() for said in each[:3]
    )
