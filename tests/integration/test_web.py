"""The console and the job status API (`mailpipe web`, mailpipe/web/), as a real server process
over the test's database and Redis.

- Who may do what: no credentials or a wrong password is 401 with a basic-auth challenge; a
  viewer reads and is refused every action (403); an operator's action needs the form's CSRF
  token (403 without it, or with another user's); a right one acts, through the same code as the
  CLI, and is logged with its user and emails.
- Pages escape what the emails hold, and no email content reaches the console's log.
- The API answers each state of a job as the database and the broker hold it: `queued` and
  `running` seen on a real worker whose job is held in its steps (tests/support/faults.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from sqlalchemy import insert, select, update

from mailpipe.broker.queues import Stage
from mailpipe.cli.ingest import store_emails
from mailpipe.coordination import pauses
from mailpipe.pipeline import emails, runs
from mailpipe.storage import flags
from mailpipe.storage.keys import raw_email_key
from mailpipe.storage.models import EmailMessage, PipelineRun, RunStatus, utcnow
from tests.support.console import OPERATOR, OPERATOR_ARGON2, VIEWER, ConsoleProcess, users_env
from tests.support.fleet import Fleet
from tests.support.waits import wait_for, wait_until_closed

pytestmark = pytest.mark.services  # Redis, PostgreSQL and the S3 server

HOSTILE = "<script>alert('subject')</script>"


def email(tag: str) -> bytes:
    return (
        f"From: a@example.org\r\nTo: b@example.org\r\nSubject: about {tag}\r\n"
        f"Message-ID: <{tag}.{os.urandom(6).hex()}@example.org>\r\n\r\nHello {tag}\r\n"
    ).encode()


def store_without_blob(res, raw: bytes) -> int:  # type: ignore[no-untyped-def]
    """An email row whose raw bytes were never written: its job fails with BlobMissing."""
    digest = hashlib.sha256(raw).hexdigest()
    with res.db.transaction() as session:
        return int(
            session.scalar(
                insert(EmailMessage)
                .values(
                    blob_key=raw_email_key(digest),
                    size=len(raw),
                    sha256=digest,
                    received_at=utcnow(),
                )
                .returning(EmailMessage.id)
            )
        )


def failed_run(res, error: str = "the test failed it") -> int:  # type: ignore[no-untyped-def]
    [email_id] = store_emails(res, [email("failed")])
    with res.db.transaction() as session:
        runs.ensure_runs(session, [email_id])
        assert runs.fail(session, email_id, error, error_class="DeferredTooLong")
    return email_id


def run_status(res, email_id: int) -> str | None:  # type: ignore[no-untyped-def]
    with res.db.session() as session:
        status = session.scalar(select(PipelineRun.status).where(PipelineRun.email_id == email_id))
    return None if status is None else status.value


@pytest.fixture
def console(res, tmp_path: Path) -> Iterator[Callable[..., ConsoleProcess]]:  # type: ignore[no-untyped-def]
    """Starts `mailpipe web` with the test's users, on the test's services unless told others."""
    started: list[ConsoleProcess] = []

    def start(env: dict[str, str] | None = None) -> ConsoleProcess:
        process = ConsoleProcess(
            {**(env or os.environ), **users_env()}, tmp_path / f"web{len(started)}.log"
        )
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


# --- who may do what ---------------------------------------------------------------------------


def test_signing_in(console) -> None:  # type: ignore[no-untyped-def]
    web = console()
    assert requests.get(f"{web.url}/healthz", timeout=5).status_code == 200
    for path in ("/", "/failed", "/review", "/emails/1", "/api/queues", "/api/jobs/1"):
        refused = requests.get(f"{web.url}{path}", timeout=5)
        assert refused.status_code == 401, path
        assert refused.headers["WWW-Authenticate"].startswith('Basic realm="mailpipe"')
    assert requests.get(f"{web.url}/api/queues", timeout=5).json() == {
        "error": "sign in as a viewer or an operator"
    }
    for wrong in ((OPERATOR[0], "wrong"), (VIEWER[0], OPERATOR[1]), ("nobody", OPERATOR[1])):
        assert requests.get(f"{web.url}/", auth=wrong, timeout=5).status_code == 401, wrong
    # Each way a password is held: plain, argon2, bcrypt; twice each (the second from the cache).
    for user in (OPERATOR, OPERATOR_ARGON2, VIEWER, OPERATOR, OPERATOR_ARGON2, VIEWER):
        page = requests.get(f"{web.url}/failed", auth=user, timeout=10)
        assert page.status_code == 200, user
        assert (">Retry selected<" in page.text) == (user != VIEWER)
    for secret in (OPERATOR[1], OPERATOR_ARGON2[1], VIEWER[1]):
        assert secret not in web.output()


def test_actions_need_an_operator_and_the_form_s_token(res, console) -> None:  # type: ignore[no-untyped-def]
    email_id = failed_run(res)
    web = console()
    viewer_token = web.csrf(VIEWER)
    operator_token = web.csrf(OPERATOR)
    assert viewer_token != operator_token
    retry = {"do": "retry-selected", "email_id": str(email_id)}

    def post(auth: tuple[str, str], form: dict[str, str]) -> requests.Response:
        return requests.post(
            f"{web.url}/failed", data=form, auth=auth, allow_redirects=False, timeout=10
        )

    assert post(VIEWER, {**retry, "csrf_token": viewer_token}).status_code == 403
    assert post(OPERATOR, retry).status_code == 403
    assert post(OPERATOR, {**retry, "csrf_token": viewer_token}).status_code == 403
    assert post(OPERATOR, {**retry, "csrf_token": "0" * 64}).status_code == 403
    assert run_status(res, email_id) == "failed"

    done = post(OPERATOR, {**retry, "csrf_token": operator_token})
    assert done.status_code == 303
    assert done.headers["location"] == "/failed?action=retry&done=1&enqueued=1&refused=0"
    assert run_status(res, email_id) == "open"
    page = requests.get(f"{web.url}{done.headers['location']}", auth=OPERATOR, timeout=10)
    assert "1 retried, 1 jobs sent" in page.text
    # Pausing a stage and switching model calls, as the overview's buttons do.
    overview = {"csrf_token": operator_token}
    stages = f"{web.url}/stages"
    paused = requests.post(
        stages, data={**overview, "stage": "model", "do": "pause"}, auth=OPERATOR
    )
    assert paused.status_code == 200 and paused.url == f"{web.url}/"  # after the 303
    assert pauses.paused(res.redis)[Stage.MODEL].by == pauses.OPERATOR
    assert "Resume" in paused.text
    requests.post(stages, data={**overview, "stage": "model", "do": "resume"}, auth=OPERATOR)
    assert pauses.paused(res.redis) == {}
    with res.db.session() as session:
        before = flags.model_calls_enabled(session)
    state = "off" if before else "on"
    switched = requests.post(
        f"{web.url}/model-calls", data={**overview, "state": state}, auth=OPERATOR
    )
    assert switched.status_code == 200
    with res.db.session() as session:
        assert flags.model_calls_enabled(session) is not before
    log = web.output()
    assert f"ops: retry selected in the failed list, 1 emails [{email_id}]" in log
    assert "ops: pause model" in log and "ops: resume model" in log
    assert f"ops: model calls {state}" in log
    assert "viewer:" not in log  # refused actions did nothing


def test_a_console_without_users_serves_loopback_names_only(res, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Open on loopback, as Flower is; a page whose name points at 127.0.0.1 (DNS rebinding)
    gets nothing."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MAILPIPE_WEB_OPERATORS", "MAILPIPE_WEB_VIEWERS")
    }
    web = ConsoleProcess(env, tmp_path / "web.log")
    try:
        assert requests.get(f"{web.url}/api/queues", timeout=10).status_code == 200
        rebound = requests.get(
            f"{web.url}/api/queues", headers={"Host": "attacker.example"}, timeout=10
        )
        assert rebound.status_code == 400
        # Its actions still need the token: another site's form cannot send it.
        refused = requests.post(f"{web.url}/stages", data={"stage": "cpu", "do": "pause"})
        assert refused.status_code == 403
        assert pauses.paused(res.redis) == {}
    finally:
        web.stop()


def test_web_refuses_every_interface_without_users(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if k not in ("MAILPIPE_WEB_OPERATORS", "MAILPIPE_WEB_VIEWERS")
        },
        "MAILPIPE_WEB_HOST": "0.0.0.0",
    }
    done = subprocess.run(
        [str(Path(sys.executable).parent / "mailpipe"), "web"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: mailpipe web refuses to serve 0.0.0.0 without users")
    assert "MAILPIPE_WEB_OPERATORS" in lines[0]


# --- what the pages show -----------------------------------------------------------------------


def test_pages_escape_what_emails_hold(res, console) -> None:  # type: ignore[no-untyped-def]
    email_id = failed_run(res, error=f"failed on {HOSTILE}")
    with res.db.transaction() as session:
        session.execute(
            update(EmailMessage).where(EmailMessage.id == email_id).values(subject=HOSTILE)
        )
        emails.mark_for_review(session, [email_id], f"reason {HOSTILE}")
    web = console()
    for path in ("/review", "/failed", f"/emails/{email_id}"):
        page = requests.get(f"{web.url}{path}", auth=VIEWER, timeout=10)
        assert page.status_code == 200, path
        assert "<script>alert" not in page.text, path
        assert "&lt;script&gt;alert(" in page.text, path
        assert page.headers["content-security-policy"].startswith("default-src 'none'")
    assert "alert" not in web.output()


def test_pages_take_their_style_and_script_from_the_console_alone(console) -> None:  # type: ignore[no-untyped-def]
    """No inline style or script, which the Content-Security-Policy would block: the console's
    own files, served as what they are."""
    web = console()
    for path in ("/", "/failed", "/review"):
        page = requests.get(f"{web.url}{path}", auth=OPERATOR, timeout=10)
        assert page.status_code == 200, path
        policy = page.headers["content-security-policy"]
        assert "'unsafe-inline'" not in policy
        assert "style-src 'self'" in policy and "script-src 'self'" in policy
        assert not re.search(r"<style|<script(?![^>]*\ssrc=)|\s(style|on[a-z]+)=", page.text), path
        assert '<link rel="stylesheet" href="/static/console.css">' in page.text, path
        assert '<script src="/static/console.js" defer></script>' in page.text, path
    for name, kind in (("console.css", "text/css"), ("console.js", "text/javascript")):
        served = requests.get(f"{web.url}/static/{name}", auth=VIEWER, timeout=10)
        assert served.status_code == 200, name
        assert served.headers["content-type"] == f"{kind}; charset=utf-8"
        assert served.headers["x-content-type-options"] == "nosniff"
        assert served.text.strip()
    assert requests.get(f"{web.url}/static/console.css", timeout=10).status_code == 401


def test_the_api_answers_in_json_and_the_pages_in_text(res, console) -> None:  # type: ignore[no-untyped-def]
    """Each Mount answers its own refusals: JSON under /api/, a line of text on the pages."""
    web = console()
    for path, status, error in (
        ("/api/jobs/987654321", 404, "no email with id 987654321"),
        ("/api/jobs/abc", 400, "an email id is a whole number"),
        ("/api/no-such-thing", 404, "Not Found"),
    ):
        answer = requests.get(f"{web.url}{path}", auth=VIEWER, timeout=10)
        assert answer.status_code == status, path
        assert answer.headers["content-type"] == "application/json", path
        assert answer.json() == {"error": error}
    for path, status, error, auth in (
        ("/emails/987654321", 404, "no email with id 987654321", VIEWER),
        ("/emails/abc", 400, "an email id is a whole number", VIEWER),
        ("/no-such-page", 404, "Not Found", VIEWER),
        ("/failed", 401, "sign in as a viewer or an operator", None),
    ):
        answer = requests.get(f"{web.url}{path}", auth=auth, timeout=10)
        assert answer.status_code == status, path
        assert answer.headers["content-type"] == "text/plain; charset=utf-8", path
        assert answer.text == f"{status}: {error}\n"


# --- the job status API on a real worker -------------------------------------------------------


def test_the_api_answers_each_state_as_the_fleet_holds_it(res, fleet, console) -> None:  # type: ignore[no-untyped-def]
    # A retry of the transient fault waits up to a minute: long enough to be seen waiting.
    f: Fleet = fleet(MAILPIPE_RETRY_BACKOFF_MAX="60", MAILPIPE_VISIBILITY_TIMEOUT="120")
    worker = f.worker("web-api", "--concurrency", "1", "--prefetch-multiplier", "1")
    web = console(f.env)

    def job(email_id: int) -> dict[str, Any]:
        answer = requests.get(f"{web.url}/api/jobs/{email_id}", auth=VIEWER, timeout=10)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    def state_is(email_id: int, state: str) -> Callable[[], bool]:
        return lambda: job(email_id)["state"] == state

    held, waiting, never, retried, paused, lost = store_emails(res, [email(t) for t in "hwnrpl"])
    missing = store_without_blob(res, email("missing"))
    copied = email("copied")
    first, second = store_emails(res, [copied, copied])

    assert job(never)["state"] == "not_enqueued"
    # One child: the held job runs, the next waits in the queue behind it.
    f.set_fault(held, "held", times=1)
    f.enqueue([held])
    wait_for(state_is(held, "running"), 60, "the held job to be running")
    f.enqueue([waiting])
    wait_for(lambda: f.queue_depth() == 1, 30, "the second job to wait in the queue")
    assert job(waiting)["state"] == "queued"
    assert job(held)["state"] == "running"
    f.release(held)
    assert wait_until_closed(res, [held, waiting]) == {held: "succeeded", waiting: "succeeded"}

    f.set_fault(retried, "transient:50", times=1)
    f.enqueue([missing, first, retried])
    assert wait_until_closed(res, [missing, first]) == {missing: "failed", first: "succeeded"}
    f.enqueue([second])
    assert wait_until_closed(res, [second]) == {second: "duplicate"}
    wait_for(state_is(retried, "retrying"), 60, "the transient fault's retry to be waiting")

    # A job behind an operator's pause waits, and says so; a job whose run is open but whose
    # message is gone (no marker, no lease) is lost until a sweep re-adds it.
    f.cli("pause", "cpu")
    queue = res.settings.queue
    wait_for(lambda: queue not in f.consumed_queues(worker.nodename), 30, "the pause applied")
    f.enqueue([paused])
    assert job(paused)["state"] == "waiting" and job(paused)["waiting_for"] == "paused_stage"
    f.cli("resume", "cpu")
    assert wait_until_closed(res, [paused]) == {paused: "succeeded"}
    with res.db.transaction() as session:
        runs.ensure_runs(session, [lost])
    assert job(lost)["state"] == "lost"

    with res.db.session() as session:
        runs_by_email = {
            run.email_id: run
            for run in session.scalars(
                select(PipelineRun).where(
                    PipelineRun.email_id.in_([held, waiting, missing, first, second, retried])
                )
            )
        }
    expected = {
        held: "succeeded",
        waiting: "succeeded",
        missing: "failed",
        first: "succeeded",
        second: "duplicate",
        retried: "retrying",
        never: "not_enqueued",
    }
    for email_id, state in expected.items():
        answer = job(email_id)
        assert answer["email_id"] == email_id and answer["state"] == state, answer
        run = runs_by_email.get(email_id)
        if run is None:
            assert answer["attempts"] == 0 and answer["history"] == []
            continue
        assert answer["attempts"] == run.attempts
        assert answer["error"] == run.error
        if run.status is not RunStatus.OPEN:
            assert answer["history"], answer  # every attempt is recorded
    assert job(missing)["history"][-1]["error_class"] == "BlobMissing"
    queues = requests.get(f"{web.url}/api/queues", auth=VIEWER, timeout=10).json()
    assert set(queues["queues"]) == {"email", "email.bulk", "model", "model.bulk", "control"}
    assert queues["runs"]["failed"] == 1 and queues["runs"]["duplicate"] == 1
    assert queues["estimated"] == []
    assert [w["hostname"] for w in queues["workers"]] == ["web-api@localhost"]
